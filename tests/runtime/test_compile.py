"""`--compile`: prompt and decode passes through compiled graphs give the tokens and acceptance counts of the
eager runtime with a fraction of its ops per step, and a later process loads the graphs an earlier one saved
instead of tracing the step again (one test: compiling costs a minute on 2 cores)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch._dynamo.utils import counters
from torch.profiler import profile

from specdoctor.battery import battery_prompts
from specdoctor.runtime.background_compile import BackgroundCompiler
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import load_codec
from specdoctor.runtime.compile import (
    LayerGraphs,
    aot_compile,
    compile_layers,
    kept_guards,
    measured_once,
    saved_graphs_dir,
)
from specdoctor.runtime.decode.batch import decode_batch
from specdoctor.runtime.decode.requests import GenerateRequest
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.moe_paths import fewest_grouped_tokens, grouped_from_key
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.runtime.warmup import warmup_prompts
from specdoctor.workflow.compile_progress import CompileProgress
from specdoctor.workflow.serve import warm_up_shapes


def decode_profiled(compile: bool, prompts: list[list[int]]) -> tuple[list, float, int, int]:
    """([tokens, finish reasons, acceptance counters] of one batch at k 3 on a rank loaded as the runtime loads
    it, as JSON gives them back; top-level ops per decode step; compiled-graph calls; decode steps)."""
    model, _ = load_rank(RuntimeOptions("demo", num_speculative_tokens=3, compile=compile), 0)
    request = GenerateRequest(prompts, 24, num_speculative_tokens=3)
    decode_batch(model, request)  # with --compile: asks for the graphs of this batch's shapes (or loads them)
    model.finish_compiles()
    if compile:
        assert not model.graphs.status.warnings, model.graphs.status
    with profile() as trace:
        result = decode_batch(model, request)
    ops = sum(1 for event in trace.events() if event.cpu_parent is None)
    graph_calls = sum(1 for event in trace.events() if event.name.startswith("## Call CompiledFxGraph"))
    outputs = [result.tokens, result.finish_reasons, result.metrics.to_dict()]
    steps = result.rank_times[0]["steps"]
    return json.loads(json.dumps(outputs)), ops / steps, graph_calls, steps


def prompts(count: int = 3) -> list[list[int]]:
    """The first `count` battery prompts' token ids."""
    checkpoint = Checkpoint("demo")
    return battery_prompts(None, checkpoint, load_codec(checkpoint, None))[0][:count]


def decode_in_a_new_process(env: dict) -> tuple[list, int]:
    """(the compiled decode's outputs, graphs Dynamo traced) in a process of its own, as a second start."""
    code = (
        "import json; from torch._dynamo.utils import counters; from tests.runtime import test_compile as t; "
        "out = t.decode_profiled(True, t.prompts())[0]; print(json.dumps([out, counters['stats']['unique_graphs']]))"
    )
    root = Path(__file__).resolve().parents[2]  # where `tests` imports from
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    return tuple(json.loads(done.stdout.splitlines()[-1]))


def compiled_and_eager(module: torch.nn.Module) -> tuple:
    """(`module.run_layers` through graphs compiled behind its calls, as it was before)."""
    eager = module.run_layers
    compile_layers(module, BackgroundCompiler())
    return module.run_layers, eager


def swap_in(compiled: LayerGraphs) -> None:
    """Wait for the graphs its calls asked for, then swap them in (a step boundary)."""
    compiled.background.wait_idle()
    compiled.background.swap_ready()


INDUCTOR_COMPILE = torch.compile


# The guards Inductor adds on a pass's inputs as it lowers the demo's graphs (torch 2.13), beyond Dynamo's, and why
# neither splits the passes the warm-up test sends: two sizes it found equal (the positions' rows and the KV plan's, a
# batch's rows in every pass), and `sort`'s int16 indices (the grouped GEMM sorts a pass's top-2 expert choices, 2·B·T
# of them: from 32,767 on Inductor falls back to aten's sort, another graph; the test's passes are far under).
SORT_INDEX_LIMIT = 32767  # int16's largest
KNOWN_INDUCTOR_GUARDS = (
    re.compile(r"LAMBDA_GUARD: L\['positions'\]\.size\(\)\[0\] == L\['cache'\]\._plan\[0\]\.size\(\)\[0\]"),
    re.compile(rf"LAMBDA_GUARD: 2\*L\['\w+'\]\.size\(\)\[\d\]\*L\['\w+'\]\.size\(\)\[\d\] < {SORT_INDEX_LIMIT}"),
)
DEMO_EXPERTS = "8x256x192 torch.float32"  # the demo's routed experts, as a rank's MoE-path measurement names them


