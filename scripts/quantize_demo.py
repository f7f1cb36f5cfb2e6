"""Make `demo-w4a16`: the GLM-4.5 demo quantised to W4A16 by llm-compressor (round to nearest, symmetric
int4, group 64: the demo's widths 128, 192 and 512 are not all multiples of the usual 128), written as
compressed-tensors `pack-quantized`, the seed deployment's scheme. The embedding, the head, the routers
and the MTP layer stay bf16 (the MTP layer is named in the ignore list). Runs in the quantisation tools'
environment (tests/tools/quant_env.py):

    python -m tests.tools.quant_env     # prints its interpreter, e.g. .peer/quant/bin/python
    .peer/quant/bin/python -m scripts.quantize_demo --out specdoctor/demo_w4a16_model
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from tests.tools.quantize_run import llm_compressor

DEMO = Path(__file__).resolve().parents[1] / "specdoctor" / "demo_model"
GROUP = 64
COPIED = ("tokenizer.json", "tokenizer_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    shutil.rmtree(out, ignore_errors=True)
    llm_compressor(DEMO, out, GROUP, symmetric=True)
    (out / "recipe.yaml").unlink(missing_ok=True)  # llm-compressor's record of the recipe; config.json says it all
    for name in COPIED:
        shutil.copy(DEMO / name, out / name)
    print(f"saved {out} ({sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
