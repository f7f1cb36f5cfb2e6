"""What the API sweep's checks share (docs/probe.md, "API sweep"): the plain replies each derives from, the asker
that sends a check's requests (to the reference too), and the rules every check decides by: a refusal is "not run",
a difference at a near tie of the plain output is numerics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specdoctor.probe.client import Probe, first_choice
from specdoctor.probe.output_sweeps import TIE_MARGIN, divergence, output_ids

API_PROMPTS = 3  # the battery's first prompts (the penalties: every battery prompt, see PENALTIES)
API_TOKENS = 48  # several accepted runs each
LOGPROBS = 2  # the top entries each token carries: the tie rule's gap, and the log-probability check's top
MAX_TOKENS_CUTS = (1, 2, 3, 5, 7, 10, 13)  # limits at every offset of a run of up to k + 1 = 5 tokens
STOP_POSITIONS = (0.2, 0.45, 0.7)  # where in the plain output a stop begins, as shares of it
STOP_CHARS = 4
API_CONCURRENCY = 16
SEED, SEED_TEMPERATURE, SEED_CHOICES = 1234, 0.8, 2
BIAS = 100.0  # a logit bias that makes its token the argmax at every step
BIAS_TOKENS = 8
# Each penalty alone, at a value that changes the demo's greedy output, on every battery prompt: a penalty applied
# per step instead of per accepted token differs only where a token repeats inside an accepted run (on the demo, 2
# to 4 of the 9 prompts at these values, none of the first 3: benchmarks/api_faults.py).
PENALTIES = {
    "presence_penalty": 1.5,
    "frequency_penalty": 1.0,
    "repetition_penalty": 1.5,  # vLLM's and SGLang's extension
}
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}
PENALTY_TOPS = 20  # top entries a penalty's reply carries: its self-check's candidates (vLLM's --max-logprobs)
SHIFT_PENALTIES = ("presence_penalty", "frequency_penalty")  # subtracted from logits: checkable on log-probabilities
MIN_TOKENS_PAST = 3  # min_tokens this far past where the plain output meets the stop id asked for
RESENT_POSITIONS = 6  # per prompt: output positions whose log-probability is asked again as a prompt's next token
PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"
REFUSED = "the server refuses"  # the start of a not-run check's evidence where the server refused its requests

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
    "min-tokens": (
        "min_tokens must mask the stop ids until the output is that long, counting each draft position's tokens "
        "(sglang#28180: masked L times too long): look where the min-tokens processor meets the drafts"
    ),
    "logit-bias": "logit_bias is not applied at verification: drafts are accepted against the unbiased target",
    "penalties": (
        "penalties must act per accepted token at verification (TRT-LLM#17701, sglang#33643: ignored with MTP, or "
        "applied once per step): compare with speculation off"
    ),
    "structured": (
        "a reply under response_format breaks its schema, or differs with speculation or batching: the grammar's "
        "bitmask must be applied at every draft position (behind a reasoning parser, at each one after the "
        "reasoning's end inside a step) and its matcher rolled back after a rejection (vllm#44006, #48228; "
        "sglang#9187): look where the structured-output bitmask meets the drafts"
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
        """A request's prompt and fields: the penalties pinned neutral unless asked for (an engine may apply a
        model's generation-config defaults, which the checks would take for the field's effect)."""
        return prompt, NEUTRAL | {
            "max_tokens": API_TOKENS,
            "logprobs": LOGPROBS,
            "return_tokens_as_token_ids": True,
        } | fields

    def ask(
        self, requests: list[tuple], reference: bool = False, concurrency: int = API_CONCURRENCY, chat: bool = False
    ) -> list[dict]:
        """The replies; with `chat`, each prompt sent as a user message, its reply in the completions' shape."""
        probe, model = (self.reference, self.reference_model) if reference else (self.probe, self.model)

        def send(request: tuple) -> dict:
            prompt, fields = request
            if not chat:
                return probe.complete(model, prompt, **fields)
            if isinstance(fields.get("logprobs"), int):  # the chat API's spelling of the completions' n top entries
                fields = fields | {"logprobs": True, "top_logprobs": fields["logprobs"]}
            return as_completion(probe.chat(model, prompt, **fields))

        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(send, requests))

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


def as_completion(reply: dict) -> dict:
    """A chat reply in the shape the checks read, the completions API's: the message's content as the text (None
    while a reasoning has not ended), its reasoning kept beside it (vLLM's `reasoning`, or `reasoning_content`), the
    log-probability entries as parallel lists."""
    if "error" in reply:
        return reply
    choice = first_choice(reply)
    message = choice.get("message") or {}
    entries = (choice.get("logprobs") or {}).get("content") or []
    logprobs = {
        "tokens": [entry.get("token") for entry in entries],
        "token_logprobs": [entry.get("logprob") for entry in entries],
        "top_logprobs": [
            {top["token"]: top["logprob"] for top in entry.get("top_logprobs") or []} for entry in entries
        ],
    }
    shaped = {
        "text": message.get("content"),
        "reasoning": message.get("reasoning") or message.get("reasoning_content"),
        "token_ids": choice.get("token_ids"),
        "logprobs": logprobs if entries else None,
        "finish_reason": choice.get("finish_reason"),
    }
    return {**reply, "choices": [shaped]}


def finish_of(reply: dict) -> str | None:
    return first_choice(reply).get("finish_reason")


def refused(reply: dict) -> bool:
    """The server refused the request as one it does not support (400 or 422), rather than failing it."""
    return "error" in reply and any(f"answered {code}" in reply["error"] for code in (400, 422))


def refused_check(name: str, family: str, replies: list[dict], whose: str = "server") -> ApiCheck | None:
    """The check not run where the server (or the reference) refused a request as one it does not support, with
    its reason."""
    reason = next((reply["error"] for reply in replies if refused(reply)), None)
    return (
        None
        if reason is None
        else ApiCheck(name, family, len(replies), NOT_RUN, f"the {whose} refuses it: {reason[:160]}")
    )


def ends_alike(reply: dict, reference: dict) -> bool:
    """Both ended at a stop token and one names it as a last token id and the other not (vLLM and specdoctor
    serve keep a stop or end-of-sequence id in `token_ids`; a server may not): the same output."""
    ours, theirs = output_ids(reply) or [], output_ids(reference) or []
    shorter, longer = sorted((ours, theirs), key=len)
    stopped = finish_of(reply) == finish_of(reference) == "stop"
    return stopped and len(longer) == len(shorter) + 1 and longer[:-1] == shorter


def parting(reply: dict, other: dict) -> dict | None:
    """Where two greedy replies first differ (output_sweeps.divergence, with the gap there), None where they do
    not, nor only by a named stop token (ends_alike)."""
    return None if ends_alike(reply, other) else divergence(reply, other)


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
