"""README's compatibility table is the one the conformance suite's field tables give
(`compat_table.py`): those tables classify every property of each route's request schema
in the specs, and check each through HTTP."""

from __future__ import annotations

from tests.conformance.compat_table import README, readme_block, table


def test_readme_table_is_the_generated_one() -> None:
    assert readme_block(README.read_text(encoding="utf-8")) == table(), (
        "README's compatibility table is out of date: run "
        "`.venv/bin/python -m tests.conformance.compat_table --write`")
