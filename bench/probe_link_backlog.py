"""The probe's send buffer while the daemon reads slower than CUPTI fills buffers (no GPU needed).

Behind a daemon that reads less than the probe queues (a busy node, a burst of churn) frames wait in the
link's send buffer (probe/link.py ``SocketLink``), up to ``buffer_bytes``. This times, in the sender's
thread (``time.thread_time``, so waiting for the GIL is not counted), what queueing and pumping cost per
64 KiB frame while such a backlog lasts: bursts of ``--burst`` frames, each burst followed by one pump
(which waits up to the sender's ``PUMP_WAIT_S`` for the socket, as the sender's does), a
reader thread taking at most ``--read-mb`` MB a second from a real Unix socket.

The tree measured is the one this file sits in: for a side-by-side run copy it into the other tree
(``git archive BASE | tar -x -C /tmp/base && cp bench/probe_link_backlog.py /tmp/base/bench/``).

Usage: python bench/probe_link_backlog.py [--frames N] [--burst B] [--wake-ms W] [--read-mb R] [--rounds K]
Prints microseconds of the sender's CPU per frame (median over rounds, and the range) and the largest
backlog seen.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import subprocess
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from gpufootprint.probe.link import SocketLink  # noqa: E402
from gpufootprint.wire import framing  # noqa: E402

try:  # the sender's bounded wait for the socket at the end of each wake (since 2026-12-06)
    from gpufootprint.probe.sender import PUMP_WAIT_S  # noqa: E402
except ImportError:
    PUMP_WAIT_S = 0.0

FRAME = 57_344  # 448 MEMORY2 records: a CUPTI buffer of the H100's cudaMallocAsync runs


_READER = """
import socket, sys, time
peer = socket.socket(fileno=int(sys.argv[1]))
rate = float(sys.argv[2]) * 1e6
start, taken = time.monotonic(), 0
while True:
    ahead = taken / rate - (time.monotonic() - start)
    if ahead > 0:
        time.sleep(min(ahead, 0.01))
        continue
    data = peer.recv(1 << 18)
    if not data:
        break
    taken += len(data)
"""


def _reader(peer: socket.socket, mb_per_s: float) -> subprocess.Popen[bytes]:
    """A process of its own, as the daemon is, taking at most ``mb_per_s`` a second in reads of up to
    256 KiB until the link closes."""
    return subprocess.Popen([sys.executable, "-c", _READER, str(peer.fileno()), str(mb_per_s)],
                            pass_fds=(peer.fileno(),))


def one_round(frames: int, burst: int, read_mb: float, buffer_bytes: int, wake_s: float) -> tuple[float, int, int]:
    """(sender CPU us per frame, largest backlog in bytes, frames dropped) for one run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "d.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        link = SocketLink(path, buffer_bytes=buffer_bytes, backoff_max_s=1.0, on_control=lambda f: None)
        assert link.try_connect()
        peer, _ = server.accept()
        reader = _reader(peer, read_mb)
        peer.close()  # the reader's now
        body = memoryview(os.urandom(FRAME))
        most = 0
        cpu = 0.0
        for i in range(frames):
            t = time.thread_time()
            link.put_parts(framing.cupti_buffer_parts(1, body, checked=False), records=448)
            if i % burst == burst - 1:
                link.pump(PUMP_WAIT_S)  # as the sender does at the end of a wake
            cpu += time.thread_time() - t
            most = max(most, link.buffered)
            if i % burst == burst - 1:
                time.sleep(wake_s)  # the sender's next wake
        dropped = link.frames_dropped
        link.close("bench")
        reader.wait(timeout=10)
        server.close()
        return cpu / frames * 1e6, most, dropped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=3000)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--read-mb", type=float, default=200.0, help="what the reader takes, MB a second")
    ap.add_argument("--buffer-mib", type=int, default=16, help="the link's bound (probe.buffer_bytes)")
    ap.add_argument("--wake-ms", type=float, default=1.0, help="the sender's sleep after each burst's pump")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import gpufootprint

    print(f"{platform.node()} {platform.machine()} cpus={os.cpu_count()} python {platform.python_version()}; "
          f"gpufootprint from {Path(gpufootprint.__file__).parent}; {args.frames} frames of {FRAME} B, bursts of "
          f"{args.burst} every {args.wake_ms:g} ms, reader {args.read_mb:g} MB/s, bound {args.buffer_mib} MiB")
    runs = [one_round(args.frames, args.burst, args.read_mb, args.buffer_mib << 20, args.wake_ms / 1000) for _ in range(args.rounds)]
    us = [r[0] for r in runs]
    print(f"sender CPU per frame: median {statistics.median(us):.1f} us (range {min(us):.1f}-{max(us):.1f}); "
          f"largest backlog {max(r[1] for r in runs) / 1e6:.1f} MB; frames dropped {sum(r[2] for r in runs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
