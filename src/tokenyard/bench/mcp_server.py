"""A small MCP server (the `mcp` SDK's MCPServer, FastMCP's successor) on 127.0.0.1, in a
process of its own: what `tokenyard bench agent` and the tests of the platform's MCP loop
(tests/e2e/test_mcp.py) call.

    python -m tokenyard.bench.mcp_server PORT [--secret S]

serves a calculator (`add`, `multiply`: read-only; `record`: not) over streamable HTTP
at http://127.0.0.1:PORT/mcp. With `--secret`, every request must carry
``X-Api-Secret: S`` (else 401): a registered server's headers reach it. Every call is
appended to `calls`, which the `last_calls` tool returns; ``GET /seen`` answers how many
HTTP requests reached it (`requests_seen`: whether anyone contacted it at all).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

from tokenyard.bench.children import free_port

ENDPOINT = "/mcp"
#: The path that answers how many requests the server received (itself not counted).
SEEN = "/seen"


def requests_seen(url: str) -> int:
    """How many HTTP requests the MCP server at `url` (its `ENDPOINT`) has received."""
    return int(httpx.get(url.removesuffix(ENDPOINT) + SEEN, timeout=10).json()["seen"])


@contextlib.contextmanager
def running_mcp_server(secret: str | None = None) -> Iterator[str]:
    """An MCP server on a free loopback port; yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenyard.bench.mcp_server", str(port)]
    if secret is not None:
        cmd += ["--secret", secret]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}{ENDPOINT}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("the MCP server exited: " + (proc.stderr.read()
                                                                if proc.stderr else ""))
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--secret")
    args = parser.parse_args()
    server = MCPServer("calculator")
    calls: list[str] = []
    read_only = ToolAnnotations(read_only_hint=True)

    @server.tool(annotations=read_only)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append(f"add {a} {b}")
        return a + b

    @server.tool(annotations=read_only)
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append(f"multiply {a} {b}")
        return a * b

    @server.tool()
    def record(note: str) -> str:
        """Write a note down."""
        calls.append(f"record {note}")
        return "recorded"

    @server.tool(annotations=read_only)
    def last_calls() -> str:
        """The calls made so far, one a line."""
        return "\n".join(calls)

    app = server.streamable_http_app(stateless_http=False)
    if args.secret is not None:
        app = _guarded(app, args.secret)
    app = _counted(app)
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def _counted(app: Any) -> Any:
    """`app`, counting the HTTP requests it receives; ``GET /seen`` answers the count."""
    seen = [0]

    async def counted(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == SEEN:
            body = f'{{"seen": {seen[0]}}}'.encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] == "http":
            seen[0] += 1
        await app(scope, receive, send)
    return counted


def _guarded(app: Any, secret: str) -> Any:
    """`app`, answering 401 to a request without the secret header."""
    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or ())
            if headers.get(b"x-api-secret") != secret.encode():
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"no secret"})
                return
        await app(scope, receive, send)
    return guarded


if __name__ == "__main__":
    main()
