"""The sweeps that read acceptance against a condition of the traffic: context length, prefix cache and
concurrency (docs/probe.md). Each compares its groups of requests with the first (the shortest prompts, the
cold ones, one request at a time) by position-0 acceptance, the rate every source but SGLang counts."""

from __future__ import annotations

import secrets
import threading
from typing import NamedTuple

from specdoctor.checks.acceptance import broken_position0_limit
from specdoctor.probe import prometheus
from specdoctor.probe.client import Probe, Served, Window
from specdoctor.probe.corpus import STARTS, corpus_prompt
from specdoctor.probe.options import ALPHA, SweepOptions
from specdoctor.probe.stats import POWER, clustered_upper_bound, fall_p_value, prompts_for_power
from specdoctor.probe.verdicts import not_run, point, sweep_of
from specdoctor.report import Finding, Sweep

CONTEXT_START = 128  # the first bucket's length; each next one doubles
# The last bucket fills this share of what max_model_len leaves after max_tokens: a prompt's token count is estimated
# from its characters, and the corpus' density varies from stretch to stretch (by a quarter, measured).
CONTEXT_FILL = 0.8
# A bucket fails when its position-0 rate is, with confidence, under this share of the first bucket's, or under the
# broken-drafter limit (a cliff). Healthy drafters decay with context: the demo's fell to about half its first
# bucket's rate at 1,500 tokens (its models were trained on 128-token sequences), and at a keep of 1/2 its runs
# failed 14.7 % of the time at a nominal 5 % (benchmarks/probe_rates.py).
CONTEXT_KEEP = 1 / 3
# The buckets' prompts are as many as a fall to this share of the first bucket's rate needs to be found with
# stats.POWER (a partial fall, 50 % -> 13 %; demo-eagle3's head run past its 128-token training falls to 23 %:
# benchmarks/probe_rates.py's runs found it in 65 % sized for a fall to 20 %, in 95.8 % sized so), from the
# first bucket's own spread; at least MIN_SWEEP_PROMPTS (the spread's estimate), at most corpus.STARTS.
CONTEXT_SIZED_FOR = 0.25
MIN_SWEEP_PROMPTS = 8
# Corpus stretches whose token count gives the server's characters per token: CALIBRATION_CHARS from each of
# CALIBRATION_STARTS of the prompts' starts, a few hundred tokens in all, which any max_model_len holds.
CALIBRATION_CHARS = 100
CALIBRATION_STARTS = 8

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
# The warm prompts must find at least this share of their tokens in the cache, or the sweep compares little: their
# length is the shortest of 128, 256, ... tokens (then the most the server takes) at which a prompt sent twice finds
# it (an engine caches whole blocks, and with a drafter vLLM recomputes the last one it matched: its CPU build's
# 128-token blocks then need prompts of 257 tokens or more, and its 512-token test deployment leaves room for a
# quarter restored, whatever the density of each prompt's stretch of the corpus).
PREFIX_SHARE = 1 / 4
# The length is chosen where a resend finds this share of itself, so the sweep's prompts, each cut to that length
# by its own measured density, restore well over PREFIX_SHARE.
PREFIX_FIND_SHARE = 1 / 2
PREFIX_DENSITY_MARGIN = 0.95  # a try cut by the last one's density aims this far under its length
# The sweep's prompts aim this far past the length found (an engine caches whole blocks, so a prompt a little
# shorter may cross under a block's edge and find a block less), and at most PREFIX_ROOM of what the server takes.
PREFIX_OVER = 1.05
PREFIX_ROOM = 0.97
# Each prompt's cut is searched, every try counted by the server: the first at PREFIX_FIRST_CUT of the aim by the
# mean density (stretches of the corpus differ by a third, so one density for all put 9 of 16 of vLLM's prompts
# under the edge of its second 128-token block: a CI run), each next one aiming at PREFIX_AIM of it, between the
# longest try under the aim and the shortest over it or refused; done once a try is within PREFIX_TOLERANCE under
# it. A stretch's tail can be far denser than its head: two tries, the second cut by the first's density, ran past
# vLLM's 512 tokens on 241 of 3,072 stretches (the demo's tokenizer, prompt seeds 0-11), and the search, simulated
# on the same stretches, ended within the tolerance on all of them by the fifth try (the second for 78 %).
PREFIX_FIRST_CUT = 0.75
PREFIX_AIM = 0.95
PREFIX_TOLERANCE = 0.1
PREFIX_TRIES = 6
PREFIX_REFUSED_CUT = 0.5  # a try refused, with no try under the aim yet: the next is cut this far
PREFIX_SIZING_CONCURRENCY = 16
PREFIX_START = 128
# The warm prompts' drafts are the ones a drafter that lost its context K/V gets wrong: at first, while its context
# is mostly the restored prompt. With prefix-cache-drafter-kv, 64 prompts sent as the sweep sends them gave a mean
# z (the test's p-value as a normal quantile) of 3.3 (demo) and 4.5 (demo-dspark) at 16 tokens in 16-17 s; at 64
# tokens 4.2 and 2.8 in 37-50 s: z squared per second 0.8-1.2 at 8 to 16 tokens, 0.2-0.5 at 64
# (benchmarks/results/prefix_design.json, 3 seeds).
PREFIX_MAX_TOKENS = 16
# Prompts go in rounds, each cold and then warm, so the cache need hold only a round's blocks. The first round
# sizes the sweep: as many prompts as a fall to PREFIX_SIZED_FOR of the cold rate needs to be found with
# stats.POWER, from that round's own spread, at most PREFIX_MAX_PROMPTS (the corpus' shares, four laps round).
PREFIX_ROUND = 32
PREFIX_SIZED_FOR = 0.85
PREFIX_MAX_PROMPTS = 4 * STARTS
CONCURRENCY_HINT = (
    "rows of a batched drafter step read what they should not: padded or stale rows (vllm#26191, tokenspeed#955) "
    "or CUDA graphs captured for another batch (vLLM PRs #54374, #52816): rerun with --enforce-eager (vLLM) or "
    "--disable-cuda-graph (SGLang) to see whether the graphs are at fault"
)
CONCURRENCY_PROMPT_CHARS = 400  # about 100 tokens each
CONCURRENCY_MIN_PROMPTS = 16  # at every level: about 200 drafts at k 3 and 32 tokens
RUNNING = "vllm:num_requests_running"  # the running batch's size, a gauge (vLLM's, specdoctor serve's)


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

    def bucket(length: int, indices: range) -> Window:
        chars = int(length * per_token)
        return probe.measure(served.model, [corpus_prompt(i, chars, options.prompt_seed) for i in indices])

    alpha = options.alpha / (len(lengths) - 1)
    count, needed, windows = options.sweep_prompts or MIN_SWEEP_PROMPTS, 0, []
    for length in lengths:
        window = bucket(length, range(count))
        if not windows and not options.sweep_prompts and not window.errors:  # the first bucket sizes them all
            needed = prompts_for_power(window.position0_units, CONTEXT_SIZED_FOR, CONTEXT_KEEP, alpha)
            count = max(count, min(STARTS, needed))
            if count > len(window.replies):
                window = window.joined(bucket(length, range(len(window.replies), count)))
        if window.errors:
            return not_run("context", f"prompts of about {length} tokens failed: {window.errors[0]}")
        windows.append(window)
    labels = [f"{prompt_tokens(window):,} tokens" for window in windows]
    sized = f"{count} prompts a bucket" + (
        " (--sweep-prompts)"
        if options.sweep_prompts
        else f" (power {POWER:g} to find a fall to {CONTEXT_SIZED_FOR:.0%} of the first bucket's rate"
        + (f", but capped at the corpus' {STARTS} starts)" if needed > STARTS else ")")
    )
    return compare_groups(
        "context",
        windows,
        labels,
        baseline,
        CONTEXT_HINT,
        cliff=True,
        keep=CONTEXT_KEEP,
        sized=sized,
        alpha=options.alpha,
    )


