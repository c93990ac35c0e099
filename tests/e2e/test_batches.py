"""The Batch API through the official SDKs against `make serve`'s server: OpenAI's files
and batches (chat, embeddings and Responses lines), Anthropic's Message Batches, their
bodies validated against the specs, the upload's line checks, and another org that can
neither see, read, cancel nor be billed for them. A completed batch has its `model` and
`usage`; each line has a request record like a live request's; its latencies go to the
batch lane of the metrics, never the live one; a cancel cuts the lines in flight."""

from __future__ import annotations

import functools
import io
import json
import sqlite3
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import openai
import pytest

from tests.conformance.keys import new_key
from tests.conformance.spec import Spec
from tests.conformance.test_anthropic import _cited
from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

T = TypeVar("T")
EMBEDDER = "all-minilm-l6-v2"


def _client(server: Server, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key or server.api_key,
                         max_retries=0)


def _wait(fn: Callable[[], T], done: Callable[[T], bool], timeout: float = 240) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    return client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))),
                               purpose="batch").id


def _ledger(server: Server, batch_id: str, columns: str = "request_id, org_id, cost_micros",
            ) -> list[tuple[Any, ...]]:
    assert server.state_dir is not None
    with sqlite3.connect(Path(server.state_dir) / "tokenyard.db") as db:
        return list(db.execute(f"SELECT {columns} FROM usage_ledger WHERE batch_id = ?",
                               (batch_id,)))


def _billed_as(server: Server, batch_id: str, usage: tuple[int, int]) -> tuple[int, int]:
    """The (prompt, output) tokens the ledger billed the batch for, once they are `usage`
    (its writer commits rows a moment after they settle), else as they are after 30 s."""
    def sums() -> tuple[int, int]:
        rows = _ledger(server, batch_id, "prompt_tokens, output_tokens")
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    return _wait(sums, lambda got: got == usage, 30)


