"""Judge a live deployment's speculative decoding from outside, over HTTP (`specdoctor probe`).

The probe sends the battery (completions, greedy, fixed max_tokens) once, with no retries that
could double count. Acceptance comes from the best source the server offers:
  per-request   counters in each response (`spec_decode`, specdoctor's server): exactly the probe's own
                traffic, whatever else the server is doing;
  sglang        `meta_info.spec_verify_ct` per response: mean length = completion tokens / verify count;
  metrics       the difference of vLLM's cumulative counters in /metrics before and after: includes any
                other traffic the server handled during the probe's window (a documented limit).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from specdoctor.battery import load_battery
from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH, acceptance_findings, bigram_baseline
from specdoctor.errors import SpecdoctorError
from specdoctor.probe import prometheus
from specdoctor.report import Finding, ProbeReport
from specdoctor.runtime.decode.metrics import SpecMetrics


@dataclass(frozen=True)
class ProbeOptions:
    url: str
    api_key: str | None = None
    model: str | None = None
    battery: Path | None = None
    min_acceptance_length: float = DEFAULT_MIN_ACCEPTANCE_LENGTH
    max_tokens: int = 32
    request_timeout: float = 60.0
    timeout: float = 600.0


class Probe:
    def __init__(self, options: ProbeOptions):
        self.options = options
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self.client = httpx.Client(base_url=options.url.rstrip("/"), headers=headers, timeout=options.request_timeout)
        self.deadline = time.monotonic() + options.timeout

    def get(self, path: str) -> httpx.Response:
        try:
            return self.client.get(path)
        except httpx.HTTPError as err:
            raise SpecdoctorError(
                f"{self.options.url}: cannot reach the server ({type(err).__name__}: {err})"
            ) from None

    def served_model(self) -> tuple[str, str]:
        """(the model to probe, the engine that serves it: /v1/models' `owned_by`, e.g. vllm or sglang)."""
        response = self.get("/v1/models")
        if response.status_code == 401:
            raise SpecdoctorError(f"{self.options.url}: the server wants an API key (--api-key)")
        try:
            owners = {entry["id"]: str(entry.get("owned_by", "")) for entry in response.json()["data"]}
        except (ValueError, KeyError, TypeError):
            raise SpecdoctorError(
                f"{self.options.url}: not an OpenAI-compatible server (GET /v1/models answered "
                f"{response.status_code} without a model list)"
            ) from None
        if not owners:
            raise SpecdoctorError(f"{self.options.url}: GET /v1/models lists no model")
        if self.options.model and self.options.model not in owners:
            raise SpecdoctorError(
                f"{self.options.url}: model {self.options.model!r} is not served (serving {list(owners)})"
            )
        model = self.options.model or next(iter(owners))
        return model, owners[model]

    def scrape(self) -> SpecMetrics | None:
        response = self.get("/metrics")
        if response.status_code != 200:
            return None
        return prometheus.spec_counters(prometheus.parse(response.text, f"{self.options.url}/metrics"))

    def complete(self, model: str, prompt: str | list[int]) -> dict:
        """The server's reply, or {"error": ...} when it answered with an error: a finding, not bad input."""
        if time.monotonic() > self.deadline:
            raise SpecdoctorError(f"the probe ran past its {self.options.timeout:.0f} s limit")
        # return_token_ids: vLLM then returns the completion's token ids (for the bigram baseline); others ignore it.
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": self.options.max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        try:
            response = self.client.post("/v1/completions", json=body)
        except httpx.HTTPError as err:
            raise SpecdoctorError(f"{self.options.url}: a completion failed ({type(err).__name__}: {err})") from None
        if response.status_code != 200:
            return {"error": f"POST /v1/completions answered {response.status_code}: {response.text[:200]}"}
        try:
            return response.json()
        except ValueError:
            return {"error": f"POST /v1/completions answered 200 without JSON: {response.text[:200]}"}


def run_probe(options: ProbeOptions) -> ProbeReport:
    probe = Probe(options)
    battery = load_battery(options.battery)
    model, engine = probe.served_model()
    before = probe.scrape()
    answers = [probe.complete(model, entry.get("prompt", entry.get("token_ids"))) for entry in battery]
    after = probe.scrape()
    replies = [answer for answer in answers if "error" not in answer]
    source, metrics = acceptance(replies, before, after)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items() if k != "api_key"}
    metrics_dict = metrics.to_dict() if isinstance(metrics, SpecMetrics) else metrics
    findings = error_findings([a["error"] for a in answers if "error" in a], len(answers))
    outputs = [((reply.get("choices") or [{}])[0] or {}).get("token_ids") for reply in replies]
    baseline = bigram_baseline(outputs) if replies and all(isinstance(o, list) for o in outputs) else None
    findings += probe_findings(source, metrics, options.min_acceptance_length, engine, baseline) if replies else []
    answered = f"{len(replies)}/{len(battery)} answered"
    return ProbeReport(options.url, model, engine, settings, source, answered, metrics_dict, findings)


