"""Start many probed PyTorch workers at once and report any that never finish: a hang check.

Each worker starts the probe first (as `gpufootprint run` does), then builds a transformer on the
GPU and trains a few steps, printing "done". Heartbeats every ``--heartbeat-ms`` widen the window
in which the probe's thread and the workload's first allocations meet (the probe once read
PyTorch's allocator figures from its own thread there: a deadlock, probe/torchnumbers.py). A
worker still running after ``--timeout`` seconds is hung; with ``--py-spy PATH`` its native
stacks are printed before it is killed.

Usage (on a GPU machine): python bench/probe_start_stress.py --workers 14 --batches 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker(heartbeat_ms: int) -> None:
    from gpufootprint import probe

    probe.start(socket="", heartbeat_ms=heartbeat_ms)
    import torch
    from _workloads import transformer_step  # bench/, this script's directory

    step = transformer_step(8, 256)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    print("done", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--heartbeat-ms", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=75.0)
    ap.add_argument("--py-spy", default="", help="a py-spy binary: native stacks of hung workers")
    args = ap.parse_args()
    if args.worker:
        worker(args.heartbeat_ms)
        return 0
    summary: dict[str, object] = {"workers": args.workers, "batches": args.batches, "heartbeat_ms": args.heartbeat_ms,
                                  "timeout_s": args.timeout, "hung": 0, "failed": 0, "done": 0, "batch_seconds": []}
    for b in range(args.batches):
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--heartbeat-ms", str(args.heartbeat_ms)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(args.workers)]
        for p in procs:
            left = args.timeout - (time.monotonic() - t0)
            try:
                out, err = p.communicate(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                summary["hung"] = int(summary["hung"]) + 1  # type: ignore[call-overload]
                print(f"batch {b}: worker {p.pid} hung after {args.timeout:.0f} s", flush=True)
                if args.py_spy:
                    subprocess.run([args.py_spy, "dump", "--native", "--pid", str(p.pid)], timeout=30, check=False)
                p.kill()
                p.communicate()
                continue
            if p.returncode == 0 and "done" in out:
                summary["done"] = int(summary["done"]) + 1  # type: ignore[call-overload]
            else:
                summary["failed"] = int(summary["failed"]) + 1  # type: ignore[call-overload]
                print(f"batch {b}: worker {p.pid} rc={p.returncode}: {err[-800:]}", flush=True)
        summary["batch_seconds"].append(round(time.monotonic() - t0, 1))  # type: ignore[attr-defined]
        print(f"batch {b}: {time.monotonic() - t0:.1f} s", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
