"""tokenyard's metrics, kept by `prometheus_client` and rendered for ``/metrics``.

Two kinds of figures share the page:

- **per request**, observed by the HTTP process as requests finish and tokens arrive
  (latency histograms, token counters, finished requests by reason): `prometheus_client`
  counters and histograms. With several HTTP workers (`tokenyard serve --workers N`) they
  run in prometheus_client's multiprocess mode: the parent sets ``PROMETHEUS_MULTIPROC_DIR``
  (a fresh directory per serve) before it starts the workers, every worker writes its
  values to its own files there, and whichever worker answers ``/metrics`` sums them all
  (`MultiProcessCollector`), so the page covers every worker, including ones that died
  and were replaced (a counter never goes back). The mode is chosen when prometheus_client
  is imported, from that variable, as the library wants.
- **engine-wide**, the replica's own figures (batch, queue, KV cache, prefix cache,
  preemptions) from an `EngineStats` snapshot taken when the page is asked for: they are
  not this process's to count or to sum across workers, so they are not kept in
  prometheus_client at all; `render` writes them after the rest, each as one sample.

The metric names are vLLM's (v1) after the prefix, but a dashboard built for vLLM does not
work unchanged. What differs:

- the prefix: ``tokenyard:`` where vLLM has ``vllm:``;
- no ``model_name`` label (one model per process): a selector such as
  ``{model_name="$model"}`` matches nothing and has to be dropped;
- the prefix-cache counters are ``prefix_cache_queries`` and ``prefix_cache_hits``, where
  vLLM exposes ``prefix_cache_queries_total`` and ``prefix_cache_hits_total``;
- the latency histograms (TTFT, inter-token, end-to-end, queue time) carry a ``lane``
  label: ``live`` (a client waits on it) or ``batch`` (a Batch API line, run at the
  lowest priority, whose latencies would otherwise fire false alerts on the live ones);
  select ``{lane="live"}`` for what clients see;
- histogram buckets are tokenyard's (`TTFT_BUCKETS` and the others below), so panels that
  read a given ``le`` differ; ``histogram_quantile`` queries work;
- only the metrics of `TokenyardMetrics` exist (and ``http_workers``, the live workers);
  panels on any other vLLM metric are empty.

The other names, types and units, and the ``finished_reason`` values (stop, length,
abort), are vLLM's. No ``_created`` series are written (`disable_created_metrics`, for
the whole process: tokenyard's page never had them, and multiprocess mode has none).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.outputs import EngineStats

prometheus_client.disable_created_metrics()

#: A histogram's cumulative counts per upper bound (`TokenyardMetrics.histogram_buckets`).
Buckets = tuple[tuple[float, float], ...]
#: The variable that puts prometheus_client in multiprocess mode (its directory of files).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Content type of the text exposition format `render` writes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

PREFIX = "tokenyard:"
# Seconds; spans a fast local GPU (ms) to a loaded CPU host (minutes).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                   300.0, 600.0, 1800.0)

#: The `lane` label's values: live traffic, and the Batch API's lines.
LANES = ("live", "batch")

#: What refused a request (`requests_refused_total`'s `stage`): the key (auth), its
#: scopes and regions (authorize), its rate limits (limit), its credit, spend cap or free
#: tier (billing), the content policy (moderation), the per-address limits and the body
#: cap (edge), and the request itself (validation: a malformed or unservable body).
REFUSAL_STAGES = ("auth", "authorize", "limit", "billing", "moderation", "edge",
                  "validation")
REFUSAL_LABELS = ("stage", "status", "code", "route")

#: The engine-wide figures: (name after the prefix, type, help, EngineStats field).
ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "gauge", "Requests in the engine's running batch.",
     "num_running"),
    ("num_requests_waiting", "gauge", "Requests waiting to be admitted.", "num_waiting"),
    ("kv_cache_usage_perc", "gauge", "KV-cache usage; 1 means 100 percent.",
     "kv_cache_usage"),
    ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache.",
     "prefix_cache_hits"),
    ("num_preemptions_total", "counter", "Requests preempted by the scheduler.",
     "num_preemptions"),
    ("num_overlapped_steps_total", "counter",
     "Engine steps planned while the step before still computed (async scheduling).",
     "num_overlapped_steps"),
    ("spec_decode_num_draft_tokens_total", "counter",
     "Draft tokens verified by speculative decoding.", "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens_total", "counter",
     "Draft tokens speculative decoding accepted.", "num_accepted_draft_tokens"),
)


def multiprocess_dir() -> str | None:
    """`$PROMETHEUS_MULTIPROC_DIR` when set: the values of every worker live there."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


