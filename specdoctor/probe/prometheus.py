"""A small reader for the Prometheus text exposition format, and vLLM's speculative counters in it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from specdoctor.runtime.metrics import SpecMetrics

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\d+)?$")
LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')
SPEC_PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        if match is None:
            continue
        labels = {m.group("key"): m.group("value") for m in LABEL.finditer(match.group("labels") or "")}
        try:
            samples.append(Sample(match.group("name"), labels, float(match.group("value"))))
        except ValueError:
            continue
    return samples


def counter(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The counter's value summed over label sets (engines add model or engine labels); None if absent.
    Accepts the name with or without `_total`; `_created` samples are timestamps and never counted."""
    wanted = {name, name + "_total"} if not name.endswith("_total") else {name}
    values = [s.value for s in samples if s.name in wanted and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def spec_counters(samples: list[Sample]) -> SpecMetrics | None:
    """vLLM's speculative-decoding counters from a scrape, or None when the server exposes none."""
    drafts = counter(samples, SPEC_PREFIX + "num_drafts")
    if drafts is None:
        return None
    positions = sorted(
        {
            int(s.labels["position"])
            for s in samples
            if s.name.startswith(SPEC_PREFIX + "num_accepted_tokens_per_pos")
            and "position" in s.labels
            and not s.name.endswith("_created")
        }
    )
    per_position = [
        int(counter(samples, SPEC_PREFIX + "num_accepted_tokens_per_pos", position=str(p)) or 0) for p in positions
    ]
    return SpecMetrics(
        num_drafts=int(drafts),
        num_draft_tokens=int(counter(samples, SPEC_PREFIX + "num_draft_tokens") or 0),
        num_accepted_tokens=int(counter(samples, SPEC_PREFIX + "num_accepted_tokens") or 0),
        num_accepted_tokens_per_pos=per_position,
    )


def difference(after: SpecMetrics, before: SpecMetrics) -> SpecMetrics:
    """Counters are cumulative over the server's life: only the difference belongs to a window."""
    width = max(len(after.num_accepted_tokens_per_pos), len(before.num_accepted_tokens_per_pos))
    pad = lambda values: values + [0] * (width - len(values))  # noqa: E731
    return SpecMetrics(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        num_accepted_tokens_per_pos=[
            a - b
            for a, b in zip(
                pad(after.num_accepted_tokens_per_pos), pad(before.num_accepted_tokens_per_pos), strict=True
            )
        ],
    )