def chars_per_token(probe: Probe, served: Served) -> float | str:
    """The server's characters per token on the corpus, from a prompt's usage.prompt_tokens; or why not."""
    step = STARTS // CALIBRATION_STARTS
    text = "".join(corpus_prompt(i * step, CALIBRATION_CHARS) for i in range(CALIBRATION_STARTS))
    reply = probe.complete(served.model, text, max_tokens=1)
    tokens = (reply.get("usage") or {}).get("prompt_tokens")
    if not isinstance(tokens, int) or tokens <= 0:
        return f"a text prompt got no usage.prompt_tokens: {reply.get('error', reply)}"
    return len(text) / tokens


def prefix_cache_sweep(probe: Probe, served: Served, options: SweepOptions) -> Sweep:
    """The same long prompts twice, round by round: cold (a random first line: never seen), then warm (their blocks
    cached)."""
    per_token = chars_per_token(probe, served)
    if isinstance(per_token, str):
        return not_run("prefix-cache", per_token)
    found = prefix_prompt_tokens(probe, served, options, per_token)
    if isinstance(found, str):
        return not_run("prefix-cache", found)
    count = options.sweep_prompts or PREFIX_MAX_PROMPTS
    rounds = prefix_rounds(probe, served, range(min(count, PREFIX_ROUND)), found, options.prompt_seed)
    if isinstance(rounds, str) or (why := uncached(rounds)):
        return not_run("prefix-cache", rounds if isinstance(rounds, str) else why)
    sized = f"{count} prompts (--sweep-prompts)"
    if not options.sweep_prompts:  # the first round sizes the sweep, from its cold prompts' spread
        units = rounds[0].cold.position0_units
        needed = prompts_for_power(units, PREFIX_SIZED_FOR, 1.0, options.alpha) if units else 0
        count = min(PREFIX_MAX_PROMPTS, max(PREFIX_ROUND, needed))
        sized = (
            f"{count} prompts, power {POWER:g} to find a fall to {PREFIX_SIZED_FOR:.0%} of the cold rate"
            + (f" (capped at {PREFIX_MAX_PROMPTS})" if needed > PREFIX_MAX_PROMPTS else "")
            if units
            else f"{count} prompts, not sized: the server counts no acceptance per request"
        )
    more = prefix_rounds(probe, served, range(PREFIX_ROUND, count), found, options.prompt_seed)
    if isinstance(more, str) or (why := uncached(rounds + more)):
        return not_run("prefix-cache", more if isinstance(more, str) else why)
    rounds += more
    cold, warm = joined([part.cold for part in rounds]), joined([part.warm for part in rounds])
    hits, total = sum(part.hits for part in rounds), prompt_tokens_sent(warm)
    sweep = compare_groups(
        "prefix-cache", [cold, warm], ["cold", "warm"], None, PREFIX_HINT, sized=sized, alpha=options.alpha
    )
    sweep.summary += f"; warm prompt tokens cached: {hits:,} of {total:,}"
    return sweep


