"""What a busy Python thread's steps lose while the probe's sender applies a watermark to its own table beside it
(no GPU needed): the GIL held through the table's pairing (numpy's sort) or let go (the C pass).

Under cudaMallocAsync a process writes about 57,000 memory records a second; the probe's sender queues their
structs and, at each watermark, pairs and applies those due (``LiveTable.advance``). A training step's Python
needs the GIL too. This times a main thread's "steps" (a fixed pure-Python loop of about ``--step-ms``) while a
second thread queues ``--records`` structs of allocation churn a ``--period-ms`` (forwarded buffers of 512, one at a
time through the period) and at the end of each period advances the table over them, with the pairing in C (``--pair c``: ``gfp_pair``, the GIL let go past
4,096 structs) or numpy's (``--pair numpy``), alternating round by round with a round of no second thread (none).
The verdict: each pairing's median and p99 step against none's, and the slowest step; a step the advance lands in
waits for as long as the advance holds the GIL, so the p99 and the slowest step move with the GIL held, the
median with the CPU taken. The machine needs two CPUs (one a thread).

Usage: python bench/probe_table_gil.py [--rounds R] [--seconds S] [--step-ms MS] [--records N] [--period-ms P]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

import numpy as np  # noqa: E402

from gpufootprint.probe.livetable import LiveTable  # noqa: E402
from gpufootprint.probe.nativecallbacks import Pairer  # noqa: E402
from gpufootprint.wire import cupti_layout  # noqa: E402

PER_BUFFER = 512


def step(n: int) -> None:
    x = 0
    for i in range(n):
        x += i * i % 7


def calibrate(step_ms: float) -> int:
    n = 1000
    while True:
        t = time.perf_counter()
        step(n)
        dt = time.perf_counter() - t
        if dt > 0.02:
            return max(1, int(n * step_ms / 1000 / dt))
        n *= 2


def sender(pair: str, records: int, period_s: float, stop: threading.Event, cpu: list[float]) -> None:
    table = LiveTable(pairer=Pairer() if pair == "c" else None)
    buf = np.zeros(PER_BUFFER, cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
    buf["op"] = np.tile([1, 2], PER_BUFFER // 2)
    buf["mk"], buf["bytes"] = 3, 4096
    buf["address"] = 0x2_0000_0000 + np.repeat(np.arange(PER_BUFFER // 2), 2) * 4096
    ts = 1_700_000_000_000_000_000
    buffers = max(1, records // PER_BUFFER)
    while not stop.is_set():
        for _ in range(buffers):  # one buffer at a time through the period, as CUPTI completes them
            if stop.wait(period_s / buffers):
                return
            buf["timestamp"] = ts + np.arange(PER_BUFFER)
            table.add_raw(buf, 1)
            ts += PER_BUFFER
        t = time.thread_time()
        table.advance(ts - PER_BUFFER * 10)  # the last ten buffers wait, as a watermark leaves the latest flush
        cpu.append(time.thread_time() - t)


def one_round(config: str, n: int, seconds: float, records: int, period_s: float) -> tuple[list[float], list[float]]:
    stop, cpu = threading.Event(), []  # type: ignore[var-annotated]
    th = None
    if config != "none":
        th = threading.Thread(target=sender, args=(config, records, period_s, stop, cpu), daemon=True)
        th.start()
    steps: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        step(n)
        steps.append(time.perf_counter() - t)
    stop.set()
    if th is not None:
        th.join()
    return steps, cpu


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=4.0, help="a configuration's time a round")
    ap.add_argument("--step-ms", type=float, default=1.0)
    ap.add_argument("--records", type=int, default=56_320, help="structs queued and advanced a period")
    ap.add_argument("--period-ms", type=float, default=250.0, help="the second thread's watermark period")
    args = ap.parse_args()
    n = calibrate(args.step_ms)
    print(f"{platform.node()} cpus={os.cpu_count()} affinity={len(os.sched_getaffinity(0))} python "
          f"{platform.python_version()} numpy {np.__version__}; steps of {args.step_ms} ms ({n} iterations), "
          f"{args.records} structs a watermark every {args.period_ms} ms, {args.rounds} rounds of {args.seconds} s each")
    configs = ("none", "numpy", "c")
    steps: dict[str, list[float]] = {c: [] for c in configs}
    cpu: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            s, u = one_round(c, n, args.seconds, args.records, args.period_ms / 1000)
            steps[c] += s
            cpu[c] += u
    base_med, base_p99 = statistics.median(steps["none"]), pct(steps["none"], 99)
    print(f"{'pairing':8s} {'steps':>7s} {'median ms':>10s} {'x none':>7s} {'p99 ms':>8s} {'x none':>7s} "
          f"{'p99.9 ms':>9s} {'max ms':>8s} {'advance CPU ms (median)':>24s}")
    for c in configs:
        st = steps[c]
        adv = f"{statistics.median(cpu[c]) * 1e3:.2f}" if cpu[c] else "-"
        print(f"{c:8s} {len(st):7d} {statistics.median(st) * 1e3:10.3f} {statistics.median(st) / base_med:7.3f} "
              f"{pct(st, 99) * 1e3:8.3f} {pct(st, 99) / base_p99:7.3f} {pct(st, 99.9) * 1e3:9.3f} "
              f"{max(st) * 1e3:8.3f} {adv:>24s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
