"""The sweeps that read acceptance against a condition of the traffic: context length, prefix cache and
concurrency (docs/probe.md). Each compares its groups of requests with the first (the shortest prompts, the
cold ones, one request at a time) by position-0 acceptance, the rate every source but SGLang counts."""

from __future__ import annotations

import secrets

from specdoctor.checks.acceptance import broken_position0_limit
from specdoctor.probe import prometheus
from specdoctor.probe.client import Probe, Served, Window
from specdoctor.probe.corpus import corpus_prompt
from specdoctor.probe.options import SweepOptions
from specdoctor.probe.stats import ALPHA, drop_p_value, rate_upper_bound
from specdoctor.probe.verdicts import not_run, point, sweep_of
from specdoctor.report import Finding, Sweep

CONTEXT_START = 128  # the first bucket's length; each next one doubles
CONTEXT_FILL = 0.9  # the last bucket fills this share of what max_model_len leaves after max_tokens
# A corpus stretch whose token count gives the server's characters per token: a few hundred tokens, which any
# max_model_len holds.
CALIBRATION_CHARS = 800

CONTEXT_HINT = (
    "vLLM drafts dummy token 0 once a sequence passes a draft model's max_model_len (vllm#58080: give the draft "
    "the target's length); a drafter without the target's RoPE scaling, or a sliding-window drafter run with full "
    "attention (vLLM PR #40898), fails past its trained range: compare the drafter's config with the target's"
)
PREFIX_HINT = (
    "prompts restored from the prefix cache lose the drafter's context K/V (vllm#47930: DFlash/DSpark, 2.98 -> 1.25; "
    "vllm#43559 with MTP): confirm with --no-enable-prefix-caching (vLLM) or --disable-radix-cache (SGLang), "
    "then upgrade"
)
PREFIX_HITS = "vllm:prefix_cache_hits"  # vLLM's counter of prompt tokens found in its prefix cache
PREFIX_PROMPT_TOKENS = 128  # most of each warm prompt is then restored from whole cached blocks
PREFIX_PROMPTS = 48  # and PREFIX_MAX_TOKENS each: about 800 drafts a group at a mean length of 2
PREFIX_MAX_TOKENS = 32
CONCURRENCY_HINT = (
    "rows of a batched drafter step read what they should not: padded or stale rows (vllm#26191, tokenspeed#955) "
    "or CUDA graphs captured for another batch (vLLM PRs #54374, #52816): rerun with --enforce-eager (vLLM) or "
    "--disable-cuda-graph (SGLang) to see whether the graphs are at fault"
)


def position0_rate(window: Window) -> float:
    accepted, drafts = window.position0
    return accepted / drafts


def context_lengths(options: SweepOptions, max_len: int, max_tokens: int) -> list[int]:
    """The buckets' prompt lengths in tokens: the user's, else doubling from CONTEXT_START to the longest that
    fits (a prompt's token count is estimated from its characters: CONTEXT_FILL leaves room for the error)."""
    longest = int((max_len - max_tokens) * CONTEXT_FILL)
    if options.context_lengths:
        return sorted({length for length in options.context_lengths if length <= longest})
    lengths = [CONTEXT_START]
    while lengths[-1] * 2 < longest:
        lengths.append(lengths[-1] * 2)
    # The longest replaces a doubling it would nearly repeat (1,024 beside 1,030).
    return [length for length in lengths if length * 1.25 < longest] + [longest]


def context_sweep(probe: Probe, served: Served, options: SweepOptions, baseline: float | None) -> Sweep:
    max_len = options.max_context or served.max_model_len
    if max_len is None:
        return not_run("context", "the server reports no max_model_len in /v1/models: pass --max-context")
    lengths = context_lengths(options, max_len, probe.options.max_tokens)
    if len(lengths) < 2:
        return not_run("context", f"a max_model_len of {max_len} leaves room for fewer than two prompt lengths")
    per_token = chars_per_token(probe, served)
    if isinstance(per_token, str):
        return not_run("context", per_token)
    count = options.sweep_prompts
    windows = []
    for length in lengths:
        prompts = [corpus_prompt(i, count, int(length * per_token)) for i in range(count)]
        window = probe.measure(served.model, prompts)
        if window.errors:
            return not_run("context", f"prompts of about {length} tokens failed: {window.errors[0]}")
        windows.append(window)
    labels = [f"{prompt_tokens(window):,} tokens" for window in windows]
    return compare_groups("context", windows, labels, baseline, cliff=True, hint=CONTEXT_HINT)


def chars_per_token(probe: Probe, served: Served) -> float | str:
    """The server's characters per token on the corpus, from a prompt's usage.prompt_tokens; or why not."""
    reply = probe.complete(served.model, corpus_prompt(0, 1, CALIBRATION_CHARS), max_tokens=1)
    tokens = (reply.get("usage") or {}).get("prompt_tokens")
    if not isinstance(tokens, int) or tokens <= 0:
        return f"a text prompt got no usage.prompt_tokens: {reply.get('error', reply)}"
    return CALIBRATION_CHARS / tokens


