"""A tiny Prometheus registry (text exposition format 0.0.4) and tokenyard's metrics.

No external dependency: counters, gauges and histograms with labels, rendered by `render`.

The metric names are vLLM's (v1) after the prefix, but a dashboard built for vLLM does not
work unchanged. What differs:

- the prefix: ``tokenyard:`` where vLLM has ``vllm:``;
- no ``model_name`` label (one model per process): a selector such as
  ``{model_name="$model"}`` matches nothing and has to be dropped;
- the prefix-cache counters are ``prefix_cache_queries`` and ``prefix_cache_hits``, where
  vLLM exposes ``prefix_cache_queries_total`` and ``prefix_cache_hits_total``;
- histogram buckets are tokenyard's (`TTFT_BUCKETS` and the others below), so panels that
  read a given ``le`` differ; ``histogram_quantile`` queries work;
- only the metrics of `TokenyardMetrics` exist; panels on any other vLLM metric are empty.

The other names, types and units, and the ``finished_reason`` values (stop, length,
abort), are vLLM's.

Concurrency: no locks. Every update and every render runs on the HTTP process's single
asyncio loop, where each method runs to completion without interleaving; updating from other
threads would need a lock around each update and `render`.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Self, TypeVar

from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.outputs import EngineStats

Number = int | float
M = TypeVar("M", bound="_Metric")


def _format_value(value: Number) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs) + "}"


class _Metric:
    """Shared parts: a name, help text, label names and one child per label-value tuple."""

    type_name = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Self] = {}

    def labels(self, *values: str, **by_name: str) -> Self:
        """The child for these label values (positional, or by name), created on first use."""
        if by_name:
            if values:
                raise ValueError("give label values positionally or by name, not both")
            values = tuple(by_name[n] for n in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._new_child()
            self._children[key] = child
        return child

    def _new_child(self) -> Self:
        raise NotImplementedError

    def _check_unlabelled(self) -> None:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use .labels(...)")

    def _series(self) -> Iterator[tuple[tuple[tuple[str, str], ...], _Metric]]:
        if not self.labelnames:
            yield (), self
            return
        for key, child in self._children.items():
            yield tuple(zip(self.labelnames, key, strict=True)), child

    def _samples(self, labels: tuple[tuple[str, str], ...]) -> list[str]:
        raise NotImplementedError

    def render(self) -> str:
        """This metric's HELP and TYPE lines and its samples."""
        lines = [
            f"# HELP {self.name} {_escape_help(self.documentation)}",
            f"# TYPE {self.name} {self.type_name}",
        ]
        for labels, child in self._series():
            lines.extend(child._samples(labels))
        return "\n".join(lines) + "\n"


class Counter(_Metric):
    """A monotonically increasing count. `set_total` takes a cumulative total from elsewhere."""

    type_name = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self.value: Number = 0

    def _new_child(self) -> Self:
        return type(self)(self.name, self.documentation)

    def inc(self, amount: Number = 1) -> None:
        """Add `amount` (≥ 0)."""
        self._check_unlabelled()
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount

    def set_total(self, total: Number) -> None:
        """Set the count to an absolute total, e.g. one the engine keeps since its start.

        A smaller total (the engine restarted) is taken as is; Prometheus's `rate` treats a
        drop as a counter reset.
        """
        self._check_unlabelled()
        self.value = total

    def _samples(self, labels: tuple[tuple[str, str], ...]) -> list[str]:
        return [f"{self.name}{_label_text(labels)} {_format_value(self.value)}"]


class Gauge(_Metric):
    """A value that goes up and down."""

    type_name = "gauge"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self.value: Number = 0

    def _new_child(self) -> Self:
        return type(self)(self.name, self.documentation)

    def set(self, value: Number) -> None:
        """Set the value."""
        self._check_unlabelled()
        self.value = value

    def inc(self, amount: Number = 1) -> None:
        """Add `amount` (may be negative)."""
        self._check_unlabelled()
        self.value += amount

    def _samples(self, labels: tuple[tuple[str, str], ...]) -> list[str]:
        return [f"{self.name}{_label_text(labels)} {_format_value(self.value)}"]


class Histogram(_Metric):
    """Observations counted into buckets with inclusive upper bounds (``le``), plus sum and count.

    Buckets are stored per bucket and made cumulative only when rendered, so `observe` is one
    binary search and two additions.
    """

    type_name = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        labelnames: Sequence[str] = (),
    ) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        if not bounds or len(set(bounds)) != len(bounds):
            raise ValueError("a histogram needs distinct finite bucket bounds")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum: float = 0.0
        self.count = 0

    def _new_child(self) -> Self:
        return type(self)(self.name, self.documentation, self.bounds)

    def observe(self, value: float) -> None:
        """Count one observation (in the metric's unit, seconds for latencies)."""
        self._check_unlabelled()
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def _samples(self, labels: tuple[tuple[str, str], ...]) -> list[str]:
        lines = []
        cumulative = 0
        for bound, n in zip([*self.bounds, math.inf], self.counts, strict=True):
            cumulative += n
            le = (*labels, ("le", _format_value(bound)))
            lines.append(f"{self.name}_bucket{_label_text(le)} {cumulative}")
        text = _label_text(labels)
        lines.append(f"{self.name}_sum{text} {_format_value(self.sum)}")
        lines.append(f"{self.name}_count{text} {self.count}")
        return lines


