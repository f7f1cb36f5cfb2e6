"""The request API under speculation (docs/probe.md, "API sweep"): stop strings and stop token ids, max_tokens
landing mid-run, log-probabilities, logit bias, penalties and seeds, all greedy except the seed's check.

What a request must return follows from the same prompt's plain greedy output (a stop string cuts it where the
string begins, max_tokens keeps its first tokens): with --reference-url that output is the reference's, speculation
off, so each reply is compared token for token with speculation off; without one it is the server's own, which
checks that the request's fields act on it as the API says. A field whose effect cannot be derived (a penalty) is
compared with the reference's reply to the same request, or is not verified. A difference at a near tie of the
plain output (TIE_MARGIN) is numerics, not a failure."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specdoctor.probe.client import Probe, Served, first_choice
from specdoctor.probe.options import SweepOptions
from specdoctor.probe.output_sweeps import TIE_MARGIN, divergence, output_ids, output_text
from specdoctor.probe.verdicts import not_run, sweep_of
from specdoctor.report import Finding, Sweep

API_PROMPTS = 3  # the battery's first prompts
API_TOKENS = 48  # several accepted runs each
LOGPROBS = 2  # the top entries each token carries: the tie rule's gap, and the log-probability check's top
MAX_TOKENS_CUTS = (1, 2, 3, 5, 7, 10, 13)  # limits at every offset of a run of up to k + 1 = 5 tokens
STOP_POSITIONS = (0.2, 0.45, 0.7)  # where in the plain output a stop begins, as shares of it
STOP_CHARS = 4
API_CONCURRENCY = 16
SEED, SEED_TEMPERATURE, SEED_CHOICES = 1234, 0.8, 2
BIAS = 100.0  # a logit bias that makes its token the argmax at every step
BIAS_TOKENS = 8
PENALTIES = {  # each penalty alone, at a value that changes the demo's greedy output
    "presence_penalty": 1.5,
    "frequency_penalty": 1.0,
    "repetition_penalty": 1.5,  # vLLM's and SGLang's extension
}
PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"

HINTS = {
    "max-tokens": (
        "the step that crosses max_tokens must keep only the tokens up to it: tokens after the limit (or after an "
        "end-of-sequence token) leaked from an accepted run (sglang#33758); look where the engine appends a step's "
        "accepted tokens"
    ),
    "stop": (
        "a stop inside an accepted run must end the request there: the engine checks only the run's last token or "
        "its new text's end (sglang#23802, #31599); look where accepted tokens are checked against stop ids/strings"
    ),
    "logprobs": (
        "the reported log-probabilities are not the target's at the emitted tokens (vllm#34497, #30846: all 0.0 "
        "with MTP, or the draft's): look where log-probabilities are gathered after verification"
    ),
    "logit-bias": "logit_bias is not applied at verification: drafts are accepted against the unbiased target",
    "penalties": (
        "penalties must act per accepted token at verification (TRT-LLM#17701, sglang#33643: ignored with MTP, or "
        "applied once per step): compare with speculation off"
    ),
    "seed": "a seeded request must be reproducible: the drafter's or verifier's noise is not drawn from the seed",
}


@dataclass
class ApiCheck:
    """One row of the sweep's table."""

    name: str
    family: str  # its HINTS entry
    requests: int
    verdict: str
    evidence: str

    def point(self) -> dict:
        return {"label": self.name, "requests": self.requests, "verdict": self.verdict, "evidence": self.evidence}


def api_sweep(probe: Probe, served: Served, options: SweepOptions, prompts: list) -> Sweep:
    prompts = prompts[:API_PROMPTS]
    reference = probe.sibling(options.reference_url) if options.reference_url else None
    asker = Asker(probe, served.model, reference, reference.served_model().model if reference else None)
    plain = asker.plain(prompts)
    if isinstance(plain, str):
        return not_run("api", plain)
    checks = [
        max_tokens_check(asker, prompts, plain),
        stop_string_check(asker, prompts, plain),
        stop_ids_check(asker, prompts, plain),
        logprobs_check(asker, plain),
        logit_bias_check(asker, prompts, plain),
        *(penalty_check(asker, prompts, plain, name, value) for name, value in PENALTIES.items()),
        seed_check(asker, prompts),
    ]
    findings = [
        Finding("probe.api", "error", f"{c.name}: {c.evidence}", HINTS[c.family], "api", c.point())
        for c in checks
        if c.verdict == FAILED
    ]
    skipped = [c for c in checks if c.verdict == NOT_RUN]
    if skipped:
        message = "not verified: " + "; ".join(f"{c.name} ({c.evidence})" for c in skipped)
        findings.append(Finding("probe.api", "warning", message, stage="api"))
    against = f"against {options.reference_url} (speculation off)" if reference else "against its own plain output"
    counts = {v: sum(c.verdict == v for c in checks) for v in (PASSED, FAILED, NOT_RUN)}
    summary = f"{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[NOT_RUN]} not run, {against}"
    return sweep_of("api", summary, None, [c.point() for c in checks], findings)


