"""What one reading of PyTorch's allocator figures costs the workload's thread (needs a CUDA GPU).

The probe reads ``allocated`` and ``reserved`` after an optimizer step, inside the workload's step
(probe/torchnumbers.py). This times the two ways side by side, interleaved, on the overhead bench's
transformer after a few training steps:

* ``flat``: ``torch.cuda.memory_allocated(d)`` and ``torch.cuda.memory_reserved(d)`` (the probe before
  2026-12-06): each builds, flattens and sorts the whole ``memory_stats`` table;
* ``nested``: the probe's ``read_now``: one ``memory_stats_as_nested_dict(d)`` a device;
* ``nested_b``: the same again (A/A: the noise of the method).

    python3 bench/torch_numbers_cost.py [--reps 2000] [--json OUT.json]

Prints the median and p90 of each in microseconds. Pin it (``taskset -c 14``) to read it on a loaded CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


def flat() -> dict[str, Any]:
    import torch

    n = torch.cuda.device_count()
    return {"allocated": {str(d): int(torch.cuda.memory_allocated(d)) for d in range(n)},
            "reserved": {str(d): int(torch.cuda.memory_reserved(d)) for d in range(n)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch
    from _workloads import transformer_step  # bench/, this script's directory
    from gpufootprint.probe.torchnumbers import read_now

    step = transformer_step(16, 512)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if flat() != read_now():
        print(f"the two readings differ: {flat()} against {read_now()}", file=sys.stderr)
        return 1
    ways = {"flat": flat, "nested": read_now, "nested_b": read_now}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.reps):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": args.reps,
                           "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                           "devices": torch.cuda.device_count()}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"median_us": round(statistics.median(ts) * 1e6, 2), "p90_us": round(ts[int(0.9 * len(ts))] * 1e6, 2)}
        print(f"{name:9s} median {out[name]['median_us']:8.2f} us   p90 {out[name]['p90_us']:8.2f} us")
    out["flat_over_nested"] = round(out["flat"]["median_us"] / out["nested"]["median_us"], 2)
    out["nested_b_over_nested"] = round(out["nested_b"]["median_us"] / out["nested"]["median_us"], 2)
    print(f"flat / nested {out['flat_over_nested']}x (A/A nested_b / nested {out['nested_b_over_nested']}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
