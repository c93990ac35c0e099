"""The request id rule (api/middleware.py) and the summary observers (telemetry/request_log)."""

from __future__ import annotations

import json
import logging
import re
from decimal import Decimal

import pytest

from tokenyard.api.middleware import new_request_id
from tokenyard.telemetry import request_log
from tokenyard.telemetry.request_log import RequestSummary


def test_a_usable_client_id_is_kept_as_the_prefix_of_a_unique_id() -> None:
    first, second = new_request_id("job-7:step.2"), new_request_id("job-7:step.2")
    assert re.fullmatch(r"job-7:step\.2\.[0-9a-f]{16}", first)
    assert first != second  # the same client id twice: two ledger rows, both billed


@pytest.mark.parametrize("client_id", [
    None, "", "has space", "x" * 41, "-leading-dash", "line\nbreak", "naïve", "a/b",
    'quote"d',
])
def test_an_unusable_client_id_is_replaced(client_id: str | None) -> None:
    assert re.fullmatch(r"req_[0-9a-f]{32}", new_request_id(client_id))


def _summary(**kw: object) -> RequestSummary:
    return RequestSummary(request_id="req_1", started_at=0.0, method="POST",
                          path="/v1/chat/completions", status=200, **kw)  # type: ignore[arg-type]


def test_observers_get_each_summary_and_a_failing_one_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[RequestSummary] = []

    def broken(summary: RequestSummary) -> None:
        raise RuntimeError("observer bug")

    request_log.add_observer(broken)
    request_log.add_observer(seen.append)
    try:
        assert request_log.has_observers()
        with caplog.at_level(logging.ERROR, "tokenyard.telemetry"):
            request_log.publish(_summary())
            request_log.publish(_summary())
        assert len(seen) == 2  # the broken observer raised; the next still ran
        assert sum("observer" in r.getMessage() for r in caplog.records) == 1  # logged once
    finally:
        request_log.remove_observer(broken)
        request_log.remove_observer(seen.append)
    assert not request_log.has_observers()


def test_the_summary_as_json_keeps_the_cost_exact() -> None:
    data = _summary(cost=Decimal(1234).scaleb(-6), timings_ms={"queue": 1.5}).to_json()
    assert data["cost"] == "0.001234"
    assert data["timings_ms"] == {"queue": 1.5}
    assert _summary().to_json()["cost"] is None


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord("tokenyard.balancer", logging.WARNING, __file__, 1,
                               "replica %s ejected", ("r1",), None)
    record.__dict__.update(extra)
    return record


def test_a_json_log_line_is_one_object_with_the_structured_fields() -> None:
    from tokenyard.telemetry.logs import JsonFormatter

    line = JsonFormatter().format(_record(event="replica_ejected", ejected_for_s=2.0))
    assert "\n" not in line
    data = json.loads(line)
    assert data["msg"] == "replica r1 ejected" and data["level"] == "warning"
    assert data["logger"] == "tokenyard.balancer" and data["ts"].endswith("+00:00")
    assert (data["event"], data["ejected_for_s"]) == ("replica_ejected", 2.0)


def test_a_text_log_line_appends_the_fields() -> None:
    from tokenyard.telemetry.logs import TextFormatter

    line = TextFormatter().format(_record(event="replica_ejected"))
    assert line.endswith('tokenyard.balancer replica r1 ejected event="replica_ejected"')


def test_the_fields_ray_adds_to_every_record_are_not_logged() -> None:
    """Inside a Ray worker (a replica's actor) Ray's record factory stamps every record
    with a private timestamp and its context filter with job, worker, node, actor and task
    ids: none of them came through `extra`, none reach the line (issue 40)."""
    from ray._common.logging_constants import LogKey
    from ray._private.log import _setup_log_record_factory

    from tokenyard.telemetry.logs import JsonFormatter

    before = logging.getLogRecordFactory()
    _setup_log_record_factory()  # Ray's own, as `ray.init` installs it
    try:
        record = logging.getLogger("tokenyard.balancer").makeRecord(
            "tokenyard.balancer", logging.INFO, __file__, 1, "replica %s up", ("r1",), None,
            extra={"event": "replica_readmitted"})
    finally:
        logging.setLogRecordFactory(before)
    # What its CoreContextFilter sets in a worker (it needs a live worker to run).
    for key in (LogKey.JOB_ID, LogKey.WORKER_ID, LogKey.NODE_ID, LogKey.ACTOR_ID,
                LogKey.TASK_ID, LogKey.ACTOR_NAME, LogKey.TASK_NAME, LogKey.TASK_FUNCTION_NAME):
        setattr(record, key.value, "ray-set")
    data = json.loads(JsonFormatter().format(record))
    assert set(data) == {"ts", "level", "logger", "msg", "event"}, data
    assert any(k.startswith("_ray") for k in vars(record))  # the factory did stamp it


def test_health_probes_are_logged_at_debug_and_requests_at_info(
        caplog: pytest.LogCaptureFixture) -> None:
    from tokenyard.telemetry import logs

    def summary(path: str) -> RequestSummary:
        return RequestSummary(request_id="req_1", started_at=0.0, method="GET", path=path,
                              status=200)

    with caplog.at_level(logging.DEBUG, logger="tokenyard.request"):
        for path in ("/healthz", "/readyz", "/v1/models"):
            logs.log_request(summary(path))
    levels = {r.getMessage(): r.levelname for r in caplog.records}
    assert levels == {"GET /healthz 200": "DEBUG", "GET /readyz 200": "DEBUG",
                      "GET /v1/models 200": "INFO"}
