"""specdoctor inside the engines users run: its drafter checks as a plugin of the engine's own workers.

What does not depend on the engine (which rows a worker's slice of a drafter table must hold, measured against the
checkpoint the runtime's drafter kind names) is in worker_check.py; an engine's package (vllm/) only finds the
worker's place, the drafter's tables, and hooks the engine's loading.
"""
