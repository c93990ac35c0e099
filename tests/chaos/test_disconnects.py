"""Disconnect storm: streaming requests whose clients vanish at every stage of a request.

At full scale, more requests at once than the replica runs (`--max-num-seqs 4`), so many
are cut while they wait. Each client speaks raw HTTP/1.1 over an asyncio socket and, at its chosen
point, either closes or resets the connection (abort: RST, no FIN):

- ``queued``: the request is sent, the socket dropped at once (no headers come back
  before the first token, so the request is still waiting or prefilling);
- ``headers``: dropped as soon as the response's status line arrives;
- ``first_delta``: after the first event with generated text;
- ``mid_stream``: after a random number of events;
- ``tool_call``: a forced tool call (grammar-constrained), dropped mid-arguments;
- ``json``: ``response_format: json_object``, dropped mid-object;
- ``complete``: the control group, read to ``[DONE]``.

Then the invariants (tests/chaos/invariants.py): nothing running, no KV block or
admission held, every request that was seen producing tokens in the ledger exactly
once, no client id billed twice, the prepaid balance equal to credit minus the ledger.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.chaos.conftest import Recorder, Scale
from tests.chaos.invariants import balances_match, check_quiescent, ledger_exactly_once
from tests.e2e.conftest import Server, running_server
from tests.e2e.test_gateway import PRICES, _with_store
from tokenyard.store import Store

pytestmark = pytest.mark.slow

CUTS = ("queued", "headers", "first_delta", "mid_stream", "tool_call", "json", "complete")
CLIENTS = "raw HTTP/1.1 streaming clients that close or reset at their cut"
CREDIT_MICROS = 50_000_000
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _body(model: str, cut: str, rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "stream": True, "max_tokens": rng.randint(6, 16),
        "messages": [{"role": "user",
                      "content": f"Tell me about the number {rng.randint(1, 999)}."}],
    }
    if cut == "tool_call":
        body.update(tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                    max_tokens=24)
        body["messages"] = [{"role": "user", "content": "What is the weather in Paris?"}]
    elif cut == "json":
        body.update(response_format={"type": "json_object"}, max_tokens=24)
        body["messages"] = [{"role": "user", "content": "Reply in JSON with a name."}]
    return body


async def _one(server: Server, client_id: str, cut: str, rng: random.Random
               ) -> dict[str, Any]:
    """One client; what it saw: status, request id, generated deltas, whether done."""
    url = urlsplit(server.base_url)
    payload = json.dumps(_body(server.model, cut, rng)).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
            f"x-request-id: {client_id}\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    seen: dict[str, Any] = {"cut": cut, "status": None, "request_id": None, "deltas": 0,
                            "done": False}
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(head + payload)
        await writer.drain()
        if cut == "queued":
            return seen
        status_line = await reader.readline()
        seen["status"] = int(status_line.split()[1]) if status_line else None
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "x-request-id":
                seen["request_id"] = value.strip()
        if cut == "headers" or seen["status"] != 200:
            return seen
        stop_after = {"first_delta": 1, "mid_stream": rng.randint(2, 8),
                      "tool_call": rng.randint(2, 6), "json": rng.randint(2, 6)}.get(cut)
        # Chunked transfer: count the SSE events carrying generated text or arguments.
        while line := await reader.readline():
            if line.startswith(b"data: [DONE]"):
                seen["done"] = True
                break
            if line.startswith(b"data: ") and b'"delta"' in line and (
                    b'"content":"' in line or b'"arguments":"' in line):
                seen["deltas"] += 1
                if stop_after is not None and seen["deltas"] >= stop_after:
                    break
        return seen
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()  # RST: the server sees a reset, not a clean close
        else:
            writer.close()


def _prepaid_key(state_dir: str, model: str) -> tuple[str, str]:
    """A prepaid org with CREDIT_MICROS and a key in it, and the model's prices."""
    async def create(store: Store) -> tuple[str, str]:
        await store.set_price(model, input=PRICES.input, cached_input=PRICES.cached_input,
                              output=PRICES.output)
        org = await store.create_org(f"storm-{uuid.uuid4().hex[:8]}",
                                     balance_micros=CREDIT_MICROS)
        secret, _ = await store.create_api_key(org.id, name="storm")
        return secret, org.id

    return _with_store(state_dir, create)


@pytest.fixture
def storm_target(scale: Scale, request: pytest.FixtureRequest, tmp_path: Any
                 ) -> Iterator[tuple[Server, str]]:
    """The server to storm and its `serve` arguments. Full scale: one of its own with
    four running slots, so that most cuts happen while requests wait. Short: the session's
    server (128 slots; starting another costs more than `make test` can spare), where the
    ``queued`` cuts land during admission and prefill instead."""
    if scale != "full":
        yield request.getfixturevalue("server"), "tokenyard serve (the session's server)"
        return
    with running_server("--max-num-seqs", "4", state_dir=str(tmp_path)) as (server, _):
        yield server, "tokenyard serve --max-num-seqs 4"


def test_a_disconnect_storm_leaves_nothing_behind(
    scale: Scale, record: Recorder, storm_target: tuple[Server, str],
) -> None:
    admin, command = storm_target
    assert admin.state_dir is not None
    state = admin.state_dir
    n, concurrency = (1000, 48) if scale == "full" else (60, 16)
    rng = random.Random(1313)
    run = f"dc{uuid.uuid4().hex[:8]}"  # every request's x-request-id starts with it
    cuts = [CUTS[i % len(CUTS)] for i in range(n)]
    rng.shuffle(cuts)
    secret, org_id = _prepaid_key(state, admin.model)
    server = Server(admin.base_url, admin.model, admin.replica_url, secret,
                    admin.replica_token, state)

    async def storm() -> list[dict[str, Any]]:
        gate = asyncio.Semaphore(concurrency)

        async def run(i: int) -> dict[str, Any]:
            async with gate:
                return await asyncio.wait_for(_one(server, f"{run}-{i}", cuts[i], rng), 120)

        return await asyncio.gather(*(run(i) for i in range(n)))

    started = time.monotonic()
    seen = asyncio.run(storm())
    elapsed = time.monotonic() - started
    statuses = Counter(s["status"] for s in seen if s["status"] is not None)
    assert all(status < 500 for status in statuses), statuses
    complete = [s for s in seen if s["cut"] == "complete"]
    assert complete and all(s["done"] for s in complete), complete
    produced = {s["request_id"] for s in seen if s["deltas"] and s["request_id"]}
    assert len(produced) >= len(complete)

    quiet = check_quiescent(admin, state_dir=state)
    ledger = ledger_exactly_once(state, produced, client_prefix=run + "-")
    money = balances_match(state, {org_id: CREDIT_MICROS})
    record("disconnect storm", command=f"{command}; {CLIENTS}",
           sent={"requests": n, "concurrency": concurrency,
                 **{f"cut_{cut}": cuts.count(cut) for cut in CUTS}},
           held={"seconds": round(elapsed, 1), "no_5xx": True,
                 "statuses": ",".join(f"{k}:{v}" for k, v in sorted(statuses.items())),
                 "produced_tokens": len(produced), **quiet, **ledger, **money})
