"""The HTTP server under a local attack: slow-header sockets by the thousand, a request dribbled a byte
at a time, many scrapes at once. A real daemon process on 127.0.0.1; timings are left to
bench/http_flood.py (figures in docs/reliability.md), here only what must hold: every scrape answered."""

from __future__ import annotations

import http.client
import re
import resource
import socket
import threading
import time
from pathlib import Path

from tests.integration.test_faults import _SETTINGS


def _scrape(port: int, method: str = "GET", path: str = "/metrics") -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def _slow_sockets(port: int, n: int) -> list[socket.socket]:
    held = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        held.append(s)
    time.sleep(0.5)
    for s in held:
        try:
            s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        except OSError:
            pass
    return held


def test_scrapes_are_answered_with_three_thousand_slow_header_sockets_open(daemons) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    d = daemons(*_SETTINGS).ready()
    held = _slow_sockets(d.port, 3000)
    try:
        for _ in range(20):
            status, body, _ = _scrape(d.port)
            assert status == 200 and b"gpufootprint_daemon_snapshot_age_seconds" in body
        # AND probes still get in: the HTTP flood took no probe descriptors
        c = socket.socket(socket.AF_UNIX)
        c.connect(str(d.sock))
        c.close()
        assert d.proc.poll() is None
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_five_hundred_concurrent_scrapes_are_all_answered(daemons) -> None:
    d = daemons(*_SETTINGS).ready()
    results: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        status, _, _ = _scrape(d.port)
        with lock:
            results.append(status)

    threads = [threading.Thread(target=one) for _ in range(500)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results.count(200) == 500


def test_a_request_dribbled_a_byte_at_a_time_is_cut_off_at_the_whole_request_deadline(tmp_path: Path) -> None:
    from gpufootprint.app import App
    from gpufootprint.configload import load_config

    app = App(load_config(env={}), socket_path=None, listen="127.0.0.1:0")
    app.start()
    assert app.http is not None
    app.http.httpd.request_deadline_s = 1.0
    try:
        s = socket.create_connection(("127.0.0.1", app.http.port))
        s.settimeout(20)
        t0 = time.monotonic()
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
        closed = False
        for byte in request:  # one byte every 50 ms: each read is quick, the request never ends
            try:
                s.send(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - t0 > 15:
                break
        reply = b""
        try:
            reply = s.recv(4096)
        except OSError:
            closed = True
        assert closed or reply.startswith(b"HTTP/1.1 408") or reply == b""
        assert time.monotonic() - t0 < 15
        s.close()
        assert app.http.httpd.timed_out >= 1
        assert _scrape(app.http.port)[0] == 200
        # and /metrics says so (its body is rendered ahead: within a render interval)
        def timed_out() -> float:
            found = re.search(rb'gpufootprint_exporter_http_connections_closed_total\{reason="timed_out"\} (\S+)',
                              _scrape(app.http.port)[1])
            return float(found.group(1)) if found else 0.0

        deadline = time.monotonic() + 10
        while timed_out() < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert timed_out() >= 1
    finally:
        app.stop()


def test_head_answers_like_get_without_a_body_and_keep_alive_serves_several_requests(daemons) -> None:
    d = daemons(*_SETTINGS).ready()
    status, body, headers = _scrape(d.port, "HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=20)
    try:
        for path in ["/healthz", "/metrics", "/readyz", "/nope"]:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == (404 if path == "/nope" else 200)
    finally:
        conn.close()