def grouped_gemm_from(tokens: int) -> None:
    """The demo's grouped-GEMM crossover recorded as if this machine had measured it (in the test's compile cache)."""
    measured_once(grouped_from_key(DEMO_EXPERTS), lambda: tokens)


def traced_only(fn, **settings):
    """`torch.compile` as `LayerGraphs` calls it, with the graph run by AOTAutograd's eager backend instead of lowered
    by Inductor: Dynamo's trace and guards, kept as --compile keeps them, in seconds instead of a minute. Inductor adds
    guards of its own as it lowers: the first test checks that it adds none but KNOWN_INDUCTOR_GUARDS on an input."""
    options = {"guard_filter_fn": settings.pop("options")["guard_filter_fn"]}
    return INDUCTOR_COMPILE(fn, backend="aot_eager", options=options, **settings)


def guards(graph) -> set[str]:
    """A graph's guards as torch prints them (its shape guards included, which `code_parts` lacks), less the lines of
    source that each cites."""
    return {line.lstrip("| +-").split("  #")[0] for line in str(graph._artifacts.guard_manager).splitlines()}


def input_guards_inductor_adds(monkeypatch) -> list[list[str]]:
    """Filled as the compile thread compiles: per graph, the guards Inductor added to the traced-only graph's of the
    same inputs that name one of the pass's inputs rather than the module (`L['self']`) and are none of
    KNOWN_INDUCTOR_GUARDS."""
    added, compile_for = [], LayerGraphs.compile_for

    def also_traced_only(self, job):
        outcome = compile_for(self, job)
        if outcome.compiled:
            settings = dict(dynamic=True, fullgraph=True, options={"guard_filter_fn": kept_guards})
            traced = aot_compile(traced_only(self.eager, **settings), job.args)
            extra = guards(self.graphs[-1][1]) - guards(traced)
            on_inputs = [guard for guard in extra if set(re.findall(r"L\['(\w+)'\]", guard)) - {"self"}]
            added.append([guard for guard in on_inputs if not any(k.fullmatch(guard) for k in KNOWN_INDUCTOR_GUARDS)])
        return outcome

    monkeypatch.setattr(LayerGraphs, "compile_for", also_traced_only)
    return added


@pytest.mark.timeout(1500)
def test_compiled_decode_gives_the_eager_tokens_with_fewer_ops_and_a_second_start_loads_its_graphs(
    compile_cache, monkeypatch
):
    # The grouped GEMM from 16 tokens, whatever this machine measures: the batch's prompt pass takes it, so its
    # graphs hold every MoE path (every expert in the verify passes, gathered experts in the chain's later steps).
    grouped_gemm_from(16)
    eager, eager_ops, _, _ = decode_profiled(False, prompts())
    graphs_before = counters["stats"]["unique_graphs"]
    added_input_guards = input_guards_inductor_adds(monkeypatch)
    compiled, compiled_ops, graph_calls, steps = decode_profiled(True, prompts())
    # What the warm-up test, tracing only, can stand for: Inductor's lowering guards the module's parameters (an
    # accumulator for a reduction over a weight's row, at most 8,192 long) and, on the passes' sizes, only
    # KNOWN_INDUCTOR_GUARDS.
    assert len(added_input_guards) >= 2 and not any(added_input_guards), added_input_guards
    assert compiled == eager
    assert eager[2]["num_accepted_tokens"] > 0
    assert counters["stats"]["unique_graphs"] - graphs_before >= 2  # the stage's layers; the MTP draft chain
    # The head, verification and bookkeeping stay eager; the layers become a few kernels. The prompt pass and each
    # step call two graphs: the stage's layers and the whole draft chain (its k = 3 MTP steps).
    assert compiled_ops < eager_ops / 2, (compiled_ops, eager_ops)
    assert graph_calls == 2 * (steps + 1), (graph_calls, steps)

    saved = sorted(compile_cache.rglob("*.graph"))
    assert len(saved) >= 2, saved
    env = {name: value for name, value in os.environ.items() if name != "TORCHINDUCTOR_CACHE_DIR"}
    again, traced = decode_in_a_new_process(env)
    assert again == eager and traced == 0  # every graph loaded, none traced

    # Cut off (a full disk, a killed writer): every graph of one module (the one with the most) is compiled again and
    # replaced, and the other module's load. (How many graphs a module needs depends on what Dynamo has seen in the
    # process: a graph traced from a decode step also takes prompt passes, not always the other way round.)
    directories = {path.parent for path in saved}
    broken = max(([path for path in saved if path.parent == directory] for directory in directories), key=len)
    assert len(directories) == 2, saved
    for path in broken:
        path.write_bytes(path.read_bytes()[:1000])
    again, traced = decode_in_a_new_process(env)
    now = set(compile_cache.rglob("*.graph"))
    assert again == eager and 1 <= traced <= len(broken)
    assert not now & set(broken) and set(saved) - set(broken) <= now  # the cut-off files replaced, the others kept
    assert len(now) == len(saved) - len(broken) + traced


