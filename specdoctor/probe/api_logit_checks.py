"""The API sweep's checks of what is chosen from the target's logits and what is reported of them:
log-probabilities, logit_bias, and the presence, frequency and repetition penalties."""

from __future__ import annotations

import math
from collections import Counter

from specdoctor.probe.api_common import (
    BIAS,
    BIAS_TOKENS,
    FAILED,
    NOT_RUN,
    PENALTY_TOPS,
    RESENT_POSITIONS,
    SHIFT_PENALTIES,
    ApiCheck,
    Asker,
    Plain,
    parting,
    refused,
    refused_check,
    verdict_of,
)
from specdoctor.probe.client import first_choice
from specdoctor.probe.output_sweeps import TIE_MARGIN, divergence, output_ids


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
    resent = resent_cases(asker, plain)
    checked = verdict_of("logprobs", "logprobs", cases + resent)
    if not resent:  # the values are then checked only against each other (and the reference's)
        checked.evidence += "; no position resent as a prompt's next token: the server names no prompt_token_ids"
    return checked


def generated(plain: Plain) -> list[tuple[int, list[int], list[int], list[float]]]:
    """Each plain reply that names its prompt's ids and a log-probability per output token: (prompt index, prompt
    ids, output ids, the output's log-probabilities)."""
    found = []
    for p, reply in enumerate(plain.own):
        choice, ids = first_choice(reply), output_ids(reply) or []
        values = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if isinstance(choice.get("prompt_token_ids"), list) and len(values) == len(ids):
            found.append((p, choice["prompt_token_ids"], ids, values))
    return found


