"""A process that runs out of GPU memory the way users' jobs do: it allocates 1 GiB at a time until
the framework raises, then prints the framework's own figures as JSON and exits 0.

  python oom_workload.py torch|cupy

Started with the probe (tests/gpu/test_oom_gpu.py sets GPUFOOTPRINT_PROBE=1 and the socket). No
cuBLAS or other library is used, so every GPU byte is the framework allocator's.
"""

from __future__ import annotations

import json
import sys
import time

from gpufootprint import probe

if not probe.status().get("started"):
    probe.start()  # before the framework: CUPTI must see the first allocation (as tests/gpu/workload.py)

GiB = 1 << 30


def run_torch() -> dict[str, object]:
    import torch

    torch.zeros(1, device="cuda")
    time.sleep(2.5)  # the probe attaches PyTorch's OOM observer at a heartbeat once CUDA is initialised
    held = []
    try:
        while True:
            held.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as exc:
        figures = {"framework": "torch", "reserved": int(torch.cuda.memory_reserved()),
                   "allocated": int(torch.cuda.memory_allocated()), "tensors": len(held), "error": str(exc)[:300]}
    del held
    return figures


def run_cupy() -> dict[str, object]:
    import cupy

    pool = cupy.get_default_memory_pool()
    cupy.zeros(1)
    time.sleep(1.5)
    held = []
    try:
        while True:
            held.append(cupy.empty(GiB, dtype=cupy.uint8))
    except cupy.cuda.memory.OutOfMemoryError as exc:
        figures = {"framework": "cupy", "reserved": int(pool.total_bytes()), "allocated": int(pool.used_bytes()),
                   "arrays": len(held), "error": str(exc)[:300]}
    del held
    return figures


def main() -> int:
    figures = run_torch() if sys.argv[1] == "torch" else run_cupy()
    cur = probe.current()
    figures["probe"] = {**cur.sender.oom.counters(), "oom_records_unavailable": cur.counters["oom_records_unavailable"]} \
        if cur is not None else None
    figures["probe_started"] = cur is not None
    print(json.dumps(figures), flush=True)
    time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