class Round(NamedTuple):
    """A round's prompts cold, then warm, and the warm ones' tokens found in the cache (None: not reported)."""

    cold: Window
    warm: Window
    hits: int | None


def prefix_rounds(
    probe: Probe,
    served: Served,
    indices: range,
    found: tuple[int, float],
    seed: int,
    max_tokens: int = PREFIX_MAX_TOKENS,
) -> list[Round] | str:
    """These prompts, PREFIX_ROUND at a time, each round sized, then sent cold and again warm; or why not."""
    rounds = []
    for first in range(indices.start, indices.stop, PREFIX_ROUND):
        part = range(first, min(indices.stop, first + PREFIX_ROUND))
        prompts = sized_prompts(probe, served, part, *found, seed)
        if isinstance(prompts, str):
            return prompts
        cold = probe.measure(served.model, prompts, max_tokens=max_tokens)
        before = probe.samples()
        warm = probe.measure(served.model, prompts, max_tokens=max_tokens)
        failed = cold.errors + warm.errors
        if failed:
            return f"{len(failed)} requests failed: {failed[0]}"
        rounds.append(Round(cold, warm, cached_tokens(warm, before, probe.samples())))
    return rounds


def uncached(rounds: list[Round]) -> str:
    """Why these rounds compare too little (their warm prompts found under PREFIX_SHARE of their tokens in the
    cache, or the server did not say), or ""."""
    total = sum(prompt_tokens_sent(part.warm) for part in rounds)
    if any(part.hits is None for part in rounds):
        return "the server reported no cached tokens for the warm prompts (usage.prompt_tokens_details or /metrics)"
    hits = sum(part.hits for part in rounds)
    if hits < PREFIX_SHARE * total:
        return f"the warm prompts found {hits:,} of their {total:,} tokens in the cache"
    return ""


def prompt_tokens_sent(window: Window) -> int:
    """The group's prompt tokens in all, as the server counted them."""
    return sum((reply.get("usage") or {}).get("prompt_tokens", 0) for reply in window.replies)


