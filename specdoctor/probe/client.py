"""Judge a live deployment's speculative decoding from outside, over HTTP (`specdoctor probe`).

The probe sends the battery (completions, greedy, fixed max_tokens) once, with no retries that
could double count: only a GET (idempotent) is sent again, once, where the server closed its connection.
Acceptance comes from the best source the server offers:
  per-request   counters in each response (`spec_decode`, specdoctor's server): exactly the probe's own
                traffic, whatever else the server is doing;
  sglang        `meta_info.spec_verify_ct` per response: mean length = completion tokens / verify count;
  metrics       the difference of vLLM's cumulative counters in /metrics before and after: includes any
                other traffic the server handled during the probe's window (a documented limit).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from specdoctor.checks.acceptance import acceptance_findings
from specdoctor.errors import SpecdoctorError
from specdoctor.probe import prometheus
from specdoctor.probe.options import ProbeOptions
from specdoctor.probe.pace import SAFETY, Pace
from specdoctor.probe.stats import Unit
from specdoctor.report import Finding
from specdoctor.runtime.decode.metrics import SpecMetrics

# uvicorn (vLLM's, SGLang's and specdoctor's server) closes a connection idle for 5 s; httpx's default keeps one
# for 5 s too, so a request sent on a connection idle for about 5 s can meet the server's close and get no reply.
# Dropping idle connections well before the server does leaves no such race (docs/probe.md, "Connections").
KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class Served:
    """What /v1/models says of the probed model."""

    model: str
    engine: str  # `owned_by`: vllm, sglang, specdoctor, ...
    max_model_len: int | None  # vLLM's and specdoctor's model cards carry it


@dataclass
class Window:
    """One group of requests: the replies, the errors, and the acceptance figures of exactly this group, in
    total and per unit (a request, where the server counts per request or the group went one at a time; else a
    wave of concurrent requests)."""

    source: str
    metrics: SpecMetrics | dict | None
    replies: list[dict]
    errors: list[str]
    units: list[SpecMetrics] = field(default_factory=list)

    def joined(self, other: "Window") -> "Window":
        """This group and `other`, one group (the same source)."""
        metrics = SpecMetrics()
        for part in (self.metrics, other.metrics):
            if not isinstance(part, SpecMetrics):  # SGLang's mean length, or no figures: none for the whole
                metrics = None
                break
            metrics.add(part)
        units = self.units + other.units
        return Window(self.source, metrics, self.replies + other.replies, self.errors + other.errors, units)

    @property
    def position0_units(self) -> list[Unit]:
        """Each unit's (position-0 acceptances, drafts)."""
        return [((unit.num_accepted_tokens_per_pos or [0])[0], unit.num_drafts) for unit in self.units]

    @property
    def position0(self) -> tuple[int, int] | None:
        """(position-0 acceptances, drafts), where the source counts them (SGLang's does not)."""
        if not isinstance(self.metrics, SpecMetrics) or not self.metrics.num_drafts:
            return None
        return (self.metrics.num_accepted_tokens_per_pos or [0])[0], self.metrics.num_drafts

    @property
    def drafted(self) -> bool:
        """Whether the group's requests were drafted for at all (SGLang's figures exist only when they were)."""
        return self.metrics is not None and (not isinstance(self.metrics, SpecMetrics) or self.metrics.num_drafts > 0)

    @property
    def mean_length(self) -> float | None:
        if isinstance(self.metrics, SpecMetrics):
            return self.metrics.mean_acceptance_length if self.metrics.num_drafts else None
        return self.metrics["mean_acceptance_length"] if self.metrics else None

    def figures(self) -> dict:
        """The point's acceptance figures, as reports show them."""
        metrics = self.metrics.to_dict() if isinstance(self.metrics, SpecMetrics) else self.metrics
        return {"source": self.source, "requests": len(self.replies), "errors": len(self.errors), "metrics": metrics}