@dataclass
class Plain:
    """Each prompt's plain greedy reply: the server's own, and what the checks derive from (the reference's where
    there is one, else the same)."""

    own: list[dict]
    expected: list[dict]


class Asker:
    """Requests to the server (and to the reference, where there is one): greedy, with token ids and the top
    log-probabilities unless the fields say otherwise, sent API_CONCURRENCY at a time, as traffic is."""

    def __init__(self, probe: Probe, model: str, reference: Probe | None, reference_model: str | None):
        self.probe, self.model, self.reference, self.reference_model = probe, model, reference, reference_model

    @staticmethod
    def body(prompt, fields: dict) -> tuple:
        return prompt, {"max_tokens": API_TOKENS, "logprobs": LOGPROBS, "return_tokens_as_token_ids": True} | fields

    def ask(self, requests: list[tuple], reference: bool = False) -> list[dict]:
        probe, model = (self.reference, self.reference_model) if reference else (self.probe, self.model)
        with ThreadPoolExecutor(API_CONCURRENCY) as pool:
            return list(pool.map(lambda request: probe.complete(model, request[0], **request[1]), requests))

    def plain(self, prompts: list) -> Plain | str:
        requests = [self.body(prompt, {}) for prompt in prompts]
        own = self.ask(requests)
        expected = self.ask(requests, reference=True) if self.reference else own
        failed = [reply["error"] for reply in own + expected if "error" in reply]
        if failed:
            return f"a plain greedy request failed: {failed[0]}"
        if any(output_ids(reply) is None for reply in own + expected):
            return "the server names no output token ids (return_token_ids, or token_id:N log-probability entries)"
        return Plain(own, expected)


def finish_of(reply: dict) -> str | None:
    return first_choice(reply).get("finish_reason")


def refused(reply: dict) -> bool:
    """The server refused the request as one it does not support (400 or 422), rather than failing it."""
    return "error" in reply and any(f"answered {code}" in reply["error"] for code in (400, 422))


def refused_check(name: str, family: str, replies: list[dict]) -> ApiCheck | None:
    """The check not run where the server refused a request as one it does not support, with its reason."""
    reason = next((reply["error"] for reply in replies if refused(reply)), None)
    return (
        None
        if reason is None
        else ApiCheck(name, family, len(replies), NOT_RUN, f"the server refuses it: {reason[:160]}")
    )


def tie_before(reply: dict, plain: dict, end: int) -> bool:
    """The reply leaves the plain output before index `end` at a near tie of the plain output's own
    log-probabilities (the reference sweep's rule): numerics, not the field."""
    found = divergence(reply, plain)
    return found is not None and found["index"] < end and found["gap"] <= TIE_MARGIN


def cut_mismatch(reply: dict, plain: dict, keep: int, finish: str) -> str | None:
    """Why the reply is not the plain output's first `keep` tokens ending with `finish` (a stop id may be kept as
    one more token); None when it is, or where it leaves the plain output at a near tie first."""
    if "error" in reply:
        return reply["error"]
    ids, plain_ids = output_ids(reply) or [], output_ids(plain)
    due = [plain_ids[:keep]] + ([plain_ids[: keep + 1]] if finish == "stop" else [])
    if ids not in due and not tie_before(reply, plain, keep):
        if ids[:keep] == due[0]:
            how = f"{len(ids) - keep} past the cut"
        else:
            how = "cut early" if ids == due[0][: len(ids)] else "not the plain output's"
        return f"{len(ids)} tokens where {keep} were due ({how})"
    if finish_of(reply) != finish:
        return f"finish_reason {finish_of(reply)!r} where {finish!r} was due"
    usage = (reply.get("usage") or {}).get("completion_tokens")
    if ids in due and usage is not None and usage != len(ids):
        return f"usage counts {usage} completion tokens for {len(ids)} returned"
    return None


def verdict_of(name: str, family: str, cases: list[tuple[str, str | None]]) -> ApiCheck:
    """A check from its cases (label, why it is wrong, or None)."""
    wrong = [(label, why) for label, why in cases if why]
    if not cases:
        return ApiCheck(name, family, 0, NOT_RUN, "the plain output left no case to send")
    if wrong:
        label, why = wrong[0]
        return ApiCheck(name, family, len(cases), FAILED, f"{len(wrong)} of {len(cases)} wrong; {label}: {why}")
    return ApiCheck(name, family, len(cases), PASSED, f"{len(cases)} requests as the plain output implies")