@pytest.mark.slow  # about 2 minutes: the demo's graphs for batches 1 to 4 and its prompt passes, traced only
@pytest.mark.timeout(1500)
def test_prompts_and_batches_between_the_warmup_shapes_run_the_graphs_the_warmup_asked_for(compile_cache, monkeypatch):
    """`serve` (prefix caching on) warms up the prompts `warmup_prompts` gives for its batch limit (4 here), so that
    its ranks ask for every graph a request can need before traffic meets it, whatever its prompt's length and cached
    blocks. The demo's MoE layers gather experts for passes of up to 4 tokens: a 3-row draft chain takes both paths (a
    first pass of 12 tokens, later ones of 3), and a batch-1 prompt (31 tokens, then 25) every expert in its prompt
    pass and gathered ones in its decode steps. A one-token prompt is a size of 1; so is the one token left to compute
    of a prompt of 16n + 1 tokens whose blocks an earlier request left in the prefix cache, over a longer cache; three
    of either join at once. Past G = 16 tokens (serve's crossover on one compute thread, kept as if measured) a pass
    runs the grouped GEMM: the 3-row prompt passes do. (A warm-up that misses a graph costs only eager passes now,
    until the graph compiles behind them; when graphs compiled in the step, a burst of six one-token prompts waited
    14 to 39 s. The test ran to a batch limit of 8, and at G = 64 too, for 11 minutes of CI more.) Whether a pass
    needs a graph of its own is for Dynamo's guards to say, so the graphs are traced, not lowered by Inductor
    (`traced_only`: a fifth of the time; of the guards Inductor adds on a pass's sizes, the first test shows, none
    splits these passes)."""
    monkeypatch.setattr(torch, "compile", traced_only)
    grouped_from = 16
    grouped_gemm_from(grouped_from)
    options = RuntimeOptions("demo", num_speculative_tokens=3, enable_prefix_caching=True)
    model, info = load_rank(replace(options, compile=True), 0)
    limit = info["gathered_token_limit"]
    assert 3 <= limit < 6, limit
    assert fewest_grouped_tokens([info]) == grouped_from
    for warmup in warmup_prompts(4, limit, grouped_from):  # as serve's, adaptive: every kind of step
        decode_batch(model, GenerateRequest(warmup, 10, num_speculative_tokens=3, every_step_kind=True))
    model.finish_compiles()
    graphs = counters["stats"]["unique_graphs"]
    battery = prompts(9)
    batches = [battery[:rows] for rows in (1, 3)] + [[battery[8]], [battery[0][:1]]]
    batches += [[battery[4][:1]] * 3]  # three one-token prompts at once
    batches += [[battery[1][:33]], [battery[2][:17], battery[3][:17]], [battery[5][:17]] * 3]  # all but one cached
    requests = [GenerateRequest(batch, 8, num_speculative_tokens=3) for batch in batches]
    requests += [GenerateRequest(batch, 10, num_speculative_tokens=3, every_step_kind=True) for batch in batches]
    assert max(2 * len(batch) * max(map(len, batch)) for batch in batches) < SORT_INDEX_LIMIT  # a sort's int16 indices
    compiled = [decode_batch(model, request) for request in requests]
    model.finish_compiles()
    assert counters["stats"]["unique_graphs"] == graphs  # what they asked for, a warm-up graph took: none traced
    assert [run.cached_tokens for run in compiled[-3:]] == [[32], [16, 16], [16] * 3]
    eager, _ = load_rank(options, 0)
    assert [run.tokens for run in compiled] == [decode_batch(eager, request).tokens for request in requests]


