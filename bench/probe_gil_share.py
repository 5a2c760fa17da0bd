"""What a busy Python thread loses while the probe's sender reads CUPTI buffers beside it (no GPU needed).

The probe's sender reads each forwarded CUPTI buffer in Python (``RawBufferReader.read``: a look at its kinds,
the walk, the structs kept for the probe's own table, the API records looked at for failed allocations, the
frame for the link), holding the GIL. A training step's Python (the main thread dispatching kernels) needs the
GIL too, so whatever the sender holds it for is, at worst, taken from the step, plus each hand-over of the GIL.
This times a main thread's "steps" (a fixed Python and small-numpy loop, about ``--step-ms`` each) while a
second thread, every ``1/--rate`` seconds:

  none     nothing (no second thread)
  aa       nothing either: the A/A pair, what this machine's noise reads
  wake     wakes and goes back to sleep (what a thread costs that holds the GIL for nothing: the floor's)
  reader   wakes and reads one buffer through the probe's ``RawBufferReader`` (caching off's layout: each
           allocation's MEMORY2 record followed by two API records, buffers of 16 to 512 records, as forced
           flushes hand them over), and applies its table every 100 buffers, as at a watermark
  reader_numpy  the same with the read after the C walk in numpy (``native_read`` off: the probe before
           2026-12-07 evening; on a tree without that setting, the same as ``reader``)

The configurations alternate step by step within each round, and the verdict is each one's median step against
``none`` over the rounds, with the reader thread's own CPU a buffer (``time.thread_time``) beside it: if the steps
lose more than that CPU, the rest is hand-overs of the GIL. The machine has its own CPU for each thread when it
has two or more.

Usage: python bench/probe_gil_share.py [--rounds R] [--steps S] [--step-ms MS] [--rate HZ]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import probe_sender
from _harness import machine
from gpufootprint.probe.rawreader import FORWARDABLE

CONFIGS = ("none", "aa", "wake", "reader", "reader_numpy")


def step(work: int) -> None:
    """A training step's Python stand-in: interpreter work and small numpy calls, as kernel dispatch is."""
    a = np.arange(64, dtype=np.float64)
    acc = 0.0
    for i in range(work):
        acc += float(a[i & 63]) * 0.5
        if i % 16 == 0:
            a = a + 1.0


class Beside:
    """The second thread: wakes ``rate`` times a second and does ``what``."""

    def __init__(self, what: str, rate: float, bufs: list) -> None:  # type: ignore[type-arg]
        self.what, self.period, self.bufs = what, 1.0 / rate, bufs
        self.stop = threading.Event()
        self.cpu = 0.0
        self.wakes = 0
        self.reader = probe_sender._reader(what != "reader_numpy")
        self.link = probe_sender._TakesAll()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        k = 0
        while not self.stop.wait(self.period):
            t0 = time.thread_time()
            if self.what in ("reader", "reader_numpy"):
                raw, valid = self.bufs[k % len(self.bufs)]
                self.reader.read(ctypes.addressof(raw), valid, forward_to=self.link,  # type: ignore[arg-type]
                                 forwardable=FORWARDABLE, tee=None, in_gap=False)
                k += 1
                if k % 100 == 0:
                    self.reader.table.advance(1 << 62)
            self.cpu += time.thread_time() - t0
            self.wakes += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40, help="steps of each configuration a round")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=200.0, help="the second thread's wakes a second")
    args = ap.parse_args()
    rng = random.Random(1)
    bufs = probe_sender.buffers(60_000, calls=True, partial=True)
    work = 1000
    t0 = time.perf_counter()
    step(work)
    work = max(100, int(work * args.step_ms / 1000 / max(1e-6, time.perf_counter() - t0)))
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        order = list(CONFIGS)
        rng.shuffle(order)
        for c in order:
            beside = Beside(c, args.rate, bufs) if c in ("wake", "reader", "reader_numpy") else None
            if beside is not None:
                beside.thread.start()
            step(work)  # settles
            per = []
            for _ in range(args.steps):
                s0 = time.perf_counter()
                step(work)
                per.append(time.perf_counter() - s0)
            if beside is not None:
                beside.stop.set()
                beside.thread.join()
                cpu[c].append(beside.cpu / max(1, beside.wakes))
            times[c].append(statistics.median(per))
        print(f"round {r}: " + ", ".join(f"{c} {times[c][-1] * 1e3:.3f} ms" for c in CONFIGS), file=sys.stderr)
    print(f"{machine()}; {args.rounds} rounds of {args.steps} steps of about {args.step_ms} ms; the second thread "
          f"{args.rate:g} wakes a second")
    print(f"{'config':8} {'median step':>12} {'vs none':>9} {'range of rounds':>20} {'thread CPU a wake':>18}")
    for c in CONFIGS:
        ratios = [t / n for t, n in zip(times[c], times["none"])]
        wake = f"{statistics.median(cpu[c]) * 1e6:.1f} us" if cpu[c] else "-"
        print(f"{c:8} {statistics.median(times[c]) * 1e3:10.3f} ms {statistics.median(ratios):9.4f} "
              f"{min(ratios):9.4f}-{max(ratios):.4f} {wake:>18}")
    print("a step loses to the reader at most its CPU a wake times the wakes in a step; more than that is the GIL's "
          "hand-overs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
