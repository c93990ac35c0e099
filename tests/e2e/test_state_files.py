"""The state directory of `tokenyard serve` is its owner's only, and its admin key is not
written to every log: after a server served a stored response and billed it, the directory
(and its journal) are 0700 and the SQLite file, its -wal and -shm, the ledger journal's
segments and the key file are 0600; the start that created the key prints it whole, a
later start on the same directory prints it masked and where the key file is — and
narrows what an earlier version left readable by others."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import Server, running_server

pytestmark = pytest.mark.slow


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _serve_a_stored_response(server: Server) -> None:
    """A stored response (the SQLite file, its WAL) and a billed request (the journal)."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                           max_retries=0)
    answer = client.responses.create(model=server.model, input="Say hello.",
                                     max_output_tokens=2, store=True)
    assert client.responses.retrieve(answer.id).id == answer.id


def _assert_private(state: Path) -> None:
    files = [state / name for name in ("tokenyard.db", "tokenyard.db-wal", "tokenyard.db-shm",
                                       "dev-key")]
    segments = sorted((state / "journal").glob("ledger-*.jsonl"))
    assert segments, "no ledger journal segment"
    modes = {str(p.relative_to(state)): oct(_mode(p)) for p in [*files, *segments]}
    assert modes == dict.fromkeys(modes, "0o600"), modes
    dirs = {str(p): oct(_mode(p)) for p in (state, state / "journal")}
    assert dirs == dict.fromkeys(dirs, "0o700"), dirs


def test_state_files_are_private_and_a_later_start_shows_the_key_masked(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    with running_server(state_dir=str(state)) as (server, _):
        key = server.api_key
        # Its output is a pipe, so its log is JSON: the key is in the key file, never in a
        # log line, even on the start that made it (a terminal shows it then).
        assert key is not None and key not in "".join(server.output)
        _serve_a_stored_response(server)
        _assert_private(state)
    assert (state / "dev-key").read_text().strip() == key

    # What a server of an earlier version left: readable by everyone.
    for path in (state, state / "journal", state / "tokenyard.db"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    with running_server(state_dir=str(state)) as (server, _):
        assert server.api_key == key  # the fixture read it from the key file
        _serve_a_stored_response(server)  # the key still works
        _assert_private(state)
        output = "".join(server.output)
        assert key not in output
        banner = next(json.loads(line) for line in server.output
                      if '"event": "banner"' in line)
        assert banner["api_key"] == f"{key[:6]}…{key[-4:]}"
        assert banner["api_key_file"] == str((state / "dev-key").absolute())
