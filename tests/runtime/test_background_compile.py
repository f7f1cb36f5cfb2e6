"""Graphs compiled behind the passes: a request runs eager until they are in, they swap in at a step boundary without
changing its tokens (greedy) or its draws (seeded sampling), and the TP ranks of a stage swap them in at the same step
whichever of them compiled first."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._inductor.loop_body import InterpreterShim
from torch.fx._symbolic_trace import _Patcher

from specdoctor.battery import battery_prompts
from specdoctor.runtime.background_compile import BackgroundCompiler, shape_class
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import load_codec
from specdoctor.runtime.compile import LayerGraphs, compile_layers
from specdoctor.runtime.decode.batch import decode_batch
from specdoctor.runtime.decode.requests import GenerateRequest
from specdoctor.runtime.launch import free_port
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.runtime.sampling import SamplingParams


def swapping_in_at_step(model, gate: threading.Event, step: int) -> tuple:
    """An `on_step` that lets the graphs in after `step` steps (the next step boundary swaps them in), and the list of
    how many graphs were active at each step."""
    active: list[int] = []

    def on_step(_result) -> None:
        active.append(model.graphs.status.active)
        if len(active) == step:
            gate.set()
            model.graphs.wait_idle()

    return on_step, active


@pytest.mark.timeout(900)
def test_graphs_swapped_in_mid_request_keep_its_greedy_tokens_and_its_seeded_draws(demo_compile_cache, gated_compiles):
    checkpoint = Checkpoint("demo")
    prompts = battery_prompts(None, checkpoint, load_codec(checkpoint, None))[0][:2]
    greedy = GenerateRequest(prompts, 40, num_speculative_tokens=3)
    seeded = GenerateRequest(prompts, 40, SamplingParams(0.8, 0, 0.95, seed=7), num_speculative_tokens=3)
    eager, _ = load_rank(RuntimeOptions("demo", num_speculative_tokens=3), 0)
    expected = [decode_batch(eager, request) for request in (greedy, seeded)]

    model, _ = load_rank(RuntimeOptions("demo", num_speculative_tokens=3, compile=True), 0)
    for request, reference in zip((greedy, seeded), expected, strict=True):
        gated_compiles.clear()
        decode_batch(model, request)  # eager: asks for the graphs of its shapes (or waits to load them)
        on_step, active = swapping_in_at_step(model, gated_compiles, 4)
        result = decode_batch(model, request, on_step=on_step)
        assert active[:4] == [active[0]] * 4 and active[-1] > active[0], active  # swapped in after step 4
        assert result.tokens == reference.tokens
        assert result.metrics.to_dict() == reference.metrics.to_dict()
    assert not model.graphs.status.failed and not model.graphs.status.warnings


class Toy(torch.nn.Module):
    graph_methods = ("run_layers",)  # what compile_layers routes through graphs

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).tanh()


def test_a_shape_class_is_asked_for_once_while_its_graph_is_on_its_way(gated_compiles, compile_cache):
    """Decode steps grow the cache span every step: one ask for their class, not one per span."""
    module = Toy()
    compiler = BackgroundCompiler()
    compile_layers(module, compiler)
    graphs = module.run_layers
    asked = compiler.status.requested  # the saved graphs' load
    for span in (5, 6, 7):
        graphs.background.request(graphs, (torch.zeros(3, 1, 8), torch.zeros(3, 1, 1, span)))
    graphs.background.request(graphs, (torch.zeros(1, 1, 8), torch.zeros(1, 1, 1, 5)))  # batch 1: a class of its own
    assert compiler.status.requested == asked + 2
    # sizes as Dynamo's duck sizing sees them: equal sizes one symbol, 0 and 1 as they are
    assert shape_class((torch.zeros(3, 1, 4), torch.zeros(3, 4), 2, None)) == (
        ("torch.float32", ("s0", 1, "s1")),
        ("torch.float32", ("s0", "s1")),
        2,
        None,
    )
    assert shape_class((torch.zeros(3, 5), torch.zeros(3, 3))) != shape_class((torch.zeros(3, 5), torch.zeros(3, 4)))


@pytest.mark.timeout(300)
def test_the_serving_thread_runs_passes_while_the_compile_thread_traces(compile_cache, monkeypatch):
    """A torch.fx trace patches nn.Module.__call__ for every thread while it runs. Each time the compile thread's
    trace patches it, the serving thread runs a pass of a module that trace does not know, before the trace goes on:
    each must run (a plain fx tracer fails it: "module is not installed as a submodule")."""
    InterpreterShim._dummy_gm.cache_clear()  # Inductor's lazy trace made anew, as in a fresh process
    patched, passes = queue.Queue(), []
    patch_method = _Patcher.patch_method

    def patch_and_wait(self, cls, name, new_fn, deduplicate=True):
        patch_method(self, cls, name, new_fn, deduplicate)
        if cls is torch.nn.Module and name == "__call__" and threading.current_thread().name == "specdoctor-compile":
            ran = threading.Event()
            patched.put(ran)
            assert ran.wait(timeout=60)

    monkeypatch.setattr(_Patcher, "patch_method", patch_and_wait)
    module, other, x = Toy(), Toy(), torch.randn(2, 3, 8)
    compiler = BackgroundCompiler()
    compile_layers(module, compiler)
    with torch.no_grad():
        expected = other.run_layers(x)
        module.run_layers(x)  # eager: asks for its graph
        while compiler.finished_jobs < compiler.status.requested or not patched.empty():
            with contextlib.suppress(queue.Empty):
                ran = patched.get(timeout=0.05)
                try:
                    passes.append(torch.equal(other.run_layers(x), expected))
                except NameError as error:
                    passes.append(str(error))
                ran.set()
    assert compiler.status.compiled == 1, compiler.status
    assert passes and all(ran is True for ran in passes), passes


def tp_rank(rank: int, port: int, cache: str, delayed: int, out: str) -> None:
    """One of two real processes in one gloo group: the same calls on both, `delayed`'s compile slower by seconds;
    writes, per step, how many graphs were active."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHINDUCTOR_CACHE_DIR=cache)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == delayed:
        run_job = LayerGraphs.run_job
        LayerGraphs.run_job = lambda self, job: (time.sleep(6), run_job(self, job))[1]
    torch.manual_seed(0)
    module = Toy()
    compiler = BackgroundCompiler(rank, dist.group.WORLD)
    compile_layers(module, compiler)
    active, x = [], torch.randn(2, 3, 8)
    with torch.no_grad():
        for _ in range(2000):  # 200 s at most: both compile in about 10-20 s on 2 cores
            compiler.swap_ready()
            module.run_layers(x)
            active.append(compiler.status.active)
            time.sleep(0.1)
            if len(active) > 1 and active[-2]:
                break  # on the same step on both ranks: it reads only what they agreed
    Path(out).write_text(" ".join(map(str, active)))
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_the_tp_ranks_of_a_stage_swap_a_graph_in_at_the_same_step_whichever_compiled_first(tmp_path):
    context = mp.get_context("spawn")
    port = free_port()
    outs = [tmp_path / f"rank{rank}.txt" for rank in range(2)]
    processes = [
        context.Process(target=tp_rank, args=(rank, port, str(tmp_path / "cache"), 1, str(outs[rank])))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=240)
        assert process.exitcode == 0
    steps = [out.read_text().split() for out in outs]
    assert steps[0] == steps[1], steps
    assert steps[0][0] == "0" and steps[0][-1] == "1", steps  # eager first, then the graph, on both at one step