def error_findings(errors: list[str], asked: int) -> list[Finding]:
    if not errors:
        return []
    return [
        Finding(
            "probe.errors",
            "error",
            f"{len(errors)} of {asked} completions failed; the first: {errors[0]}",
            "the deployment errors while decoding speculatively: its log says why",
            "probe",
            {"errors": errors},
        )
    ]


def acceptance(replies: list[dict], before, after) -> tuple[str, SpecMetrics | dict | None]:
    """(source, figures) for the probe's traffic, from the best source the server offers."""
    per_request = [reply.get("spec_decode") for reply in replies]
    if replies and all(isinstance(spec, dict) for spec in per_request):
        total = SpecMetrics()
        for spec in per_request:
            total.add(
                SpecMetrics(
                    spec["num_drafts"],
                    spec["num_draft_tokens"],
                    spec["num_accepted_tokens"],
                    list(spec["num_accepted_tokens_per_pos"]),
                )
            )
        return "per-request", total
    verify_counts = [(reply.get("meta_info") or {}).get("spec_verify_ct") for reply in replies]
    if replies and all(isinstance(count, int) and count > 0 for count in verify_counts):
        tokens = sum(reply["usage"]["completion_tokens"] for reply in replies)
        return "sglang", {"mean_acceptance_length": tokens / sum(verify_counts), "verify_steps": sum(verify_counts)}
    if before is None or after is None:
        return "none", None
    if after.num_drafts < before.num_drafts:
        raise SpecdoctorError("the speculative counters went backwards: the server restarted during the probe")
    return "metrics", prometheus.difference(after, before)


# How each engine turns speculative decoding on, named by /v1/models' owned_by.
ENABLE_HINTS = {
    "vllm": """start vLLM with --speculative-config '{"method":"mtp","num_speculative_tokens":3}'""",
    "sglang": "start SGLang with --speculative-algorithm NEXTN --speculative-num-steps 3",
    "specdoctor": "start specdoctor serve with --num-speculative-tokens 3",
}


def enable_hint(engine: str) -> str:
    if engine in ENABLE_HINTS:
        return ENABLE_HINTS[engine]
    return "start the server with a drafter: " + "; ".join(ENABLE_HINTS.values())


def probe_findings(source: str, metrics, min_length: float, engine: str = "", baseline=None) -> list[Finding]:
    if metrics is None:
        return [
            Finding(
                "probe.enabled",
                "error",
                "speculative decoding is not enabled: the server reports no speculative counters",
                enable_hint(engine),
                "probe",
            )
        ]
    if isinstance(metrics, dict):  # SGLang: only the mean length is known
        mean, rates = metrics["mean_acceptance_length"], []
    else:
        if metrics.num_drafts == 0:
            return [
                Finding(
                    "probe.enabled",
                    "error",
                    "no drafts were proposed during the probe",
                    "speculative decoding is configured but not drafting",
                    "probe",
                )
            ]
        mean, rates = metrics.mean_acceptance_length, metrics.per_position_rates
    summary = f"mean acceptance length {mean:.2f} (counts the bonus token), from {source} figures"
    return acceptance_findings("probe", summary, mean, rates, min_length, "probe", baseline)