def _latency_counts(server: Server) -> dict[str, float]:
    """The TTFT and end-to-end histograms' counts by lane, from /metrics."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(("tokenyard:time_to_first_token_seconds_count",
                                "tokenyard:e2e_request_latency_seconds_count"))}


def test_openai_batches_of_chat_embeddings_and_responses(server: Server) -> None:
    client = _client(server)
    spec = Spec.load("openai")
    chat: list[dict[str, Any]] = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": server.model, "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": f"Count to {i}."}]}}
            for i in range(3)]
    embeds: list[dict[str, Any]] = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
               "body": {"model": EMBEDDER, "input": f"text {i}"}} for i in range(2)]
    responses: list[dict[str, Any]] = [
        {"custom_id": "r0", "method": "POST", "url": "/v1/responses",
                  "body": {"model": server.model, "input": "Say hi.",
                           "max_output_tokens": 4}}]
    started = {}
    metrics_before = _latency_counts(server)
    for endpoint, lines in (("/v1/chat/completions", chat), ("/v1/embeddings", embeds),
                            ("/v1/responses", responses)):
        file_id = _upload(client, lines)
        spec.validate(client.files.retrieve(file_id).model_dump(exclude_none=True),
                      "OpenAIFile", "file")
        batch = client.batches.create(input_file_id=file_id, endpoint=endpoint,  # type: ignore[arg-type]
                                      completion_window="24h", metadata={"run": "e2e"})
        assert batch.status == "in_progress" and batch.request_counts is not None
        assert batch.request_counts.total == len(lines)
        started[batch.id] = (endpoint, lines)
    listed = {b.id for b in client.batches.list(limit=100)}
    assert set(started) <= listed

    live = client.chat.completions.create(model=server.model, max_tokens=4, temperature=0,
                                          messages=chat[0]["body"]["messages"])
    for batch_id, (endpoint, lines) in started.items():
        batch = _wait(functools.partial(client.batches.retrieve, batch_id),
                      lambda b: b.status == "completed")
        spec.validate(batch.model_dump(exclude_none=True), "Batch", "batch")
        assert batch.status == "completed", batch
        # Its model and its lines' usage (the SDK's `Batch.usage`), as billed.
        assert batch.model == lines[0]["body"]["model"]
        assert batch.usage is not None and batch.usage.input_tokens > 0
        assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
        usage = (batch.usage.input_tokens, batch.usage.output_tokens)
        assert _billed_as(server, batch_id, usage) == usage
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (len(lines), 0)
        assert batch.output_file_id and not batch.error_file_id
        out = [json.loads(line) for line in
               client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)
        for line in out:
            spec.validate(line, "BatchRequestOutput", "output line")
            assert line["response"]["status_code"] == 200
            body = line["response"]["body"]
            if endpoint == "/v1/chat/completions":
                spec.validate(body, spec.response_schema("/chat/completions", 200), "chat")
                # The route's own renderer: the same fields as the live answer's.
                assert set(live.model_dump(exclude_unset=True)) <= set(body)
                assert body["id"].startswith("chatcmpl-") and "cost" in body
            elif endpoint == "/v1/embeddings":
                assert len(body["data"][0]["embedding"]) == 384
            else:
                assert body["object"] == "response"
                assert body["status"] in ("completed", "incomplete")
        # Every line that produced tokens is one ledger row of this org, at batch prices.
        rows = _ledger(server, batch_id)
        assert sorted(r[0] for r in rows) == sorted(
            line["response"]["request_id"] for line in out)
        # ... and has a request record, as a live request has (its log line beside it).
        first_id = out[0]["response"]["request_id"]
        record = _wait(functools.partial(_record, server, first_id),
                       lambda r: r is not None, timeout=30)
        assert record is not None and record["endpoint"] == endpoint
        assert record["status"] == 200 and record["tokens"]["prompt"] > 0
    # The generating lines (3 chat, 1 Responses) moved the batch lane's latencies; the
    # live ones moved by the one live request only.
    after = _latency_counts(server)
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
        live_key, batch_key = (f'tokenyard:{name}{{lane="{lane}"}}' for lane in ("live", "batch"))
        assert after[live_key] - metrics_before[live_key] == 1, name
        assert after[batch_key] - metrics_before[batch_key] == 4, name


def _record(server: Server, request_id: str) -> dict[str, Any] | None:
    """`GET /v1/requests/{id}` (None while it is not there yet)."""
    raw = urllib.request.Request(f"{server.base_url}/v1/requests/{request_id}",
                                 headers={"Authorization": f"Bearer {server.api_key}"})
    try:
        with urllib.request.urlopen(raw, timeout=30) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise


def test_a_cancelled_batch_cuts_its_lines_in_flight(server: Server) -> None:
    """30 long lines (200 tokens each, minutes of work on a CPU) cancelled a second after
    creation: the batch ends cancelled soon after (not when its lines would have ended,
    nor when their leases run out), every line not completed is in the error file as
    `batch_cancelled`, and what was billed is what ran: the ledger's rows of the batch
    are its `usage`, each cut line billed for fewer output tokens than it asked for."""
    client = _client(server)
    spec = Spec.load("openai")
    lines = [{"custom_id": f"x{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": server.model, "max_tokens": 200, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Tell a long story {i}."}]}}
             for i in range(30)]
    batch = client.batches.create(input_file_id=_upload(client, lines),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    time.sleep(1.0)
    cancelling = client.batches.cancel(batch.id)
    cancelled_at = time.monotonic()
    assert cancelling.status in ("cancelling", "cancelled")
    spec.validate(cancelling.model_dump(exclude_none=True), "Batch", "cancelling batch")
    ended = _wait(lambda: client.batches.retrieve(batch.id),
                  lambda b: b.status == "cancelled", timeout=120)
    took = time.monotonic() - cancelled_at
    print(f"cancelled batch ended {took:.1f} s after the cancel")
    assert ended.status == "cancelled", ended
    assert took < 60  # not the lines' own end, nor their 60 s leases
    spec.validate(ended.model_dump(exclude_none=True), "Batch", "cancelled batch")
    counts = ended.request_counts
    assert counts is not None and counts.total == 30
    assert counts.completed + counts.failed == 30 and counts.failed > 0
    done = ([json.loads(x)["custom_id"] for x in
             client.files.content(ended.output_file_id).text.splitlines()]
            if ended.output_file_id else [])
    assert ended.error_file_id is not None
    errors = [json.loads(x) for x in client.files.content(ended.error_file_id).text.splitlines()]
    for line in errors:
        spec.validate(line, "BatchRequestOutput", "error line")
        assert line["response"] is None and line["error"]["code"] == "batch_cancelled"
    assert sorted(done + [e["custom_id"] for e in errors]) == sorted(x["custom_id"]
                                                                     for x in lines)
    assert ended.usage is not None
    usage = (ended.usage.input_tokens, ended.usage.output_tokens)
    assert _billed_as(server, batch.id, usage) == usage
    billed = _ledger(server, batch.id, "request_id, status, prompt_tokens, output_tokens")
    cut = [r for r in billed if r[1] == "aborted"]
    assert len(cut) + len(done) == len(billed)
    assert all(r[3] < 200 for r in cut)


def test_the_upload_names_the_first_bad_line(server: Server) -> None:
    client = _client(server)
    good: dict[str, Any] = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": server.model, "messages": [{"role": "user", "content": "x"}]}}
    cases = [
        (_jsonl([good]) + b"{not json\n", "Line 2", "not valid JSON"),
        (_jsonl([good, {**good, "custom_id": "b", "url": "/v1/images"}]), "Line 2", "'url'"),
        (_jsonl([good, good]), "Line 2", "duplicate custom_id"),
        (_jsonl([good, {**good, "custom_id": "b", "body": {"model": server.model}}]),
         "Line 2", "messages"),
        (_jsonl([{**good, "body": {**good["body"], "stream": True}}]), "Line 1", "stream"),
    ]
    for content, line, why in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
        message = refused.value.body["message"]  # type: ignore[index]
        assert line in message and why in message, message


def test_a_batch_over_the_enqueued_token_quota_is_refused_naming_it(server: Server) -> None:
    client = _client(server)
    huge = [{"custom_id": "h", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": server.model, "max_tokens": 30_000_000,
                      "messages": [{"role": "user", "content": "x"}]}}]
    with pytest.raises(openai.RateLimitError) as refused:
        client.batches.create(input_file_id=_upload(client, huge),
                              endpoint="/v1/chat/completions", completion_window="24h")
    assert "batch_enqueued_tokens" in str(refused.value)


def test_another_org_cannot_see_read_cancel_or_be_billed(server: Server) -> None:
    owner, other = _client(server), _client(server, new_key(server))
    lines = [{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": server.model, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "Hello there."}]}}]
    file_id = _upload(owner, lines)
    batch = owner.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
    for attempt in (lambda: other.files.retrieve(file_id),
                    lambda: other.files.content(file_id),
                    lambda: other.files.delete(file_id),
                    lambda: other.batches.retrieve(batch.id),
                    lambda: other.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.BadRequestError):  # its file is not theirs to batch
        other.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert batch.id not in {b.id for b in other.batches.list()}
    assert file_id not in {f.id for f in other.files.list()}
    done = _wait(lambda: owner.batches.retrieve(batch.id), lambda b: b.status == "completed")
    assert done.status == "completed"
    owner_org = {r[1] for r in _ledger(server, batch.id)}
    assert len(owner_org) == 1 and "org_default" in owner_org


def test_anthropic_message_batches(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key,
                                 max_retries=0)
    spec = Spec.load("anthropic")
    requests: Any = [{"custom_id": f"m{i}", "params": {
        "model": server.model, "max_tokens": 4,
        "messages": [{"role": "user", "content": f"Name a color, {i}."}]}}
        for i in range(2)]
    batch = client.messages.batches.create(requests=requests)
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 2
    spec.validate(batch.model_dump(mode="json"), "MessageBatch", "batch")
    assert batch.id in {b.id for b in client.messages.batches.list(limit=100)}
    ended = _wait(lambda: client.messages.batches.retrieve(batch.id),
                  lambda b: b.processing_status == "ended")
    assert ended.processing_status == "ended" and ended.request_counts.succeeded == 2
    spec.validate(ended.model_dump(mode="json"), "MessageBatch", "ended batch")
    results = list(client.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == ["m0", "m1"]
    assert {r.result.type for r in results} == {"succeeded"}
    assert ended.results_url is not None
    raw = urllib.request.Request(ended.results_url, headers={"x-api-key": server.api_key or ""})
    with urllib.request.urlopen(raw, timeout=30) as response:
        for text in response.read().decode().splitlines():  # as sent, but for citations
            line = json.loads(text)
            line["result"]["message"] = _cited(line["result"]["message"])
            spec.validate(line, "MessageBatchIndividualResponse", "result")
    assert len(_ledger(server, batch.id)) == 2

    # A cancelled batch ends with what ran and the rest canceled; then it can be deleted.
    many: Any = [{"custom_id": f"k{i}", "params": {
        "model": server.model, "max_tokens": 64,
        "messages": [{"role": "user", "content": f"Write about {i}."}]}} for i in range(12)]
    doomed = client.messages.batches.create(requests=many)
    cancelled_at = time.monotonic()
    cancelling = client.messages.batches.cancel(doomed.id)
    assert cancelling.processing_status in ("canceling", "ended")
    over = _wait(lambda: client.messages.batches.retrieve(doomed.id),
                 lambda b: b.processing_status == "ended")
    # The lines in flight are cut, even those claimed a moment before the cancel (they
    # used to hold their leases, a minute, when the cut found them reading their key).
    assert time.monotonic() - cancelled_at < 20
    spec.validate(over.model_dump(mode="json"), "MessageBatch", "canceled batch")
    counts = over.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.canceled == 12
    kinds = [r.result.type for r in client.messages.batches.results(doomed.id)]
    assert len(kinds) == 12 and set(kinds) <= {"succeeded", "canceled"}
    assert kinds.count("canceled") == counts.canceled
    # The succeeded are billed whole; a request cut in flight for what it computed.
    statuses = _wait(lambda: [r[0] for r in _ledger(server, doomed.id, "status")],
                     lambda st: len(st) - st.count("aborted") == counts.succeeded, 30)
    assert len(statuses) - statuses.count("aborted") == counts.succeeded
    deleted = client.messages.batches.delete(doomed.id)
    assert deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(doomed.id)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.batches.create(requests=[{"custom_id": "bad id", "params": {}}])  # type: ignore[typeddict-item]
    assert "custom_id" in str(refused.value)
