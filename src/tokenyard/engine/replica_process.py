"""The replica's process: load the model, serve `ReplicaServer`'s routes until SIGTERM
(or SIGINT), drain, exit (the drain's rules are in `engine/server.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tokenyard.config import EngineConfig, KVEventsConfig
from tokenyard.engine.async_core import AsyncEngineCore
from tokenyard.engine.kv_events import tokenyard_publisher, vllm_publisher
from tokenyard.engine.replica_access import check_exposure
from tokenyard.engine.server import ReplicaServer

log = logging.getLogger("tokenyard.engine")


async def run_server(
    engine: AsyncEngineCore,
    host: str,
    port: int,
    *,
    drain_timeout: float = 30.0,
    token: str | None = None,
    on_ready: Callable[[str], None] | None = None,
    kv_events: bool = True,
    vllm_events: KVEventsConfig | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain and return.

    `port` 0 binds a free port; `token` is required of every caller but health probes;
    `on_ready` receives the URL actually served; `kv_events`: publish the prefix
    cache's events (`engine/kv_events.py`) and advertise them in the info;
    `vllm_events`: also publish them in vLLM's format where it says.
    """
    server = ReplicaServer(engine, drain_timeout=drain_timeout, token=token)
    if kv_events and engine.core.kv.enable_caching:
        block_size = engine.core.kv.block_size
        medium = "GPU" if engine.core.runner.device.type == "cuda" else "CPU"  # vLLM's words
        server.kv_events = tokenyard_publisher(host, block_size, medium, token=token)
        publishers = [server.kv_events]
        if vllm_events is not None and vllm_events.vllm_endpoint is not None:
            server.vllm_kv_events = vllm_publisher(vllm_events, block_size, medium)
            publishers.append(server.vllm_kv_events)

        def publish(events: list[tuple[object, ...]]) -> None:
            for publisher in publishers:
                publisher.publish(events)

        engine.publish_kv_events(publish)
    runner = web.AppRunner(
        server.make_app(),
        handler_cancellation=True,  # a disconnect cancels the handler: abort at once
        access_log=None,  # per-request logging costs CPU the model could use
        shutdown_timeout=1.0,  # handlers are already done when cleanup runs
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{bound}"
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            server.request_shutdown()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
        await server.drain()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        for publisher in (server.kv_events, server.vllm_kv_events):
            if publisher is not None:
                publisher.close()


def serve_engine(
    host: str = "127.0.0.1",
    port: int = 8001,
    *,
    drain_timeout: float = 30.0,
    token: str | None = None,
    show_progress: bool = True,
    **engine_config: Any,
) -> int:
    """Load the model, serve the replica API until SIGTERM, drain, and return 0.

    `token`: the bearer token callers must send (None: loopback hosts only, see
    `check_exposure`). Keyword arguments beyond these are EngineConfig fields.
    """
    check_exposure(host, token)  # before the model loads: a refusal should be quick
    config = EngineConfig.from_env(**engine_config)
    vllm_events = KVEventsConfig.from_env()
    engine = AsyncEngineCore(config, show_progress=show_progress)
    # On stderr: stdout's one line is the ready mark that `tokenyard serve` waits for.
    log.info("tokenyard engine: %s loaded with %s weights", engine.model_name,
             engine.weights, extra={"event": "model_loaded", "model": engine.model_name,
                                    "weights": engine.weights})

    def ready(url: str) -> None:
        # One write, newline included: the log thread writes to the same pipe, and a
        # line of its between the mark and its newline broke the parent's parse of the URL.
        print(f"tokenyard engine: {engine.model_name} serving at {url}\n", end="", flush=True)

    try:
        asyncio.run(run_server(engine, host, port, drain_timeout=drain_timeout, token=token,
                               on_ready=ready, vllm_events=vllm_events))
    finally:
        engine.shutdown()
    return 0
