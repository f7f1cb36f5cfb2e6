"""The API sweep's checks of where an output ends and what it repeats: max_tokens landing mid-run, stop strings and
stop token ids inside accepted runs, min_tokens, and seeded sampling."""

from __future__ import annotations

from specdoctor.probe.api_common import (
    API_TOKENS,
    BIAS_TOKENS,
    MAX_TOKENS_CUTS,
    MIN_TOKENS_PAST,
    SEED,
    SEED_CHOICES,
    SEED_TEMPERATURE,
    STOP_CHARS,
    STOP_POSITIONS,
    ApiCheck,
    Asker,
    Plain,
    cut_mismatch,
    finish_of,
    parting,
    refused_check,
    tie_before,
    verdict_of,
)
from specdoctor.probe.output_sweeps import TIE_MARGIN, output_ids, output_text


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


def min_tokens_check(asker: Asker, prompts: list, plain: Plain) -> ApiCheck:
    """A stop token id the plain output meets at m, with min_tokens m + MIN_TOKENS_PAST: the id is masked until
    then, so the output keeps the plain output's first m tokens, leaves it at m, holds at least min_tokens tokens,
    and has the id nowhere before them; with a reference, it is the reference's reply to the same request."""
    cuts = []
    for p, reply in enumerate(plain.expected):
        ids = output_ids(reply)
        index = next((i for i in range(len(ids) // 5, len(ids)) if ids.index(ids[i]) == i), None)
        if index is not None and index + MIN_TOKENS_PAST < API_TOKENS:
            cuts.append((p, index, ids[index]))
    requests = [asker.body(prompts[p], {"stop_token_ids": [t], "min_tokens": m + MIN_TOKENS_PAST}) for p, m, t in cuts]
    replies = asker.ask(requests)
    if refusal := refused_check("min_tokens", "min-tokens", replies):
        return refusal
    theirs = asker.ask(requests, reference=True) if asker.reference else [None] * len(cuts)
    cases = [
        (
            f"prompt {p + 1}, stop_token_ids [{t}], min_tokens {m + MIN_TOKENS_PAST}",
            min_tokens_mismatch(reply, reference, plain.expected[p], m, t),
        )
        for (p, m, t), reply, reference in zip(cuts, replies, theirs, strict=True)
    ]
    return verdict_of("min_tokens", "min-tokens", cases)


def min_tokens_mismatch(reply: dict, reference: dict | None, plain: dict, stop_at: int, stop_id: int) -> str | None:
    """The rules that follow from the plain output, then (with a reference) the reference's reply: a parting at the
    stop id is never a tie (the id is masked, so its raw log-probability says nothing)."""
    if "error" in reply:
        return reply["error"]
    ids, least = output_ids(reply) or [], stop_at + MIN_TOKENS_PAST
    if ids[:stop_at] != output_ids(plain)[:stop_at] and not tie_before(reply, plain, stop_at):
        return f"its first {stop_at} tokens are not the plain output's (the stop id masks nothing there)"
    if len(ids) < least:
        return f"{len(ids)} tokens where min_tokens asked for {least}"
    if stop_id in ids[:least]:
        return f"the stop id {stop_id} at token {ids.index(stop_id)}, before min_tokens {least}"
    if reference is None:
        return None
    if "error" in reference:
        return f"the reference: {reference['error']}"
    found = parting(reply, reference)
    if found is None:
        return None
    at = found["index"]
    at_stop = stop_id in (ids[at : at + 1] + (output_ids(reference) or [])[at : at + 1])
    return f"differs from speculation off at token {at}" if at_stop or found["gap"] > TIE_MARGIN else None


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
