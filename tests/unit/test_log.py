"""Log lines: logfmt by default, JSON objects with --log.format json; fields as keys in both."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from gpufootprint.app import App
from gpufootprint.configload import load_config
from gpufootprint.log import JsonFormatter, LogfmtFormatter, split_fields

from tests.conftest import cli_env


def _record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("gpufootprint.x", logging.WARNING, __file__, 1, msg, args, exc_info)


@pytest.mark.parametrize(("message", "text", "fields"), [
    ("serving metrics url=http://localhost:9878/metrics", "serving metrics",
     {"url": "http://localhost:9878/metrics"}),
    ("leak suspected pid=12 gpu=0 growth_bytes_per_second=1.5 sites=a.py:3x2", "leak suspected",
     {"pid": 12, "gpu": 0, "growth_bytes_per_second": 1.5, "sites": "a.py:3x2"}),
    ("budget action scope=pod name=x reason='over the hard limit'", "budget action",
     {"scope": "pod", "name": "x", "reason": "over the hard limit"}),
    ("signal SIGTERM: shutting down", "signal SIGTERM: shutting down", {}),
    ("config reload refused: a=b is not valid here", "config reload refused: a=b is not valid here", {}),
    ("value=nan", "", {"value": "nan"}),
])
def test_the_message_is_split_into_its_text_and_its_fields(message: str, text: str, fields: dict) -> None:
    assert split_fields(message) == (text, fields)


def test_json_lines_are_objects_with_the_fields_as_keys() -> None:
    line = JsonFormatter().format(_record("shut down cleanly connections_closed=%d pending_records=%d", 2, 0))
    obj = json.loads(line)
    assert obj["msg"] == "shut down cleanly"
    assert obj["connections_closed"] == 2 and obj["pending_records"] == 0
    assert obj["level"] == "warning" and obj["logger"] == "gpufootprint.x" and obj["ts"].endswith("Z")
    assert "exc" in json.loads(JsonFormatter().format(_record("failed", exc=True)))


def test_logfmt_quotes_what_needs_it_and_keeps_one_line_per_record() -> None:
    line = LogfmtFormatter().format(_record("budget action scope=pod reason=%r", "over the limit"))
    assert line.split(" ", 1)[1] == ('level=warning logger=gpufootprint.x msg="budget action" scope=pod '
                                     'reason="over the limit"')
    assert "\n" not in LogfmtFormatter().format(_record("failed", exc=True))


def test_the_cli_writes_json_objects_with_log_format_json(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "demo", "--listen", "127.0.0.1:0", "--duration", "1",
                        "--log.format", "json", "--log.level", "info"], env=cli_env(), capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(ln) for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(o) for o in lines)
    assert any(o["msg"] == "shut down cleanly" and "connections_closed" in o for o in lines), lines


def test_the_daemon_exports_its_own_process_metrics() -> None:
    app = App(load_config(env={}), socket_path=None, listen="127.0.0.1:0")
    app.start()
    try:
        assert app.http is not None
        body = urllib.request.urlopen(f"http://127.0.0.1:{app.http.port}/metrics", timeout=10).read().decode()
    finally:
        app.stop()
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                 "process_start_time_seconds"):
        assert f"\n{name} " in body, name
