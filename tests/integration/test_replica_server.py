"""`tokenyard engine` as a real process, driven through ReplicaClient over HTTP.

One replica process serves the whole module (loading the model takes seconds). It runs
one request at a time with a waiting queue of one, so overload is easy to provoke, and it
requires a token (TOKENYARD_REPLICA_TOKEN) of every caller but health probes. The SIGTERM
test stops it, so it stays last in the file.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import aiohttp
import pytest

from tokenyard.balancer.replica_client import (
    ReplicaClient,
    ReplicaOverloaded,
    ReplicaRequestError,
    ReplicaUnauthorized,
)
from tokenyard.engine.llm import LLM
from tokenyard.engine.replica_access import is_loopback
from tokenyard.wire.protocol import CoreDelta
from tokenyard.wire.replica_info import ReplicaInfo, ReplicaStats
from tokenyard.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

T = TypeVar("T")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
#: The module replica's shared secret.
TOKEN = "test-replica-token"


@dataclass
class Replica:
    proc: subprocess.Popen[str]
    url: str
    stderr: IO[str]

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]


def _read_url(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """The URL the replica prints once it serves (None if it died or took too long)."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not selector.select(timeout=deadline - time.monotonic()):
                continue
            line = proc.stdout.readline()
            if not line:
                return None  # EOF: the process exited
            match = re.search(r"http://\S+", line)
            if match:
                return match.group(0)
    finally:
        selector.close()
    return None


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "tokenyard.cli", "engine",
                "--host", "127.0.0.1", "--port", "0",  # port 0: the OS picks a free one
                "--weights", "float32",  # what the `llm` fixture it is compared with serves
                "--kv-cache-gib", "0.05", "--max-num-seqs", "1",
                "--max-waiting-requests", "1", "--drain-timeout", "20",
            ],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, "TOKENYARD_REPLICA_TOKEN": TOKEN},
        )
        replica = Replica(proc, "", stderr)
        try:
            url = _read_url(proc, timeout=120)
            if url is None:
                pytest.fail(f"the replica did not start:\n{replica.log()}")
            replica.url = url
            yield replica
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def run(url: str, scenario: Callable[[ReplicaClient], Awaitable[T]],
        token: str | None = TOKEN) -> T:
    """Run an async scenario with a fresh client (its session lives in this loop) that
    sends `token` (None: no Authorization header)."""

    async def main() -> T:
        async with ReplicaClient(url, token=token) as client:
            return await scenario(client)

    return asyncio.run(main())


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


