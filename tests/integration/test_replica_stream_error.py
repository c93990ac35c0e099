"""A replica's failure after its stream began, as the gateway's client reads it: the
replica's own text (the engine's exception) goes to the log, never into the error a
tenant's error event carries."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from tokenyard.balancer.generation import replica_error
from tokenyard.balancer.replica_client import (
    STREAM_FAILED_MESSAGE,
    ReplicaClient,
    ReplicaStreamError,
)
from tokenyard.wire.protocol import GENERATE_PATH, dumps, encode_stream_error
from tokenyard.wire.sampling_params import SamplingParams

ENGINE_TEXT = "engine step failed: RuntimeError('CUDA error at /srv/models/x.gguf')"


async def _generate(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    delta = {"new_token_ids": [28120], "new_logprobs": None, "finish_reason": None,
             "stop_reason": None, "num_prompt_tokens": 3, "num_cached_tokens": 0}
    await response.write(dumps(delta) + b"\n")
    await response.write(encode_stream_error(ENGINE_TEXT))
    return response


def test_the_engines_text_is_logged_not_passed_on(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> ReplicaStreamError:
        app = web.Application()
        app.router.add_post(GENERATE_PATH, _generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with ReplicaClient(url) as client:
                with pytest.raises(ReplicaStreamError) as failed:
                    async for _ in client.generate("r-1", [1, 2, 3],
                                                   SamplingParams(max_tokens=4)):
                        pass
            return failed.value
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.ERROR, logger="tokenyard.balancer"):
        err = asyncio.run(go())
    assert err.message == STREAM_FAILED_MESSAGE
    tenant_sees = replica_error(err).message
    assert "RuntimeError" not in tenant_sees and "/srv/" not in tenant_sees
    assert "127.0.0.1" not in tenant_sees
    assert ENGINE_TEXT in caplog.text  # the operator still learns what failed