class Registry:
    """The metrics one ``/metrics`` page shows, in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: M) -> M:
        """Add `metric` (names are unique) and return it."""
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def __iter__(self) -> Iterator[_Metric]:
        return iter(self._metrics.values())

    def get(self, name: str) -> _Metric | None:
        """The metric named `name`, if registered."""
        return self._metrics.get(name)


#: Content type of the text exposition format this module renders.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render(registry: Registry) -> str:
    """The registry in Prometheus text exposition format 0.0.4."""
    return "".join(metric.render() for metric in registry)


# -------------------------------------------------------------------- tokenyard's metrics

PREFIX = "tokenyard:"
# Seconds; spans a fast local GPU (ms) to a loaded CPU host (minutes).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                   300.0, 600.0, 1800.0)


class TokenyardMetrics:
    """tokenyard's metrics in their own registry.

    Per-request figures are observed by the HTTP process as requests finish
    (`observe_finished`) and as tokens arrive (`observe_inter_token`); engine-wide figures
    arrive as `EngineStats` snapshots whose counts are totals since the engine started
    (`update_from_stats`).
    """

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry if registry is not None else Registry()
        r = self.registry
        p = PREFIX
        self.time_to_first_token = r.register(Histogram(
            f"{p}time_to_first_token_seconds", "Time to first token in seconds.",
            TTFT_BUCKETS))
        self.inter_token_latency = r.register(Histogram(
            f"{p}inter_token_latency_seconds", "Time between consecutive token arrivals "
            "in seconds.", ITL_BUCKETS))
        self.e2e_request_latency = r.register(Histogram(
            f"{p}e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            REQUEST_BUCKETS))
        self.request_queue_time = r.register(Histogram(
            f"{p}request_queue_time_seconds", "Time requests spent waiting in the queue "
            "in seconds.", REQUEST_BUCKETS))
        self.num_requests_running = r.register(Gauge(
            f"{p}num_requests_running", "Requests in the engine's running batch."))
        self.num_requests_waiting = r.register(Gauge(
            f"{p}num_requests_waiting", "Requests waiting to be admitted."))
        self.kv_cache_usage = r.register(Gauge(
            f"{p}kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent."))
        self.prefix_cache_queries = r.register(Counter(
            f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache."))
        self.prefix_cache_hits = r.register(Counter(
            f"{p}prefix_cache_hits", "Prompt tokens served from the prefix cache."))
        self.prompt_tokens = r.register(Counter(
            f"{p}prompt_tokens_total", "Prompt tokens of finished requests."))
        self.generation_tokens = r.register(Counter(
            f"{p}generation_tokens_total", "Generated tokens of finished requests."))
        self.request_success = r.register(Counter(
            f"{p}request_success_total", "Finished requests by finish reason.",
            labelnames=("finished_reason",)))
        self.num_preemptions = r.register(Counter(
            f"{p}num_preemptions_total", "Requests preempted by the scheduler."))

    def update_from_stats(self, stats: EngineStats) -> None:
        """Set the engine-wide gauges and cumulative counters from one snapshot."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_queries.set_total(stats.prefix_cache_queries)
        self.prefix_cache_hits.set_total(stats.prefix_cache_hits)
        self.num_preemptions.set_total(stats.num_preemptions)

    def observe_inter_token(self, interval_ns: int | None) -> None:
        """One inter-token latency sample, as `Timeline.mark_token` returns it (None: skip)."""
        if interval_ns is not None:
            self.inter_token_latency.observe(interval_ns / 1e9)

    def observe_finished(
        self,
        ttft_s: float | None,
        e2e_s: float,
        queue_s: float | None,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        finished_reasons: str | Sequence[str],
    ) -> None:
        """Record one finished request: latencies in seconds (None: not measured), counts,
        and the finish reason of each of its completions (n > 1 counts each, as vLLM's
        per-sequence counter does)."""
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        self.e2e_request_latency.observe(e2e_s)
        if queue_s is not None:
            self.request_queue_time.observe(queue_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)
        reasons = [finished_reasons] if isinstance(finished_reasons, str) else finished_reasons
        for reason in reasons:
            self.request_success.labels(finished_reason=reason).inc()

    def observe_request(
        self,
        timeline: Timeline,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        finished_reasons: str | Sequence[str],
    ) -> None:
        """`observe_finished` with the latencies read off a finished request's timeline.

        TTFT and end-to-end latency run from ``received``; ``done`` falls back to now.
        """
        done = timeline.get("done")
        end = done if done is not None else time.perf_counter_ns()
        self.observe_finished(
            ttft_s=timeline.interval_s("received", "first_token"),
            e2e_s=max(0, end - timeline.events["received"]) / 1e9,
            queue_s=timeline.interval_s("queued", "admitted"),
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            finished_reasons=finished_reasons,
        )

    def render(self) -> str:
        """The ``/metrics`` page."""
        return render(self.registry)