class Probe:
    def __init__(self, options: ProbeOptions, url: str | None = None, deadline: float | None = None):
        self.options = options
        self.url = (url or options.url).rstrip("/")
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)
        self.client = httpx.Client(base_url=self.url, headers=headers, limits=limits)
        # each request's timeout follows this server's pace, inside the one budget
        self.pace = Pace(options.request_timeout, options.timeout, deadline)
        self.in_flight = 0
        self.lock = threading.Lock()

    def sibling(self, url: str) -> "Probe":
        """A probe of another server (a reference, with a pace of its own) within this probe's budget."""
        return Probe(self.options, url, self.pace.deadline)

    def get(self, path: str) -> httpx.Response:
        try:
            try:
                return self.client.get(path, timeout=self.pace.timeout(1, 1))
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                # the server closed a kept-alive connection as the request went out (a server whose keep-alive
                # is shorter than KEEPALIVE_S): a GET changes nothing, so it goes once more, on a new connection
                return self.client.get(path, timeout=self.pace.timeout(1, 1))
        except httpx.HTTPError as err:
            raise SpecdoctorError(f"{self.url}: cannot reach the server ({type(err).__name__}: {err})") from None

    def served_model(self, wanted: str | None = None) -> Served:
        """The model to probe (`wanted`, else the first listed) as /v1/models describes it."""
        response = self.get("/v1/models")
        if response.status_code == 401:
            raise SpecdoctorError(f"{self.url}: the server wants an API key (--api-key)")
        try:
            cards = {entry["id"]: entry for entry in response.json()["data"]}
        except (ValueError, KeyError, TypeError):
            raise SpecdoctorError(
                f"{self.url}: not an OpenAI-compatible server (GET /v1/models answered "
                f"{response.status_code} without a model list)"
            ) from None
        if not cards:
            raise SpecdoctorError(f"{self.url}: GET /v1/models lists no model")
        if wanted and wanted not in cards:
            raise SpecdoctorError(f"{self.url}: model {wanted!r} is not served (serving {list(cards)})")
        model = wanted or next(iter(cards))
        length = cards[model].get("max_model_len")
        return Served(model, str(cards[model].get("owned_by", "")), length if isinstance(length, int) else None)

    def samples(self) -> list | None:
        """Every sample of /metrics, or None where the server has no Prometheus endpoint."""
        response = self.get("/metrics")
        if response.status_code != 200:
            return None
        return prometheus.parse(response.text, f"{self.url}/metrics")

    def scrape(self) -> SpecMetrics | None:
        samples = self.samples()
        return None if samples is None else prometheus.spec_counters(samples)

    def complete(self, model: str, prompt: str | list[int], **fields) -> dict:
        """The server's reply, or {"error": ...} when it answered with an error: a finding, not bad input.
        Greedy with the probe's max_tokens unless `fields` say otherwise."""
        return self.post("/v1/completions", {"model": model, "prompt": prompt}, fields)

    def chat(self, model: str, text: str, **fields) -> dict:
        """The chat API's reply to one user message, as `complete`."""
        return self.post(
            "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}]}, fields
        )

    def post(self, path: str, request: dict, fields: dict) -> dict:
        # return_token_ids: vLLM then returns the completion's token ids (for the bigram baseline); others ignore it.
        body = {**request, "max_tokens": self.options.max_tokens, "temperature": 0, "return_token_ids": True, **fields}
        with self.lock:
            self.in_flight += 1
            in_flight = self.in_flight
        timeout, sent = self.pace.timeout(body["max_tokens"], in_flight), time.monotonic()
        try:
            response = self.client.post(path, json=body, timeout=timeout)
        except httpx.TimeoutException:
            raise SpecdoctorError(
                f"{self.url}: a completion of {body['max_tokens']} tokens got no reply within {timeout:.0f} s ("
                f"{SAFETY:g}x the server's slowest pace so far, with {in_flight} in flight)"
            ) from None
        except httpx.HTTPError as err:
            raise SpecdoctorError(f"{self.url}: a completion failed ({type(err).__name__}: {err})") from None
        finally:
            with self.lock:
                self.in_flight -= 1
        if response.status_code != 200:
            return {"error": f"POST {path} answered {response.status_code}: {error_message(response)}"}
        try:
            reply = response.json()
        except ValueError:
            return {"error": f"POST {path} answered 200 without JSON: {response.text[:200]}"}
        tokens = ((reply.get("usage") if isinstance(reply, dict) else None) or {}).get("completion_tokens")
        self.pace.observe(time.monotonic() - sent, tokens if isinstance(tokens, int) else body["max_tokens"], in_flight)
        return reply

    def complete_all(self, model: str, prompts: list, concurrency: int = 1, **fields) -> list[dict]:
        """Every prompt's reply, in order, with at most `concurrency` requests in flight."""
        if concurrency == 1:
            return [self.complete(model, prompt, **fields) for prompt in prompts]
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda prompt: self.complete(model, prompt, **fields), prompts))

    def measure(self, model: str, prompts: list, concurrency: int = 1, **fields) -> Window:
        """Send these prompts as one group, in waves of `concurrency`, and read the group's acceptance from the
        best source. Where that is /metrics, the counters are read around each wave too: the units a variance
        counts (one request each at concurrency 1)."""
        before = last = self.scrape()
        answers, units = [], []
        for start in range(0, len(prompts), concurrency):
            wave = self.complete_all(model, prompts[start : start + concurrency], concurrency, **fields)
            answers += wave
            if last is not None and not all("spec_decode" in answer for answer in wave):
                now = self.scrape()
                units.append(prometheus.difference(now, last) if now is not None else None)
                last = now
        after = self.scrape() if last is before else last
        replies = [answer for answer in answers if "error" not in answer]
        source, metrics = acceptance(replies, before, after)
        if source == "per-request":
            units = [per_request_metrics(reply["spec_decode"]) for reply in replies]
        elif source != "metrics" or None in units:
            units = []
        errors = [answer["error"] for answer in answers if "error" in answer]
        return Window(source, metrics, replies, errors, units)


def error_message(response: httpx.Response) -> str:
    """An error reply's own message where it is OpenAI-style (vLLM's, SGLang's, ours), else its text's start."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    return message[:300] if isinstance(message, str) else response.text[:200]


def first_choice(reply: dict) -> dict:
    """A completion's first choice ({} where it has none)."""
    return (reply.get("choices") or [None])[0] or {}


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
            total.add(per_request_metrics(spec))
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


def per_request_metrics(spec: dict) -> SpecMetrics:
    """A reply's own counters (`spec_decode`, specdoctor serve's)."""
    return SpecMetrics(
        spec["num_drafts"],
        spec["num_draft_tokens"],
        spec["num_accepted_tokens"],
        list(spec["num_accepted_tokens_per_pos"]),
    )


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
