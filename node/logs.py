"""How every role's log lines look: text for people, or one JSON object per line for machines.

    agora-node --log-format json <role> ...

Milestones (joined, phase changed, averaging round, reroute, ban, checkpoint written, credential
renewed) are ordinary log records that carry `extra={"milestone": NAME, "fields": {...}}`;
any module can emit one without importing this. In JSON each line has `ts` (ISO 8601, UTC),
`level`, `logger`, `message`, and for a milestone `event` plus its fields; in text the message
alone already says it all. The formatter never raises on an odd field: what JSON cannot carry
is written as its `str()`.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

__all__ = ["LOG_FORMATS", "JsonLogFormatter", "configure_logging"]

LOG_FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# By number: hivemind renames the standard levels' names ("WARN") in every process that imports it.
_LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error",
           logging.CRITICAL: "critical"}


class JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": _LEVELS.get(record.levelno, record.levelname.lower()),
            "logger": record.name,
            "message": record.getMessage(),
        }
        milestone = getattr(record, "milestone", None)
        if milestone:
            line["event"] = milestone
            fields = getattr(record, "fields", None)
            if isinstance(fields, dict):
                for key, value in fields.items():
                    line.setdefault(str(key), value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str, log_format: str = "text", stream=sys.stderr) -> None:
    """The root logger's one handler (like `logging.basicConfig`, a no-op if one is configured already)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else logging.Formatter(_TEXT))
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO), handlers=[handler])
