"""One JSON object per log line, so request logs can be searched by field.

Standard library only: gunicorn.conf.py gives the same formatter to gunicorn's own loggers in the master.
"""
from __future__ import annotations

import json
import logging
import sys
import time

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and goes into the JSON.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as a single JSON line with its ``extra`` fields, and the process that wrote it (``pid``:
    with several workers, which one loaded a version or answered a request)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                 + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name, "pid": record.process,
                 "msg": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


ACCESS_LOGGER = "visionserve.access"  # each request's line (a record with its ``status``)


class ErrorAnswersOnly(logging.Filter):
    """ACCESS_LOG=errors: a request's line only when it was answered 4xx or 5xx."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status", None)
        return not isinstance(status, int) or status >= 400


def configure_logging(level: str, access: str = "all") -> None:
    """Send the service's logs to stderr as JSON lines, the requests' lines as ``access`` (ACCESS_LOG) says
    (idempotent)."""
    root = logging.getLogger()
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
    root.setLevel(level.upper())
    configure_access_log(access)


def configure_access_log(access: str) -> None:
    """ACCESS_LOG: every request's line (``all``), those of error answers (``errors``), or none (``off``: its level
    above any it logs at, so the request paths do not even make the line)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.setLevel(logging.CRITICAL if access == "off" else logging.NOTSET)
    for kept in [kept for kept in logger.filters if isinstance(kept, ErrorAnswersOnly)]:
        logger.removeFilter(kept)
    if access == "errors":
        logger.addFilter(ErrorAnswersOnly())
