"""What a local process can make the daemon hold, attack by attack (docs/reliability.md, Bounds).

Starts a real daemon with the default configuration, then, from this process (a peer like any
other on the node), one attack after another on fresh connections:

* ``devices``: one MEMORY batch of 20,000 records, each on another device number;
* ``marks``: 100,000 MARK frames, each naming another pid;
* ``allocations``: 2,000,000 live allocations of 4 KiB (batches of 10,000);
* ``meta``: 40 META frames of 8 MB, each naming another pid;
* ``overflow``: 512 allocations of 2**63 + 5 bytes.

After each: the daemon's RSS and peak RSS (VmHWM), a timed /metrics scrape, /readyz, and
``gpufootprint_daemon_snapshot_age_seconds``.

    python bench/hostile_memory.py                                   # this checkout
    python bench/hostile_memory.py --source /tmp/old/daemon --label before
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import free_port, machine, usage  # noqa: E402

from gpufootprint.records import MEMORY_DTYPE, RecordKind  # noqa: E402
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ME = os.getpid()


def allocations(n: int, start: int, size: int = 4096) -> np.ndarray:
    recs = np.zeros(n, MEMORY_DTYPE)
    recs["ts"] = time.time_ns() + np.arange(n)
    recs["addr"] = 0x10_0000_0000 + (start + np.arange(n, dtype=np.uint64)) * 4096
    recs["bytes"] = np.uint64(size)
    recs["pid"], recs["op"], recs["mk"] = ME, 1, 3
    return recs


def attack(name: str, sock: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": ME, "start_time": time.time_ns()}))
    if name == "devices":
        recs = allocations(20_000, 0)
        recs["dev"] = np.arange(20_000)
        s.sendall(encode_batch(RecordKind.MEMORY, recs))
    elif name == "marks":
        now = time.time_ns()
        frames = b"".join(encode_json(FrameType.MARK, {"label": "m", "ts": now, "pid": 10_000_000 + i, "dev": 0})
                          for i in range(100_000))
        s.sendall(frames)
    elif name == "allocations":
        for i in range(200):
            s.sendall(encode_batch(RecordKind.MEMORY, allocations(10_000, i * 10_000)))
    elif name == "meta":
        blob = "x" * (8 * 1024 * 1024)
        for i in range(40):
            s.sendall(encode_json(FrameType.META, {"pid": 20_000_000 + i, "blob": blob}))
    elif name == "overflow":
        s.sendall(encode_batch(RecordKind.MEMORY, allocations(512, 50_000_000, size=(1 << 63) + 5)))
    time.sleep(1.0)
    s.close()


def get(port: int, path: str) -> tuple[int, float, bytes]:
    t0 = time.perf_counter()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
        c.close()
        return r.status, time.perf_counter() - t0, body
    except (OSError, http.client.HTTPException):
        return 0, time.perf_counter() - t0, b""


def sample(text: bytes, name: str) -> float | None:
    for line in text.decode(errors="replace").splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default=str(ROOT / "daemon"))
    ap.add_argument("--label", default="after")
    ap.add_argument("--attacks", default="devices,marks,allocations,meta,overflow")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after each attack before measuring")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gfp-hostile-")
    sock, port = os.path.join(tmp, "probe.sock"), free_port()
    daemon = subprocess.Popen([sys.executable, "-m", "gpufootprint", "daemon", "--socket", sock, "--listen",
                               f"127.0.0.1:{port}", "--set", "nvml.enabled=false"],
                              env=dict(os.environ, PYTHONPATH=args.source), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    rows = []
    try:
        end = time.monotonic() + 30
        while get(port, "/healthz")[0] != 200:
            assert time.monotonic() < end, "daemon did not start"
            time.sleep(0.1)
        u = usage(daemon.pid)
        rows.append({"label": args.label, "attack": "start", "rss_mib": round(u.rss_bytes / 2**20),
                     "hwm_mib": round(u.hwm_bytes / 2**20)})
        for name in args.attacks.split(","):
            t0 = time.monotonic()
            attack(name, sock)
            time.sleep(args.settle)
            if daemon.poll() is not None:
                rows.append({"label": args.label, "attack": name, "daemon": f"exited rc={daemon.returncode}"})
                break
            u = usage(daemon.pid)
            status, took, body = get(port, "/metrics")
            ready = get(port, "/readyz")[0]
            rows.append({"label": args.label, "attack": name, "seconds": round(time.monotonic() - t0, 1),
                         "rss_mib": round(u.rss_bytes / 2**20), "hwm_mib": round(u.hwm_bytes / 2**20),
                         "scrape_status": status, "scrape_ms": round(took * 1000, 1), "readyz": ready,
                         "snapshot_age_s": sample(body, "gpufootprint_daemon_snapshot_age_seconds"),
                         "tick_errors": sample(body, "gpufootprint_daemon_tick_errors_total")})
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
    for r in rows:
        print(json.dumps(r))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
