"""`--compile`: each rank's passes through torch.compile (Inductor), so a pass runs a few fused kernels
instead of a few hundred small ops, each of which costs more in dispatch than in arithmetic on a small model
(docs/performance.md: the compiled decode step).

What is compiled is the part of a pass after its entry point has done the host work: the stage's layers
(`TargetStage.run_layers`) and the drafter's layers with its head (its `run_layers`). The entry point looks up
the embedding and the rotary table and plans the KV cache (span and causal mask), so a compiled graph holds no
host synchronisation; the span reaches it as the mask's size, so one graph serves every length, prompt passes'
included (sizes of 1 and each MoE path aside). A drafter's greedy draft chain (`greedy_chain`, where it has one:
an MTP drafter's k steps, each an embedding, a pass and an argmax) is one graph: its steps' keys are planned from
one host read before it, so a step calls two graphs (the verify pass's layers and the chain) instead of one per pass.
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

Each graph is compiled with torch's AOT compile (as vLLM's `VLLM_USE_AOT_COMPILE` does), behind the passes: a
pass no active graph takes runs eager and asks the rank's compile thread for one, which swaps it in at a step
boundary (runtime/background_compile.py). It is saved whole, Dynamo's output and guards with Inductor's kernels, in
the user's cache directory (`graph_cache_dir`): a later start loads it instead of tracing the step's Python again
(docs/runtime.md: `--compile`). A module whose layers break the graph (AOT compile needs one whole graph) runs
eager, with a warning.
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
import torch.fx.experimental._config as fx_config

from specdoctor import kernels
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.background_compile import BackgroundCompiler, JobOutcome, shape_class
from specdoctor.runtime.models.moe import MoE
from specdoctor.runtime.options import MAX_SPECULATIVE_TOKENS

# A verify pass feeds the pending token and k <= 8 drafts; the drafter's chain steps feed one position. Past
# that, a pass is a prompt's.
DECODE_POSITIONS = MAX_SPECULATIVE_TOKENS + 1
# Graphs a rank may need, per compiled module: batch, positions and cache span each 1 or larger, times each MoE
# path; past as many, a module's passes of shapes no graph takes run eager.
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


def compile_layers(module: torch.nn.Module, compiler: BackgroundCompiler) -> None:
    """Route each of the module's `graph_methods` (a stage's or a drafter's: `run_layers`, its first argument
    [B, T, ...], and a drafter's greedy draft chain or cache fill where it has them) through graphs `compiler`
    compiles behind the passes, a greedy chain as one graph per chain."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(graph_cache_dir())
    for method in module.graph_methods:
        setattr(module, method, LayerGraphs(module, compiler, method))


