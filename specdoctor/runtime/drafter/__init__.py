"""The drafter: one interface for every kind (kind.py), the kinds (mtp.py, dspark.py, eagle3.py) and their
registry (registry.py), a drafter checkpoint of its own (checkpoint.py), the loading-policy ladder they share
(policy.py), what the live drafter holds (measure.py), its repair (repair.py), and where a drafter's taps
travel under pipeline parallelism (taps.py)."""
