"""The drafter: checkpoint-key rules (keys.py), loading policies (loading.py), what the live drafter
holds (state.py) and its repair (repair.py)."""
