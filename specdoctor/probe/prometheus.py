"""vLLM's speculative counters in a Prometheus scrape, read with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.decode.metrics import SpecMetrics

SPEC_PREFIX = "vllm:spec_decode_"


def parse(text: str, source: str = "/metrics") -> list[Sample]:
    """Every sample of a text exposition; a scrape the parser rejects is an error naming the source."""
    try:
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except ValueError as err:
        raise SpecdoctorError(f"{source}: not Prometheus text exposition ({err})") from None


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
