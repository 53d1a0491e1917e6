"""Log formats of the daemons: the classic text line, or one JSON object per line.

``--log-format json`` gives each record as one JSON object: ``time`` (UTC, ISO
8601 with milliseconds), ``level``, ``logger``, ``message``, ``pid``, ``role``
(coordinator, worker, local), and every *extra* field the call passed
(``log.debug("...", extra={"op_id": 12, "generation": 3})``): the worker's per-op
lines carry ``op_id``, ``generation``, ``kind``, ``tensor``, ``ranks``, ``bytes``,
``latency_s`` and ``code``, so a client's error can be found with ``jq``.
"""

from __future__ import annotations

import datetime
import json
import logging

__all__ = ["LOG_FORMATS", "JsonFormatter", "text_formatter"]

LOG_FORMATS = ("text", "json")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", (), None)).keys()
) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the record's ``extra`` fields at the top level."""

    def __init__(self, role: str = "") -> None:
        super().__init__()
        self._role = role

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        out: dict[str, object] = {
            "time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if self._role:
            out["role"] = self._role
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_") and key not in out:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def text_formatter(role: str) -> logging.Formatter:
    return logging.Formatter(f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s")
