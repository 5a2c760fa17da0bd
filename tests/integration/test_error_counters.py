"""Failures the daemon counts are exported: through a real App and its /metrics over HTTP."""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.app import App
from gpufootprint.configload import load_config
from prometheus_client.parser import text_string_to_metric_families


def _if(value: Any, pred: Any) -> Any:
    """``value`` where ``pred(value)`` holds, else None (what a wait polls for)."""
    return value if pred(value) else None



def _scrape(port: int, auth: str | None = None) -> dict[str, float]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def _until(pred: Callable[[], Any], timeout: float = 20.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout} s")


def test_engine_and_ingest_loop_failures_are_exported_and_the_daemon_goes_on(tmp_path: Path) -> None:
    config = load_config(env={}, overrides={"exporter.render_interval_ms": 100})
    app = App(config, socket_path=str(tmp_path / "p.sock"), listen="127.0.0.1:0")

    def engines_fail(snap: object) -> None:
        raise RuntimeError("an engine bug")

    app.engines.step = engines_fail  # type: ignore[assignment, method-assign]
    real_drain = app.ingest._drain_inbox
    failures = [2]

    def drain_fails_twice() -> None:
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("a loop bug")
        real_drain()

    app.ingest._drain_inbox = drain_fails_twice  # type: ignore[method-assign]
    app.start()
    try:
        assert app.http is not None
        port = app.http.port
        def both_counted() -> dict[str, float] | None:
            m = _scrape(port)
            loop, engines = m.get("gpufootprint_daemon_loop_errors_total"), m.get("gpufootprint_engine_errors_total")
            return m if loop == 2 and engines is not None and engines >= 2 else None

        m = _until(both_counted)  # every tick's snapshot fails the engines: counted on each
        assert m["gpufootprint_exporter_auth_failures_total"] == 0
        assert m["gpufootprint_daemon_tick_errors_total"] == 0  # neither failure is a tick's
    finally:
        app.stop()


def test_refused_credentials_are_counted_in_metrics(tmp_path: Path) -> None:
    bcrypt = pytest.importorskip("bcrypt")
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yaml"
    web.write_text(f"basic_auth_users:\n  prometheus: {hashed}\n")
    config = load_config(env={}, overrides={"exporter.render_interval_ms": 100,
                                            "exporter.web_config_file": str(web)})
    app = App(config, socket_path=None, listen="127.0.0.1:0")
    app.start()
    try:
        assert app.http is not None
        port = app.http.port
        for auth in (None, "prometheus:wrong", "nobody:s3cret"):
            with pytest.raises(urllib.error.HTTPError) as exc:
                _scrape(port, auth)
            assert exc.value.code == 401
        m = _until(lambda: _if(_scrape(port, "prometheus:s3cret"), lambda m: (
                m.get("gpufootprint_exporter_auth_failures_total") == 3)))
        assert m["gpufootprint_exporter_renders_total"] >= 1
        assert m["gpufootprint_exporter_render_errors_total"] == 0
        assert m["gpufootprint_exporter_http_accept_errors_total"] == 0
        assert m["gpufootprint_exporter_tls_handshake_failures_total"] == 0
    finally:
        app.stop()
