"""The pipeline's one entry, called without HTTP (as the batch worker will): a `Call` built
by hand goes through `Pipeline.run` over a real gateway (SQLite store, in-process limiter)
and a mock replica process — routed, admitted, generated, settled — and its ledger row is
written; a key outside the model's scope is refused before its `build` ever runs."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from tests.e2e.test_gateway import _db_url, _ledger_rows, _mock_replica
from tokenyard.config import default_cache_dir
from tokenyard.deployments import DeploymentSpec, FleetSpec
from tokenyard.errors import APIError
from tokenyard.gateway.call import Call, Prepared
from tokenyard.gateway.gate import Gateway
from tokenyard.gateway.kinds import build_served, replica_client
from tokenyard.gateway.limits import InProcessLimiter
from tokenyard.gateway.pipeline import Pipeline, preparer
from tokenyard.gateway.routing import Router
from tokenyard.gateway.served import Fleet, Served
from tokenyard.store.records import Scopes
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.sampling_params import SamplingParams

MODEL = "mock-2026-11-26"


def _build(served: Served, timeline: Timeline) -> Prepared:
    prepare, _ = preparer(served)
    messages = [{"role": "user", "content": "Say hi."}]
    prompt = prepare.conversation(messages, timeline, prefill=False)
    params = prepare.fit(len(prompt), SamplingParams(max_tokens=4, temperature=0.0), "messages")
    return Prepared([prompt], [params], messages=list(messages))


async def _scenario(replica_url: str, state: Path) -> None:
    gateway, _ = await Gateway.open(_db_url(str(state)), InProcessLimiter(),
                                    state / "journal")
    spec = DeploymentSpec(MODEL, "engine", urls=(replica_url,),
                          capabilities=frozenset({"chat", "completions"}))
    served = await build_served(spec, [(replica_url, replica_client(replica_url))],
                                default_cache_dir())
    fleet = Fleet({MODEL: served}, Router(FleetSpec({MODEL: spec})), 0, gateway=gateway)
    pipeline = Pipeline(fleet)
    pipeline.start()
    try:
        org = await gateway.store.create_org("batch")
        secret, _ = await gateway.store.create_api_key(org.id, name="batch")
        key = await gateway.store.find_key(secret)
        assert key is not None
        call = Call(endpoint="batch", request_id="batch_req_1", timeline=Timeline(),
                    model=MODEL, build=_build, key=key)
        run = await pipeline.run(call)
        try:
            completions = await run.completions()
            run.settle()
        finally:
            await run.close()
        assert completions[0][0].token_ids
        assert run.ticket is not None and run.ticket.status == "completed"
        assert run.cost is not None  # metered: the ledger row's charge

        denied_secret, _ = await gateway.store.create_api_key(
            org.id, name="denied", scopes=Scopes(models=("gpt-*",)))
        denied = await gateway.store.find_key(denied_secret)
        assert denied is not None
        built: list[str] = []

        def must_not_build(served: Served, timeline: Timeline) -> Prepared:
            built.append(served.name)
            return _build(served, timeline)

        with pytest.raises(APIError) as refused:
            await pipeline.run(Call(endpoint="batch", request_id="batch_req_2",
                                    timeline=Timeline(), model=MODEL,
                                    build=must_not_build, key=denied))
        assert refused.value.status == 403 and built == []
    finally:
        await pipeline.close()
        await served.pool.close()
        await gateway.close()


def test_a_call_without_http_runs_the_whole_pipeline() -> None:
    with _mock_replica() as url, tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_scenario(url, Path(tmp)))
        rows = _ledger_rows(tmp)
    assert [(r["request_id"], r["status"]) for r in rows] == [("batch_req_1", "completed")]
