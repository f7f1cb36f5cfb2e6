"""The quantisation tools the quantised-checkpoint tests take as oracles, in a virtual environment of their
own: llm-compressor 0.14 pins transformers 5.15-5.17 and compressed-tensors 0.19, older than the test
environment's transformers. AutoAWQ 0.2.9 (archived; its pins want an old torch) is installed without its
dependencies: its GEMM packing and dequantisation are plain torch.

    python -m tests.tools.quant_env    # install (CI runs this before the tests); prints the interpreter
"""

from __future__ import annotations

import os

from tests.helpers.tool_env import ROOT, ToolEnv, install_main

QUANT = ToolEnv(
    name="quant",
    requirements=("torch==2.13.0", "llmcompressor==0.14.0.1"),
    without_deps=("autoawq==0.2.9",),
    check="import llmcompressor, awq.modules.linear.gemm",
    env_var="SPECDOCTOR_QUANT_VENV",
)
TOOL_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # the tools' interpreter imports the repository's scripts

if __name__ == "__main__":
    install_main(QUANT)
