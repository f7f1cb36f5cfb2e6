"""`specdoctor check` on a model larger than the machine: DeepSeek-V3 at its real size (61 layers + the MTP
layer, 256 experts, bf16: 1.37 TB as sparse shards; tests/helpers/real_size.py), PP 8, as an unpatched
engine loads it, with --repair. Reports the time to verdict, the peak resident memory of check and every
process it starts (summed), the stages that ran, and the time to write the checkpoint.

    python -m benchmarks.real_size [--dir /tmp/real-size] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import add_json_option, machine, write_json
from tests.helpers.peak_memory import run_measured
from tests.helpers.real_size import DEEPSEEK_V3, write_sparse_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temporary directory)")
    add_json_option(parser, "real_size")
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="real-size-"))
    try:
        start = time.perf_counter()
        write_sparse_checkpoint(directory, DEEPSEEK_V3)
        written = time.perf_counter() - start
        command = [sys.executable, "-m", "specdoctor", "check", "--model", str(directory), "--pp", "8", "--repair"]
        run = run_measured([*command, "--json", "-"], timeout_s=1800)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    report = json.loads(run.stdout)
    result = {
        "machine": machine(),
        "model": "DeepSeek-V3 layout, 1.37 TB bf16 (sparse shards), PP 8, --repair",
        "write_checkpoint_s": round(written, 1),
        "check_s": round(run.seconds, 1),
        "peak_memory_gib": round(run.peak_bytes / 2**30, 2),
        "exit_code": run.returncode,
        "verdict": report["verdict"]["summary"],
        "timings": report["timings"],
        "memory_needed_tb": round(report["memory"]["needed"] / 1e12, 2),
    }
    write_json(args.json, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
