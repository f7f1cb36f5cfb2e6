"""`--compile`: each rank's decode passes through torch.compile (Inductor), so a step runs a few fused
kernels instead of a few hundred small ops, each of which costs more in dispatch than in arithmetic on
a small model (docs/performance.md: the step profile).

What is compiled is the part of a pass after its entry point has done the host work: the stage's layers
(`TargetStage.run_layers`) and the drafter's layers with its head (its `run_layers`). The entry point
looks up the embedding and the rotary table and plans the KV cache (span and causal mask), so a compiled
graph holds no host synchronisation; the span reaches it as the mask's size, so one graph serves every
length. Passes the graphs would have to break stay eager: prompt passes (more positions than a verify
pass ever feeds), and passes that take an MoE layer's per-expert loop, which reads its expert list on
the host (models whose routed experts are too large to gather or run all at once, GLM-4.5's at any
batch, and packed quantised experts at any size; the floating-point demos' never do). A grouped-GEMM
MoE kernel would lift that limit. On CUDA the same graphs are compiled without CUDA graphs
(`mode="reduce-overhead"`): a step writes its KV cache, a graph input, in place, and Inductor skips
CUDA graphs for graphs that mutate their inputs.

Compiled graphs persist in the user's cache directory (`graph_cache_dir`), so only the first start with a
model pays for compiling; later starts trace the step and load the kernels (docs/performance.md: start-up).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdoctor.runtime.models.moe import MoE
from specdoctor.runtime.options import MAX_SPECULATIVE_TOKENS

# A verify pass feeds the pending token and k <= 8 drafts; the drafter's chain steps feed one position.
DECODE_POSITIONS = MAX_SPECULATIVE_TOKENS + 1
# Graphs a rank may need: one or several positions, times batch 1 or larger, per compiled module.
RECOMPILE_LIMIT = 32


def graph_cache_dir() -> Path:
    """Where compiled graphs are kept: TORCHINDUCTOR_CACHE_DIR where the user set it, else
    $XDG_CACHE_HOME/specdoctor/compile/torch-VERSION (Inductor's default, /tmp, is emptied at reboot). Inside it
    Inductor keys each graph by its code, shapes, dtypes and device, so by model too (parameters are inputs)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # Inductor writes its default there once it has looked
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "specdoctor" / "compile" / f"torch-{torch.__version__}"


def compile_decode(module: torch.nn.Module) -> None:
    """Route `module.run_layers` (its first argument [B, T, ...]) through torch.compile for decode passes."""
    import torch._dynamo

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(graph_cache_dir())
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
    eager = module.run_layers
    # dynamic: batch, positions, span and cache length are sizes, not constants (each size 1 still gets
    # its own graph), so a rank compiles a handful of graphs, not one per request.
    compiled = torch.compile(eager, dynamic=True)
    moe_limits = [layer.loop_token_limit() for layer in module.modules() if isinstance(layer, MoE)]
    token_limit = min((limit for limit in moe_limits if limit is not None), default=None)

    def run_layers(*args):
        batch, positions = args[0].shape[:2]
        in_graph = positions <= DECODE_POSITIONS and (token_limit is None or batch * positions <= token_limit)
        return compiled(*args) if in_graph else eager(*args)

    module.run_layers = run_layers
