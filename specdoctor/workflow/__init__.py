"""Diagnose and repair, once for every command: pre-flight (headers) → load → measure the drafter → findings →
repair → measure again → findings. `check` and `repair` run it with the correctness battery (check.py); `serve`
runs its start-up part on the engine it serves from (drafter.py); a model larger than the machine gets the
loaded-drafter stage on the drafter's rank alone (alone.py). Commands only parse flags and render.

The runtime and the checks are imported inside the functions: the CLI itself starts without torch.
"""
