"""/metrics, written with prometheus_client as vLLM does: its speculative-decoding counters, request and
token counters, the running and waiting request gauges, and a time-to-first-token histogram."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from specdoctor.runtime.compile_status import CompileStatus, compile_totals
from specdoctor.runtime.decode.metrics import SpecMetrics

COMPILE_GAUGES = {
    "active": "Compiled graphs the ranks run (loaded or compiled, swapped in).",
    "pending": "Graphs asked for and not yet compiled: their passes run eager.",
    "compiled": "Graphs compiled since start-up.",
    "loaded": "Graphs loaded from the compile cache.",
    "failed": "Compiles that failed: their passes stay eager.",
}
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

disable_created_metrics()  # vLLM's scrape has no `_created` samples either


class ServerMetrics:
    def __init__(self, model_name: str, speculative: bool, compiled: bool = False):
        self.model_name, self.speculative, self.compiled = model_name, speculative, compiled
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def counter(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, help_text, label + list(extra), registry=self.registry)

        if speculative:
            self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            self.accepted_per_pos = counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ("position",)
            )
        self.requests = counter("vllm:request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced.")
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", label, registry=self.registry
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting for a place.", label, registry=self.registry
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            label,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        if compiled:  # the graphs compiled behind serving (runtime/background_compile.py), over every rank
            self.compile_gauges = {
                name: Gauge(f"specdoctor:compile_{name}", text, label, registry=self.registry)
                for name, text in COMPILE_GAUGES.items()
            }
        self._lock = threading.Lock()

    def record_request(self, outcome: str, prompt_tokens: int, generation_tokens: int, spec: SpecMetrics | None):
        name = self.model_name
        with self._lock:
            self.requests.labels(name, outcome).inc()
            self.prompt_tokens.labels(name).inc(prompt_tokens)
            self.generation_tokens.labels(name).inc(generation_tokens)
            if spec is None or not self.speculative:
                return
            self.drafts.labels(name).inc(spec.num_drafts)
            self.draft_tokens.labels(name).inc(spec.num_draft_tokens)
            self.accepted.labels(name).inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.num_accepted_tokens_per_pos):
                self.accepted_per_pos.labels(name, str(position)).inc(count)

    def record_ttft(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def set_compile(self, statuses: dict[int, CompileStatus]) -> None:
        if self.compiled:
            for name, value in compile_totals(statuses).items():
                if name in self.compile_gauges:
                    self.compile_gauges[name].labels(self.model_name).set(value)

    def render(self) -> str:
        if self.speculative:  # vLLM shows the counters at 0 before the first request
            for series in (self.drafts, self.draft_tokens, self.accepted):
                series.labels(self.model_name)
        for series in (self.prompt_tokens, self.generation_tokens):
            series.labels(self.model_name)
        return generate_latest(self.registry).decode()
