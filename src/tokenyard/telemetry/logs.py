"""Logs: one JSON object per line on stderr (or plain text), and the per-request line.

Everything logs through stdlib `logging`; `configure` installs one handler on the root
logger with `JsonFormatter` or `TextFormatter`, behind a queue: the logging call only
enqueues the record and a `QueueListener` thread formats and writes it, so no log line
makes the event loop wait for stderr (a full pipe, a slow disk). `stop` (run at exit)
writes what is still queued. Structured fields travel as the record's
`extra` attributes (``logger.info("replica ejected", extra={"event": "replica_ejected",
"replica": url})``), so code that logs needs nothing from here. The JSON line holds
``ts`` (UTC, ISO 8601 with ms), ``level``, ``logger``, ``msg`` and those fields.

`log_request` is the observer of `request_log` that writes a request's line when it
ended: its summary's fields, which hold no prompt, output or credential.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import os
import queue
import sys
from datetime import UTC, datetime
from logging.handlers import QueueHandler, QueueListener
from typing import Any

from tokenyard.telemetry.request_log import RequestSummary, add_observer

FORMATS = ("json", "text")
#: `auto` (serve's default): text on a terminal, JSON anywhere else (a pipe, a file, a
#: log collector).
AUTO = "auto"
LEVELS = ("debug", "info", "warning", "error")
#: How `tokenyard serve` tells its HTTP worker processes the log settings it was given.
FORMAT_ENV = "TOKENYARD_LOG_FORMAT"
LEVEL_ENV = "TOKENYARD_LOG_LEVEL"

#: The attributes every LogRecord has; anything else on a record came through `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName",
}

#: What Ray adds to every record in a process it runs (its core context filter and its
#: record factory's timestamp): not ours to log, and the same on every line.
_RAY_FIELDS = frozenset({"job_id", "worker_id", "node_id", "actor_id", "task_id",
                         "actor_name", "task_name", "task_func_name", "timestamp_ns"})
#: Requests that only probe the process (load balancers, kubelets): logged at debug.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/livez"})

request_logger = logging.getLogger("tokenyard.request")
#: The format `configure` put in force ("json" or "text"; None before it ran).
active_format: str | None = None
#: The thread writing the queued records, while `configure`'s settings are in force.
_listener: QueueListener | None = None


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """What came through `extra` (private attributes and Ray's context left out)."""
    return {k: v for k, v in vars(record).items()
            if k not in _STANDARD and k not in _RAY_FIELDS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(_fields(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time logger message key=value …`` for a person reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _fields(record)
        if not fields:
            return text
        extra = " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in fields.items())
        head, sep, tail = text.partition("\n")  # keep a traceback after the fields
        return f"{head} {extra}{sep}{tail}"


class _Enqueue(QueueHandler):
    """Hands a record to the listener's thread unformatted (the stock `prepare` formats
    it here, on the caller's thread, and drops its traceback for the JSON `exc` field)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record = copy.copy(record)
        # The arguments are the caller's objects: render them now, before they change.
        record.msg, record.args = record.getMessage(), None
        return record


def resolve_format(fmt: str | None) -> str:
    """`fmt`, with `auto` (and None) made text when stderr is a terminal, else json."""
    if fmt in (None, AUTO):
        isatty = getattr(sys.stderr, "isatty", None)
        return "text" if isatty is not None and isatty() else "json"
    return fmt


def configure(fmt: str | None = None, level: str | None = None) -> None:
    """Log to stderr in `fmt` (json, text or auto: `resolve_format`) at `level`; unset:
    the environment's (`FORMAT_ENV`, `LEVEL_ENV`), else auto and info. Requests get their
    line when the level lets info through. The lines are written by a thread of their
    own until `stop`, which runs at exit."""
    global _listener, active_format
    fmt = resolve_format(fmt or os.environ.get(FORMAT_ENV))
    level = level or os.environ.get(LEVEL_ENV) or "info"
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    stop()  # a second configure replaces the first: its queued lines are written first
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(_Enqueue(records))
    root.setLevel(level.upper())
    _listener = QueueListener(records, handler)
    _listener.start()
    active_format = fmt
    # Alembic announces its context at info on every migration check (twice a start);
    # the store logs the one line that matters ("database migrated ...").
    logging.getLogger("alembic.runtime.migration").setLevel(logging.WARNING)
    if request_logger.isEnabledFor(logging.INFO):
        add_observer(log_request)


def stop() -> None:
    """Write every queued line and end the writing thread (at exit); later lines are
    written by the caller, as nothing is left to wait for then."""
    global _listener
    if _listener is None:
        return
    root = logging.getLogger()
    for old in list(root.handlers):  # first, so that no line lands in a queue nobody reads
        if isinstance(old, _Enqueue):
            root.removeHandler(old)
    for handler in _listener.handlers:
        root.addHandler(handler)
    _listener.stop()
    _listener = None


# Registered after logging's own exit hook, so it runs first: the queue is written out
# before logging flushes and closes the stream handler.
atexit.register(stop)


def log_request(summary: RequestSummary) -> None:
    """The request's log line (an observer of `request_log`); health probes at debug."""
    level = logging.DEBUG if summary.path in PROBE_PATHS else logging.INFO
    if request_logger.isEnabledFor(level):
        request_logger.log(level, "%s %s %d", summary.method, summary.path, summary.status,
                           extra=summary.to_json())
