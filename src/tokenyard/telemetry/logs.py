"""Logs: one JSON object per line on stderr (or plain text), and the per-request line.

Everything logs through stdlib `logging`; `configure` installs one handler on the root
logger with `JsonFormatter` or `TextFormatter`. Structured fields travel as the record's
`extra` attributes (``logger.info("replica ejected", extra={"event": "replica_ejected",
"replica": url})``), so code that logs needs nothing from here. The JSON line holds
``ts`` (UTC, ISO 8601 with ms), ``level``, ``logger``, ``msg`` and those fields.

`log_request` is the observer of `request_log` that writes a request's line when it
ended: its summary's fields, which hold no prompt, output or credential.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

from tokenyard.telemetry.request_log import RequestSummary, add_observer

FORMATS = ("json", "text")
LEVELS = ("debug", "info", "warning", "error")
#: How `tokenyard serve` tells its HTTP worker processes the log settings it was given.
FORMAT_ENV = "TOKENYARD_LOG_FORMAT"
LEVEL_ENV = "TOKENYARD_LOG_LEVEL"

#: The attributes every LogRecord has; anything else on a record came through `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName",
}

request_logger = logging.getLogger("tokenyard.request")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


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


def configure(fmt: str | None = None, level: str | None = None) -> None:
    """Log to stderr in `fmt` (json or text) at `level`; unset: the environment's
    (`FORMAT_ENV`, `LEVEL_ENV`), else json and info. Requests get their line when the
    level lets info through."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or "json"
    level = level or os.environ.get(LEVEL_ENV) or "info"
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    if request_logger.isEnabledFor(logging.INFO):
        add_observer(log_request)


def log_request(summary: RequestSummary) -> None:
    """The request's log line (an observer of `request_log`)."""
    request_logger.info("%s %s %d", summary.method, summary.path, summary.status,
                        extra=summary.to_json())
