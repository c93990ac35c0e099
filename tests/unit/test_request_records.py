"""The gateway's request log over a real store: records queued off the request path and
found at once, the org check, body capture redacted and cut, settings, and the purge job
(records past the retention window, captures past their expiry). Backend-neutral:
tests/integration/test_store_postgres.py runs them again on PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from typing import Any

from tests.unit.test_store import database_url, run  # noqa: F401
from tokenyard.api.ops import openapi_document
from tokenyard.api.requests import RequestRecordObject
from tokenyard.config import ServeConfig
from tokenyard.gateway.admin import Admin, AdminError
from tokenyard.gateway.requests import RequestLog
from tokenyard.store import Store
from tokenyard.store.records import KeyContext, Limits, Scopes
from tokenyard.store.requests import Capture, insert_requests
from tokenyard.store.sql import utcnow
from tokenyard.telemetry.request_log import RequestSummary

EMAIL = "jane.doe@example.com"


def _key(org_id: str, admin: bool = False) -> KeyContext:
    return KeyContext(key_id="key_t", key_name="t", prefix="sk-ty-Test", org_id=org_id,
                      project_id=None, user_id=None, scopes=Scopes(admin=admin),
                      key_limits=Limits(), org_limits=Limits(), expires_at=None,
                      revoked_at=None, free_tier_daily_requests=None)


def _summary(request_id: str, org_id: str | None, **kw: Any) -> RequestSummary:
    fields: dict[str, Any] = {
        "model": "smol", "deployment": "smol", "replica": "http://127.0.0.1:1",
        "finish_reason": "stop", "prompt_tokens": 12, "cached_tokens": 8, "output_tokens": 3,
        "cost": Decimal("0.000042"), "timings_ms": {"queue": 1.5, "prefill": 2.25,
                                                     "decode": 10.0}}
    return RequestSummary(
        request_id=request_id, started_at=time.time(), method="POST",
        path="/v1/chat/completions", status=200, key_prefix="sk-ty-Test", org_id=org_id,
        **{**fields, **kw})


def _with_log(url: str, scenario: Callable[[Store, RequestLog], Awaitable[Any]],
              **config: Any) -> Any:
    async def body(store: Store) -> Any:
        log = RequestLog(store, ServeConfig(**config), flush_s=0.01)
        await log.start()
        try:
            return await scenario(store, log)
        finally:
            await log.close()

    return run(url, body)


def test_a_record_is_found_at_once_then_from_the_store_by_its_org_only(
    database_url: str,  # noqa: F811
) -> None:
    async def scenario(store: Store, log: RequestLog) -> None:
        org, other = (await store.create_org("a")).id, (await store.create_org("b")).id
        log.observe(_summary("req_1", org))
        log.observe(_summary("req_models", org, deployment=None))  # GET /v1/models
        log.observe(_summary("req_anon", None))  # refused before authentication
        for stage in ("queued", "stored"):
            found = await log.find("req_1", _key(org))
            assert found is not None, stage
            assert found["tokens"] == {"prompt": 12, "cached": 8, "output": 3}
            assert found["cache_hit"] is True and found["status"] == 200
            assert found["cost"] == {"currency": "USD", "total": "0.000042"}
            assert found["timeline"]["prefill"] == 2.25
            # The replica's URL is an internal address: an admin key's only.
            assert found["replica"] is None and found["capture"] is None
            assert RequestRecordObject.model_validate(found).tokens.cached == 8  # the API shape
            assert await log.find("req_1", _key(other)) is None
            as_admin = await log.find("req_1", _key(other, admin=True))
            assert as_admin is not None and as_admin["replica"] == "http://127.0.0.1:1"
            await log.flush()
        assert await log.find("req_models", _key(org)) is None
        assert await log.find("req_anon", _key(org, admin=True)) is None

    _with_log(database_url, scenario)


def test_the_openapi_document_describes_get_request() -> None:
    doc = openapi_document()
    op = doc["paths"]["/v1/requests/{request_id}"]["get"]
    ref = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/RequestRecordObject")
    assert "timeline" in doc["components"]["schemas"]["RequestRecordObject"]["properties"]


def test_captured_bodies_are_redacted_cut_and_shown_to_the_owning_org(
    database_url: str,  # noqa: F811
) -> None:
    async def scenario(store: Store, log: RequestLog) -> None:
        org = (await store.create_org("a")).id
        key = _key(org)
        log.observe(_summary("req_off", org))
        log.capture("req_off", key, b"{}", {})  # the org does not capture: nothing kept
        admin = Admin(store, log)
        assert (await admin.set_capture(org, {"retention_days": 3}))["retention_days"] == 3
        assert log.capturing(key) and (await admin.capture(org))["capture"] is True
        body = ('{"messages": [{"role": "user", "content": "mail ' + EMAIL + '"}], '
                '"user": "Bearer abcdefgh12345678"}').encode()
        log.observe(_summary("req_on", org))
        log.capture("req_on", key, body, {"choices": [{"text": "call +1 555 123 4567"}]})
        # Found whole while its batch is being written (redaction slowed down here).
        redact = log._redacted

        def slow(*args: Any) -> Capture:
            time.sleep(0.3)
            return redact(*args)

        log._redacted = slow  # type: ignore[method-assign]
        writing = asyncio.create_task(log.flush())
        await asyncio.sleep(0.1)
        log._redacted = redact  # type: ignore[method-assign]
        during = await log.find("req_on", key)
        assert during is not None and during["capture"] is not None
        await writing
        log.observe(_summary("req_big", org))
        log.capture("req_big", key, b'{"prompt": "' + b"x" * 200 + EMAIL.encode(), None)
        await log.flush()

        on = await log.find("req_on", key)
        assert on is not None and on["capture"]["truncated"] is False
        assert on["capture"]["request"]["messages"][0]["content"] == "mail [REDACTED:email]"
        assert on["capture"]["request"]["user"] == "Bearer [REDACTED:token]"
        assert on["capture"]["response"] == {"choices": [{"text": "call [REDACTED:phone]"}]}
        big = await log.find("req_big", key)
        assert big is not None and big["capture"]["truncated"] is True
        assert isinstance(big["capture"]["request"], str) and EMAIL not in big["capture"][
            "request"] and big["capture"]["response"] is None
        off = await log.find("req_off", key)
        assert off is not None and off["capture"] is None

        await admin.set_capture(org, {"enabled": False})
        assert not log.capturing(key) and (await admin.capture(org))["capture"] is False
        for bad in ({"retention_days": 0}, {"enabled": "yes"}):
            try:
                await admin.set_capture(org, bad)
            except AdminError:
                continue
            raise AssertionError(f"{bad} was accepted")

    _with_log(database_url, scenario, capture_max_bytes=180)


def test_a_queued_capture_is_redacted_for_its_org_only_and_cut_before_redaction(
    database_url: str,  # noqa: F811
) -> None:
    """GET /v1/requests/{id} of a queued record redacts on demand: only for a key that may
    see it, and only the part that is kept (a response of megabytes was redacted whole,
    on the event loop, before it was cut)."""
    async def scenario(store: Store, log: RequestLog) -> None:
        org, other = (await store.create_org("a")).id, (await store.create_org("b")).id
        key = _key(org)
        await Admin(store, log).set_capture(org, {"retention_days": 1})
        seen: list[int] = []
        text = log.redactor.text

        def counted(value: str) -> str:
            seen.append(len(value))
            return text(value)

        log.redactor.text = counted  # type: ignore[method-assign]
        log.observe(_summary("req_huge", org))
        log.capture("req_huge", key, b"{}", {"choices": [{"text": "a-" * 2_000_000}]})
        assert await log.find("req_huge", _key(other)) is None
        assert seen == []  # another org's key costs no redaction
        found = await log.find("req_huge", key)
        assert found is not None and found["capture"]["truncated"] is True
        assert sum(seen) <= 4096 + 16

    _with_log(database_url, scenario, capture_max_bytes=4096)


def test_the_purge_job_deletes_old_records_and_expired_captures(
    database_url: str,  # noqa: F811
) -> None:
    async def scenario(store: Store, log: RequestLog) -> None:
        org = (await store.create_org("a")).id
        now = utcnow()
        fresh, old = log_record("req_new", org, now), log_record("req_old", org, now)
        old = replace(old, created_at=now - timedelta(hours=2))
        kept = Capture("req_new", org, now, now + timedelta(days=1), "{}", None, False)
        expired = Capture("req_old", org, now - timedelta(days=8), now - timedelta(seconds=1),
                          "{}", None, False)
        await insert_requests(store.db, [fresh, old], [kept, expired])
        key = _key(org)
        assert (await log.find("req_old", key) or {}).get("capture") is None  # expired
        # The job runs at start and then every purge interval (0.05 s here).
        deadline = time.monotonic() + 5
        while await log.find("req_old", key) is not None:
            assert time.monotonic() < deadline, "the purge job did not delete the old record"
            await asyncio.sleep(0.05)
        found = await log.find("req_new", key)
        assert found is not None and found["capture"] is not None
        assert await log.purge() == (0, 0)

    _with_log(database_url, scenario, request_records_retention_hours=1.0,
              request_records_purge_interval_s=0.05)


def log_record(request_id: str, org_id: str, now: Any) -> Any:
    from tokenyard.gateway.requests import record_of

    return replace(record_of(_summary(request_id, org_id)), created_at=now)
