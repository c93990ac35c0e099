"""AsyncEngineCore builds its core on the step thread, and a failed build raises in the
caller: every torch op of a replica on one thread keeps OpenMP to one pool of workers
(docs/architecture.md, "In process, the step loop runs on a thread")."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tokenyard.config import EngineConfig
from tokenyard.engine import async_core


def test_the_core_is_built_on_the_step_thread_and_a_failed_build_raises_in_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built_on: list[threading.Thread] = []

    def build_core(config: EngineConfig, show_progress: bool) -> Any:
        built_on.append(threading.current_thread())
        raise OSError("no such model file")

    monkeypatch.setattr(async_core, "build_core", build_core)
    with pytest.raises(OSError, match="no such model file"):
        async_core.AsyncEngineCore(EngineConfig())
    assert len(built_on) == 1
    assert built_on[0] is not threading.current_thread()
    assert built_on[0].name == "tokenyard-engine"
    assert not built_on[0].is_alive()  # the failed build left no thread behind
