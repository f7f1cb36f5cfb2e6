"""`specdoctor check` on a quantised checkpoint with its weights held packed (the quantised GEMMs) and dequantised
at load, side by side in one run: the bytes the ranks hold for their tensors (the memory plan, which
tests/runtime/test_packed_weights.py holds equal to what the ranks allocate), the peak resident memory of check
and every process it starts (summed), the time to verdict, and whether the two reports agree.

    python -m benchmarks.packed_weights [--model demo-w4a16] [--pp 2] [--json FILE]
    python -m benchmarks.packed_weights --larger DIR   # a 190M-parameter GLM-4.5 that llm-compressor quantises
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from benchmarks.common import add_json_option, numeric_table, write_json
from tests.conftest import make_hf_checkpoint
from tests.helpers.peak_memory import run_measured
from tests.helpers.reports import findings_of
from tests.helpers.tool_env import ROOT
from tests.tools.quant_env import QUANT, TOOL_ENV

MODES = ("packed", "dequantized")
# The loaded-drafter and repair stages start from the same bytes in both runs (the fill is zeros, not whatever
# torch.empty gives), so the reports can be compared whole.
ARGS = ("--drafter-policy", "engine-legacy", "--head-policy", "engine-legacy", "--fill", "zeros", "--repair")


# A GLM-4.5 large enough that its weights, not the processes, set the peak: 6 layers (5 MoE with 16 experts), the
# MTP layer, hidden 1024; about 190M parameters, 0.76 GB in fp32.
LARGER = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, n_routed_experts=16,
    num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
)  # fmt: skip


def make_larger(directory: Path) -> Path:
    """The LARGER model saved by transformers, then W4A16 (group 128) by llm-compressor in its own environment."""
    quantised = directory / "w4a16"
    if not (quantised / "config.json").exists():
        make_hf_checkpoint(directory / "float", shard_size="200MB", **LARGER)
        command = [str(QUANT.ensure()), "tests/tools/quantize_run.py", "w4a16", str(directory / "float"),
                   str(quantised), "128", json.dumps([[1, 2, 3]])]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, cwd=ROOT, env=TOOL_ENV, timeout=3600)
    return quantised


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo-w4a16")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--larger", type=Path, help="build (once) and measure the larger model in this directory")
    add_json_option(parser, "packed_weights")
    args = parser.parse_args()
    if args.larger:
        args.model = str(make_larger(args.larger))
    runs, reports = {}, {}
    for mode in MODES:
        command = [sys.executable, "-m", "specdoctor", "check", "--model", args.model, "--pp", str(args.pp), *ARGS]
        run = run_measured([*command, "--quantized-weights", mode, "--json", "-"], timeout_s=1800)
        reports[mode] = json.loads(run.stdout)
        runs[mode] = {
            "weights_mib": round(sum(rank["weights"] for rank in reports[mode]["memory"]["ranks"]) / 2**20, 2),
            "peak_memory_mib": round(run.peak_bytes / 2**20),
            "check_s": round(run.seconds, 1),
            "exit_code": run.returncode,
        }
    same = findings_of(reports["packed"]) == findings_of(reports["dequantized"])
    table = numeric_table(f"check --model {args.model} --pp {args.pp}", ("weights", *runs["packed"]))
    for mode, row in runs.items():
        table.add_row(mode, *map(str, row.values()))
    Console().print(table)
    print(f"same findings, battery and verdict: {same}")
    write_json(args.json, {"model": args.model, "pp": args.pp, "runs": runs, "same_reports": same})


if __name__ == "__main__":
    main()