async def wait_idle(client: ReplicaClient, within: float) -> ReplicaStats:
    """Poll stats until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + within
    while True:
        stats = await client.stats()
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and stats.num_free_kv_blocks == stats.num_kv_blocks:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"replica not idle after {within} s: {stats}")
        await asyncio.sleep(0.02)


def test_info_and_health(replica: Replica) -> None:
    async def scenario(client: ReplicaClient) -> None:
        assert await client.health()
        info = await client.info()
        assert info.max_model_len == 8192 and info.vocab_size == 49152
        assert info.block_size == 16 and info.num_kv_blocks > 0 and info.eos_token_ids
        assert info.weights == "float32"

    run(replica.url, scenario)


def test_replica_info_from_a_replica_without_the_weights_field_still_decodes() -> None:
    body = {"model": "m", "max_model_len": 64, "vocab_size": 10, "eos_token_ids": [2],
            "block_size": 16, "num_kv_blocks": 4}
    assert ReplicaInfo.from_json(body).weights is None
    assert ReplicaInfo.from_json({**body, "weights": "q4_1"}).weights == "q4_1"
    with pytest.raises(KeyError):
        ReplicaInfo.from_json({k: v for k, v in body.items() if k != "vocab_size"})


def test_greedy_generate_matches_the_in_process_engine(replica: Replica, llm: LLM) -> None:
    ids = llm.frontend.prompt_token_ids(CHAT)
    expected = llm.generate([ids], greedy(16))[0].token_ids

    async def scenario(client: ReplicaClient) -> list[CoreDelta]:
        return [d async for d in client.generate("greedy", ids, greedy(16, logprobs=2))]

    deltas = run(replica.url, scenario)
    assert [t for d in deltas for t in d.new_token_ids] == expected
    # One delta a step, or fewer where the reader fell behind (the queued ones joined).
    assert [d.finish_reason for d in deltas][-1:] == ["length"]
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[0].num_prompt_tokens == len(ids)
    assert all(d.new_logprobs is not None and len(d.new_logprobs) == len(d.new_token_ids)
               and all(len(lp.top) == 2 for lp in d.new_logprobs) for d in deltas)
    # The first delta says how long the request queued and prefilled on the replica.
    first = deltas[0]
    assert first.queue_time is not None and first.queue_time >= 0
    assert first.prefill_time is not None and first.prefill_time > 0
    assert all(d.queue_time is None and d.prefill_time is None for d in deltas[1:])


def test_prompt_longer_than_the_context_and_bad_params_are_400(replica: Replica) -> None:
    async def scenario(client: ReplicaClient) -> None:
        with pytest.raises(ReplicaRequestError) as info:
            async for _ in client.generate("long", [5] * 9000, greedy(4)):
                pass
        assert info.value.status == 400 and info.value.code == "context_length_exceeded"
        assert "9000" in info.value.message and "8192" in info.value.message
        with pytest.raises(ReplicaRequestError) as info:
            async for _ in client.generate("n2", [5, 6], SamplingParams(n=2)):
                pass
        assert info.value.status == 400 and info.value.param == "n"

    run(replica.url, scenario)


def test_client_that_stops_reading_aborts_and_frees_blocks_within_a_second(
    replica: Replica,
) -> None:
    async def scenario(client: ReplicaClient) -> None:
        stream = client.generate("leaver", [1, 2, 3, 4, 5], greedy(500))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()  # closes the HTTP stream; the replica must notice alone
        assert got == 3  # left mid-way: 500 tokens with ignore_eos cannot end within 1 s
        await wait_idle(client, within=1.0)

    run(replica.url, scenario)


def test_full_waiting_queue_answers_503_with_retry_after(replica: Replica) -> None:
    async def scenario(client: ReplicaClient) -> ReplicaOverloaded:
        running = client.generate("running", [7, 8, 9], greedy(500))
        await anext(running)  # admitted and running: the one running slot is taken

        async def consume() -> None:
            async for _ in client.generate("waiting", [7, 8, 10], greedy(500)):
                pass

        waiting = asyncio.create_task(consume())
        try:
            for _ in range(100):
                if (await client.stats()).num_waiting == 1:
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(ReplicaOverloaded) as info:
                async for _ in client.generate("shed", [7, 8, 11], greedy(4)):
                    pass
        finally:
            waiting.cancel()
            await running.aclose()
        await asyncio.gather(waiting, return_exceptions=True)
        await wait_idle(client, within=2.0)
        return info.value

    overloaded = run(replica.url, scenario)
    assert overloaded.code == "overloaded" and overloaded.retry_after == 1.0


def test_stop_and_abort_end_the_stream(replica: Replica) -> None:
    async def scenario(client: ReplicaClient) -> tuple[list[CoreDelta], list[CoreDelta]]:
        ends: list[list[CoreDelta]] = []
        for request_id in ("stopped", "aborted"):
            deltas: list[CoreDelta] = []
            async for delta in client.generate(request_id, [3, 1, 4, 1, 5], greedy(300)):
                deltas.append(delta)
                if len(deltas) == 2:
                    if request_id == "stopped":
                        await client.stop(request_id, "xyz")
                    else:
                        await client.abort(request_id)
            ends.append(deltas)
        await wait_idle(client, within=1.0)
        return ends[0], ends[1]

    stopped, aborted = run(replica.url, scenario)
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == "xyz"
    assert aborted[-1].finish_reason == "abort"
    # Ended soon after the call. The last delta carries no token of its own, but a reader
    # behind the replica gets the tokens sampled before the end joined into it
    # (wire.outputs.merge_steps): count tokens, not deltas.
    for deltas in (stopped, aborted):
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert sum(len(d.new_token_ids) for d in deltas) < 20


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_caller_without_the_token_gets_401_on_every_route_but_health(
    replica: Replica, token: str | None,
) -> None:
    async def scenario(client: ReplicaClient) -> None:
        assert await client.health()  # probes need no token
        for call in (client.info(), client.stats(), client.abort("x"), client.stop("x", "y")):
            with pytest.raises(ReplicaUnauthorized):
                await call
        # Nor may it choose a tenant: a request naming another org's salt never runs.
        with pytest.raises(ReplicaUnauthorized):
            async for _ in client.generate("intruder", [1, 2, 3], greedy(2),
                                           cache_salt="org_victim", priority=-1):
                pass

    run(replica.url, scenario, token)

    async def raw() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session, session.post(
            replica.url + "/v1/engine/generate",
            json={"request_id": "raw", "prompt_token_ids": [1, 2], "params": {},
                  "cache_salt": "org_victim"},
        ) as r:
            return r.status, json.loads(await r.read())

    status, body = asyncio.run(raw())
    assert status == 401 and body["error"]["code"] == "unauthorized"  # the replica's shape
    # With the token the replica answers, and the refused request never reached it.
    stats = run(replica.url, lambda client: client.stats())
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
    ("replica.internal", False),  # a name may resolve to anything
])
def test_which_hosts_count_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_without_a_token_the_engine_refuses_to_bind_beyond_loopback() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TOKENYARD_REPLICA_TOKEN"}
    refused = subprocess.run(
        [sys.executable, "-m", "tokenyard.cli", "engine", "--host", "0.0.0.0", "--port", "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert refused.returncode == 2
    assert "TOKENYARD_REPLICA_TOKEN" in refused.stderr and "0.0.0.0" in refused.stderr


def test_sigterm_lets_in_flight_requests_finish_refuses_new_ones_and_exits_0(
    replica: Replica,
) -> None:
    async def scenario(client: ReplicaClient) -> tuple[list[CoreDelta], ReplicaOverloaded]:
        stream = client.generate("in-flight", [2, 7, 1, 8], greedy(40))
        deltas = [await anext(stream)]
        replica.proc.send_signal(signal.SIGTERM)
        for _ in range(100):
            if not await client.health():
                break
            await asyncio.sleep(0.02)
        with pytest.raises(ReplicaOverloaded) as info:
            async for _ in client.generate("late", [2, 7], greedy(4)):
                pass
        deltas += [d async for d in stream]
        return deltas, info.value

    deltas, refused = run(replica.url, scenario)
    assert refused.code == "draining"
    # Every token (a reader behind the replica gets queued deltas joined: count tokens).
    assert sum(len(d.new_token_ids) for d in deltas) == 40
    assert deltas[-1].finish_reason == "length"
    assert replica.proc.wait(timeout=15) == 0, replica.log()
