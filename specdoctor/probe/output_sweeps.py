"""The sweeps that check the output itself, which acceptance cannot show (docs/probe.md): is sampled output
the target's own distribution, and is greedy output the same with speculation off?"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdoctor.probe.client import Probe, Served, first_choice
from specdoctor.probe.options import SweepOptions
from specdoctor.probe.sampling_settings import SamplingSetting, merge_sparse_bins, rank_probabilities
from specdoctor.probe.stats import Unit, calibration_p_value, fall_p_value
from specdoctor.probe.verdicts import not_run, sweep_of
from specdoctor.report import Finding, Sweep

SAMPLING_BINS = 5  # the reported top 5 by rank, then the rest: 5 degrees of freedom
SAMPLING_TOKENS_PER_REQUEST = 128
SAMPLING_CONCURRENCY = 4
MIN_EXPECTED = 5  # tokens expected in every bin: the textbook condition for the chi-square approximation
# Greedy output may differ at a near tie: bf16 keeps 8 significant bits, so each of two logits near 16 is off by
# up to 2^-4 after one rounding, and their gap by up to 2^-3: two runs that batch differently can land on either
# side of a gap under 0.125 nat.
TIE_MARGIN = 0.125

SAMPLING_HINT = (
    "the rejection sampler no longer keeps the target's distribution: vLLM reused the Philox offset for "
    "probabilistic drafts (PRs #47386, #54282), vllm-ascend reused the acceptance uniform for the resample "
    "(#16370), vLLM v0 verified at temperature 1 whatever the request asked (#9834, fixed by #10198): upgrade, "
    "or draft greedily (vLLM's default draft_sample_method)"
)
REFERENCE_HINT = (
    "greedy output must not change with speculation: a verification bug (TRT-LLM PR #17110: accuracy fell at the "
    "same acceptance) or NaN target logits accepting everything; compare a failing prompt's logprobs on both servers"
)


def sampling_fields(engine: str, setting: SamplingSetting) -> dict:
    """The setting asked for and nothing else that reshapes the distribution: the reported log-probabilities are
    the raw ones (vLLM's default logprobs mode), and engines fill unset fields from the model's generation config."""
    fields = {
        "temperature": setting.temperature,
        "top_p": setting.top_p,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logprobs": SAMPLING_BINS,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    if engine in ("vllm", "sglang"):  # their extensions; vLLM disables top-k with 0, SGLang with -1
        off = 0 if engine == "vllm" else -1
        fields |= {"top_k": setting.top_k or off, "min_p": 0.0, "repetition_penalty": 1.0}
    elif setting.top_k:
        fields["top_k"] = setting.top_k  # specdoctor's server takes it
    return fields


@dataclass
class SampledSteps:
    """Every sampled token whose rank distribution the setting fixes: its bins' probabilities (the reported ranks,
    then the rest) and the bin it landed in; `outside`: tokens drawn where the setting gives no chance."""

    probabilities: list[list[float]] = field(default_factory=list)
    outcomes: list[int] = field(default_factory=list)
    outside: int = 0
    undetermined: int = 0  # steps the unreported tail leaves open under this setting
    # per reply: (tokens drawn at rank 1, tokens with a reported top): temperature and top-p keep the ranks, so every
    # step counts here, those the unreported tail leaves open too
    top_draws: list[Unit] = field(default_factory=list)


def sampled_steps(replies: list[dict], setting: SamplingSetting) -> SampledSteps | str:
    """The steps of these replies, or why they cannot be read: no log-probabilities, or entries named by text
    (texts collide, and which do can depend on the token sampled, which would bias the bins)."""
    steps = SampledSteps()
    for reply in replies:
        firsts, drawn = 0, 0
        logprobs = first_choice(reply).get("logprobs")
        if not logprobs or not logprobs.get("top_logprobs"):
            return "returns no top log-probabilities"
        if not all(str(token).startswith("token_id:") for token in logprobs.get("tokens") or []):
            return "names log-probability entries by text, not by id (vLLM's return_tokens_as_token_ids)"
        for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=False):
            ranked = sorted((top or {}).items(), key=lambda item: -item[1])[:SAMPLING_BINS]
            if len(ranked) < SAMPLING_BINS:  # a vocabulary smaller than the bins
                continue
            firsts, drawn = firsts + (ranked[0][0] == token), drawn + 1
            bins = rank_probabilities([value for _, value in ranked], setting)
            if bins is None:
                steps.undetermined += 1
                continue
            names = [name for name, _ in ranked]
            outcome = names.index(token) if token in names else SAMPLING_BINS
            if bins[outcome] == 0:
                steps.outside += 1
                continue
            steps.probabilities.append(bins)
            steps.outcomes.append(outcome)
        steps.top_draws.append((firsts, drawn))
    return steps


def calibration(probe: Probe, served: Served, tokens: int, prompts: list, setting: SamplingSetting) -> dict | str:
    """The sampled tokens' bins against the reported distribution under `setting`: the test's figures, or why it
    cannot run."""
    requests = -(-tokens // SAMPLING_TOKENS_PER_REQUEST)
    group = [prompts[i % len(prompts)] for i in range(requests)]
    fields = {**sampling_fields(served.engine, setting), "max_tokens": SAMPLING_TOKENS_PER_REQUEST}
    window = probe.measure(served.model, group, SAMPLING_CONCURRENCY, **fields)
    if window.errors:
        return f"sampled requests failed: {window.errors[0]}"
    steps = sampled_steps(window.replies, setting)
    if isinstance(steps, str):
        return f"{probe.url} {steps}"
    merged = merge_sparse_bins(steps.probabilities, steps.outcomes, MIN_EXPECTED)
    if merged is None and not steps.outside:
        return (
            f"{len(steps.outcomes)} sampled tokens at {setting.label} ({steps.undetermined} more left open by the "
            f"unreported tail) leave fewer than two bins expecting {MIN_EXPECTED}: ask more"
        )
    result = {
        "setting": setting.label,
        "tokens": len(steps.outcomes) + steps.outside,
        "undetermined": steps.undetermined,
        "outside": steps.outside,
        "statistic": 0.0,
        "df": 0,
        "p_value": 0.0,  # a token the setting gives no chance: impossible under a sampler that applies it
        "drafted": window.drafted,
        "top_draws": steps.top_draws,
        **point_figures(window),
    }
    if merged:  # the bins by rank, the last one holding every rank folded into it
        probabilities, outcomes = merged
        statistic, p_value, df = calibration_p_value(probabilities, outcomes)
        result |= {"statistic": statistic, "df": df, "p_value": 0.0 if steps.outside else p_value}
        result["expected"] = [sum(column) for column in zip(*probabilities, strict=True)]
        result["observed"] = [outcomes.count(b) for b in range(len(probabilities[0]))]
    return result


def point_figures(window) -> dict:
    return {"source": window.source, "mean_acceptance_length": window.mean_length}


def sampling_sweep(probe: Probe, served: Served, options: SweepOptions, prompts: list) -> Sweep:
    """One calibration per setting asked for; the sweep fails where any setting's output is not the distribution
    the server reports, transformed to that setting. With a reference (speculation off), each setting is sampled
    there too, and the two samples compared."""
    points, findings, summaries = [], [], []
    alpha = options.alpha / len(options.sampling_settings)
    other = probe.sibling(options.reference_url) if options.reference_url else None
    other_served = other.served_model() if other else None
    for setting in options.sampling_settings:
        result = calibration(probe, served, options.sampling_tokens, prompts, setting)
        if isinstance(result, str):
            return not_run("sampling", result)
        if not result["drafted"]:
            return not_run("sampling", "no draft was proposed for the sampled requests: speculation was not tested")
        summary = f"{setting.label}: {result['tokens']} tokens, p = {result['p_value']:.2g}"
        reference = None
        if other:
            reference = calibration(other, other_served, options.sampling_tokens, prompts, setting)
            if isinstance(reference, dict):
                findings += two_sample_findings(options.reference_url, setting, result, reference, alpha)
                summary += f", against speculation off p = {result['two_sample_p_value']:.2g}"
        points.append({"label": f"{probe.url} at {setting.label}", **result})
        if isinstance(reference, dict):
            points.append({"label": f"{options.reference_url} at {setting.label}", **reference})
        summaries.append(summary)
        if result["p_value"] < alpha:
            findings.append(sampling_finding(setting, result, reference, alpha))
    return sweep_of("sampling", "; ".join(summaries), points[0]["source"], points, findings)


def two_sample_findings(reference_url: str, setting, result: dict, reference: dict, alpha: float) -> list[Finding]:
    """The server's sample against the reference's at one setting: how often each drew the token its own reported
    distribution ranks first, the request as the unit (a sampler that keeps the setting's distribution draws it as
    often with speculation as without); an error where the two differ at `alpha`, two-sided."""
    ours, theirs = result["top_draws"], reference["top_draws"]
    p_value = min(1.0, 2 * min(fall_p_value(theirs, ours), fall_p_value(ours, theirs)))
    result["two_sample_p_value"] = p_value
    if p_value >= alpha:
        return []
    share = [sum(x for x, _ in units) / max(1, sum(n for _, n in units)) for units in (ours, theirs)]
    message = (
        f"at {setting.label}, the token its own distribution ranks first was drawn {share[0]:.1%} of the time, "
        f"{share[1]:.1%} without speculation ({reference_url}): two-sample, request as the unit, p = {p_value:.1e} "
        f"< {alpha:.1g}"
    )
    return [Finding("probe.sampling", "error", message, SAMPLING_HINT, "sampling", result)]


def sampling_finding(setting, result: dict, reference: dict | str | None, alpha: float) -> Finding:
    """The setting's output is off its distribution at `alpha` (the setting's share of the sweep's); with a
    reference, the same test without speculation tells the sampler from the speculation."""
    if result["outside"]:
        message = (
            f"at {setting.label}, {result['outside']} of {result['tokens']} sampled tokens fell where that setting "
            "gives the reported distribution no chance (outside its top-p nucleus or top-k): the request's sampling "
            "parameters were not applied, or the reported log-probabilities are not the ones sampled from"
        )
    else:
        message = (
            f"at {setting.label}, sampled output is not the target's reported distribution: chi-square "
            f"{result['statistic']:.1f} on {result['df']} degrees of freedom over {result['tokens']} tokens "
            f"(p = {result['p_value']:.1e} < {alpha:.1g})"
        )
    severity = "error"
    if isinstance(reference, dict) and reference["p_value"] < alpha:
        severity, message = "warning", message + "; the reference fails too: the sampler, not speculation"
    return Finding("probe.sampling", severity, message, SAMPLING_HINT, "sampling", result)


def output_ids(reply: dict) -> list | None:
    """The completion's token ids where the server names them (vLLM's return_token_ids, or log-probability
    entries named token_id:N), else None."""
    choice = first_choice(reply)
    if isinstance(choice.get("token_ids"), list):
        return choice["token_ids"]
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
    return None


def output_text(reply: dict) -> str:
    return first_choice(reply).get("text") or ""


def divergence(spec: dict, reference: dict) -> dict | None:
    """Where greedy output first differs, with the reference's log-probability gap between the two tokens there
    (inf when the speculative token is not among the reference's top 2), or None when it does not differ. Token
    ids where both servers name them; otherwise the texts (character index, no gap)."""
    ours, theirs = output_ids(spec), output_ids(reference)
    if ours is None or theirs is None:
        ours, theirs = output_text(spec), output_text(reference)
    if ours == theirs:
        return None
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    gap = math.inf
    tops = (first_choice(reference).get("logprobs") or {}).get("top_logprobs") or []
    if isinstance(ours, list) and index < len(tops) and index < len(ours):
        top = tops[index] or {}
        ranked = sorted(top.values(), reverse=True)
        mine = top.get(f"token_id:{ours[index]}")
        gap = ranked[0] - mine if mine is not None and ranked else math.inf
    return {"index": index, "gap": gap}


def reference_sweep(probe: Probe, served: Served, options: SweepOptions, battery: list[dict], prompts: list) -> Sweep:
    reference = probe.sibling(options.reference_url)
    other = reference.served_model()
    fields = {"logprobs": 2, "return_tokens_as_token_ids": True}
    window = probe.measure(served.model, prompts, **fields)
    theirs = reference.complete_all(other.model, prompts, **fields)
    failed = window.errors + [reply["error"] for reply in theirs if "error" in reply]
    if failed:
        return not_run("reference", f"{len(failed)} greedy requests failed: {failed[0]}")
    if not window.drafted:
        return not_run("reference", "no draft was proposed for these requests: speculation was not compared")
    ours = window.replies
    differing = {
        entry["name"]: found
        for entry, mine, theirs_reply in zip(battery, ours, theirs, strict=True)
        if (found := divergence(mine, theirs_reply)) is not None
    }
    ties = {name: found for name, found in differing.items() if found["gap"] <= TIE_MARGIN}
    findings = []
    real = {name: found for name, found in differing.items() if name not in ties}
    if real:
        name, found = next(iter(real.items()))
        message = (
            f"greedy output differs from {options.reference_url} on {len(real)} of {len(battery)} prompts; "
            f"{name} first at token {found['index']}"
        )
        findings.append(Finding("probe.reference", "error", message, REFERENCE_HINT, "reference", {"prompts": real}))
    if ties:
        message = f"{len(ties)} prompt(s) differ at a near tie (under {TIE_MARGIN} nat): numerics, not speculation"
        findings.append(Finding("probe.reference", "warning", message, stage="reference", data={"prompts": ties}))
    same = len(battery) - len(differing)
    summary = f"greedy output identical to {options.reference_url} on {same} of {len(battery)} prompts"
    points = [{"label": entry["name"], "divergence": differing.get(entry["name"])} for entry in battery]
    return sweep_of("reference", summary, None, points, findings)
