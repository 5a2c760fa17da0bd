"""Does switching CUPTI's per-API launch records on and off leave a loop of launches slower for good?

In the overhead bench (docs/performance.md, runs 28 to 31) some probed workers' loop of tiny launches
stepped up by 4-13 % at one round and stayed there, while workers without launch windows never did.
This diagnostic repeats a launch window's switching many times in one process, with nothing else of
the probe, and records every step: a lasting slowdown shows as a step change in the step time.

Each process arms CUPTI exactly as the probe does (bench/overhead.py's ``CuptiFloor``: buffers handed
back unread, launch-call priming while CUDA starts) and runs a loop of 100 tiny ``add_`` launches and a
synchronize in turns of ``--turn-ms``, one process at a time (all on the same two CPUs, in a fresh
random order each cycle, as the bench's workers take turns: processes running side by side moved each
other's steps by 30 %). Each step's launching is timed, not its wait. In each turn a window (the launch
and wait calls' per-API switches, as ``CuptiBackend.launch_api_records``) of ``--window-ms`` opens
10 ms in. Modes, by who switches and when:

  none       no window (the control)
  side       a thread of its own, through ctypes with the GIL released (the probe's way)
  side_gil   a thread of its own, through cupti-python with the GIL held (the probe's way until 2026-12-03)
  side_ctx   as side, the thread having made the loop's CUDA context current on itself first
  side_warm  as side, the thread having launched a kernel of its own first (CUDA and CUPTI know it)
  pending    a thread of its own decides when; the switching itself runs on the loop's thread, at its
             next bytecode boundary (Py_AddPendingCall: no signal handler, nothing the program sees)
  thread_side     the loop on a thread of its own (not the main thread), switched as side
  thread_pending  the loop on a thread of its own, switched on the main thread as pending (which
                  only waits, a millisecond at a time): does the switching thread need to be the
                  launching one, or only not a side thread?
  main_idle  the loop's own thread, between two steps (after the synchronize: no launch in flight)
  main_busy  the loop's own thread, in the middle of a step's launches

    python bench/launch_toggle.py --out OUT.json --modes none,side,side_warm,pending,main_idle --replicas 2

Each mode runs in ``--replicas`` processes. The summary gives, per process, the median step of the
first and last tenth of the run (steps outside windows), the largest jump (the median of the steps in
the 5 s after a window's end over the 5 s before it) and the median of each 2 s.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODES = ("none", "side", "side_gil", "side_ctx", "side_warm", "pending", "main_idle", "main_busy",
         "thread_side", "thread_pending")


def child(mode: str, turn_ms: float, window_ms: float, cpus: str) -> None:
    """One process: set up, then a turn of steps at each ``go`` on stdin (``done`` on stdout), its
    window opened and closed inside the turn; at ``stop`` every step and window as JSON."""
    from gpufootprint.probe.launches import DRIVER_CBIDS, RUNTIME_CBIDS
    from overhead import CuptiFloor, pin_all_threads  # the probe's own arming, buffers handed back unread

    floor = CuptiFloor()
    import torch

    tiny = torch.zeros(256, device="cuda")
    for _ in range(200):
        tiny.add_(1.0)
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10
    while floor.priming and time.monotonic() < deadline:  # as the probe: priming ends at the first buffer
        for _ in range(100):
            tiny.add_(1.0)
        torch.cuda.synchronize()
        time.sleep(0.01)
    backend = floor.backend

    def switch(on: bool) -> None:
        if mode == "side_gil":
            backend._per_api("launch windows", DRIVER_CBIDS, RUNTIME_CBIDS, on)
        else:
            backend.launch_api_records(on)

    windows: list[tuple[float, float]] = []
    go, side_done = threading.Event(), threading.Event()
    offset = 0.010  # a window opens this long into a turn, while the steps run

    ctx = ctypes.c_void_p()
    libcuda = ctypes.CDLL("libcuda.so.1")
    if libcuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        raise SystemExit("launch_toggle: no current CUDA context on the loop's thread")

    pending_done = threading.Event()
    pending_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)

    def on_main(arg: int | None) -> int:  # the loop's thread, between two bytecodes, GIL held
        switch(arg == 1)
        pending_done.set()
        return 0

    pending_cb = pending_fn(on_main)  # kept alive as long as the process
    add_pending = ctypes.pythonapi.Py_AddPendingCall
    add_pending.argtypes = [pending_fn, ctypes.c_void_p]
    add_pending.restype = ctypes.c_int

    def switch_from_side(on: bool) -> None:
        if mode not in ("pending", "thread_pending"):
            switch(on)
            return
        pending_done.clear()
        if add_pending(pending_cb, 1 if on else 2) != 0:
            print("launch_toggle: Py_AddPendingCall refused", file=sys.stderr, flush=True)
            os._exit(3)
        pending_done.wait()

    def side() -> None:
        if mode == "side_ctx" and libcuda.cuCtxSetCurrent(ctx) != 0:
            print("launch_toggle: cuCtxSetCurrent failed on the side thread", file=sys.stderr, flush=True)
            os._exit(3)
        if mode == "side_warm":
            torch.zeros(1, device="cuda").add_(1.0)
            torch.cuda.synchronize()
        while True:
            go.wait()
            go.clear()
            time.sleep(offset)
            t0 = time.perf_counter()
            switch_from_side(True)
            time.sleep(window_ms / 1000)
            switch_from_side(False)
            windows.append((t0, time.perf_counter()))
            side_done.set()

    sided = mode.startswith(("side", "thread_")) or mode == "pending"

    def serve_turns(tiny: Any, steps: list[tuple[float, float]], t_start: float) -> None:
        """A turn of steps at each ``go`` on stdin, ``done`` after it, until ``stop``."""
        t_turn, closed = 0.0, False  # this turn's start, and whether its window has come and gone
        open_at: float | None = None  # when this turn's window opened (None: not open)

        def switch_here(now: float) -> None:
            """The loop's own thread opens the turn's window ``offset`` in, and closes it ``window_ms`` later."""
            nonlocal open_at, closed
            if open_at is None and not closed and now - t_turn >= offset:
                switch(True)
                open_at = now
            elif open_at is not None and now - open_at >= window_ms / 1000:
                switch(False)
                windows.append((open_at, time.perf_counter()))
                open_at, closed = None, True

        for line in sys.stdin:
            if line.strip() != "go":
                break
            side_done.clear()
            t_turn = time.perf_counter()
            open_at, closed = None, mode == "none"
            if sided:
                go.set()
            while True:
                now = time.perf_counter()
                if now - t_turn >= turn_ms / 1000 and (closed or side_done.is_set()):
                    break
                if mode == "main_idle":  # between two steps: nothing in flight on this thread
                    switch_here(now)
                t0 = time.perf_counter()
                for i in range(100):
                    tiny.add_(1.0)
                    if mode == "main_busy" and i == 50:  # among the step's launches, half of them queued
                        switch_here(time.perf_counter())
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                steps.append((t0 - t_start, t1 - t0))  # the host's launching only, not the wait
            print("done", flush=True)

    if sided:
        threading.Thread(target=side, daemon=True).start()
    steps: list[tuple[float, float]] = []
    t_start = time.perf_counter()
    if mode.startswith("thread_"):
        loop = threading.Thread(target=serve_turns, args=(tiny, steps, t_start), daemon=True)
        loop.start()
        pin_all_threads({int(c) for c in cpus.split(",")})
        print("ready", flush=True)
        while loop.is_alive():  # the main thread only waits: pending calls run between its sleeps
            time.sleep(0.001)
    else:
        pin_all_threads({int(c) for c in cpus.split(",")})  # once warm, CUPTI's threads too, as the bench
        print("ready", flush=True)
        serve_turns(tiny, steps, t_start)
    floor.stop()
    print(json.dumps({"mode": mode, "pid": os.getpid(), "steps": steps,
                      "windows": [(a - t_start, b - t_start) for a, b in windows],
                      "errors": backend.errors[:5], "priming_ended": not floor.priming}), flush=True)


def outside(steps: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Steps that began and ended outside every window (a window's own records cost what they cost)."""
    out, wi = [], 0
    ws = sorted(windows)
    for t, d in steps:
        while wi < len(ws) and ws[wi][1] < t:
            wi += 1
        if wi < len(ws) and ws[wi][0] <= t + d:
            continue
        out.append((t, d))
    return out


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    steps = outside(res["steps"], res["windows"])
    d = [s for _, s in steps]
    n = len(d)
    tenth = max(1, n // 10)
    first, last = statistics.median(d[:tenth]), statistics.median(d[-tenth:])
    # The largest jump: at each window's end (or every second without windows), the median of the steps
    # in the next 5 s over the median of those in the 5 s before; and the median of each 2 s, to see it.
    import bisect

    times = [t for t, _ in steps]
    cuts = [b for _, b in res["windows"]] or list(range(1, int(times[-1])))
    best: tuple[float, float | None] = (1.0, None)
    for c in cuts:
        i0, i, i1 = (bisect.bisect_left(times, x) for x in (c - 5, c, c + 5))
        if i - i0 < 100 or i1 - i < 100:
            continue
        r = statistics.median(d[i:i1]) / statistics.median(d[i0:i])
        if abs(r - 1) > abs(best[0] - 1):
            best = (r, c)
    bins = [round(statistics.median(d[bisect.bisect_left(times, b):bisect.bisect_left(times, b + 2)]) * 1e3, 4)
            for b in range(0, int(times[-1]) - 1, 2) if bisect.bisect_left(times, b + 2) > bisect.bisect_left(times, b)]
    return {"mode": res["mode"], "steps": len(res["steps"]), "steps_outside": n, "windows": len(res["windows"]),
            "first_tenth_ms": round(first * 1e3, 4), "last_tenth_ms": round(last * 1e3, 4),
            "last_over_first": round(last / first, 4), "largest_jump": round(best[0], 4),
            "jump_at_s": None if best[1] is None else round(best[1], 2), "errors": res["errors"],
            "median_ms_each_2s": bins}


def turn_medians(res: dict[str, Any]) -> list[float]:
    """The median step of each turn (steps more than 50 ms apart start a new turn), windows' steps left out."""
    out: list[float] = []
    cur: list[float] = []
    last = None
    for t, d in outside(res["steps"], res["windows"]):
        if last is not None and t - last > 0.05 and cur:
            out.append(statistics.median(cur))
            cur = []
        cur.append(d)
        last = t + d
    if cur:
        out.append(statistics.median(cur))
    return out


def against_none(results: list[dict[str, Any]], parts: int = 3) -> list[dict[str, Any]]:
    """Each process's turns against the mean of the ``none`` processes' same turns (the machine's drift
    hits both, as the bench's rounds): the median ratio over each third of the run."""
    turns = [turn_medians(r) if "steps" in r else [] for r in results]
    nones = [t for r, t in zip(results, turns, strict=True) if r.get("mode") == "none" and t]
    if not nones:
        return []
    n = min(len(t) for t in turns if t)
    if n < parts:  # not taken in turns (the first, side-by-side run): one long turn each
        return []
    ref = [statistics.mean(t[k] for t in nones) for k in range(n)]
    rows = []
    for r, t in zip(results, turns, strict=True):
        if not t:
            continue
        ratios = [t[k] / ref[k] for k in range(n)]
        size = max(1, n // parts)
        rows.append({"mode": r["mode"], "turns": n, "windows": len(r["windows"]),
                     "vs_none_by_part": [round(statistics.median(ratios[i * size:(i + 1) * size]), 4) for i in range(parts)]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--turn-ms", type=float, default=100.0, help="a process's turn of steps, one window in each")
    ap.add_argument("--window-ms", type=float, default=20.0)
    ap.add_argument("--out", help="the run's JSON (required for a run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cpus", help=argparse.SUPPRESS)
    ap.add_argument("--analyse", metavar="JSON", help="print the turn-by-turn table of an earlier run's JSON (.gz too)")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.turn_ms, args.window_ms, args.cpus)
        return
    if args.analyse:
        import gzip

        opener: Any = gzip.open if args.analyse.endswith(".gz") else open
        with opener(args.analyse, "rt") as f:
            print_against_none(json.load(f)["raw"])
        return
    if not args.out:
        ap.error("--out is required for a run (only --analyse goes without)")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"launch_toggle: unknown mode {m!r} (known: {', '.join(MODES)})")
    cpus = sorted(os.sched_getaffinity(0))
    mine = ",".join(map(str, cpus[-2:]))  # every process on the same two CPUs once warm, as the bench's workers
    procs = []
    for _ in range(args.replicas):
        for m in modes:
            cmd = [sys.executable, __file__, "--child", m, "--turn-ms", str(args.turn_ms),
                   "--window-ms", str(args.window_ms), "--cpus", mine, "--out", "-"]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, bufsize=1))
    for p in procs:
        if p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise SystemExit(f"launch_toggle: a child did not start (exit {p.poll()})")
    # Turns, one process at a time in a fresh random order each cycle: the machine is the same for all.
    import random

    t_end, cycles = time.monotonic() + args.seconds, 0
    while time.monotonic() < t_end:
        for p in random.sample(procs, len(procs)):
            p.stdin.write("go\n")  # type: ignore[union-attr]
            if p.stdout.readline().strip() != "done":  # type: ignore[union-attr]
                raise SystemExit(f"launch_toggle: a child stopped (exit {p.poll()})")
        cycles += 1
    results = []
    for p in procs:
        out, _ = p.communicate("stop\n", timeout=120)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        results.append(json.loads(lines[-1]) if lines and not p.returncode else {"error": f"child exited {p.returncode}"})
    rows = [summarise(r) if "steps" in r else r for r in results]
    meta = {"cycles": cycles, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": os.uname().nodename,
            "commit": os.environ.get("GPUFOOTPRINT_COMMIT"), "args": vars(args)}
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": rows, "against_none": against_none(results),
                                          "raw": results}))
    print(f"{'mode':10s} {'windows':>7s} {'steps':>6s} {'first ms':>9s} {'last ms':>9s} {'last/first':>10s} {'jump':>7s} {'at s':>6s}")
    for r in rows:
        if "error" in r:
            print(r)
            continue
        print(f"{r['mode']:10s} {r['windows']:7d} {r['steps']:6d} {r['first_tenth_ms']:9.4f} {r['last_tenth_ms']:9.4f} "
              f"{r['last_over_first']:10.4f} {r['largest_jump']:7.4f} {r['jump_at_s']!s:>6s}")
    print()
    print_against_none(results)


def print_against_none(results: list[dict[str, Any]]) -> None:
    print(f"{'mode':15s} {'windows':>7s} {'turns':>6s}  step against none's, by third of the run")
    for row in against_none(results):
        print(f"{row['mode']:15s} {row['windows']:7d} {row['turns']:6d}  "
              + "  ".join(f"{x:.3f}" for x in row["vs_none_by_part"]))


if __name__ == "__main__":
    main()
