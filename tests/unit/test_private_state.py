"""Local secrets stay local: the SQLite store (stored responses, captured bodies, key
hashes) and its -wal and -shm files are 0600 in a 0700 directory, whoever opens it
(`tokenyard serve`, `tokenyard admin`); the serve banner shows the development key whole
only on the start that created it. (tests/e2e/test_state_files.py checks a real server's
state directory.)"""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

from sqlalchemy import text

from tokenyard.cli.serve import banner, private_dir
from tokenyard.store import Database

KEY = "sk-ty-zYg4wbdXFK7q-Ip6wH_XnQRQlbCZ5VXecoqdjyV-U2k"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _modes_while_open(path: Path) -> dict[str, int]:
    async def main() -> dict[str, int]:
        db = await Database.open(f"sqlite+aiosqlite:///{path}")
        try:
            async with db.engine.begin() as conn:  # a write: the -wal and -shm exist now
                await conn.execute(text("CREATE TABLE IF NOT EXISTS t (x INTEGER)"))
                await conn.execute(text("INSERT INTO t VALUES (1)"))
            return {p.name: _mode(p) for p in path.parent.glob(path.name + "*")}
        finally:
            await db.close()

    return asyncio.run(main())


def test_a_new_sqlite_store_is_its_owner_s_only(tmp_path: Path) -> None:
    path = tmp_path / "state" / "tokenyard.db"
    modes = _modes_while_open(path)
    assert modes == {"tokenyard.db": 0o600, "tokenyard.db-wal": 0o600,
                     "tokenyard.db-shm": 0o600}, {k: oct(v) for k, v in modes.items()}
    assert _mode(path.parent) == 0o700


def test_an_existing_store_left_readable_is_narrowed(tmp_path: Path) -> None:
    path = tmp_path / "tokenyard.db"
    _modes_while_open(path)
    path.chmod(0o644)
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    assert set(_modes_while_open(path).values()) == {0o600}
    private_dir(state)
    assert _mode(state) == 0o700


def test_the_banner_shows_the_key_whole_only_when_it_was_just_made(tmp_path: Path) -> None:
    made = banner("http://127.0.0.1:8000", "m", "http://127.0.0.1:9", KEY)
    assert f"API key: {KEY}" in made and f"Bearer {KEY}" in made
    key_file = tmp_path / "dev-key"
    later = banner("http://127.0.0.1:8000", "m", "http://127.0.0.1:9", KEY, key_file)
    assert KEY not in later
    assert f"API key: sk-ty-…{KEY[-4:]} (the whole key is in {key_file})" in later
    assert f"$(cat {key_file})" in later  # the snippets read it from the file
