"""The sender's wake behind busy Python threads: its socket and wake-up calls through Python or the C library.

Behind busy Python threads every call that lets the GIL go costs the caller a wait to win it back (up to the
interpreter's switch interval, 5 ms) and the busy thread a forced switch. A wake of the probe's sender makes
three such calls through Python (the eventfd's clear, the socket's send, the read of control frames); through
the probe's C library (ctypes.PyDLL) they keep the GIL. This runs the probe's own ``SocketLink`` and
``Wakeup`` with ``--spinners`` Python threads spinning, a reader process taking what the link sends, and
``--rate`` wakes a second, each queueing one 57,344-byte CUPTI_BUFFER frame and pumping it, and prints the
wall time of a wake's work (median, p90, p99) and the spinners' loops a second, for each way in turn.

Usage: python bench/probe_wake_gil.py [--seconds S] [--rate R] [--spinners N] [--rounds K]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _linkbench import Spinners, library, linked, machine
from gpufootprint.probe.wakeup import Wakeup
from gpufootprint.wire import framing


def one_run(native: object, seconds: float, rate: float, spinners: int) -> tuple[list[float], float]:
    """(each wake's work in seconds, the spinners' loops a second)."""
    with linked(buffer_bytes=64 << 20, native=native) as link:
        wake = Wakeup(native)
        body = memoryview(os.urandom(57_344))
        spin = Spinners(spinners)
        works: list[float] = []
        start = time.monotonic()
        next_at = start
        while time.monotonic() - start < seconds:
            next_at += 1 / rate
            wake.set()  # as CUPTI's thread does when it completes a buffer
            wake.wait(max(0.0, next_at - time.monotonic()))
            t0 = time.perf_counter()
            wake.clear()
            link.put_parts(framing.cupti_buffer_parts(1, body, checked=False), records=448)
            link.pump()
            works.append(time.perf_counter() - t0)
            time.sleep(max(0.0, next_at - time.monotonic()))
        loops = spin.stop()
        took = time.monotonic() - start
        wake.close()
    return works, loops / took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rate", type=float, default=140.0, help="wakes a second (cudaMallocAsync churn: about 140)")
    ap.add_argument("--spinners", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lib = library()
    print(f"{machine()}; "
          f"{args.rate:g} wakes a second for {args.seconds:g} s, {args.spinners} spinning threads")
    for r in range(args.rounds):
        for name, native in (("python", None), ("c", lib)):
            works, loops = one_run(native, args.seconds, args.rate, args.spinners)
            works.sort()
            ms = [w * 1e3 for w in works]
            print(f"round {r} {name:6s} wakes {len(ms)}: work median {statistics.median(ms):.3f} ms, "
                  f"p90 {ms[int(0.9 * len(ms))]:.3f}, p99 {ms[int(0.99 * len(ms))]:.3f}; spinners {loops:,.0f} loops/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