def joined(parts: list[Window]) -> Window:
    """The rounds' windows as one group."""
    whole = parts[0]
    for part in parts[1:]:
        whole = whole.joined(part)
    return whole


def prefix_prompt_tokens(
    probe: Probe, served: Served, options: SweepOptions, per_token: float
) -> tuple[int, float] | str:
    """The sweep's prompts' length in tokens and a first guess at the characters per token: PREFIX_OVER past the
    shortest of PREFIX_START tokens, doubling, up to what the server takes, whose resend finds PREFIX_FIND_SHARE of
    its tokens in the cache; or why there is none. Each try's reply counts its tokens, and the next try is cut by
    that density (the last fills the server's room)."""
    max_len = options.max_context or served.max_model_len or 2 * PREFIX_START
    longest, found, chars_per_token = max_len - PREFIX_MAX_TOKENS, [], per_token
    lengths = [PREFIX_START * 2**i for i in range(16) if PREFIX_START * 2**i < longest * CONTEXT_FILL] + [longest]
    nonce = secrets.token_hex(8)
    for length in lengths:
        fill = CONTEXT_FILL if length == longest and not found else 1  # room for the density, unless a try measured it
        body = corpus_prompt(STARTS - 1, int(length * chars_per_token * fill))
        prompt = f"# {nonce} size {length}\n" + body
        probe.complete(served.model, prompt, max_tokens=1)
        before = probe.samples()
        reply = probe.complete(served.model, prompt, max_tokens=1)
        hits = cached_tokens(Window("", None, [reply], []), before, probe.samples())
        if hits is None:
            return (
                "the server reports no prefix-cache hits, so a cache that never hits would pass "
                "(vLLM: --enable-prompt-tokens-details, or its /metrics)"
            )
        tokens = (reply.get("usage") or {}).get("prompt_tokens") or 0
        found.append(f"{hits} of {tokens}")
        if tokens:
            chars_per_token = len(body) / tokens
        if tokens and hits >= PREFIX_FIND_SHARE * tokens:
            return int(min(tokens * PREFIX_OVER, longest * PREFIX_ROOM)), chars_per_token
        chars_per_token *= PREFIX_DENSITY_MARGIN
    shown = ", ".join(found) or "none"
    return (
        f"no prompt up to {longest} tokens found {PREFIX_FIND_SHARE:.0%} of itself in the cache when sent again "
        f"(cached tokens: {shown}): caching is off, or its blocks are longer than the prompts the server takes"
    )


def sized_prompts(
    probe: Probe, served: Served, indices: range, tokens: int, per_token: float, seed: int = 0
) -> list[str] | str:
    """The prompts of these indices, of `tokens` tokens or up to PREFIX_TOLERANCE fewer, each a random first line
    (never seen) and its stretch of the corpus cut by a search the server counts (CutSearch); or why not. The tries
    go under another first line, so no block of the prompts is cached before the cold round."""
    scratch, nonce = secrets.token_hex(8), secrets.token_hex(8)
    searches = {i: CutSearch(tokens, int(tokens * per_token * PREFIX_FIRST_CUT)) for i in indices}
    for _ in range(PREFIX_TRIES):
        pending = [i for i in indices if not searches[i].done]
        if not pending:
            break
        trial = [f"# {scratch} {i}\n" + corpus_prompt(i, searches[i].chars, seed) for i in pending]
        replies = probe.complete_all(served.model, trial, PREFIX_SIZING_CONCURRENCY, max_tokens=1)
        for i, reply in zip(pending, replies, strict=True):
            counted = (reply.get("usage") or {}).get("prompt_tokens")
            if "error" not in reply and (not isinstance(counted, int) or counted <= 0):
                return f"prompt {i}, sent to count its tokens, got no usage.prompt_tokens: {reply}"
            searches[i].tried(counted if "error" not in reply else None, reply.get("error", ""))
    unsized = [i for i in indices if searches[i].under is None]
    if unsized:
        why = searches[unsized[0]].error or "each try counted more"
        return f"prompt {unsized[0]}: no cut of it within {tokens} tokens in {PREFIX_TRIES} tries ({why})"
    return [f"# {nonce} {i}\n" + corpus_prompt(i, searches[i].under[0], seed) for i in indices]


