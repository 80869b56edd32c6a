"""A server's Prometheus text, and vLLM's speculative-decoding counters in it.

vLLM (v1 engine, vllm/v1/spec_decode/metrics.py) exports three counters per engine:
`vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens` and
`vllm:spec_decode_num_accepted_tokens` (exposed with the `_total` suffix, one sample per engine
label set). The mean acceptance length over an interval is 1 + accepted / drafts of the counter
deltas: each draft yields its accepted tokens plus the one token the target model adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"


class MetricsError(Exception):
    """The metrics endpoint could not be read or parsed."""


def parse_counters(text: str) -> dict[str, float]:
    """Family name -> value summed over label sets (engines, models) of counters and gauges.

    Counters are keyed by their family name without `_total`, as prometheus_client's parser
    names them; `_created` timestamps are not values and are left out.
    """
    totals: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise MetricsError(f"not Prometheus text: {exc}") from None
    for family in families:
        if family.type not in ("counter", "gauge", "unknown"):
            continue
        values = [s.value for s in family.samples if not s.name.endswith("_created")]
        if values:
            totals[family.name] = float(sum(values))
    return totals


@dataclass(frozen=True)
class SpecDecodeCounters:
    drafts: float
    draft_tokens: float
    accepted_tokens: float

    def minus(self, earlier: SpecDecodeCounters) -> SpecDecodeCounters:
        return SpecDecodeCounters(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted_tokens - earlier.accepted_tokens,
        )

    @property
    def acceptance_length(self) -> float | None:
        """1 + accepted / drafts (the bonus token included); None when nothing was drafted."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts > 0 else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None


def spec_decode_counters(counters: dict[str, float]) -> SpecDecodeCounters | None:
    """The speculative-decoding counters, or None when the server does not export them
    (speculative decoding off)."""
    if SPEC_DRAFTS not in counters or SPEC_ACCEPTED_TOKENS not in counters:
        return None
    return SpecDecodeCounters(
        drafts=counters[SPEC_DRAFTS],
        draft_tokens=counters.get(SPEC_DRAFT_TOKENS, 0.0),
        accepted_tokens=counters[SPEC_ACCEPTED_TOKENS],
    )


async def fetch_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    try:
        response = await client.get(url)
    except httpx.HTTPError as exc:
        raise MetricsError(f"GET {url} failed: {exc!r}") from None
    if response.status_code != 200:
        raise MetricsError(f"GET {url} answered HTTP {response.status_code}")
    return parse_counters(response.text)
