"""Diagnostic (not a test): which CUPTI per-API records does a PyTorch loop of launches and waits write?

Each MODE runs in a fresh process: a loop of steps (an MLP step, 100 tiny ``add_`` launches, a
``torch.cuda.synchronize``), timed before and after three 50 ms windows. A window switches on:

  late    the per-API switches of probe/launches.py (launch and wait calls, driver and runtime),
          after PyTorch initialised CUDA (what a launch window does)
  early   the same switches once before CUDA is initialised (then off), and again in each window
  kinds   CUPTI's whole DRIVER and RUNTIME activity kinds (every call's record)
  none    nothing (A/A for the timing)
  late_alloc  the probe's OOM switches (the allocation calls, probe/oom.py) switched on once after
          PyTorch initialised CUDA, as a probe started after CUDA does; each window allocates a new
          block through cudaMalloc (a cache miss), to see whether its record arrives

It prints and writes the records seen per (kind, cbid name) in the windows, and the step time after
each window over the step time before (``lasting_ratio``).

    python tests/gpu/launch_api_diag.py OUT.json MODE
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from typing import Any

from cupti import cupti

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/daemon")
from gpufootprint.probe.launches import DRIVER_CBIDS, RUNTIME_CBIDS

seen: Counter[str] = Counter()
api_rows: list[tuple[int, int, int, int, int]] = []  # (kind, cbid, start, end, tid)


def requested() -> tuple[int, int]:
    return 1 << 20, 0


def completed(recs: list[Any]) -> None:
    for r in recs:
        kind = int(r.kind)
        if kind in (int(cupti.ActivityKind.DRIVER), int(cupti.ActivityKind.RUNTIME)):
            enum = cupti.driver_api_trace_cbid if kind == int(cupti.ActivityKind.DRIVER) else cupti.runtime_api_trace_cbid
            try:
                name = enum(int(r.cbid)).name
            except ValueError:
                name = str(int(r.cbid))
            seen[f"{'driver' if kind == 4 else 'runtime'}:{name}"] += 1
            api_rows.append((kind, int(r.cbid), int(r.start), int(r.end), int(r.thread_id)))


def switch_api(on: bool) -> None:
    for c in DRIVER_CBIDS:
        cupti.activity_enable_driver_api(c, int(on))
    for c in RUNTIME_CBIDS:
        cupti.activity_enable_runtime_api(c, int(on))


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    cupti.activity_register_callbacks(requested, completed)
    cupti.activity_enable(cupti.ActivityKind.MEMORY2)
    if mode == "early":
        switch_api(True)
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256, device="cuda")
    tiny = torch.zeros(256, device="cuda")
    if mode == "early":
        switch_api(False)
        cupti.activity_flush_all(1)
        out_early = dict(seen)
        seen.clear()
        api_rows.clear()

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
        for _ in range(100):
            tiny.add_(1.0)
        torch.cuda.synchronize()

    def timed(seconds: float) -> list[float]:
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return times

    blocks: list[Any] = []

    def window(on: bool) -> None:
        if mode == "late_alloc" and on:
            torch.cuda.empty_cache()
            blocks.append(torch.empty((64 << 20) * (len(blocks) + 1), dtype=torch.uint8, device="cuda"))
        if mode in ("late", "early"):
            switch_api(on)
        elif mode == "kinds":
            for k in (cupti.ActivityKind.DRIVER, cupti.ActivityKind.RUNTIME):
                (cupti.activity_enable if on else cupti.activity_disable)(k)

    timed(1.5)
    phases = {"before": statistics.median(timed(2.0))}
    if mode == "late_alloc":
        from gpufootprint.probe.oom import switched_cbids

        driver, runtime = switched_cbids(False)
        for c in driver:
            cupti.activity_enable_driver_api(c, 1)
        for c in runtime:
            cupti.activity_enable_runtime_api(c, 1)
    in_window: list[float] = []
    for i in range(3):
        window(True)
        in_window += timed(0.05)
        window(False)
        cupti.activity_flush_all(1)
        phases[f"after{i}"] = statistics.median(timed(2.0))
    result: dict[str, Any] = {"mode": mode, "records_in_windows": dict(seen.most_common()),
                              "api_records": len(api_rows), "step_s": phases,
                              "step_in_window_s": statistics.median(in_window) if in_window else None,
                              "lasting_ratio": statistics.median([phases[f"after{i}"] for i in range(3)])
                              / phases["before"]}
    if mode == "early":
        result["records_early"] = out_early
    if api_rows:
        result["first_rows"] = api_rows[:300]
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "first_rows"})[:3000])


if __name__ == "__main__":
    main()