class CutSearch:
    """One prompt's cut (characters of its stretch) searched for `tokens` tokens, try by try: `under` is the
    longest try within them (characters, tokens counted), `over` the shortest past them (tokens None: refused)."""

    def __init__(self, tokens: int, chars: int):
        self.tokens, self.chars = tokens, chars
        self.under: tuple[int, int] | None = None
        self.over: tuple[int, int | None] | None = None
        self.error = ""

    @property
    def done(self) -> bool:
        return self.under is not None and self.under[1] >= (1 - PREFIX_TOLERANCE) * self.tokens

    def tried(self, counted: int | None, error: str = "") -> None:
        """The server's count of the last try (None: it refused it), and the next try's cut."""
        if counted is not None and counted <= self.tokens:
            self.under = max(self.under or (0, 0), (self.chars, counted))
        elif self.over is None or self.chars < self.over[0]:
            self.over, self.error = (self.chars, counted), error or self.error
        aim = PREFIX_AIM * self.tokens
        if self.under and self.over and self.over[1]:  # between the two, by their counts
            (short, few), (long, many) = self.under, self.over
            chars = short + (long - short) * (aim - few) / (many - few)
        elif self.under and self.over:  # refused past the longest under: halfway
            chars = (self.under[0] + self.over[0]) / 2
        elif self.under:
            chars = self.under[0] * aim / self.under[1]
        else:
            chars = self.over[0] * (aim / self.over[1] if self.over[1] else PREFIX_REFUSED_CUT)
        self.chars = int(chars)


def cached_tokens(warm: Window, before: list | None, after: list | None) -> int | None:
    """The warm prompts' tokens found in the prefix cache: from their usage (vLLM with
    --enable-prompt-tokens-details, specdoctor serve), else vLLM's hit counter around them; None when neither."""
    details = [(reply.get("usage") or {}).get("prompt_tokens_details") or {} for reply in warm.replies]
    counts = [entry.get("cached_tokens") for entry in details]
    if counts and all(isinstance(count, int) for count in counts):
        return sum(counts)
    hits = [prometheus.counter(samples, PREFIX_HITS) if samples else None for samples in (before, after)]
    return None if None in hits else int(hits[1] - hits[0])


def concurrency_sweep(probe: Probe, served: Served, options: SweepOptions) -> Sweep:
    """The same prompts at each level (as many corpus prompts as the highest level, every one its own text: a
    prompt sent twice would count twice), sent in waves of it; the server's running-requests gauge, read while
    they run, says whether each level was reached."""
    levels = sorted(set(options.concurrency))
    count = max(levels[-1], CONCURRENCY_MIN_PROMPTS)
    group = [corpus_prompt(i, CONCURRENCY_PROMPT_CHARS, options.prompt_seed) for i in range(count)]
    windows, peaks = [], []
    for level in levels:
        with RunningPeak(probe) as peak:
            window = probe.measure(served.model, group, concurrency=level)
        if window.errors:
            return not_run(
                "concurrency", f"the server failed {len(window.errors)} requests at {level}: {window.errors[0]}"
            )
        windows.append(window)
        peaks.append(peak.highest)
    labels = [f"{level} in flight" for level in levels]
    sweep = compare_groups("concurrency", windows, labels, None, CONCURRENCY_HINT, alpha=options.alpha)
    for point_, highest in zip(sweep.points, peaks, strict=True):
        point_["running_peak"] = highest
    if None in peaks:
        sweep.summary += "; the server has no running-requests gauge: the levels reached are not confirmed"
        return sweep
    short = [f"{level} (seen {peak})" for level, peak in zip(levels, peaks, strict=True) if peak < level]
    seen = ", ".join(map(str, peaks))
    sweep.summary += f"; running requests seen at most: {seen}" + (
        f" (the gauge, read every {RunningPeak.POLL:g} s, did not confirm {', '.join(short)})" if short else ""
    )
    return sweep


class RunningPeak:
    """The most requests the server's running gauge showed while the block ran (read every POLL seconds), or
    None where it has no such gauge."""

    POLL = 0.05

    def __init__(self, probe: Probe):
        self.probe, self.highest = probe.sibling(probe.url), None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "RunningPeak":
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.done.set()
        self.thread.join()
        self.probe.client.close()

    def _poll(self) -> None:
        while True:
            samples = self.probe.samples()
            value = prometheus.counter(samples, RUNNING) if samples else None
            if value is None:
                return
            self.highest = max(self.highest or 0, int(value))
            if self.done.wait(self.POLL):
                return


