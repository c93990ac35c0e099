"""`bench fleet`'s tenants: orgs with API keys of their own, and each org's conversations.

`create_tenants` makes the orgs and one key each with `tokenyard admin` on a state
directory that the benchmark's `tokenyard serve` then opens, so every request carries
its org's key and the gateway salts its prefix-cache blocks with its org
(`store/records.py`): no org's prompt can hit another's blocks, on the replicas or in
the balancer's index.

`tenant_conversations` is one org's traffic: a long system prompt of its own in front of
every request, and several multi-turn conversations (`bench/workloads.py`'s `multiturn`
shape: each turn resends the earlier ones plus a new user message), taken in a seeded
random order; after a turn a conversation may go idle for some of the org's requests,
long enough, on a small KV pool, for its blocks to be evicted before it comes back.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokenyard.bench.workloads import LengthDist, RequestSpec, words


@dataclass(frozen=True)
class Tenant:
    """One org of the benchmark and the secret of its key."""

    org_id: str
    api_key: str


def _admin(state_dir: Path, *args: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "TOKENYARD_DATABASE_URL"}
    env["TOKENYARD_STATE_DIR"] = str(state_dir)
    done = subprocess.run([sys.executable, "-m", "tokenyard.cli", "admin", "--format", "json",
                           *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"tokenyard admin {' '.join(args)} failed: {done.stderr[-2000:]}")
    result: dict[str, object] = json.loads(done.stdout)
    return result


def create_tenants(state_dir: Path, count: int) -> list[Tenant]:
    """`count` orgs (postpaid, no limits) with one key each, in `state_dir`'s store."""
    tenants = []
    for i in range(count):
        org = str(_admin(state_dir, "orgs", "create", f"bench-tenant-{i}")["id"])
        key = _admin(state_dir, "keys", "create", "--org", org, "--name", "bench-fleet")
        tenants.append(Tenant(org, str(key["secret"])))
    return tenants


@dataclass(frozen=True)
class TenantShape:
    """One org's traffic (see the module's docstring)."""

    system_len: int = 384
    input_len: int = 24
    output_len: int = 8
    turns: int = 4
    conversations: int = 3
    #: After each turn, the chance that its conversation goes idle ...
    idle_p: float = 0.25
    #: ... for this many of the org's requests.
    idle_for: int = 6

    def __post_init__(self) -> None:
        if min(self.system_len, self.input_len, self.output_len, self.turns,
               self.conversations) < 1:
            raise ValueError("lengths, turns and conversations must be at least 1")
        if not 0.0 <= self.idle_p < 1.0 or self.idle_for < 0:
            raise ValueError("idle_p must be in [0, 1) and idle_for >= 0")


@dataclass
class _Conversation:
    id: int
    #: The turns so far, after the system prompt.
    history: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0
    #: The org's request count before which it stays idle.
    idle_until: int = 0


def tenant_conversations(shape: TenantShape, seed: int) -> Iterator[RequestSpec]:
    """One org's requests, endless and fixed by `seed` (see the module's docstring). A
    conversation that ends is replaced by a new one; when every open conversation is
    idle, the one due back first takes the turn."""
    rng = random.Random(seed)
    system = {"role": "system", "content": words(rng, shape.system_len)}
    out_len = LengthDist(shape.output_len)
    numbers = itertools.count()
    open_ = [_Conversation(next(numbers)) for _ in range(shape.conversations)]
    for sent in itertools.count():
        ready = [c for c in open_ if c.idle_until <= sent]
        conv = rng.choice(ready) if ready else min(open_, key=lambda c: c.idle_until)
        messages = [system, *conv.history,
                    {"role": "user", "content": words(rng, shape.input_len)}]
        max_tokens = out_len.sample(rng)
        yield RequestSpec(messages, max_tokens, shape.system_len + shape.input_len,
                          conversation=conv.id, turn=conv.turn)
        reply = {"role": "assistant", "content": words(rng, max_tokens)}
        if conv.turn + 1 < shape.turns:
            conv.history = [*messages[1:], reply]
            conv.turn += 1
            if rng.random() < shape.idle_p:
                conv.idle_until = sent + 1 + shape.idle_for
        else:
            open_[open_.index(conv)] = _Conversation(next(numbers))
