"""What a load run measured, reduced to a report: pure functions over per-request records.

Latencies are kept in seconds in `RequestRecord` and reported in milliseconds. Definitions
(the same as vLLM's serving benchmark, so figures compare):

- TTFT: request sent → first content token received.
- ITL: the gaps between consecutive content chunks of one stream, pooled over requests.
- TPOT: per request, (e2e − TTFT) / (output tokens − 1), for requests with > 1 token.
- e2e: request sent → the response's last byte.
- goodput: completed requests per second whose TTFT and mean ITL both meet the SLOs.

Percentiles interpolate linearly between the closest ranks, which is numpy's default
(``method="linear"``): for sorted x of n values, rank h = (n − 1) · q / 100 and the value is
x[⌊h⌋] + (h − ⌊h⌋) · (x[⌊h⌋ + 1] − x[⌊h⌋]).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request as the load generator saw it. Times in seconds (perf_counter based)."""

    index: int
    #: When the request was due (open loop: its Poisson arrival), from the run's start.
    scheduled_s: float
    #: When it was actually sent, from the run's start.
    start_s: float
    ok: bool = False
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    #: Of those, the ones the server's prefix cache served (OpenAI's usage
    #: ``prompt_tokens_details.cached_tokens``), when it says.
    cached_tokens: int | None = None
    #: Why it failed: ``http_<status>``, ``stream_<error type>``, ``incomplete_stream``, or
    #: the exception's class name. None when it succeeded.
    error: str | None = None
    #: The error body's own words (type, code, message), for the report's examples.
    error_detail: str | None = None
    #: Server-Timing stages in ms (the header, completed by a stream's timing comment).
    server_timing_ms: dict[str, float] = field(default_factory=dict)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, or None with fewer than 2 tokens."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def mean_itl_s(self) -> float | None:
        """The mean gap between this stream's content chunks, or None with fewer than 2."""
        return sum(self.itls_s) / len(self.itls_s) if self.itls_s else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in 0..100) by linear interpolation (numpy's default method).

    Raises ValueError for an empty sequence or q outside 0..100.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency (ms): count, mean and the percentiles the report shows."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def distribution(values_s: Iterable[float]) -> Distribution | None:
    """Summarise latencies given in seconds as milliseconds; None when there are none."""
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        return None
    return Distribution(
        count=len(ms), mean=sum(ms) / len(ms), p50=percentile(ms, 50),
        p90=percentile(ms, 90), p99=percentile(ms, 99), max=max(ms),
    )


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    """Whether a request completed with TTFT ≤ `slo_ttft_ms` and mean ITL ≤ `slo_itl_ms`.

    An SLO that is None is not checked; a stream with one chunk has no ITL and meets any
    ITL SLO. A failed request never meets them.
    """
    if not record.ok:
        return False
    if slo_ttft_ms is not None and (
        record.ttft_s is None or record.ttft_s * 1000.0 > slo_ttft_ms
    ):
        return False
    mean_itl = record.mean_itl_s
    return slo_itl_ms is None or mean_itl is None or mean_itl * 1000.0 <= slo_itl_ms


def mean_stages(records: Iterable[RequestRecord]) -> dict[str, float]:
    """Mean Server-Timing duration (ms) of each stage over the requests that reported it,
    in the order the stages first appeared."""
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for record in records:
        for stage, ms in record.server_timing_ms.items():
            sums[stage] = sums.get(stage, 0.0) + ms
            counts[stage] += 1
    return {stage: total / counts[stage] for stage, total in sums.items()}


@dataclass
class Report:
    """One load run's figures. Latencies in ms, rates per second."""

    sent: int
    completed: int
    failed: int
    failures: dict[str, int]
    duration_s: float
    request_rate: float
    output_token_rate: float
    prompt_tokens: int
    output_tokens: int
    ttft_ms: Distribution | None
    itl_ms: Distribution | None
    tpot_ms: Distribution | None
    e2e_ms: Distribution | None
    #: Open loop: how late requests went out against their Poisson schedule.
    send_lag_ms: Distribution | None
    slo_ttft_ms: float | None
    slo_itl_ms: float | None
    #: Completed requests per second meeting both SLOs (None without SLOs).
    goodput: float | None
    server_timing_ms: dict[str, float]
    #: One example message per failure type.
    failure_examples: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data."""
        return asdict(self)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_itl_ms: float | None = None,
) -> Report:
    """The report of a run that sent `records` and lasted `duration_s` seconds (first send
    to last response)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    failures = Counter(r.error or "unknown" for r in failed)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error or "unknown", r.error_detail or "")
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    output_tokens = sum(r.output_tokens for r in done)
    goodput = None
    if slo_ttft_ms is not None or slo_itl_ms is not None:
        goodput = sum(meets_slo(r, slo_ttft_ms, slo_itl_ms) for r in done) * per_s
    return Report(
        sent=len(records),
        completed=len(done),
        failed=len(failed),
        failures=dict(failures.most_common()),
        duration_s=duration_s,
        request_rate=len(done) * per_s,
        output_token_rate=output_tokens * per_s,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in done),
        output_tokens=output_tokens,
        ttft_ms=distribution(r.ttft_s for r in done if r.ttft_s is not None),
        itl_ms=distribution(itl for r in done for itl in r.itls_s),
        tpot_ms=distribution(t for r in done if (t := r.tpot_s) is not None),
        e2e_ms=distribution(r.e2e_s for r in done),
        send_lag_ms=distribution(max(0.0, r.start_s - r.scheduled_s) for r in records),
        slo_ttft_ms=slo_ttft_ms,
        slo_itl_ms=slo_itl_ms,
        goodput=goodput,
        server_timing_ms=mean_stages(done),
        failure_examples=examples,
    )


def difference(base: Distribution | None, other: Distribution | None) -> dict[str, float] | None:
    """`other` − `base` at p50, p90, p99 and mean (ms): e.g. what a gateway adds to the
    latency of going direct. None when either side has no data."""
    if base is None or other is None:
        return None
    return {q: getattr(other, q) - getattr(base, q) for q in ("mean", "p50", "p90", "p99")}
