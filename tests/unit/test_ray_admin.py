"""`tokenyard admin replicas scale DEPLOYMENT N --config` (`cli/ray_admin.py`): what it
refuses before it reaches Ray, each with the reason and exit code 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenyard.cli.main import main

FLEET = """
[[deployments]]
name = "on-ray"
placement = "ray"
replicas = 1
max_replicas = 2

[[deployments]]
name = "local"
replicas = 1
"""


@pytest.mark.parametrize(("deployment", "count", "reason"), [
    ("on-ray", 3, "replicas: from 1 to 2, not 3"),
    ("on-ray", 0, "replicas: from 1 to 2, not 0"),
    ("local", 1, 'local: not a deployment of .* with placement = "ray"'),
    ("missing", 1, "missing: not a deployment"),
])
def test_scale_refuses_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       deployment: str, count: int, reason: str) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    assert main(["admin", "replicas", "scale", deployment, str(count),
                 "--config", str(fleet)]) == 2
    err = capsys.readouterr().err
    assert re.search(reason, err), err


def test_scale_names_a_broken_fleet_file(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[deployments]]\nname = "x"\nplacement = "k8s"\n')
    assert main(["admin", "replicas", "scale", "x", "1", "--config", str(fleet)]) == 2
    assert "placement: one of local, ray" in capsys.readouterr().err
