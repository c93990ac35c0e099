"""An OTLP/HTTP endpoint that accepts every export and keeps nothing but a count: what
`bench gateway --telemetry traces` points tokenyard's exporter at, so spans are really
encoded and sent while the benchmark runs, in a process of their own.

    python -m tokenyard.bench.otlp_sink --port 0
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from aiohttp import web


async def serve(port: int) -> None:
    exports = 0

    async def accept(request: web.Request) -> web.Response:
        nonlocal exports
        await request.read()
        exports += 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/traces", accept)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"otlp sink serving at http://127.0.0.1:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(f"otlp sink: {exports} exports received", flush=True)
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