def resent_cases(asker: Asker, plain: Plain) -> list[tuple[str, str | None]]:
    """A token's log-probability inside the output against the same position computed as a prompt's next token
    (the prompt's ids and the output's before it, max_tokens 1): no draft there, so a value reported from the
    drafter's distribution, or from the wrong position, differs."""
    due = []
    for p, prompt_ids, ids, values in generated(plain):
        step = max(1, len(ids) // RESENT_POSITIONS)
        due += [(p, i, prompt_ids + ids[:i], ids[i], values[i]) for i in range(1, len(ids), step)]
    replies = asker.ask([asker.body(prompt, {"max_tokens": 1}) for _, _, prompt, _, _ in due])
    cases = []
    for (p, i, _, token, value), again in zip(due, replies, strict=True):
        entries = (first_choice(again).get("logprobs") or {}) if "error" not in again else {}
        fresh = (entries.get("top_logprobs") or [{}])[0].get(f"token_id:{token}")
        if "error" in again or fresh is None:
            why = again.get("error") or f"token {token} is not among the resent position's top entries"
        else:
            off = abs(fresh - value) > TIE_MARGIN
            why = f"{value:.3f} in the output, {fresh:.3f} as the next token of the same ids" if off else None
        cases.append((f"prompt {p + 1}, token {i}", why))
    return cases


def prompt_logprobs_check(asker: Asker, plain: Plain) -> ApiCheck:
    """vLLM's `prompt_logprobs` over each prompt followed by its own plain output: at the output's positions the
    prompt pass's values must be the ones the reply reported as it generated them (through drafts and verification),
    within the tie margin; with a reference, the reference's for the same prompt. Refused (400): not run; a reply
    without them: the server ignores the field, not run."""
    label, due = "prompt_logprobs", [entry for entry in generated(plain) if entry[2]]
    if not due:
        return ApiCheck(label, "logprobs", 0, NOT_RUN, "the server names no prompt_token_ids: nothing to send again")
    requests = [asker.body(prompt + ids, {"max_tokens": 1, "prompt_logprobs": 1}) for _, prompt, ids, _ in due]
    replies = asker.ask(requests)
    if refusal := refused_check(label, "logprobs", replies):
        return refusal
    if all(
        "error" not in again and again.get("choices") and first_choice(again).get("prompt_logprobs") is None
        for again in replies
    ):
        return ApiCheck(label, "logprobs", len(requests), NOT_RUN, "the server ignores prompt_logprobs (none returned)")
    theirs = asker.ask(requests, reference=True) if asker.reference else [None] * len(requests)
    cases = []
    for (p, prompt, ids, values), again, reference in zip(due, replies, theirs, strict=True):
        shown = prompt_values(again, prompt + ids)
        if isinstance(shown, str):
            cases.append((f"prompt {p + 1}", shown))
            continue
        found = shown[len(prompt) - 1 :]  # the output's positions
        off = next((i for i, (a, b) in enumerate(zip(values, found, strict=True)) if abs(a - b) > TIE_MARGIN), None)
        why = None if off is None else f"token {off}: {values[off]:.3f} as generated, {found[off]:.3f} in the prompt"
        if why is None and reference is not None and not refused(reference):
            why = reference_parting(shown, prompt_values(reference, prompt + ids))
        cases.append((f"prompt {p + 1}", why))
    return verdict_of(label, "logprobs", cases)


def reference_parting(shown: list[float], theirs: list[float] | str) -> str | None:
    if isinstance(theirs, str):
        return f"the reference: {theirs}"
    far = next((i for i, (a, b) in enumerate(zip(shown, theirs, strict=True)) if abs(a - b) > TIE_MARGIN), None)
    return None if far is None else f"prompt token {far + 1}: {shown[far]:.3f}, {theirs[far]:.3f} with speculation off"


def prompt_values(reply: dict, ids: list[int]) -> list[float] | str:
    """Each prompt token's log-probability from the second, as the reply's `prompt_logprobs` give it, or why not."""
    if "error" in reply:
        return reply["error"]
    entries = first_choice(reply).get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        return (
            f"prompt_logprobs hold {len(entries) if isinstance(entries, list) else 'no'} entries for {len(ids)} tokens"
        )
    values = []
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        found = (entry or {}).get(str(token))
        if not isinstance(found, dict) or "logprob" not in found:
            return f"prompt token {token} has no entry of its own"
        values.append(found["logprob"])
    return values


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


def penalty_check(
    asker: Asker, prompts: list, plain: Plain, name: str, value: float, logprobs_trusted: bool
) -> ApiCheck:
    """The penalty's output against the reference's for the same request; without one, a presence or frequency
    penalty against the reply's own raw log-probabilities (penalised_mismatch) where those passed their own check,
    and the repetition penalty is not verified (the evidence says whether it changed the output)."""
    requests = [asker.body(prompt, {name: value, "logprobs": PENALTY_TOPS}) for prompt in prompts]
    replies = asker.ask(requests)
    label = f"{name} {value:g}"
    if refusal := refused_check(label, "penalties", replies):
        return refusal
    if not asker.reference:
        return own_penalty_check(label, name, value, replies, plain, logprobs_trusted)
    theirs = asker.ask(requests, reference=True)
    if refusal := refused_check(label, "penalties", theirs, "reference"):
        return refusal
    cases, undecided = [], []
    for p, (reply, reference) in enumerate(zip(replies, theirs, strict=True)):
        if "error" in reply or "error" in reference:
            cases.append((f"prompt {p + 1}", reply.get("error") or f"the reference: {reference['error']}"))
            continue
        found = penalised_gap(reply, reference, name, value)
        if found is not None and found[1] is None:
            undecided.append(f"prompt {p + 1} parts from speculation off at token {found[0]}")
        wrong = found is not None and found[1] is not None and found[1] > TIE_MARGIN
        cases.append((f"prompt {p + 1}", f"differs from speculation off at token {found[0]}" if wrong else None))
    checked = verdict_of(label, "penalties", cases)
    if undecided and checked.verdict != FAILED:
        why = (
            f"{undecided[0]}, where the penalty's scores cannot be read from log-probabilities ({len(undecided)} such)"
        )
        return ApiCheck(label, "penalties", len(replies), NOT_RUN, why)
    return checked


def top_entries(reply: dict, index: int) -> dict[int, float]:
    """The top log-probability entries at output position `index`, by token id."""
    tops = (first_choice(reply).get("logprobs") or {}).get("top_logprobs") or []
    top = tops[index] if index < len(tops) else None
    return {int(key.split(":", 1)[1]): lp for key, lp in (top or {}).items() if key.startswith("token_id:")}


def shift(name: str, value: float, seen: Counter, token: int) -> float:
    """What a presence or frequency penalty subtracts from a token's logit (so from its raw log-probability) after
    an output with these counts."""
    return value * (seen[token] if name == "frequency_penalty" else min(1, seen[token]))


def penalised_gap(reply: dict, reference: dict, name: str, value: float) -> tuple[int, float | None] | None:
    """Where the reply parts from the reference's reply (None: nowhere), and the reference's margin there between
    its token and the reply's as the penalty scores them: the tie rule on the scores the choice was made from (a
    raw gap says nothing of them). A reply token outside the top entries scores at most the lowest entry's raw
    value, penalised. None where the margin cannot be read: the reference's own token outside its top entries, or a
    token the repetition penalty scales (it divides or multiplies a logit, which log-probabilities do not show)."""
    found = parting(reply, reference)
    if found is None:
        return None
    ours, theirs, index = output_ids(reply) or [], output_ids(reference) or [], found["index"]
    if index >= min(len(ours), len(theirs)):
        return index, math.inf  # one ends where the other goes on
    top, mine, due, seen = top_entries(reference, index), ours[index], theirs[index], Counter(theirs[:index])
    if due not in top:
        return index, None
    if name == "repetition_penalty":
        scaled = set(first_choice(reference).get("prompt_token_ids") or []) | set(seen)
        return index, None if {mine, due} & scaled or mine not in top else top[due] - top[mine]
    mine_at_most = top.get(mine, min(top.values())) - shift(name, value, seen, mine)
    return index, top[due] - shift(name, value, seen, due) - mine_at_most


def own_penalty_check(
    label: str, name: str, value: float, replies: list[dict], plain: Plain, logprobs_trusted: bool
) -> ApiCheck:
    changed = sum(output_ids(r) != output_ids(o) for r, o in zip(replies, plain.own, strict=False) if "error" not in r)
    compared = min(len(replies), len(plain.own))  # the prompts with a plain reply
    effect = f"changed {changed} of {compared} outputs" if changed else "changed no output (ignored?)"
    if name not in SHIFT_PENALTIES:
        return ApiCheck(label, "penalties", len(replies), NOT_RUN, f"{effect}; its values need --reference-url")
    if not logprobs_trusted:
        why = f"{effect}; it is checked on the log-probabilities, which failed their own check"
        return ApiCheck(label, "penalties", len(replies), NOT_RUN, why)
    found = [penalised_mismatch(reply, name, value) for reply in replies]
    if not any(raw for raw, _ in found):
        why = f"{effect}; no reply shows raw log-probabilities (a token chosen under another's), so the penalty's "
        return ApiCheck(label, "penalties", len(replies), NOT_RUN, why + "choices cannot be checked on them")
    cases = [(f"prompt {p + 1}", why) for p, (_, why) in enumerate(found)]
    return verdict_of(label, "penalties", cases)


def penalised_mismatch(reply: dict, name: str, value: float) -> tuple[bool, str | None]:
    """(whether the log-probabilities are raw, why the output is not the penalised greedy one or None). A presence
    or frequency penalty subtracts from a token's logit what its count in the output so far implies, so it shifts
    its raw log-probability alike: each emitted token must score, so shifted, at least every top entry's score
    (within TIE_MARGIN). Raw values show where a token was chosen under another's raw value; if none was, they may
    be penalised already, and nothing is decided."""
    if "error" in reply:
        return False, reply["error"]
    entries = first_choice(reply).get("logprobs") or {}
    ids, values, tops = output_ids(reply) or [], entries.get("token_logprobs") or [], entries.get("top_logprobs") or []
    if not ids or len(values) != len(ids) or len(tops) != len(ids):
        return False, "no log-probabilities returned"
    raw, wrong, seen = False, None, Counter()
    for i, (token, own) in enumerate(zip(ids, values, strict=True)):
        top = top_entries(reply, i)
        raw = raw or max(top.values(), default=own) - own > TIE_MARGIN
        scores = {t: lp - shift(name, value, seen, t) for t, lp in top.items()}
        best = max(scores, key=scores.get, default=token)
        mine = own - shift(name, value, seen, token)
        if wrong is None and scores.get(best, mine) - mine > TIE_MARGIN:
            wrong = f"token {i} (id {token}) scores {mine:.3f} penalised, under id {best}'s {scores[best]:.3f}"
        seen[token] += 1
    return raw, wrong
