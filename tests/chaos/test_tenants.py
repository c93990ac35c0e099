"""Keys and tenants: what one org can learn about another, and who may call what.

On the session's server, two fresh orgs A and B:

- the prefix cache: A's long prompt, twice, then B's identical one — B gets no cached
  token and pays A's cold prefill time (its TTFT is near A's first, not A's cached
  second), over a few rounds of fresh prompts whose fastest times are compared;
- request records (``GET /v1/requests/{id}``) and stored responses
  (``GET /v1/responses/{id}``) of A are 404 to B; usage, orgs, keys, the dashboard,
  deployments and moderation events (the admin routes) are 403 to both;
- the replica refuses a caller without its token (or with a wrong one) on every route
  but health;
- secrets are never compared as strings (an AST scan of src/): keys are found by the
  SHA-256 of the presented secret in an indexed lookup, so the time taken depends on a
  hash the caller cannot steer byte by byte, not on how many leading characters of a
  real key it guessed; the replica token, the one secret held in memory, goes through
  `hmac.compare_digest`;
- guessing keys from one address is throttled (gateway/auth_throttle.py; the full
  check, with each dialect's shape, is tests/e2e/test_auth_throttle.py): here from
  127.0.0.77, which leaves the other tests' 127.0.0.1 alone.
"""

from __future__ import annotations

import ast
import asyncio
import re
import time
import uuid
from pathlib import Path

import aiohttp
import openai
import pytest

import tokenyard
from tests.chaos.conftest import Recorder
from tests.chaos.invariants import check_quiescent
from tests.e2e.conftest import Server
from tests.e2e.test_tenancy import cached_tokens, new_key
from tokenyard.wire.protocol import GENERATE_PATH, INFO_PATH, STATS_PATH

pytestmark = pytest.mark.slow

ADMIN_ROUTES = ("/admin/v1/usage", "/admin/v1/orgs", "/admin/v1/keys", "/admin/v1/dashboard",
                "/admin/v1/deployments", "/admin/v1/moderation/events")
#: Names that hold a secret itself (not its hash, its prefix or its length).
_SECRET_NAME = re.compile(r"(^|_)(secret|api_key|password|replica_token|token)$", re.I)
#: Comparisons of configured secrets with each other, where no caller's input takes part.
NOT_AUTHENTICATION = {
    # --workers checks at start that a deployment's replicas share one token.
    "cli/workers.py",
}
GUESSER = "127.0.0.77"  # loopback, but not the address every other test calls from
#: Rounds of (A cold, A warm, B cold), each on a fresh prompt; the fastest time of each
#: kind is compared, since load on the machine only ever slows a request down.
CACHE_ROUNDS = 3
#: B's cold TTFT must be at least this fraction of A's: on CPU a cached prefix answers in
#: about a tenth of the cold time (0.16 s against 1.5 s at 542 prompt tokens, 2 busy cores).
COLD_FRACTION = 0.3


