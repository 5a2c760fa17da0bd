"""Logging: logfmt lines (the default, as Prometheus's own components write) or JSON objects on stderr.

Call sites write their fields into the message, ``log.info("serving metrics url=%s", url)``; the
formatter splits the formatted message into its text and its trailing ``key=value`` fields, so
both formats carry them as fields: ``msg="serving metrics" url=http://...`` in logfmt and
``{"msg": "serving metrics", "url": "http://..."}`` in JSON. A message whose tail is not all
``key=value`` stays whole in ``msg``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

#: ``key=value`` with a bare, "double" or 'single' quoted value (as %r writes strings)
_FIELD = re.compile(r"""\s*([A-Za-z_][\w.-]*)=("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\S*)""")
_FIRST = re.compile(r"(?:^|\s)[A-Za-z_][\w.-]*=")
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?\d+\.\d*(?:[eE][-+]?\d+)?")
FORMATS = ("logfmt", "text", "json")  # text: the older name of logfmt


def split_fields(message: str) -> tuple[str, dict[str, Any]]:
    """``"leak suspected pid=3 bytes=10"`` -> ``("leak suspected", {"pid": 3, "bytes": 10})``."""
    first = _FIRST.search(message)
    if first is None:
        return message, {}
    text, rest = message[:first.start()].rstrip(), message[first.start():]
    fields: dict[str, Any] = {}
    pos = 0
    while pos < len(rest):
        m = _FIELD.match(rest, pos)
        if m is None or m.end() == pos:
            return message, {}  # free text after a field: not a field list
        fields[m.group(1)] = _value(m.group(2))
        pos = m.end()
        if pos < len(rest) and not rest[pos].isspace():
            return message, {}
    return text, fields


def _value(raw: str) -> Any:
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return raw[1:-1].replace("\\" + raw[0], raw[0])
    if _INT.fullmatch(raw):
        return int(raw)
    if _FLOAT.fullmatch(raw):
        return float(raw)
    return raw


def _ts(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _logfmt_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    if text == "" or any(c in text for c in ' "=\\\n\t'):
        return json.dumps(text)
    return text


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text, fields = split_fields(record.getMessage())
        pairs = {"ts": _ts(record), "level": record.levelname.lower(), "logger": record.name, "msg": text,
                 **{k: v for k, v in fields.items() if k not in ("ts", "level", "logger", "msg")}}
        line = " ".join(f"{k}={_logfmt_value(v)}" for k, v in pairs.items())
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text, fields = split_fields(record.getMessage())
        out: dict[str, Any] = {"ts": _ts(record), "level": record.levelname.lower(), "logger": record.name,
                               "msg": text}
        for key, value in fields.items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str = "info", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger("gpufootprint")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
