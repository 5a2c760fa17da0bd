"""The sender's wait for its socket's room behind busy Python threads, in Python or in one C call (no GPU needed).

When CUPTI hands over a burst of several MB (cudaMallocAsync churn: 14 MB a second on the H100's four PyTorch
threads) the probe's sender queues it in its send buffer and, at the end of the wake, waits up to
``PUMP_WAIT_S`` for the socket to take it (``SocketLink.pump``). The kernel holds about 200 KiB of a Unix socket's
data, so a burst needs many waits for room. In Python each wait lets the GIL go and wins it back, behind busy
Python threads up to a switch interval, longer where the CPU is shared; through the probe's C library
(``gfp_pump``, ctypes.CDLL) the whole wait is one call without the GIL. This runs the probe's own ``SocketLink``
with the library's send (both ways) and, every ``1/--rate`` s, queues a burst of ``--burst-mb`` in 64 KiB
CUPTI_BUFFER frames and pumps it as the sender does, ``--spinners`` Python threads spinning and ``--hogs``
CPU-bound processes beside, a reader process taking what the link sends. The ways alternate round by round.

Prints per way: MB the link moved a second, the largest backlog, frames dropped for a full send buffer
(``--buffer-mb``, the probe's 16 MiB by default), the pumps' wall time (median, p90) and the spinners' loops.

Usage: python bench/probe_pump_gil.py [--seconds S] [--rate R] [--burst-mb MB] [--spinners N] [--hogs H] [--rounds K]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from _linkbench import Spinners, library, linked, machine
from gpufootprint.probe.sender import PUMP_WAIT_S
from gpufootprint.wire import framing

_FRAME = 65_536


def one_run(lib: object, c_pump: bool, args: argparse.Namespace) -> dict[str, float]:
    # native_pump off: the library's send, Python's wait for room (the probe before gfp_pump)
    with linked(buffer_bytes=int(args.buffer_mb * (1 << 20)), native=lib, native_pump=c_pump) as link:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
        body = memoryview(os.urandom(_FRAME))
        per_burst = max(1, round(args.burst_mb * (1 << 20) / _FRAME))
        spin = Spinners(args.spinners)
        pumps: list[float] = []
        most = 0
        start = time.monotonic()
        next_at = start
        while time.monotonic() - start < args.seconds:
            next_at += 1 / args.rate
            for _ in range(per_burst):
                link.put_parts(framing.cupti_buffer_parts(1, body, checked=False), records=512)
            most = max(most, link.buffered)
            t0 = time.perf_counter()
            link.pump(PUMP_WAIT_S)
            pumps.append(time.perf_counter() - t0)
            link_wait = next_at - time.monotonic()
            if link_wait > 0:
                time.sleep(link_wait)
        took = time.monotonic() - start
        loops = spin.stop()
        for h in hogs:
            h.kill()
            h.wait()
        sent, dropped = link.bytes_sent, link.frames_dropped
    pumps.sort()
    return {"mb_s": sent / took / 1e6, "backlog_mb": most / 1e6, "dropped": dropped,
            "pump_ms_median": statistics.median(pumps) * 1e3, "pump_ms_p90": pumps[int(0.9 * len(pumps))] * 1e3,
            "loops_s": loops / took}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rate", type=float, default=10.0, help="bursts a second (CUPTI's flush period: 10)")
    ap.add_argument("--burst-mb", type=float, default=1.0, help="MB a burst (10 MB a second at the default rate)")
    ap.add_argument("--buffer-mb", type=float, default=16.0, help="the send buffer's bound (probe.buffer_bytes)")
    ap.add_argument("--spinners", type=int, default=2)
    ap.add_argument("--hogs", type=int, default=0, help="CPU-bound processes beside (a machine whose CPU is shared)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lib = library()
    print(f"{machine()}; "
          f"{args.burst_mb:g} MB bursts {args.rate:g} a second for {args.seconds:g} s, {args.spinners} spinning "
          f"threads, {args.hogs} busy processes, a {args.buffer_mb:g} MB send buffer; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rows: dict[str, list[dict[str, float]]] = {"python_wait": [], "c_pump": []}
    for r in range(args.rounds):
        for name in (("python_wait", "c_pump") if r % 2 == 0 else ("c_pump", "python_wait")):
            got = one_run(lib, name == "c_pump", args)
            rows[name].append(got)
            print(f"round {r} {name:11s} {got['mb_s']:6.2f} MB/s moved, backlog at most {got['backlog_mb']:5.1f} MB, "
                  f"{got['dropped']:4.0f} frames dropped, pump {got['pump_ms_median']:.2f} ms median "
                  f"(p90 {got['pump_ms_p90']:.2f}), spinners {got['loops_s']:,.0f} loops/s", flush=True)
    for name, runs in rows.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        print(f"{name:11s} median of {len(runs)}: {med['mb_s']:.2f} MB/s, backlog {med['backlog_mb']:.1f} MB, "
              f"dropped {med['dropped']:.0f}, pump {med['pump_ms_median']:.2f} ms, spinners {med['loops_s']:,.0f} loops/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