def prefix_cache_sweep(probe: Probe, served: Served) -> Sweep:
    """The same long prompts twice: cold (a random first line: never seen), then warm (their blocks cached)."""
    per_token = chars_per_token(probe, served)
    if isinstance(per_token, str):
        return not_run("prefix-cache", per_token)
    nonce = secrets.token_hex(8)
    body = int(PREFIX_PROMPT_TOKENS * per_token)
    prompts = [f"# {nonce} {i}\n" + corpus_prompt(i, PREFIX_PROMPTS, body) for i in range(PREFIX_PROMPTS)]
    cold = probe.measure(served.model, prompts, max_tokens=PREFIX_MAX_TOKENS)
    before = probe.samples()
    warm = probe.measure(served.model, prompts, max_tokens=PREFIX_MAX_TOKENS)
    after = probe.samples()
    failed = cold.errors + warm.errors
    if failed:
        return not_run("prefix-cache", f"{len(failed)} requests failed: {failed[0]}")
    hits = cached_tokens(warm, before, after)
    if hits is None:
        return not_run(
            "prefix-cache",
            "the server reports no prefix-cache hits, so a cache that never hits would pass "
            "(vLLM: --enable-prompt-tokens-details, or its /metrics)",
        )
    if hits == 0:
        return not_run("prefix-cache", "the warm prompts found nothing in the prefix cache: caching is off")
    sweep = compare_groups("prefix-cache", [cold, warm], ["cold", "warm"], None, cliff=False, hint=PREFIX_HINT)
    total = sum((reply.get("usage") or {}).get("prompt_tokens", 0) for reply in warm.replies)
    sweep.summary += f"; warm prompt tokens cached: {hits:,} of {total:,}"
    return sweep


def cached_tokens(warm: Window, before: list | None, after: list | None) -> int | None:
    """The warm prompts' tokens found in the prefix cache: from their usage (vLLM with
    --enable-prompt-tokens-details, specdoctor serve), else vLLM's hit counter around them; None when neither."""
    details = [(reply.get("usage") or {}).get("prompt_tokens_details") or {} for reply in warm.replies]
    counts = [entry.get("cached_tokens") for entry in details]
    if counts and all(isinstance(count, int) for count in counts):
        return sum(counts)
    hits = [prometheus.counter(samples, PREFIX_HITS) if samples else None for samples in (before, after)]
    return None if None in hits else int(hits[1] - hits[0])


def concurrency_sweep(probe: Probe, served: Served, options: SweepOptions, prompts: list) -> Sweep:
    levels = sorted(set(options.concurrency))
    windows = []
    for level in levels:
        group = [prompts[i % len(prompts)] for i in range(max(len(prompts), level))]
        window = probe.measure(served.model, group, concurrency=level)
        if window.errors:
            return not_run(
                "concurrency", f"the server failed {len(window.errors)} requests at {level}: {window.errors[0]}"
            )
        windows.append(window)
    labels = [f"{level} in flight" for level in levels]
    return compare_groups("concurrency", windows, labels, None, cliff=False, hint=CONCURRENCY_HINT)


def prompt_tokens(window: Window) -> int:
    """The group's mean prompt length, as the server counted it."""
    counts = [(reply.get("usage") or {}).get("prompt_tokens", 0) for reply in window.replies]
    return round(sum(counts) / len(counts)) if counts else 0


def compare_groups(
    name: str, windows: list[Window], labels: list[str], baseline: float | None, cliff: bool, hint: str
) -> Sweep:
    """Each later group against the first. Concurrency (the same prompts at each level: any real drop is a
    fault) fails on a significant drop; context (other prompts at each length) fails on a cliff: a length whose
    position-0 rate is, with confidence, under the broken-drafter limit, and warns on a significant halving."""
    points = [point(label, window) for label, window in zip(labels, windows, strict=True)]
    stopped = [label for label, window in zip(labels, windows, strict=True) if not window.drafted]
    if windows[0].drafted and stopped:  # the first group drafted, a later one not once: speculation stopped there
        message = f"no draft was proposed at {stopped[0]}, where {labels[0]} drafted: speculative decoding stopped"
        finding = Finding(f"probe.{name}", "error", message, hint, name, {"from": stopped[0]})
        return sweep_of(name, message, windows[0].source, points, [finding])
    if any(window.position0 is None for window in windows):
        return not_run(name, f"the {windows[0].source} figures count no position-0 acceptances", points=points)
    reference, limit = windows[0].position0, broken_position0_limit(baseline)
    if cliff and position0_rate(windows[0]) < limit:
        return not_run(name, f"acceptance already collapsed at {labels[0]} (the battery's finding)", points=points)
    alpha = ALPHA / (len(windows) - 1)  # Bonferroni over the comparisons with the first group
    first = position0_rate(windows[0])
    cliffs, drops = [], []
    for index, window in enumerate(windows[1:], start=1):
        p_value, rate = drop_p_value(reference, window.position0), position0_rate(window)
        if cliff and rate_upper_bound(*window.position0, alpha) < limit:
            cliffs.append((index, p_value))
        elif p_value < alpha and (not cliff or rate < first / 2):
            drops.append((index, p_value))
    findings = []
    for found, severity in ((cliffs, "error"), (drops, "warning" if cliff else "error")):
        if found:
            index, p_value = found[0]
            before, window = windows[index - 1], windows[index]
            evidence = (
                f"mean acceptance length {before.mean_length:.2f} at {labels[index - 1]}, {window.mean_length:.2f} "
                f"from {labels[index]} (position 0: {first:.0%} at {labels[0]}, {position0_rate(window):.0%} "
                f"from {labels[index]}; p = {p_value:.1e})"
            )
            what = "falls off a cliff" if found is cliffs else f"falls with {name}"
            data = {"from": labels[index], "p_value": p_value, "limit": limit, "alpha": alpha}
            findings.append(Finding(f"probe.{name}", severity, f"acceptance {what}: {evidence}", hint, name, data))
    shown = ", ".join(f"{w.mean_length:.2f} at {label}" for w, label in zip(windows, labels, strict=True))
    floor = (
        f"; cliff limit the {limit:.0%} floor: the server returns no token ids" if cliff and baseline is None else ""
    )
    return sweep_of(name, f"mean acceptance length {shown}{floor}", windows[0].source, points, findings)