async def _get(session: aiohttp.ClientSession, url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(url, headers=headers) as r:
        await r.read()
        return r.status


def _timed_cached(server: Server, key: str, messages: list[dict[str, str]]
                  ) -> tuple[int, float, int]:
    """Cached tokens, seconds (its TTFT, near enough: one token) and prompt tokens of one
    completion."""
    started = time.monotonic()
    prompt, cached = cached_tokens(server, key, messages)
    return cached, time.monotonic() - started, prompt


def _a_request_and_a_response(server: Server, key: str) -> tuple[str, str]:
    """One chat completion's request id and one stored response's id, both of `key`."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    stored = client.responses.create(model=server.model, input="Hi", max_output_tokens=2)
    return raw.headers["x-request-id"], stored.id


def plain_secret_comparisons(root: Path) -> list[str]:
    """`==` / `!=` with an operand named like a secret, anywhere under `root`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or not any(
                    isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
                continue
            for operand in (node.left, *node.comparators):
                name = (operand.id if isinstance(operand, ast.Name) else
                        operand.attr if isinstance(operand, ast.Attribute) else None)
                if name and _SECRET_NAME.search(name):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_orgs_see_nothing_of_each_other_and_secrets_are_guarded(
    server: Server, record: Recorder,
) -> None:
    rounds = []
    for _ in range(CACHE_ROUNDS):
        # Fresh orgs each round: an org's own earlier prompt would share the chat
        # template's first block with this one.
        a, b = new_key(server), new_key(server)
        # Unique from its first token, so that no earlier prompt's blocks match it; long
        # enough (~500 tokens) that prefill dominates the time of a one-token answer.
        text = f"{uuid.uuid4().hex} Summarise this. " + "The quick brown fox jumps. " * 80
        messages = [{"role": "user", "content": text}]
        rounds.append((_timed_cached(server, a, messages), _timed_cached(server, a, messages),
                       _timed_cached(server, b, messages)))
    for a_cold, a_warm, b_cold in rounds:
        assert a_cold[0] == 0 and a_warm[0] > 200, (a_cold, a_warm)
        assert b_cold[0] == 0, "org B was served from org A's cached prefix"
    a_cold_s, a_warm_s, b_cold_s = (min(r[kind][1] for r in rounds) for kind in range(3))
    assert b_cold_s >= COLD_FRACTION * a_cold_s, (
        f"org B's first request took {b_cold_s:.3f} s, near A's cached {a_warm_s:.3f} s, "
        f"not A's cold {a_cold_s:.3f} s: it was served from A's prefix")

    request_id, response_id = _a_request_and_a_response(server, a)

    async def probes() -> dict[str, int]:
        base = server.base_url
        async with aiohttp.ClientSession() as session:
            seen = {
                "a_request": await _get(session, f"{base}/v1/requests/{request_id}", a),
                "b_request": await _get(session, f"{base}/v1/requests/{request_id}", b),
                "a_response": await _get(session, f"{base}/v1/responses/{response_id}", a),
                "b_response": await _get(session, f"{base}/v1/responses/{response_id}", b),
            }
            for route in ADMIN_ROUTES:
                seen[f"admin {route}"] = await _get(session, base + route, b)
            replica = server.replica_url.rstrip("/")
            for path in (STATS_PATH, INFO_PATH):
                seen[f"replica {path} no token"] = await _get(session, replica + path, None)
                seen[f"replica {path} wrong token"] = await _get(session, replica + path,
                                                                 "not-the-token")
            async with session.post(replica + GENERATE_PATH, json={}) as r:
                seen["replica generate no token"] = r.status
        guesser = aiohttp.TCPConnector(local_addr=(GUESSER, 0))
        async with aiohttp.ClientSession(connector=guesser) as session:
            statuses = [await _get(session, f"{server.base_url}/v1/models", f"sk-guess-{i}")
                        for i in range(70)]
        seen["guesses_401"] = statuses.count(401)
        seen["guesses_429"] = statuses.count(429)
        async with aiohttp.ClientSession() as session:  # 127.0.0.1 is not throttled
            seen["owner_after_guesses"] = await _get(session, f"{server.base_url}/v1/models", a)
        return seen

    seen = asyncio.run(probes())
    assert seen["a_request"] == 200 and seen["a_response"] == 200, seen
    assert seen["b_request"] == 404 and seen["b_response"] == 404, seen
    assert all(seen[f"admin {route}"] == 403 for route in ADMIN_ROUTES), seen
    assert all(v == 401 for k, v in seen.items() if k.startswith("replica")), seen
    assert seen["guesses_429"] >= 1 and seen["guesses_401"] <= 60, seen
    assert seen["owner_after_guesses"] == 200, seen
    comparisons = [c for c in plain_secret_comparisons(Path(tokenyard.__file__).parent)
                   if c.split(":", 1)[0] not in NOT_AUTHENTICATION]
    assert comparisons == [], comparisons

    quiet = check_quiescent(server)
    record("keys and tenants", command="tokenyard serve (the session's server), two fresh orgs",
           sent={"prefix_prompt_tokens": rounds[0][0][2], "prefix_rounds": CACHE_ROUNDS,
                 "admin_routes": len(ADMIN_ROUTES),
                 "key_guesses": 70, "guess_address": GUESSER},
           held={"a_cached_second_min": min(r[1][0] for r in rounds),
                 "b_cached_first_max": max(r[2][0] for r in rounds),
                 "a_cold_s_min": round(a_cold_s, 3), "a_warm_s_min": round(a_warm_s, 3),
                 "b_cold_s_min": round(b_cold_s, 3),
                 "b_cold_over_a_cold": round(b_cold_s / a_cold_s, 2),
                 "other_org_request_404": True, "other_org_response_404": True,
                 "admin_routes_403": True, "replica_without_token_401": True,
                 "plain_secret_comparisons": 0,
                 "guesses_401": seen["guesses_401"], "guesses_429": seen["guesses_429"],
                 **quiet})


def test_the_secret_scan_finds_a_plain_comparison(tmp_path: Path) -> None:
    """The scan above is not vacuous: it flags the comparison it is there to forbid."""
    (tmp_path / "auth.py").write_text(
        "def ok(presented, secret):\n    return presented == secret\n")
    (tmp_path / "fine.py").write_text(
        "def ok(row, h):\n    return row.secret_hash == h and len(h) == 64\n")
    assert plain_secret_comparisons(tmp_path) == ["auth.py:2: presented == secret"]

