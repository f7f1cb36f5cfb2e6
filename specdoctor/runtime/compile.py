"""`--compile`: each rank's passes through torch.compile (Inductor), so a pass runs a few fused kernels
instead of a few hundred small ops, each of which costs more in dispatch than in arithmetic on a small model
(docs/performance.md: the step profile).

What is compiled is the part of a pass after its entry point has done the host work: the stage's layers
(`TargetStage.run_layers`) and the drafter's layers with its head (its `run_layers`). The entry point looks up
the embedding and the rotary table and plans the KV cache (span and causal mask), so a compiled graph holds no
host synchronisation; the span reaches it as the mask's size, so one graph serves every length, prompt passes'
included (sizes of 1 and each MoE path aside). An MTP drafter's greedy draft chain (`MtpDrafter.greedy_chain`:
its k steps, each an embedding, a pass and an argmax) is one graph: its steps' keys are planned from one host
read before it, so a step calls two graphs (the verify pass's layers and the chain) instead of one per pass.
Passes the graphs would have to break, or retrace per length, stay eager: prompt passes longer than a verify pass
of modules whose layers loop over the positions (`loops_over_positions`: Gated DeltaNet's recurrence, which a
trace unrolls, so each prompt length would be a graph of its own), and passes that take an MoE layer's per-expert
loop, which reads its expert list on the host (models whose routed experts are too large to gather or run all at
once, GLM-4.5's at any batch, and packed quantised experts at any size; the floating-point demos' never do). A
grouped-GEMM MoE kernel would lift that limit. On CUDA the same graphs are compiled without CUDA graphs
(`mode="reduce-overhead"`): a step writes its KV cache, a graph input, in place, and Inductor skips CUDA graphs
for graphs that mutate their inputs. On the CPU a graph's calls are made from Inductor's C++ wrapper, not a
generated Python function: at the demo's size a pass is a hundred calls of tens of microseconds each, and the
Python between them cost as much as a tenth of a served token's time.

Each graph is compiled ahead of its first use with torch's AOT compile (as vLLM's `VLLM_USE_AOT_COMPILE`
does) and saved whole, Dynamo's output and guards with Inductor's kernels, in the user's cache directory
(`graph_cache_dir`): a later start loads it instead of tracing the step's Python again (docs/performance.md:
start-up). A module whose layers break the graph (AOT compile
needs one whole graph) is compiled by plain torch.compile, which traces on every start.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import uuid
from pathlib import Path

import torch

from specdoctor import kernels
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.cache.prefix import BLOCK_SIZE
from specdoctor.runtime.models.moe import MoE
from specdoctor.runtime.options import MAX_SPECULATIVE_TOKENS

# A verify pass feeds the pending token and k <= 8 drafts; the drafter's chain steps feed one position. Past
# that, a pass is a prompt's.
DECODE_POSITIONS = MAX_SPECULATIVE_TOKENS + 1
# Graphs a rank may need, per compiled module: batch, positions and cache span each 1 or larger, times each MoE
# path; past as many compiles in one process a module runs eager.
RECOMPILE_LIMIT = 32


def graph_cache_dir() -> Path:
    """Where compiled graphs are kept: TORCHINDUCTOR_CACHE_DIR where the user set it, else
    $XDG_CACHE_HOME/specdoctor/compile/torch-VERSION (Inductor's default, /tmp, is emptied at reboot)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # Inductor writes its default there once it has looked
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "specdoctor" / "compile" / f"torch-{torch.__version__}"


def measured_once(key: str, measure) -> int | None:
    """`measure()`'s answer for `key`, kept in the compile cache: a choice timed on a noisy machine can come out
    either way between starts, and the saved graphs check the choice their layers made, so a later start reads the
    first one's instead of timing again (and of tracing again). Not kept where the cache cannot be written."""
    path = graph_cache_dir() / "measured.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = measure()
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
            partial.write_text(json.dumps(known, indent=1))
            partial.replace(path)  # whole or not at all: another rank may write it at the same time
    return known[key]


def warmup_batches(max_batch: int) -> list[int]:
    """The batch sizes whose passes meet every graph a batch of up to `max_batch` rows can need: 1 (sizes of 1 get
    graphs of their own), each power of two, and `max_batch`. Where a pass's MoE layers switch paths past L tokens
    (runtime/models/moe.py), the draft chain, one graph over a pass of B x (k + 1) tokens and passes of B, takes one
    path in all (B <= L / (k + 1)), the other in all (B > L), or both: that middle range (L / (k + 1), L] spans at
    least a factor of two, so a power of two falls in it whatever L is."""
    return sorted({*(1 << n for n in range(max_batch.bit_length())), max_batch})


def warmup_prompts(max_batch: int, gathered_tokens: int, grouped_from: int | None = None) -> list[list[list[int]]]:
    """The batches of prompts whose prompt passes and decode steps meet every graph a batch of up to `max_batch`
    rows can need, where MoE layers gather experts for passes of up to `gathered_tokens` tokens (the ranks'
    `gathered_token_limit`) and, measured on a CPU rank, run a grouped GEMM from `grouped_from` tokens on (None:
    never): two-token prompts at each of `warmup_batches`, one-token prompts (sizes of 1 get graphs of their own),
    then prompts of 16n + 1 tokens past the limit, each sent twice. The first time their prompt pass takes every
    expert (or the grouped GEMM), which no decode pass of one row (k + 1 <= the limit) nor a two-token prompt pass
    of two reaches; the second time, with prefix caching, it computes the one token past the cached blocks against
    a cache of 16n + 1 positions (a one-token pass over a longer cache is another graph again). Where a grouped
    GEMM runs, prompts just past the limit and just past `grouped_from` tokens a batch come too, so a batch's prompt
    pass meets each side of both switches (a power of two would also equal a head size: a graph traced with two
    sizes equal takes them as one). The one-token passes run at batch 1, 2 (gathered experts up to the
    limit) and the first warm-up batch past the limit (every expert)."""
    sizes = warmup_batches(max_batch)
    one_token = sorted({*sizes[:2], *[batch for batch in sizes if batch > gathered_tokens][:1]})
    batches = [[[1, 2]] * batch for batch in sizes] + [[[1]] * batch for batch in one_token]
    length = BLOCK_SIZE * (gathered_tokens // BLOCK_SIZE + 1) + 1
    for batch in one_token:  # a token of its own per batch size: one size's blocks are no prefix of the other's
        batches += [[[batch] * length] * batch] * 2
        if grouped_from is not None:
            # a token no other warm-up prompt starts with: no cached block shortens their passes
            switches = {gathered_tokens // batch + 1, grouped_from // batch + 1} - {length, 1}  # 1: run above
            batches += [[[max_batch + batch] * tokens] * batch for tokens in sorted(switches)]
    return batches


def compile_layers(module: torch.nn.Module) -> None:
    """Route `module.run_layers` (its first argument [B, T, ...]) through compiled graphs, and a drafter's greedy
    draft chain (`greedy_chain`, where it has one) as one graph per chain."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(graph_cache_dir())
    module.run_layers = LayerGraphs(module)
    if hasattr(module, "greedy_chain"):
        module.greedy_chain = LayerGraphs(module, "greedy_chain")
    if hasattr(module, "fill_layers"):
        module.fill_layers = LayerGraphs(module, "fill_layers")


class LayerGraphs:
    """`module.run_layers` under --compile: a pass runs a graph of the module's whose guards (the shapes, dtypes
    and constants it was traced with) pass, trying first the one the last pass with the same input shapes ran,
    compiling and saving one when none does."""

    def __init__(self, module: torch.nn.Module, method: str = "run_layers"):
        self.module, self.eager = module, getattr(module, method)
        moe_limits = [layer.loop_token_limit() for layer in module.modules() if isinstance(layer, MoE)]
        self.token_limit = min((limit for limit in moe_limits if limit is not None), default=None)
        self.loops_over_positions = any(getattr(layer, "loops_over_positions", False) for layer in module.modules())
        # dynamic: batch, positions, span and cache length are sizes, not constants (each size 1 still gets
        # its own graph), so a rank compiles a handful of graphs, not one per request. On the CPU a graph's hundred
        # or so kernel and matmul calls are made from Inductor's C++ wrapper instead of a generated Python function
        # (docs/performance.md: the C++ wrapper).
        on_cpu = next(module.parameters()).device.type == "cpu"
        options = {"guard_filter_fn": kept_guards, "cpp_wrapper": on_cpu}
        self.compiler = torch.compile(self.eager, dynamic=True, fullgraph=True, options=options)
        self.directory = saved_graphs_dir(module, method)
        self.graphs: list = []  # AOT-compiled functions
        self.last_for_shapes: dict = {}  # the graph the last pass with these input shapes ran: tried first
        self.loaded, self.compiled = False, 0
        self.traced = None  # plain torch.compile, for a module whose layers break the graph

    def __call__(self, *args):
        batch, positions = args[0].shape[:2]
        prompt_unrolled = self.loops_over_positions and positions > DECODE_POSITIONS
        if prompt_unrolled or (self.token_limit is not None and batch * positions > self.token_limit):
            return self.eager(*args)
        if self.traced is None and (graph := self.matching(args) or self.add(args)):
            return graph(self.module, *args)
        return (self.traced or self.eager)(*args)  # eager past the graph limit

    def __reduce__(self):
        # Dynamo saves the module's attributes with a graph's guards; the graphs never read this one.
        return LayerGraphs.__new__, (LayerGraphs,)

    def matching(self, args):
        shapes = tuple(tuple(arg.shape) for arg in args if isinstance(arg, torch.Tensor))
        last = self.last_for_shapes.get(shapes)
        for graph in ([last] if last else []) + self.graphs:
            if graph.guard_check(self.module, *args):
                self.last_for_shapes[shapes] = graph
                return graph
        return None

    def add(self, args):
        import torch._dynamo

        if not self.loaded:
            self.loaded = True
            for path in sorted(self.directory.glob("*.graph")):
                self.load(path)
            if graph := self.matching(args):
                return graph
        if self.compiled >= RECOMPILE_LIMIT:
            return None
        self.compiled += 1
        try:
            with torch._dynamo.config.patch(specialize_float=True):  # floats as constants: one trace, no restart
                graph = self.compiler.aot_compile((args, {}))
        except Exception:  # a graph break, unsaveable guards, Inductor's caches turned off: trace as torch.compile
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
            self.traced = torch.compile(self.eager, dynamic=True)  # an error of the layers themselves shows there
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(self.directory / f"{uuid.uuid4().hex}.graph"))
        except Exception:  # a read-only or full cache, something unpicklable: this process still has the graph
            pass
        return self.ready(graph)

    def load(self, path: Path) -> None:
        """Add a saved graph; remove its file where it no longer loads (cut off by a full disk or a killed writer)."""
        try:
            with path.open("rb") as file:
                graph = torch.compiler.load_compiled_function(file, f_globals=self.eager.__func__.__globals__)
        except Exception:  # whatever its unpickling raises: the graph is compiled again
            path.unlink(missing_ok=True)
            return
        self.ready(graph)

    def ready(self, graph):
        graph.disable_guard_check()  # `matching` has checked them; calling would check again
        self.graphs.append(graph)
        return graph


# Guards on the module's structure (its submodules' types, attributes not shadowed, empty hook dicts) and on its
# parameters and buffers (type, shape, dtype, device): 900 of the demo stage's 1,077 guards, checked before every
# pass. A rank builds its modules once and never swaps a submodule, adds a hook or changes a parameter's layout,
# and a saved graph is only loaded by a module of the same class and parameters (`saved_graphs_dir`: names, so also
# which of them are one tensor, shapes, dtypes and devices).
STRUCTURE_GUARDS = {"TYPE_MATCH", "EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT"}


def kept_guards(entries) -> list[bool]:
    """Which of a graph's guards are saved and checked: what AOT compile keeps by default (no guards on globals
    or of kinds it cannot save), less the guards on the module's structure and parameters. Guards on the pass's
    inputs (shapes, dtypes, the cache's layout), on the module's constants (layer ids, tap entries, config values)
    and on which of its tensors are one tensor stay."""
    from torch._dynamo.guards import CheckFunctionManager

    def kept(entry) -> bool:
        if entry.is_global or entry.guard_type in CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES:
            return False
        if not (entry.name == "self" or entry.name.startswith(("self.", "self["))):
            return True  # an input's
        if entry.guard_type == "DUPLICATE_INPUT":  # a graph traced with two names for one tensor reads it once
            return isinstance(entry.value, torch.Tensor)  # (modules sharing one config object: no matter)
        on_parameter = "._parameters[" in entry.name or "._buffers[" in entry.name
        return not (entry.guard_type in STRUCTURE_GUARDS or on_parameter)

    return [kept(entry) for entry in entries]


def saved_graphs_dir(module: torch.nn.Module, method: str) -> Path:
    """The module's saved graphs: one directory per system (Python, torch, GPU: what torch checks before it
    loads a graph), version of specdoctor's code, module class, kernel backend, tensor-parallel group, intra-op
    threads and parameter layout, so a start only loads graphs its guards can accept. (Guards on globals do not survive
    saving; the kernel backend and the tensor-parallel group, whose name a collective in a graph holds, are
    what the layers read from globals.)"""
    from torch._dynamo.package import SystemInfo

    parameters = [(name, tuple(p.shape), str(p.dtype), str(p.device)) for name, p in module.named_parameters()]
    first = next(module.parameters())
    tp = tensor_parallel.current()
    group = (tp.rank, tp.size, getattr(tp.group, "group_name", None))
    module_class = type(module).__qualname__
    # Inductor's CPU kernels are written for the intra-op thread count (serial code for one thread), and `serve`'s
    # ranks run fewer threads than `bench`'s
    threads = torch.get_num_threads()
    key = repr((SystemInfo.current(), source_digest(), module_class, method, kernels.backend(first), group, threads))
    key += repr(parameters)
    return graph_cache_dir() / "graphs" / hashlib.sha256(key.encode()).hexdigest()[:32]


@functools.cache
def source_digest() -> str:
    """specdoctor's source: a graph traced through other code is never loaded."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()
