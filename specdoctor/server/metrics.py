"""Prometheus text exposition: vLLM's speculative-decoding counters, request and token counters,
and a time-to-first-token histogram."""

from __future__ import annotations

import threading

from specdoctor.runtime.metrics import SpecMetrics

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, model_name: str, speculative: bool):
        self.model_name, self.speculative = model_name, speculative
        self.spec = SpecMetrics()
        self.requests: dict[str, int] = {}  # finish reason / error -> count
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft_counts = [0] * len(TTFT_BUCKETS)
        self.ttft_sum, self.ttft_count = 0.0, 0
        self._lock = threading.Lock()

    def record_request(self, outcome: str, prompt_tokens: int, generation_tokens: int, spec: SpecMetrics | None):
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            if spec is not None:
                self.spec.add(spec)

    def record_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            for index, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_counts[index] += 1

    def render(self) -> str:
        label = f'model_name="{self.model_name}"'
        lines: list[str] = []

        def counter(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} counter")
            lines.extend(f"{name}_total{{{labels}}} {value}" for labels, value in samples)

        with self._lock:
            if self.speculative:
                spec = self.spec
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", [(label, spec.num_drafts)])
                counter(
                    "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", [(label, spec.num_draft_tokens)]
                )
                counter(
                    "vllm:spec_decode_num_accepted_tokens",
                    "Number of accepted tokens.",
                    [(label, spec.num_accepted_tokens)],
                )
                counter(
                    "vllm:spec_decode_num_accepted_tokens_per_pos",
                    "Accepted tokens per draft position.",
                    [(f'{label},position="{i}"', n) for i, n in enumerate(spec.num_accepted_tokens_per_pos)],
                )
            counter(
                "vllm:request_success",
                "Finished requests by finish reason.",
                [(f'{label},finished_reason="{reason}"', n) for reason, n in sorted(self.requests.items())],
            )
            counter("vllm:prompt_tokens", "Prefill tokens processed.", [(label, self.prompt_tokens)])
            counter("vllm:generation_tokens", "Generation tokens produced.", [(label, self.generation_tokens)])
            name = "vllm:time_to_first_token_seconds"
            lines += [f"# HELP {name} Time to first token.", f"# TYPE {name} histogram"]
            for bound, count in zip(TTFT_BUCKETS, self.ttft_counts, strict=True):
                lines.append(f'{name}_bucket{{{label},le="{bound}"}} {count}')
            lines.append(f'{name}_bucket{{{label},le="+Inf"}} {self.ttft_count}')
            lines.append(f"{name}_sum{{{label}}} {self.ttft_sum}")
            lines.append(f"{name}_count{{{label}}} {self.ttft_count}")
        return "\n".join(lines) + "\n"