def mark_worker_dead(pid: int, path: str | None = None) -> None:
    """Forget a dead worker's live gauges (its counters and histograms stay in the sums).
    The parent calls it for each worker that exits."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)


def _format_value(value: float) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def render_engine_stats(stats: EngineStats) -> str:
    """The engine-wide metrics of one snapshot in the text exposition format, each with
    its HELP and TYPE lines and one unlabelled sample."""
    lines = []
    for name, kind, doc, attr in ENGINE_METRICS:
        full = PREFIX + name
        lines += [f"# HELP {full} {doc}", f"# TYPE {full} {kind}",
                  f"{full} {_format_value(getattr(stats, attr))}"]
    return "\n".join(lines) + "\n"


#: The engine-wide figures a router built for vLLM scrapes from each replica's /metrics
#: (llm-d's endpoint picker, Dynamo, production-stack), under vLLM's own names and label:
#: (vLLM's name, type, `ENGINE_METRICS` name it aliases).
VLLM_ALIASES: tuple[tuple[str, str, str], ...] = (
    ("vllm:num_requests_running", "gauge", "num_requests_running"),
    ("vllm:num_requests_waiting", "gauge", "num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "gauge", "kv_cache_usage_perc"),
    ("vllm:prefix_cache_queries", "counter", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "counter", "prefix_cache_hits"),
)


def render_replica_metrics(stats: EngineStats, model_name: str) -> str:
    """A replica's /metrics: its engine-wide figures under tokenyard's names, then the
    ones vLLM routers read under vLLM's (a counter's sample with ``_total``, as
    prometheus_client writes it, and the ``model_name`` label)."""
    fields = {name: attr for name, _, _, attr in ENGINE_METRICS}
    docs = {name: doc for name, _, doc, _ in ENGINE_METRICS}
    label = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    lines = []
    for full, kind, name in VLLM_ALIASES:
        sample = f"{full}_total" if kind == "counter" else full
        lines += [f"# HELP {sample} {docs[name]}", f"# TYPE {sample} {kind}",
                  f'{sample}{{model_name="{label}"}} '
                  f"{_format_value(getattr(stats, fields[name]))}"]
    return render_engine_stats(stats) + "\n".join(lines) + "\n"


class TokenyardMetrics:
    """tokenyard's metrics, in a registry of their own.

    Per-request figures are observed as requests finish (`observe_finished`) and as tokens
    arrive (`observe_inter_token`); engine-wide figures arrive as `EngineStats` snapshots
    whose counts are totals since the engine started (`update_from_stats`). In multiprocess
    mode the metrics' values go to this worker's files, and `render` sums every worker's.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.stats: EngineStats | None = None
        r, p = self.registry, PREFIX
        lane = ("lane",)
        self.time_to_first_token = Histogram(
            f"{p}time_to_first_token_seconds", "Time to first token in seconds.",
            labelnames=lane, buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            f"{p}inter_token_latency_seconds", "Time between consecutive token arrivals "
            "in seconds.", labelnames=lane, buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            f"{p}e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            labelnames=lane, buckets=REQUEST_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            f"{p}request_queue_time_seconds", "Time requests spent waiting in the queue "
            "in seconds.", labelnames=lane, buckets=REQUEST_BUCKETS, registry=r)
        # Each lane's children, made once (labels() locks and builds a key each call);
        # both lanes' series exist from the start, at 0.
        self._lanes = {name: _Latencies(self, name) for name in LANES}
        self.prompt_tokens = Counter(
            f"{p}prompt_tokens_total", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            f"{p}generation_tokens_total", "Generated tokens of finished requests.",
            registry=r)
        self.request_success = Counter(
            f"{p}request_success_total", "Finished requests by finish reason.",
            labelnames=("finished_reason",), registry=r)
        # Not vLLM's: the gateway's refusals (4xx), by the stage that refused them
        # (REFUSAL_STAGES), the HTTP status, the error code and the route.
        self.requests_refused = Counter(
            f"{p}requests_refused_total", "Requests the gateway refused, by stage, status, "
            "error code and route.", labelnames=REFUSAL_LABELS, registry=r)
        self._refused: dict[tuple[str, str, str, str], Counter] = {}
        # livesum: the workers alive now (a dead worker's file is removed by its parent).
        self.http_workers = Gauge(
            f"{p}http_workers", "HTTP worker processes serving.", registry=r,
            multiprocess_mode="livesum")
        self.http_workers.set(1)
        # labels() takes a lock and builds a key each call: keep each reason's child.
        self._success_by_reason: dict[str, Counter] = {}

    def update_from_stats(self, stats: EngineStats) -> None:
        """Keep the replica's snapshot for the engine-wide figures of the next `render`."""
        self.stats = stats

    def observe_inter_token(self, interval_ns: int | None, lane: str = "live") -> None:
        """One inter-token latency sample, as `Timeline.mark_token` returns it (None: skip),
        of a request of `lane`."""
        if interval_ns is not None:
            self._lanes[lane].inter_token.observe(interval_ns / 1e9)

    def observe_finished(
        self,
        ttft_s: float | None,
        e2e_s: float,
        queue_s: float | None,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        finished_reasons: str | Sequence[str],
        lane: str = "live",
    ) -> None:
        """Record one finished request of `lane`: latencies in seconds (None: not
        measured), counts, and the finish reason of each of its completions (n > 1 counts
        each, as vLLM's per-sequence counter does)."""
        latencies = self._lanes[lane]
        if ttft_s is not None:
            latencies.ttft.observe(ttft_s)
        latencies.e2e.observe(e2e_s)
        if queue_s is not None:
            latencies.queue.observe(queue_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)
        reasons = [finished_reasons] if isinstance(finished_reasons, str) else finished_reasons
        for reason in reasons:
            child = self._success_by_reason.get(reason)
            if child is None:
                child = self._success_by_reason[reason] = self.request_success.labels(reason)
            child.inc()

    def observe_refused(self, stage: str, status: int, code: str, route: str) -> None:
        """Count one refused request (`stage`: one of REFUSAL_STAGES)."""
        labels = (stage, str(status), code, route)
        child = self._refused.get(labels)
        if child is None:
            child = self._refused[labels] = self.requests_refused.labels(*labels)
        child.inc()

    def refusals(self) -> dict[tuple[str, str, str, str], float]:
        """Every worker's refusals so far: (stage, status, code, route) → count."""
        out: dict[tuple[str, str, str, str], float] = {}
        for family in self._source().collect():
            if family.name != PREFIX + "requests_refused":
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    got = sample.labels
                    labels = (got["stage"], got["status"], got["code"], got["route"])
                    out[labels] = out.get(labels, 0.0) + sample.value
        return out

    def observe_request(
        self,
        timeline: Timeline,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        finished_reasons: str | Sequence[str],
    ) -> None:
        """`observe_finished` with the latencies (and the lane) read off a finished
        request's timeline.

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
            lane=timeline.lane,
        )

    def _source(self) -> CollectorRegistry:
        """This process's registry, or in multiprocess mode one that sums every worker's."""
        path = multiprocess_dir()
        if path is None:
            return self.registry
        source = CollectorRegistry()
        MultiProcessCollector(source, path)
        return source

    def histogram_buckets(self, lane: str = "live") -> dict[str, Buckets]:
        """Each latency histogram's cumulative bucket counts (every worker's) of `lane`,
        by its name after the prefix: ``time_to_first_token_seconds`` → ((le, count), …),
        the last bound +Inf."""
        out: dict[str, Buckets] = {}
        for family in self._source().collect():
            if family.type != "histogram":
                continue
            out[family.name.removeprefix(PREFIX)] = tuple(
                (float(sample.labels["le"]), sample.value) for sample in family.samples
                if sample.name.endswith("_bucket") and sample.labels.get("lane") == lane)
        return out

    def render(self) -> str:
        """The ``/metrics`` page: the per-request metrics (every worker's, summed, in
        multiprocess mode), then the engine-wide ones of the last snapshot."""
        text = generate_latest(self._source()).decode()
        if self.stats is not None:
            text += render_engine_stats(self.stats)
        return text


class _Latencies:
    """One lane's children of the latency histograms."""

    def __init__(self, metrics: TokenyardMetrics, lane: str) -> None:
        self.ttft = metrics.time_to_first_token.labels(lane)
        self.inter_token = metrics.inter_token_latency.labels(lane)
        self.e2e = metrics.e2e_request_latency.labels(lane)
        self.queue = metrics.request_queue_time.labels(lane)
