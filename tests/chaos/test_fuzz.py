"""Schemathesis over /openapi.json: every operation, generated bodies valid and invalid,
with the session key and without one; each answer must be in the document (its status
codes, its content type, its body's schema) and never a 5xx other than 503/529.

Generation is kept cheap by a hook that clamps token counts and choices (the fuzzer tests
the edges of the API, not the model) and turns streaming off (a stream is SSE, not the
JSON the document describes for the route). Short: a few examples per operation with a
fixed seed; full (TOKENYARD_CHAOS=full): many more.
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from requests.adapters import HTTPAdapter
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS

from tests.chaos.conftest import Recorder, chaos_scale
from tests.chaos.invariants import check_quiescent
from tests.e2e.conftest import Server

EXAMPLES = 4 if chaos_scale() == "short" else 60
#: Fields capped so no generated request makes the model write more than a few tokens.
_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2,
         "best_of": 2}


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    """Clamp generation (valid and invalid values alike keep their sign and type)."""
    if isinstance(body, dict):
        for name, cap in _CAPS.items():
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[name] = cap
        if body.get("stream") is True:
            body["stream"] = False
    return body


class FromAddress(HTTPAdapter):
    """Connections from one loopback address: the fuzzer's failed authentications would
    otherwise lock 127.0.0.1, which every other test of the session speaks from, out of
    the session's server for a minute (gateway/auth_throttle.py)."""

    def __init__(self, address: str) -> None:
        self.address = address
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["source_address"] = (self.address, 0)
        super().init_poolmanager(*args, **kwargs)


def _fuzz(operation: Any, headers: dict[str, str], session: requests.Session,
          sent: list[int]) -> str | None:
    """Run `operation`'s examples (counted in `sent`); the first failure's report, or None.
    Keyed, the check that a request without the key is refused is left to the unkeyed run:
    each would count as a failed authentication, and enough of them lock the address."""
    names = ["positive_data_acceptance", *(["ignored_auth"] if headers else [])]
    excluded = CHECKS.get_by_names(names)

    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    def run(case: Any) -> None:
        sent.append(1)
        case.call_and_validate(headers=headers, session=session, timeout=60,
                               excluded_checks=excluded)

    try:
        run()
    except Exception as failure:  # schemathesis' failure groups, hypothesis' errors
        return f"{operation.label}: {failure}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("keyed", [True, False], ids=["with-key", "without-key"])
def test_every_operation_answers_within_its_document(
        server: Server, keyed: bool, record: Recorder) -> None:
    api = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    headers = server.headers if keyed else {}
    operations = [result.ok() for result in api.get_all_operations()]
    session = requests.Session()
    session.mount("http://", FromAddress("127.0.0.7" if keyed else "127.0.0.8"))
    sent: list[int] = []
    failures = [f for f in (_fuzz(op, headers, session, sent) for op in operations) if f]
    assert not failures, "\n\n".join(failures)
    assert len(sent) >= len(operations) * 2, (len(sent), len(operations))
    held = check_quiescent(server)
    record(f"fuzzing ({'with' if keyed else 'without'} a key)",
           command="pytest tests/chaos/test_fuzz.py",
           sent={"operations": len(operations), "requests": len(sent),
                 "examples_per_operation": EXAMPLES},
           held={"answers_within_document": True, "server_errors": 0, **held})