def prompt_tokens(window: Window) -> int:
    """The group's mean prompt length, as the server counted it."""
    return round(prompt_tokens_sent(window) / len(window.replies)) if window.replies else 0


def compare_groups(
    name: str,
    windows: list[Window],
    labels: list[str],
    baseline: float | None,
    hint: str,
    cliff: bool = False,
    keep: float = 1.0,
    sized: str = "",
    alpha: float = ALPHA,
) -> Sweep:
    """Each later group against the first, by position-0 rate with the request as the unit (paired prompt by
    prompt where each group counted per request: the sweeps send the same prompts, or prompts starting alike, in
    the same order). A group fails when its rate is, with confidence, under `keep` x the first group's (1 for
    the same prompts under another condition: any real fall is a fault) or, with `cliff`, under the
    broken-drafter limit. `alpha`: the family-wise rate (a benchmark's, to resolve it in fewer runs)."""
    points = [point(label, window) for label, window in zip(labels, windows, strict=True)]
    stopped = [label for label, window in zip(labels, windows, strict=True) if not window.drafted]
    if windows[0].drafted and stopped:  # the first group drafted, a later one not once: speculation stopped there
        message = f"no draft was proposed at {stopped[0]}, where {labels[0]} drafted: speculative decoding stopped"
        finding = Finding(f"probe.{name}", "error", message, hint, name, {"from": stopped[0]})
        return sweep_of(name, message, windows[0].source, points, [finding])
    if any(window.position0 is None for window in windows):
        return not_run(name, f"the {windows[0].source} figures count no position-0 acceptances", points=points)
    limit = broken_position0_limit(baseline)
    if cliff and position0_rate(windows[0]) < limit:
        return not_run(name, f"acceptance already collapsed at {labels[0]} (the battery's finding)", points=points)
    family, alpha = alpha, alpha / (len(windows) - 1)  # Bonferroni over the comparisons with the first group
    units = [window.position0_units or [window.position0] for window in windows]
    per_request = all(len(group) == len(window.replies) for group, window in zip(units, windows, strict=True))
    paired = per_request and all(len(window.replies) == len(windows[0].replies) for window in windows)
    first = position0_rate(windows[0])
    cliffs, falls = [], []
    for index, group in enumerate(units[1:], start=1):
        p_value = fall_p_value(units[0], group, keep, paired)
        if cliff and (bound := clustered_upper_bound(group, alpha)) < limit:
            # A cliff's evidence is its bound under the limit: the fall test may not reject (a third of a low
            # first rate can sit under the limit too), and its p-value would read as no evidence.
            under = f"at most {bound:.1%} with confidence, under the broken-drafter limit {limit:.1%}"
            cliffs.append((index, p_value, under))
        elif p_value < alpha:
            falls.append((index, p_value, f"p = {p_value:.1e}"))
    findings = []
    for found in (cliffs, falls):
        if found:
            index, p_value, test = found[0]
            before, window = windows[index - 1], windows[index]
            evidence = (
                f"mean acceptance length {before.mean_length:.2f} at {labels[index - 1]}, {window.mean_length:.2f} "
                f"from {labels[index]} (position 0: {first:.0%} at {labels[0]}, {position0_rate(window):.0%} "
                f"from {labels[index]}; {test})"
            )
            what = "falls off a cliff" if found is cliffs else f"falls with {name}"
            if found is falls and keep < 1:
                what += f" to under {keep:.0%} of its rate at {labels[0]}"
            data = {"from": labels[index], "p_value": p_value, "limit": limit, "alpha": alpha, "keep": keep}
            findings.append(Finding(f"probe.{name}", "error", f"acceptance {what}: {evidence}", hint, name, data))
    shown = ", ".join(f"{w.mean_length:.2f} at {label}" for w, label in zip(windows, labels, strict=True))
    floor = (
        f"; cliff limit the {limit:.0%} floor: the server returns no token ids" if cliff and baseline is None else ""
    )
    unit = ("paired per-request" if paired else "per-request") if per_request else "per-wave"
    if any(len(group) < 2 for group in units):
        unit = "binomial (a group was a single wave)"
    summary = f"mean acceptance length {shown}{floor}; {unit} variance, false-positive rate {family:g}"
    return sweep_of(name, summary + (f"; {sized}" if sized else ""), windows[0].source, points, findings)
