"""The C forwarder against the sender's own read, on the CPU: how far a busy "workload" gets beside each.

A probed child process (tests/integration/probe_child.py: the real probe, its CUPTI faked) streams full 64 KiB
buffers of MEMORY2 structs from a C thread that never takes the GIL (tests/native/cupti_threads.c, as CUPTI's
worker under cudaMallocAsync), ``--mb-per-s`` a second in ten bursts a second, to a real daemon in this process,
while two Python threads spin holding the GIL whenever they run, as a framework's threads do between calls.
Each run is one of ``sender`` (each buffer wakes the sender, which reads and frames it holding the GIL: the
default), ``forwarder`` (``GPUFOOTPRINT_PROBE_NATIVE_FORWARD=1``: a C thread reads and frames, the sender wakes for
the frames in bulk) or ``sender_b`` (the default again: the A/A control), interleaved round by round in a
rotating order. Per run: the spinners' loops a second (the workload's progress), the sender thread's CPU
seconds and wakes, the forwarder's CPU, records dropped. Prints medians and each configuration against
``sender`` round by round.

Usage: python bench/probe_forwarder.py [--rounds N] [--seconds S] [--mb-per-s R] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "daemon"))

from tests.integration.test_probe_link import Daemon, child, finish  # noqa: E402
from tests.native import shim  # noqa: E402

CONFIGS = {"sender": "0", "forwarder": "1", "sender_b": "0"}


def one_run(where: Path, compiled: Path, native_forward: str, seconds: float, mb_per_s: float) -> dict[str, float]:
    sock = str(where / "p.sock")
    daemon = Daemon(sock)
    try:
        # the probe's default cadence (the tests' children flush every 20 ms and beat every 100 ms)
        p = child(sock, where, "sleep:0.3", "forwarding", "mark:start", "cpu:start", f"stream:{seconds}:{mb_per_s}:2",
                  "cpu:end", "mark:end", STREAM_SHIM=str(compiled), GPUFOOTPRINT_PROBE_NATIVE_FORWARD=native_forward,
                  GPUFOOTPRINT_PROBE_FLUSH_MS="100", GPUFOOTPRINT_PROBE_HEARTBEAT_MS="1000")
        res = finish(p)
        end = daemon.wait_mark("end")
    finally:
        daemon.stop()
    st = res["status"]
    if not end["matches"]:
        raise SystemExit(f"the end mark did not match: {end}")
    a, b = res["cpu_at"]["start"], res["cpu_at"]["end"]

    def during(name: str) -> float:  # CPU seconds while the buffers streamed (the kernel's 10 ms ticks)
        return b.get(name, 0.0) - a.get(name, 0.0)

    return {"spin_per_s": res["spun"] / seconds, "sender_cpu_s": during("gpufootprint-probe"),
            "wakeups": st["sender_wakeups"], "forwarder_cpu_s": during("gfp-forwarder"),
            "native_forwards": st["native_forwards"], "dropped": st["records_dropped"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--mb-per-s", type=float, default=10.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gfp-fwd-bench-"))
    compiled = shim.build(base)
    if compiled is None:
        raise SystemExit("no C compiler for tests/native/cupti_threads.c")
    names = list(CONFIGS)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            where = base / f"r{r}-{name}"
            where.mkdir()
            runs[name].append(one_run(where, compiled, CONFIGS[name], a.seconds, a.mb_per_s))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(f"{platform.machine()} cpus={os.cpu_count()} python {platform.python_version()}; {a.rounds} rounds, "
          f"{a.seconds} s at {a.mb_per_s} MB/s, 2 spinning threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    keys = ["spin_per_s", "sender_cpu_s", "wakeups", "forwarder_cpu_s", "native_forwards", "dropped"]
    print(f"{'config':10} " + " ".join(f"{k:>16}" for k in keys) + "   spin vs sender (median of rounds)")
    for name in names:
        med = {k: statistics.median(run[k] for run in runs[name]) for k in keys}
        ratio = statistics.median(x["spin_per_s"] / y["spin_per_s"] for x, y in zip(runs[name], runs["sender"], strict=True))
        print(f"{name:10} " + " ".join(f"{med[k]:16.3f}" for k in keys) + f"   {ratio:.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
