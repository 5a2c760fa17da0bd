"""What one CUPTI buffer hand-over costs the thread CUPTI calls it on: the C callbacks against the ctypes ones.

A C thread (tests/native/cupti_threads.c, compiled here) makes N request/complete cycles, as CUPTI does
on the thread that records (request) and on its worker (complete), on a pool warmed first (no malloc, no
refusal in the timed pass), each completion waking an eventfd as the probe's sender's. Timed: the C
thread's wall time per cycle, with no Python running (``--busy 0``) or with a Python thread spinning,
holding the GIL as a training step's Python does (``--busy 1``): there the ctypes callbacks wait for the
GIL, up to the interpreter's switch interval (5 ms) a call.
A/A: each kind is run twice, alternating.

    python bench/callback_cost.py [--cycles 20000] [--reps 5] [--busy 0|1]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "daemon"), str(ROOT)]

from gpufootprint.probe.nativecallbacks import NativeDelivery
from gpufootprint.probe.rawcallbacks import RawDelivery
from gpufootprint.probe.wakeup import Wakeup

from tests.native import shim as native_shim


def build_shim() -> ctypes.CDLL:
    try:
        path = native_shim.build(Path(tempfile.mkdtemp()))
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    lib = ctypes.CDLL(str(path))
    lib.run_threads.restype = ctypes.c_int
    return lib


def one(shim: ctypes.CDLL, kind: str, cycles: int, busy: bool) -> dict[str, float]:
    """``cycles`` request/complete cycles on one C thread, timed on a warm pool (every buffer malloc'ed and
    given back before), so the figure is the callbacks' own cost and never a refusal or a malloc."""
    wakeup = Wakeup()  # as the probe's sender: the C callbacks write its eventfd, the thunks call set()
    if kind == "c":
        d: NativeDelivery | RawDelivery = NativeDelivery(256, cycles, wakeup.fd if wakeup.fd is not None else -1)
    else:
        queue: list[int] = []

        def on_completed(address: int, valid: int) -> None:  # what Intake.raw_completed does
            queue.append(address)
            wakeup.set()

        d = RawDelivery(256, cycles, on_completed)

    def give_all_back() -> None:
        addresses = [a for a, _ in d.take()] if isinstance(d, NativeDelivery) else [queue.pop() for _ in list(queue)]
        for address in addresses:
            d.give_back(address)

    if shim.run_threads(d._req, d._cmp, 1, cycles) != 0:  # warm: every buffer allocated
        raise SystemExit("warm-up refused requests")
    give_all_back()
    stop = threading.Event()

    def spin() -> None:  # Python holding the GIL, as a training step's Python does
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin) if busy else None
    if spinner is not None:
        spinner.start()
    t0 = time.perf_counter()
    refused = shim.run_threads(d._req, d._cmp, 1, cycles)
    wall = time.perf_counter() - t0
    stop.set()
    if spinner is not None:
        spinner.join()
    give_all_back()
    d.retire()  # no more writes to the eventfd: it may close
    wakeup.close()
    return {"us_per_cycle": wall / cycles * 1e6, "refused": refused}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    shim = build_shim()
    runs: dict[str, list[float]] = {"c": [], "c_aa": [], "python": [], "python_aa": []}
    refused: dict[str, int] = {k: 0 for k in runs}
    for _ in range(args.reps):
        for name, times in runs.items():
            r = one(shim, name.split("_")[0], args.cycles, bool(args.busy))
            times.append(r["us_per_cycle"])
            refused[name] += int(r["refused"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{'callbacks':10s} {'us/cycle median':>16s} {'min':>8s} {'max':>8s} {'refused':>8s}  "
          f"(cycles {args.cycles}, reps {args.reps}, busy {args.busy})")
    for k, v in runs.items():
        print(f"{k:10s} {med[k]:16.3f} {min(v):8.3f} {max(v):8.3f} {refused[k]:8d}")
    print(f"python / c: {med['python'] / med['c']:.1f}x; A/A c_aa / c {med['c_aa'] / med['c']:.3f}, "
          f"python_aa / python {med['python_aa'] / med['python']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "refused": refused}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
