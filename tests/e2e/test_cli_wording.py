"""What the CLI says of itself: `tokenyard admin --help` describes every noun and each
noun's --help every verb; `tokenyard chat --help` states the URL and model it uses, and
a chat session names both before the first prompt."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.e2e.conftest import Server


def _cli(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "tokenyard.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=60, env=os.environ)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _undescribed(help_text: str) -> tuple[list[str], list[str]]:
    """The subcommands `help_text` lists (its {a,b,…} line), and those without words."""
    names = re.search(r"^  \{([\w,-]+)\}$", help_text, re.M)
    assert names, help_text
    listed = names.group(1).split(",")
    described = set(re.findall(r"^    ([\w-]+) +\S", help_text, re.M))
    return listed, [n for n in listed if n not in described]


def test_admin_help_describes_every_noun_and_verb() -> None:
    nouns, bare = _undescribed(_cli("admin", "--help"))
    assert len(nouns) >= 14 and bare == []
    for noun in nouns:
        text = _cli("admin", noun, "--help")
        if not re.search(r"^  \{[\w,-]+\}$", text, re.M):  # a noun without verbs
            continue
        verbs, bare = _undescribed(text)
        assert verbs and bare == [], (noun, bare)


def test_chat_help_and_session_name_the_url_and_the_model(server: Server) -> None:
    text = _cli("chat", "--help")
    assert "http://127.0.0.1:8000/v1" in text and "/v1/models" in text
    assert re.search(r"--temperature TEMPERATURE\s+\S", text)
    said = _cli("chat", "--base-url", server.base_url + "/v1", "--api-key",
                server.api_key or "", stdin="/exit\n")
    assert f"[{server.base_url}/v1, model {server.model}]" in said, said
