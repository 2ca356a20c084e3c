"""Structured logging: one JSON object per line (or plain text) on stderr.

Use ``log.info("message", extra={"fields": {...}})`` to attach structured
fields; they are merged into the JSON record.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Callable


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = f"{self.formatTime(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


def setup_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("gcache")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class RateLimitedLog:
    """At most one WARNING per ``interval_s`` for each key (a small fixed set, such as a
    refusal reason); the next line that gets through says how many were suppressed in
    between. Events a hostile peer can trigger at will (refused connections, failed
    handshakes) log through this, and are counted exactly in metrics instead."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object, fields: dict | None = None) -> bool:
        """Log unless ``key`` logged less than ``interval_s`` ago; True when logged."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            n = self._suppressed.pop(key, 0)
        out = dict(fields or {})
        if n:
            out["suppressed"] = n
        self.logger.warning(msg, *args, extra={"fields": out})
        return True