def max_tokens_check(asker: Asker, prompts: list, plain: Plain) -> ApiCheck:
    """Each limit keeps exactly the plain output's first tokens, finish_reason "length"."""
    cuts = [(p, m) for p, reply in enumerate(plain.expected) for m in MAX_TOKENS_CUTS if m < len(output_ids(reply))]
    replies = asker.ask([asker.body(prompts[p], {"max_tokens": m}) for p, m in cuts])
    cases = [
        (f"prompt {p + 1}, max_tokens {m}", cut_mismatch(reply, plain.expected[p], m, "length"))
        for (p, m), reply in zip(cuts, replies, strict=True)
    ]
    return verdict_of("max_tokens mid-run", "max-tokens", cases)


def stop_at(text: str, share: float) -> tuple[str, int] | None:
    """A stop string beginning at or after this share of the text and found nowhere earlier, and its start."""
    for start in range(int(len(text) * share), len(text) - STOP_CHARS):
        stop = text[start : start + STOP_CHARS]
        if stop.strip() and text.find(stop) == start:
            return stop, start
    return None


def stop_string_check(asker: Asker, prompts: list, plain: Plain) -> ApiCheck:
    """Stop strings (with a second, later one that must not win) cut the text where the first begins,
    finish_reason "stop", and the tokens kept are the plain output's."""
    requests, due = [], []
    for p, reply in enumerate(plain.expected):
        text = output_text(reply)
        for share in STOP_POSITIONS:
            found = stop_at(text, share)
            if found is None or any(d[0] == p and d[1] == found[0] for d in due):
                continue
            stop, start = found
            later = stop_at(text, min(1.0, (start + STOP_CHARS) / len(text) + 0.1))
            requests.append(asker.body(prompts[p], {"stop": [later[0], stop] if later else [stop]}))
            due.append((p, stop, text[:start]))
    replies = asker.ask(requests)
    cases = [
        (f"prompt {p + 1}, stop {stop!r}", stop_mismatch(reply, plain.expected[p], text))
        for (p, stop, text), reply in zip(due, replies, strict=True)
    ]
    return verdict_of("stop strings", "stop", cases)


def stop_mismatch(reply: dict, plain: dict, text: str) -> str | None:
    if "error" in reply:
        return reply["error"]
    ids = output_ids(reply) or []
    if ids != output_ids(plain)[: len(ids)]:
        return None if tie_before(reply, plain, len(ids)) else "its tokens are not the plain output's"
    if output_text(reply) != text:
        return f"the text ends {output_text(reply)[-30:]!r} where it should end {text[-30:]!r}"
    if finish_of(reply) != "stop":
        return f"finish_reason {finish_of(reply)!r} where 'stop' was due"
    return None


def stop_ids_check(asker: Asker, prompts: list, plain: Plain) -> ApiCheck:
    """A stop token id ends the output at its first occurrence, finish_reason "stop" (the id itself kept in the
    token ids or not: engines differ)."""
    cuts = []
    for p, reply in enumerate(plain.expected):
        ids = output_ids(reply)
        for share in STOP_POSITIONS:
            index = next((i for i in range(int(len(ids) * share), len(ids)) if ids.index(ids[i]) == i), None)
            if index is not None and (p, index) not in cuts:
                cuts.append((p, index))
    stop_id = [output_ids(plain.expected[p])[i] for p, i in cuts]
    replies = asker.ask(
        [asker.body(prompts[p], {"stop_token_ids": [t]}) for (p, _), t in zip(cuts, stop_id, strict=True)]
    )
    cases = [
        (f"prompt {p + 1}, stop_token_ids [{t}]", cut_mismatch(reply, plain.expected[p], i, "stop"))
        for (p, i), t, reply in zip(cuts, stop_id, replies, strict=True)
    ]
    return verdict_of("stop token ids", "stop", cases)


def logprobs_check(asker: Asker, plain: Plain) -> ApiCheck:
    """Greedy: each token's log-probability is its top entry's (within the tie margin), at most 0, and not all are
    0.0; with a reference, they are the reference's within the tie margin up to where the outputs part."""
    cases, values = [], []
    for p, (reply, expected) in enumerate(zip(plain.own, plain.expected, strict=True)):
        entries = first_choice(reply).get("logprobs") or {}
        mine, tops = entries.get("token_logprobs") or [], entries.get("top_logprobs") or []
        if not mine or len(tops) != len(mine):
            cases.append((f"prompt {p + 1}", "no log-probabilities returned"))
            continue
        values += mine
        theirs = (first_choice(expected).get("logprobs") or {}).get("token_logprobs") or []
        cases.append(
            (f"prompt {p + 1}", logprob_mismatch(mine, tops, theirs if asker.reference else [], reply, expected))
        )
    if values and all(value == 0.0 for value in values):
        cases.append(("every prompt", f"all {len(values)} log-probabilities are 0.0"))
    return verdict_of("logprobs", "logprobs", cases)


