"""`tokenyard admin users …`, `keys create --user`, `budgets …` and `usage --group-by
user`, on the store the CLI opens (the state directory's SQLite file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenyard.cli.main import main


def test_the_cli_makes_users_their_keys_and_budgets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TOKENYARD_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENYARD_DATABASE_URL", raising=False)

    def cli(*args: str, code: int = 0) -> Any:
        assert main(["admin", "--format", "json", *args]) == code
        out = capsys.readouterr()
        return json.loads(out.out) if code == 0 else out.err

    org = cli("orgs", "create", "acme")["id"]
    project = cli("projects", "create", org, "web")["id"]
    user = cli("users", "create", "--org", org, "--email", "ada@acme.test", "--name", "Ada",
               "--project", project, "--monthly-budget", "20")
    assert (user["project_id"], user["monthly_budget"], user["total_budget"]) == (
        project, "20.000000", None)
    assert "already has a user" in cli("users", "create", "--org", org, "--email",
                                       "ada@acme.test", code=2)
    key = cli("keys", "create", "--org", org, "--user", user["id"], "--total-budget", "5")
    assert (key["user_id"], key["project_id"], key["total_budget"]) == (
        user["id"], project, "5.000000")
    other = cli("orgs", "create", "other")["id"]
    assert "no user" in cli("keys", "create", "--org", other, "--user", user["id"], code=2)

    assert cli("budgets", "set", "--user", user["id"], "--monthly", "none",
               "--total", "100")["total_budget"] == "100.000000"
    listed = {row["id"]: row for row in cli("budgets", "list", "--org", org)}
    assert listed[user["id"]]["monthly_budget"] is None
    assert listed[key["id"]]["total_spent"] == "0.000000"
    assert [u["email"] for u in cli("users", "list", "--org", org)] == ["ada@acme.test"]
    assert cli("usage", "--group-by", "user") == []
