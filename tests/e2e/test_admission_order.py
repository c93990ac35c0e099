"""Tokenization waits for the model's scope and a byte bound, through HTTP on the embedded
model (its real window): a text that cannot fit the window whatever the tokenizer makes
of it is refused untokenized, a key outside the model's scope gets its 403 at once
however long its prompt, and the event loop keeps answering meanwhile.

Shown to fail before the pipeline owned the order: a 3.6 MB prompt was templated and
tokenized on the event loop (seconds, every other request held) before either check.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest

from tests.e2e.conftest import Server
from tests.integration.test_admission_order import new_key
from tokenyard.store.records import Scopes


class _Pinger:
    """GET /healthz in a loop on its own thread; the longest answer it waited for."""

    def __init__(self, server: Server) -> None:
        self.url = server.base_url + "/healthz"
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=30) as response:
                response.read()
            self.worst = max(self.worst, time.perf_counter() - began)
            time.sleep(0.005)

    def __enter__(self) -> _Pinger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_a_prompt_longer_than_the_window_can_spell_is_refused_untokenized(
    server: Server,
) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key or "x",
                           max_retries=0, timeout=60)
    huge = "lorem ipsum dolor " * 200_000  # 3.6 MB, under the 4 MiB body cap
    with _Pinger(server) as pinger:
        for _ in range(3):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model=server.model, max_tokens=4, messages=[{"role": "user", "content": huge}])
            assert refused.value.code == "context_length_exceeded"
            assert "characters of text" in refused.value.message
        # Outside the model's scope: a 403 at once, whatever the prompt's length.
        denied = new_key(server, scopes=Scopes(models=("gpt-*",)))
        with pytest.raises(openai.PermissionDeniedError):
            openai.OpenAI(base_url=server.base_url + "/v1", api_key=denied,
                          max_retries=0).chat.completions.create(
                model=server.model, max_tokens=4, messages=[{"role": "user", "content": huge}])
    # A stall bound, not a speed target: tokenizing 3.6 MB on the event loop held every
    # other request for seconds.
    assert pinger.worst < 1.0, f"/healthz waited {pinger.worst:.2f} s"