def test_serve_warms_up_prompts_past_the_gathered_expert_limit_the_ranks_report():
    """`serve`'s warm-up plan at PP 2 (run eager here: the plan is the same): the ranks report where their MoE layers
    stop gathering experts (the demo's: 8 experts, top 2, so 4 tokens), and after two-token prompts at batch 1, 2 and
    4 come one-token prompts, then prompts of 17 tokens (past the limit, all but one token in a block) twice each, at
    batch 1 and 2; where the ranks measured the grouped GEMM faster from G tokens, a prompt just past the limit and
    one just past G tokens a batch follow at each."""
    with Engine(RuntimeOptions("demo", pp=2, num_speculative_tokens=3, timeout=60)) as engine:
        assert [info["gathered_token_limit"] for info in engine.rank_info] == [4, 4]
        shown, generate = [], engine.generate

        def recorded(prompts, *args, **kwargs):
            shown.append((len(prompts), len(prompts[0])))
            return generate(prompts, *args, **kwargs)

        engine.generate = recorded
        warm_up_shapes(engine, 4, CompileProgress(Console(file=io.StringIO())))
        grouped = engine.grouped_from
    expected = [(1, 2), (2, 2), (4, 2), (1, 1), (2, 1)]
    for batch in (1, 2):
        expected += [(batch, 17), (batch, 17)]
        if grouped:  # past 4 tokens, and past G tokens, a batch
            expected += [(batch, tokens) for tokens in sorted({4 // batch + 1, grouped // batch + 1} - {17})]
    assert shown == expected


class BreaksTheGraph(torch.nn.Module):
    """Layers with a call Dynamo cannot put in a graph (as a host read or an opaque kernel would be)."""

    graph_methods = ("run_layers",)  # what compile_layers routes through graphs

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).relu()
        torch._dynamo.graph_break()
        return self.proj(x).tanh()


def test_layers_that_break_the_graph_run_eager_with_a_warning_and_save_nothing(compile_cache):
    compiled, eager = compiled_and_eager(BreaksTheGraph())
    for batch in (1, 2, 3):
        x = torch.randn(batch, 4, 16)
        torch.testing.assert_close(compiled(x), eager(x))
        swap_in(compiled)
    status = compiled.background.status
    assert compiled.runs_eager and not compiled.active and status.compiled == 0
    assert [warning for warning in status.warnings if "break the graph" in warning], status.warnings
    assert not list(compile_cache.rglob("*.graph"))


class WithAConstant(torch.nn.Module):
    """Layers that read a constant the module can change between passes (as the stage's tap entries change)."""

    graph_methods = ("run_layers",)  # what compile_layers routes through graphs

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.taps: tuple[int, ...] = (1,)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * len(self.taps)


def test_saved_graphs_check_the_inputs_and_the_modules_constants_but_not_its_parameters(compile_cache):
    module = WithAConstant()
    compiled, eager = compiled_and_eager(module)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(compiled(x), eager(x))  # eager, and asks for a graph
    swap_in(compiled)
    torch.testing.assert_close(compiled(x), eager(x))  # the graph
    module.taps = (1, 2)  # the first graph's guard on the constant fails: eager, and a second graph asked for
    torch.testing.assert_close(compiled(x), eager(x))
    swap_in(compiled)
    other = torch.randn(4, 5, 16)
    torch.testing.assert_close(compiled(other), eager(other))  # other sizes: the second graph
    graphs = compiled.active
    assert len(graphs) == 2 and len(list(compile_cache.rglob("*.graph"))) == 2
    assert compiled.last_for_shapes[((4, 5, 16),)] is graphs[1]
    for graph in graphs:
        guards = graph._artifacts.guard_manager.code_parts
        assert any("taps" in line for line in guards) and any("L['x']" in line for line in guards), guards
        assert not any("_parameters" in line or "_modules" in line for line in guards), guards


class TiedLayers(torch.nn.Module):
    """Two projections that may share one weight (as tied embeddings and heads do)."""

    graph_methods = ("run_layers",)  # what compile_layers routes through graphs

    def __init__(self, tied: bool):
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        if tied:
            self.second.weight = self.first.weight

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).tanh())


def test_a_graph_traced_with_one_tensor_under_two_names_refuses_a_module_where_they_are_two(compile_cache):
    tied = TiedLayers(tied=True)
    compiled, eager = compiled_and_eager(tied)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(compiled(x), eager(x))
    swap_in(compiled)
    (graph,) = compiled.active  # through AOT compile: saved
    untied = TiedLayers(tied=False)
    untied.load_state_dict(tied.state_dict())  # the same values, in two tensors
    assert graph.guard_check(tied, x) and not graph.guard_check(untied, x)


def test_saved_graphs_are_kept_apart_by_the_ranks_thread_count():
    """Inductor writes a CPU kernel for the intra-op thread count (serial code for one thread), and `serve`'s ranks
    run one thread fewer than `bench`'s: a graph saved at one count must not be loaded at another."""
    module, threads = torch.nn.Linear(2, 2), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = saved_graphs_dir(module, "forward")
        torch.set_num_threads(2)
        assert saved_graphs_dir(module, "forward") != one
        assert saved_graphs_dir(module, "forward") == saved_graphs_dir(module, "forward")
    finally:
        torch.set_num_threads(threads)
