"""The request API under speculation (docs/probe.md, "API sweep"): stop strings and stop token ids, max_tokens
landing mid-run, min_tokens, log-probabilities (of the output and of the prompt), logit bias, penalties, structured
output and seeds, all greedy except the seed's check.

What a request must return follows from the same prompt's plain greedy output (a stop string cuts it where the
string begins, max_tokens keeps its first tokens): with --reference-url that output is the reference's, speculation
off, so each reply is compared token for token with speculation off; without one it is the server's own, which
checks that the request's fields act on it as the API says. A penalty is compared with the reference's reply to
the same request; without one, presence and frequency penalties are checked against the raw log-probabilities the
reply reports (a shift of each token's logit, so of its log-probability), and the repetition penalty is not
verified. A log-probability is checked against the same position sent again as a prompt's last. A difference at a
near tie of the plain output (TIE_MARGIN) is numerics, not a failure."""

from __future__ import annotations

from specdoctor.probe.api_common import API_PROMPTS, FAILED, HINTS, NOT_RUN, PASSED, PENALTIES, Asker
from specdoctor.probe.api_logit_checks import logit_bias_check, logprobs_check, penalty_check, prompt_logprobs_check
from specdoctor.probe.api_output_checks import (
    max_tokens_check,
    min_tokens_check,
    seed_check,
    stop_ids_check,
    stop_string_check,
)
from specdoctor.probe.api_structured_checks import structured_checks
from specdoctor.probe.client import Probe, Served
from specdoctor.probe.options import SweepOptions
from specdoctor.probe.verdicts import not_run, sweep_of
from specdoctor.report import Finding, Sweep


def api_sweep(probe: Probe, served: Served, options: SweepOptions, prompts: list) -> Sweep:
    battery, prompts = prompts, prompts[:API_PROMPTS]
    reference = probe.sibling(options.reference_url) if options.reference_url else None
    asker = Asker(probe, served.model, reference, reference.served_model().model if reference else None)
    plain = asker.plain(prompts)
    if isinstance(plain, str):
        return not_run("api", plain)
    logprobs = logprobs_check(asker, plain)
    trusted = logprobs.verdict != FAILED  # the penalties' own check reads them
    checks = [
        max_tokens_check(asker, prompts, plain),
        stop_string_check(asker, prompts, plain),
        stop_ids_check(asker, prompts, plain),
        min_tokens_check(asker, prompts, plain),
        logprobs,
        prompt_logprobs_check(asker, plain),
        logit_bias_check(asker, prompts, plain),
        *(penalty_check(asker, battery, plain, name, value, trusted) for name, value in PENALTIES.items()),
        *structured_checks(asker, prompts, plain),
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
