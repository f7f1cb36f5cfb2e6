"""What the commands run, once for every command; `commands/` only parse flags and render what this returns.

`check` and `repair` (check.py): pre-flight (headers) → load → examine the drafter → repair → examine again, with
the correctness battery; a model larger than the machine gets the examinations on the drafter's rank alone
(alone.py). `serve` (serve.py) runs the examine-and-repair loop (examine_and_repair.py) on the engine it then
serves from; `generate` (generate.py) and `bench` (bench.py) run the runtime and report what it did.

The runtime and the checks are imported inside the functions: the CLI itself starts without torch.
"""
