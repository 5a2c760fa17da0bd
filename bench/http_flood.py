"""/metrics latency while a local process floods the HTTP port (docs/reliability.md).

A real daemon process; this script plays both the attacker and Prometheus:

1. ``baseline``: sequential scrapes, nothing else going on;
2. ``slow``: the same with N sockets open that each sent part of a request header and never the
   rest (the "slow header" attack), and whether a probe can still connect;
3. ``concurrent``: M scrapes started at once, each on a new connection (from one thread with
   non-blocking sockets, so the client's own threads do not add their wait for the GIL).

    python bench/http_flood.py                       # this checkout
    python bench/http_flood.py --source /tmp/old/daemon --label before   # another tree's daemon/

Prints one JSON line per phase (p50/p99/max in ms, errors) and a table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import free_port, machine, percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ERRORS: list[str] = []  # what went wrong with failed scrapes, printed at the end


def scrape(port: int, timeout: float) -> float | None:
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        resp.read()
        conn.close()
        if resp.status != 200:
            ERRORS.append(f"status {resp.status}")
            return None
    except (OSError, http.client.HTTPException) as exc:
        ERRORS.append(f"{type(exc).__name__}: {exc}")
        return None
    return time.perf_counter() - t0


def concurrent_scrapes(port: int, n: int, timeout: float) -> list[float | None]:
    """``n`` scrapes started at once from one thread with non-blocking sockets, so the figures are the
    server's (500 client threads would measure their own wait for the GIL). Each time runs from its
    connect() to the last byte of its response."""
    sel = selectors.DefaultSelector()
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    state: dict[socket.socket, list[object]] = {}
    times: list[float | None] = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        t0 = time.perf_counter()
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        except OSError:
            times.append(None)
            s.close()
            continue
        state[s] = [t0, False, bytearray()]
        sel.register(s, selectors.EVENT_WRITE)
    end = time.monotonic() + timeout
    while state and time.monotonic() < end:
        for key, events in sel.select(0.1):
            s = key.fileobj  # type: ignore[assignment]
            t0, sent, buf = state[s]
            try:
                if not sent:
                    s.send(request)
                    state[s][1] = True
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                data = s.recv(1 << 20)
            except OSError:
                data = b""
                buf = bytearray()  # an error: no whole response
            if data:
                buf += data  # type: ignore[operator]
                continue
            ok = bytes(buf[:12]).startswith(b"HTTP/1.1 200")  # type: ignore[index]
            times.append(time.perf_counter() - t0 if ok else None)  # type: ignore[operator]
            sel.unregister(s)
            s.close()
            del state[s]
    for s in state:
        times.append(None)
        s.close()
    return times


def summary(label: str, phase: str, times: list[float | None], **extra: object) -> dict[str, object]:
    ok = [t for t in times if t is not None]
    return {"label": label, "phase": phase, "n": len(times), "errors": len(times) - len(ok),
            "p50_ms": round(percentile(ok, 50) * 1000, 1), "p99_ms": round(percentile(ok, 99) * 1000, 1),
            "max_ms": round(max(ok) * 1000, 1) if ok else None, **extra}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default=str(ROOT / "daemon"), help="directory holding the gpufootprint package")
    ap.add_argument("--label", default="after")
    ap.add_argument("--slow", type=int, default=3000, help="slow-header sockets")
    ap.add_argument("--concurrent", type=int, default=500, help="scrapes released at once")
    ap.add_argument("--scrapes", type=int, default=200, help="sequential scrapes per phase")
    ap.add_argument("--nofile", type=int, default=8192, help="RLIMIT_NOFILE of the daemon")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.slow + args.concurrent + 1024), hard))

    tmp = tempfile.mkdtemp(prefix="gfp-http-flood-")
    sock, port = os.path.join(tmp, "probe.sock"), free_port()
    env = dict(os.environ, PYTHONPATH=args.source)
    limit = args.nofile
    daemon = subprocess.Popen([sys.executable, "-m", "gpufootprint", "daemon", "--socket", sock, "--listen",
                               f"127.0.0.1:{port}", "--set", "nvml.enabled=false"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    results = []
    try:
        end = time.monotonic() + 30
        while scrape(port, 2) is None:
            if time.monotonic() > end:
                raise RuntimeError("daemon did not start")
            time.sleep(0.1)
        ERRORS.clear()  # refusals while it started
        results.append(summary(args.label, "baseline", [scrape(port, 10) for _ in range(args.scrapes)]))

        held = []
        for _ in range(args.slow):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                continue
            held.append(s)
        time.sleep(1.0)
        for s in held:
            try:
                s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                pass
        time.sleep(1.0)
        times = [scrape(port, 10) for _ in range(args.scrapes)]
        probe_ok = True
        try:
            c = socket.socket(socket.AF_UNIX)
            c.settimeout(5)
            c.connect(sock)
            c.close()
        except OSError:
            probe_ok = False
        results.append(summary(args.label, "slow", times, slow_sockets=len(held), probe_connects=probe_ok))
        for s in held:
            s.close()
        time.sleep(1.0)

        out = concurrent_scrapes(port, args.concurrent, timeout=10.0)
        results.append(summary(args.label, "concurrent", out))
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for r in results:
        print(json.dumps(r))
    for e in sorted(set(ERRORS)):
        print(f"# error x{ERRORS.count(e)}: {e}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}")
    print(f"{'label':8} {'phase':11} {'n':>5} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for r in results:
        print(f"{r['label']:8} {r['phase']:11} {r['n']:>5} {r['errors']:>6} {r['p50_ms']:>8} {r['p99_ms']:>8} "
              f"{r['max_ms']!s:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