class LayerGraphs:
    """`module.run_layers` under --compile: a pass runs an active graph of the module's whose guards (the shapes,
    dtypes and constants it was traced with) pass, trying first the one the last pass with the same input shapes ran;
    when none does it runs eager and asks the rank's compiler for one (runtime/background_compile.py)."""

    def __init__(self, module: torch.nn.Module, compiler: BackgroundCompiler, method: str = "run_layers"):
        self.module, self.eager, self.background = module, getattr(module, method), compiler
        self.name = f"{type(module).__name__}.{method}"
        self.moe_layers = [layer for layer in module.modules() if isinstance(layer, MoE)]
        moe_limits = [layer.loop_token_limit() for layer in self.moe_layers]
        self.token_limit = min((limit for limit in moe_limits if limit is not None), default=None)
        self.loops_over_positions = any(getattr(layer, "loops_over_positions", False) for layer in module.modules())
        # dynamic: batch, positions, span and cache length are sizes, not constants (each size 1 still gets
        # its own graph), so a rank compiles a handful of graphs, not one per request. On the CPU a graph's hundred
        # or so kernel and matmul calls are made from Inductor's C++ wrapper instead of a generated Python function
        # (docs/runtime.md: `--compile`, the C++ wrapper).
        on_cpu = next(module.parameters()).device.type == "cpu"
        options = {"guard_filter_fn": kept_guards, "cpp_wrapper": on_cpu}
        self.compiler = torch.compile(self.eager, dynamic=True, fullgraph=True, options=options)
        self.directory = saved_graphs_dir(module, method)
        self.active: list = []  # the graphs passes run: swapped in at step boundaries
        self.last_for_shapes: dict = {}  # the graph the last pass with these input shapes ran: tried first
        # The compile thread's: (job number, graph) of every graph it has, and the job that found the layers break
        # the graph (their passes stay eager once it is swapped in).
        self.graphs: list[tuple[int, object]] = []
        self.breaks_at: int | None = None
        self.runs_eager, self.full = False, False
        self.requests: dict = {}  # the serving thread's: the job asked for each shape class, and how often
        compiler.add(self)

    def __call__(self, *args):
        batch, positions = args[0].shape[:2]
        prompt_unrolled = self.loops_over_positions and positions > DECODE_POSITIONS
        looped_experts = self.token_limit is not None and batch * positions > self.token_limit
        if self.runs_eager or prompt_unrolled or looped_experts:
            return self.eager(*args)
        if graph := self.matching(args):
            return graph(self.module, *args)
        self.background.request(self, args)
        return self.eager(*args)

    def __reduce__(self):
        # Dynamo saves the module's attributes with a graph's guards; the graphs never read this one.
        return LayerGraphs.__new__, (LayerGraphs,)

    def shape_key(self, args) -> tuple:
        """The graph a pass needs, roughly (`shape_class`), and the path its MoE layers take: for a pass's B x T tokens,
        and for B (a draft chain's later steps), so a prompt pass and a decode step of one batch ask apart."""
        batch, positions = args[0].shape[:2]
        paths = {layer.path(tokens) for layer in self.moe_layers for tokens in (batch * positions, batch)}
        return shape_class(args), tuple(sorted(paths))

    def matching(self, args):
        shapes = tuple(tuple(arg.shape) for arg in args if isinstance(arg, torch.Tensor))
        last = self.last_for_shapes.get(shapes)
        for graph in ([last] if last else []) + self.active:
            if graph.guard_check(self.module, *args):
                self.last_for_shapes[shapes] = graph
                return graph
        return None

    def activate(self, finished: int) -> int:
        """Swap in the graphs of the jobs numbered below `finished` (a step boundary); how many are active."""
        self.active = [graph for job, graph in list(self.graphs) if job < finished]
        self.runs_eager = self.breaks_at is not None and self.breaks_at < finished
        return len(self.active)

    def run_job(self, job) -> JobOutcome:
        """The compile thread's work for one job: load the saved graphs, or compile (and save) one for the job's
        inputs, unless a graph it has already takes them."""
        if job.args is None:
            return JobOutcome(loaded=self.load_saved(job.number))
        with torch.set_grad_enabled(job.grad):  # the pass's (thread-local): guards check it, traces run under it
            return self.compile_for(job)

    def compile_for(self, job) -> JobOutcome:
        graphs = list(self.graphs)
        if self.breaks_at is not None or any(graph.guard_check(self.module, *job.args) for _, graph in graphs):
            return JobOutcome()
        if len(graphs) >= RECOMPILE_LIMIT:  # said once: the thread skips the asks after it
            said, self.full = self.full, True
            warning = f"{self.name}: {RECOMPILE_LIMIT} graphs, no more: passes no graph takes run eager"
            return JobOutcome(warning=None if said else warning)
        try:
            graph = aot_compile(self.compiler, job.args)
        except torch._dynamo.exc.Unsupported as err:  # AOT compile needs one whole graph
            self.breaks_at = job.number
            return JobOutcome(warning=f"{self.name}: its layers break the graph ({first_line(err)}): they run eager")
        except Exception as err:  # Inductor's or the C++ compiler's failure, a killed compile worker, a full disk
            return JobOutcome(warning=f"{self.name}: a compile failed ({first_line(err)}): those passes run eager")
        self.save(graph)
        self.graphs.append((job.number, self.ready(graph)))
        return JobOutcome(compiled=1)

    def save(self, graph) -> None:
        """Into the cache whole or not at all: written aside, then renamed (a process stopped mid-write leaves a
        `.partial` file that no start loads)."""
        partial = self.directory / f".{uuid.uuid4().hex}.partial"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(partial))
            partial.replace(self.directory / f"{uuid.uuid4().hex}.graph")
        except Exception:  # a read-only or full cache, something unpicklable: this process still has the graph
            partial.unlink(missing_ok=True)

    def load_saved(self, number: int) -> int:
        """Add every saved graph as job `number`'s; remove the files that no longer load (cut off by a full disk or
        a killed writer). How many loaded."""
        for path in sorted(self.directory.glob("*.graph")):
            try:
                with path.open("rb") as file:
                    graph = torch.compiler.load_compiled_function(file, f_globals=self.eager.__func__.__globals__)
            except Exception:  # whatever its unpickling raises: the graph is compiled again
                path.unlink(missing_ok=True)
                continue
            self.graphs.append((number, self.ready(graph)))
        return len(self.graphs)

    @staticmethod
    def ready(graph):
        graph.disable_guard_check()  # `matching` has checked them; calling would check again
        return graph


def aot_compile(compiler, args: tuple):
    """`compiler`'s whole graph for `args`, with its guards. Floats are constants: one trace, no restart. Sizes that
    happen to be equal (a batch of 2 and 2 KV heads, a prompt pass's length and its span) are kept apart, so a graph
    does not take them as one."""
    with torch._dynamo.config.patch(specialize_float=True), fx_config.patch(use_duck_shape=False):
        return compiler.aot_compile((args, {}))


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]


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
