"""Where a serving load's time goes, in one process: `serve`'s continuous batching loop (`RunningBatch`) on the
demo, compiled and warmed up as `serve` warms up, on the threads `serve` gives its rank, with `serve`'s prefix
caching, and c streams each sending the battery prompts back to back (a request joins as soon as one finishes;
each makes --max-tokens tokens, no stop tokens, as with `ignore_eos`). No HTTP, tokenizer or rank processes: the
time split between admitting requests (their prompt passes, joined into the running batch), dropping finished rows
and decode steps, tokens/s over the three, and what one join and one step cost: the joiners, their prompt tokens
computed (past the blocks prefix caching restored) and the milliseconds, against a step's rows and milliseconds.
With several --num-speculative-tokens, each k runs the same loads in turn (k 0: plain decoding, the drafter
loaded but not run); each k > 0 with adaptive speculation (`serve`'s default) and with every step speculating.

    python -m benchmarks.serve_replay [--streams 1 16] [--num-speculative-tokens 3] [--requests 96] [--max-tokens 64]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import time

import torch
from rich.console import Console
from rich.progress import Progress

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from specdoctor.battery import battery_prompts
from specdoctor.commands.serve import serve
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import load_codec
from specdoctor.runtime.decode.batch import decode_batch
from specdoctor.runtime.decode.continuous import RunningBatch, merge_updates
from specdoctor.runtime.decode.requests import GenerateRequest, SequenceRequest
from specdoctor.runtime.moe_paths import fewest_grouped_tokens
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.protocol import Command, Join, Order
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.runtime.rank_process import rank_threads
from specdoctor.runtime.warmup import warmup_prompts
from specdoctor.workflow.serve import HOST_CORES, ServeOptions

PREFIX_CACHING = inspect.signature(serve).parameters["enable_prefix_caching"].default  # serve's default


@torch.no_grad()
def replay(
    model, k: int, adaptive: bool, prompts: list[list[int]], streams: int, requests: int, max_tokens: int
) -> dict:
    running = RunningBatch(model, k, sampled_drafts=False, adaptive=adaptive)
    seconds = {"admit": 0.0, "drop": 0.0, "step": 0.0}
    sent = finished = tokens = steps = joins_run = joiners = prompt_tokens = rows = 0
    prompt_of: dict[str, list[int]] = {}

    def joins(count: int) -> list:
        nonlocal sent
        new = [
            Order(Command.JOIN, Join(str(sent + n), SequenceRequest(prompts[(sent + n) % len(prompts)], max_tokens)))
            for n in range(count)
        ]
        prompt_of.update((join.request_id, join.sequence.prompt) for _, join in new)
        sent += count
        return new

    def timed(phase: str, call, *args):
        start = time.perf_counter()
        result = call(*args)
        seconds[phase] += time.perf_counter() - start
        return result

    messages = joins(min(streams, requests))
    while finished < requests:
        timed("admit", running.apply, messages)
        joins_run, joiners = joins_run + bool(messages), joiners + len(messages)
        news = timed("drop", running.updates)  # a joiner's first token, or a row its prompt pass finished
        # a joiner's first news: the prompt tokens its pass computed, past those prefix caching restored
        firsts = [(prompt_of.pop(rid), update) for rid, update in news.items() if rid in prompt_of]
        prompt_tokens += sum(len(prompt) - update.cached_tokens for prompt, update in firsts)
        rows += len(running.ids)
        timed("step", running.step)
        news.update(merge_updates(news, timed("drop", running.updates)))  # a joiner's first token, then its step's
        steps += 1
        tokens += sum(len(update.new_tokens) for update in news.values())
        done = sum(1 for update in news.values() if update.finish_reason)
        finished += done
        messages = joins(min(done, requests - sent))
    wall = sum(seconds.values())
    per_join = {
        "joiners_per_join": joiners / joins_run,
        "prompt_tokens_per_join": prompt_tokens / joins_run,
        "ms_per_join": 1000 * seconds["admit"] / joins_run,
        "rows_per_step": rows / steps,
        "ms_per_step": 1000 * seconds["step"] / steps,
    }
    return {
        "k": k,
        "adaptive": adaptive,
        "streams": streams,
        "tokens": tokens,
        "steps": steps,
        "tokens_per_s": tokens / wall,
        **seconds,
        **per_join,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[3])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_json_option(parser, "serve_replay")
    args = parser.parse_args()
    checkpoint = Checkpoint("demo")
    prompts = battery_prompts(None, checkpoint, load_codec(checkpoint, None))[0]
    torch.set_num_threads(rank_threads(1, HOST_CORES))  # as `serve` sets its one rank's
    speculative = max(args.num_speculative_tokens)  # the drafter loaded where any k runs it
    options = RuntimeOptions(
        "demo", num_speculative_tokens=speculative, compile=True, enable_prefix_caching=PREFIX_CACHING
    )
    model, info = load_rank(options, 0)
    rows = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("warming up (compiling)", total=None)
        # as serve warms up at its default batch limit
        limits = info["gathered_token_limit"], fewest_grouped_tokens([info])
        for k in args.num_speculative_tokens:
            progress.update(task, description=f"k {k}: warming up (compiling)")
            for warmup in warmup_prompts(ServeOptions.max_num_seqs, *limits):  # every kind of step, as serve's
                request = GenerateRequest(warmup, 2 * k + 4, num_speculative_tokens=k, every_step_kind=k > 0)
                decode_batch(model, request)
            model.finish_compiles()  # the graphs compiled behind the warm-up, swapped in
            for adaptive, streams in itertools.product([True, False] if k else [False], args.streams):
                progress.update(task, description=f"k {k}{' adaptive' if adaptive else ''}, {streams} streams")
                rows.append(replay(model, k, adaptive, prompts, streams, args.requests, args.max_tokens))
    table = numeric_table(
        f"serving loop, in one process (demo, compiled, {args.requests} requests x {args.max_tokens} tokens)",
        (
            "k",
            "streams",
            "tok/s",
            "steps",
            "admit s",
            "drop s",
            "step s",
            "admit share",
            "joiners",
            "prompt tokens",
            "ms/join",
            "rows",
            "ms/step",
        ),
    )
    for row in rows:
        wall = row["admit"] + row["drop"] + row["step"]
        table.add_row(
            f"{row['k']}{' adaptive' if row['adaptive'] else ''}",
            str(row["streams"]),
            f"{row['tokens_per_s']:.0f}",
            str(row["steps"]),
            f"{row['admit']:.2f}",
            f"{row['drop']:.2f}",
            f"{row['step']:.2f}",
            f"{row['admit'] / wall:.0%}",
            f"{row['joiners_per_join']:.1f}",
            f"{row['prompt_tokens_per_join']:.1f}",
            f"{row['ms_per_join']:.1f}",
            f"{row['rows_per_step']:.1f}",
            f"{row['ms_per_step']:.1f}",
        )
    console = Console(width=140)
    console.print(table)
    console.print("admit: the joiners' prompt passes and joining the running batch; drop: finished rows leaving it")
    console.print("per join: joiners, prompt tokens computed (past the blocks prefix caching restored), ms; per step:")
    console.print(f"rows and ms. Prefix caching: {'on' if PREFIX_CACHING else 'off'}, as `serve`'s default")
    console.print(f"machine: {machine()}")
    write_json(args.json, {"max_tokens": args.max_tokens, "prefix_caching": PREFIX_CACHING, "rows": rows})


if __name__ == "__main__":
    main()