def logprob_mismatch(mine: list, tops: list, theirs: list, reply: dict, expected: dict) -> str | None:
    parted = divergence(reply, expected)  # the reference's values are compared up to where the outputs part
    same = parted["index"] if parted else len(mine)
    for i, (value, top) in enumerate(zip(mine, tops, strict=True)):
        best = max((top or {}).values(), default=value)
        if value > 1e-6:
            return f"token {i}'s log-probability is {value:.3g} > 0"
        if best - value > TIE_MARGIN:
            return f"token {i} was emitted at greedy with log-probability {value:.3f} under its top entry's {best:.3f}"
        if i < min(same, len(theirs)) and abs(value - theirs[i]) > TIE_MARGIN:
            return f"token {i}'s log-probability {value:.3f} is {theirs[i]:.3f} with speculation off"
    return None


def logit_bias_check(asker: Asker, prompts: list, plain: Plain) -> ApiCheck:
    """A bias of BIAS on one token makes it every step's argmax: every output token is that token."""
    tokens = [output_ids(reply)[len(output_ids(reply)) // 2] for reply in plain.expected]
    fields = [{"logit_bias": {str(t): BIAS}, "max_tokens": BIAS_TOKENS} for t in tokens]
    replies = asker.ask([asker.body(prompt, f) for prompt, f in zip(prompts, fields, strict=True)])
    if refusal := refused_check("logit_bias", "logit-bias", replies):
        return refusal
    cases = []
    for p, (t, reply) in enumerate(zip(tokens, replies, strict=True)):
        ids = output_ids(reply) if "error" not in reply else None
        wrong = reply.get("error") or (
            None if ids == [t] * BIAS_TOKENS else f"tokens {ids} where [{t}] x {BIAS_TOKENS} were due"
        )
        cases.append((f"prompt {p + 1}, logit_bias {{{t}: {BIAS:g}}}", wrong))
    return verdict_of("logit_bias", "logit-bias", cases)


def penalty_check(asker: Asker, prompts: list, plain: Plain, name: str, value: float) -> ApiCheck:
    """The penalty's output against the reference's for the same request; without one it is not verified (the
    evidence says whether it changed the output)."""
    requests = [asker.body(prompt, {name: value}) for prompt in prompts]
    replies = asker.ask(requests)
    label = f"{name} {value:g}"
    if refusal := refused_check(label, "penalties", replies):
        return refusal
    if not asker.reference:
        changed = sum(
            output_ids(r) != output_ids(o) for r, o in zip(replies, plain.own, strict=True) if "error" not in r
        )
        why = f"changed {changed} of {len(replies)} outputs" if changed else "changed no output (ignored?)"
        return ApiCheck(label, "penalties", len(replies), NOT_RUN, f"{why}; its values need --reference-url")
    theirs = asker.ask(requests, reference=True)
    if any(refused(reply) for reply in theirs):
        reason = next(reply["error"] for reply in theirs if refused(reply))
        return ApiCheck(label, "penalties", len(replies), NOT_RUN, f"the reference refuses it: {reason[:160]}")
    cases = []
    for p, (reply, reference) in enumerate(zip(replies, theirs, strict=True)):
        if "error" in reply or "error" in reference:
            cases.append((f"prompt {p + 1}", reply.get("error") or f"the reference: {reference['error']}"))
            continue
        found = divergence(reply, reference)
        wrong = (
            None
            if found is None or found["gap"] <= TIE_MARGIN
            else f"differs from speculation off at token {found['index']}"
        )
        cases.append((f"prompt {p + 1}", wrong))
    return verdict_of(label, "penalties", cases)


def seed_check(asker: Asker, prompts: list) -> ApiCheck:
    """The same seeded request, n choices at a temperature, twice: the same choices."""
    fields = {
        "temperature": SEED_TEMPERATURE,
        "top_p": 0.95,
        "seed": SEED,
        "n": SEED_CHOICES,
        "max_tokens": BIAS_TOKENS * 2,
    }
    requests = [asker.body(prompt, fields) for prompt in prompts] * 2
    replies = asker.ask(requests)
    if refusal := refused_check("seed", "seed", replies):
        return refusal
    half = len(prompts)
    cases = []
    for p, (first, second) in enumerate(zip(replies[:half], replies[half:], strict=True)):
        wrong = first.get("error") or second.get("error")
        if not wrong:
            texts = [[c.get("text") for c in reply.get("choices") or []] for reply in (first, second)]
            wrong = (
                None
                if texts[0] == texts[1] and len(texts[0]) == SEED_CHOICES
                else f"choices {texts[0]} then {texts[1]}"
            )
        cases.append((f"prompt {p + 1}, seed {SEED}, n {SEED_CHOICES}", wrong))
    return verdict_of("seed", "seed", cases)
