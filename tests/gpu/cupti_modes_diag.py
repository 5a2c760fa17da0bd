"""Diagnostic (not a test): two questions about CUPTI on the lent GPU, each mode in a fresh process.

``oom MODE``: which CUPTI path sees a *failed* allocation call, with its return value?
    On the H200 (2026-12-03 05:43 UTC) the per-API DRIVER records for the allocation entry points
    showed no failed call, neither PyTorch's nor CuPy's. MODES: ``driver`` (cuptiActivityEnableDriverApi
    for cuMemAlloc* and friends), ``runtime`` (cuptiActivityEnableRuntimeApi for cudaMalloc* and
    friends), ``both``, ``callback`` (a callback subscriber on the same driver and runtime functions,
    reading the return value at API exit). Each makes one successful and several failing
    allocations through CuPy, PyTorch and cuda-bindings' driver API, then lists what arrived.

``windows MODE``: does a short window of kernel activity leave the workload slower after it closes?
    Run 17 (docs/performance.md) measured a loop of tiny launches about 9 % slower for the whole run
    once a 50 ms window of CONCURRENT_KERNEL had been open. CUPTI instruments kernel code for
    CONCURRENT_KERNEL; the serial KERNEL kind times kernels without instrumenting them. MODES:
    ``none`` (A/A: the same schedule, no window), ``concurrent``, ``kernel``, ``runtime_launch``
    (per-API RUNTIME records for the launch calls only), ``hw_trace`` (cuptiActivityEnableHWTrace,
    then CONCURRENT_KERNEL). The process times the loop before any window, then after each of
    three 50 ms windows; the ratio after/before is the lasting cost (``none`` is its control).

    python tests/gpu/cupti_modes_diag.py OUT.json oom MODE
    python tests/gpu/cupti_modes_diag.py OUT.json windows MODE

Run on the H200 on 2026-12-03 at 06:53 UTC (bench/results/h200_2026-12-03T0653Z_cupti_modes_*.json);
the window's switching was folded into one function afterwards, not run since.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from typing import Any

from cupti import cupti

GiB = 1 << 30
records: list[dict[str, Any]] = []
callbacks: list[dict[str, Any]] = []
kernel_records: list[tuple[int, int]] = []  # (start, end) of kernel records

DRIVER_ALLOC = ("cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocAsync", "cuMemAllocFromPoolAsync",
                "cuMemAllocManaged", "cuMemCreate", "cuMemAllocHost_v2", "cuMemHostAlloc")
RUNTIME_ALLOC = ("cudaMalloc_v3020", "cudaMallocPitch_v3020", "cudaMallocAsync_v11020",
                 "cudaMallocFromPoolAsync_v11020", "cudaMallocManaged_v6000", "cudaMallocHost_v3020",
                 "cudaHostAlloc_v3020", "cudaMalloc3D_v3020")
RUNTIME_LAUNCH = ("cudaLaunchKernel_v7000", "cudaLaunchKernelExC_v11060")


def requested() -> tuple[int, int]:
    return 1 << 20, 0


def completed(recs: list[Any]) -> None:
    for r in recs:
        kind = r.kind
        if kind in (cupti.ActivityKind.DRIVER, cupti.ActivityKind.RUNTIME):
            records.append({"kind": "driver" if kind == cupti.ActivityKind.DRIVER else "runtime",
                            "cbid": int(r.cbid), "ret": int(r.return_value)})
        elif kind in (cupti.ActivityKind.KERNEL, cupti.ActivityKind.CONCURRENT_KERNEL):
            kernel_records.append((int(r.start), int(r.end)))


def cbids(enum: Any, names: tuple[str, ...]) -> dict[int, str]:
    return {int(getattr(enum, n)): n for n in names if hasattr(enum, n)}


def on_api(userdata: Any, domain: int, cbid: int, data: Any) -> None:
    if data.callback_site != cupti.ApiCallbackSite.API_EXIT:
        return
    ret_ptr = ctypes.c_void_p.from_address(int(data.ptr) + 24).value  # CUpti_CallbackData.functionReturnValue
    ret = ctypes.c_int.from_address(ret_ptr).value if ret_ptr else None
    callbacks.append({"domain": int(domain), "cbid": int(cbid), "ret": ret})


def oom(mode: str) -> dict[str, Any]:
    cupti.activity_register_callbacks(requested, completed)
    cupti.activity_enable(cupti.ActivityKind.MEMORY2)
    drv = cbids(cupti.driver_api_trace_cbid, DRIVER_ALLOC)
    rt = cbids(cupti.runtime_api_trace_cbid, RUNTIME_ALLOC)
    out: dict[str, Any] = {"mode": mode, "driver_cbids": drv, "runtime_cbids": rt}
    if mode in ("driver", "both"):
        for c in drv:
            cupti.activity_enable_driver_api(c, 1)
    if mode in ("runtime", "both"):
        for c in rt:
            cupti.activity_enable_runtime_api(c, 1)
    if mode == "callback":
        sub = cupti.subscribe(on_api, None)
        for c in drv:
            cupti.enable_callback(1, sub, cupti.CallbackDomain.DRIVER_API, c)
        for c in rt:
            cupti.enable_callback(1, sub, cupti.CallbackDomain.RUNTIME_API, c)
    steps: list[dict[str, Any]] = []

    def attempt(name: str, fn: Any) -> None:
        before_r, before_c = len(records), len(callbacks)
        try:
            fn()
            res = "ok"
        except Exception as exc:  # noqa: BLE001 - the failure is the point
            res = type(exc).__name__ + ": " + str(exc)[:120]
        cupti.activity_flush_all(1)
        steps.append({"step": name, "result": res, "records": records[before_r:], "callbacks": callbacks[before_c:]})

    import cupy
    attempt("cupy_malloc_1GiB", lambda: cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(GiB)))
    attempt("cupy_malloc_200GiB", lambda: cupy.cuda.runtime.malloc(200 * GiB))
    attempt("cupy_empty_200GiB", lambda: cupy.empty(200 * GiB, dtype=cupy.uint8))
    import torch
    attempt("torch_empty_1GiB", lambda: torch.empty(GiB, dtype=torch.uint8, device="cuda"))
    attempt("torch_empty_200GiB", lambda: torch.empty(200 * GiB, dtype=torch.uint8, device="cuda"))
    from cuda.bindings import driver as cu

    def cu_alloc(size: int) -> None:
        err, ptr = cu.cuMemAlloc(size)
        if int(err) != 0:
            raise RuntimeError(f"cuMemAlloc: {err}")
        cu.cuMemFree(ptr)
    attempt("cu_mem_alloc_1GiB", lambda: cu_alloc(GiB))
    attempt("cu_mem_alloc_200GiB", lambda: cu_alloc(200 * GiB))
    out["steps"] = steps
    return out


def windows(mode: str) -> dict[str, Any]:
    import torch
    cupti.activity_register_callbacks(requested, completed)
    cupti.activity_enable(cupti.ActivityKind.MEMORY2)
    tiny = torch.zeros(256, device="cuda")
    out: dict[str, Any] = {"mode": mode}
    if mode == "hw_trace":
        try:
            cupti.activity_enable_hw_trace(1)
            out["hw_trace"] = "enabled"
        except Exception as exc:  # noqa: BLE001 - unsupported is a result
            out["hw_trace"] = repr(exc)[:200]
    launch = cbids(cupti.runtime_api_trace_cbid, RUNTIME_LAUNCH)

    def step() -> None:
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

    def switch(on: bool) -> None:
        """What a window of this mode switches on (``on``) and off again; "none" switches nothing."""
        kind = {"concurrent": cupti.ActivityKind.CONCURRENT_KERNEL, "hw_trace": cupti.ActivityKind.CONCURRENT_KERNEL,
                "kernel": cupti.ActivityKind.KERNEL}.get(mode)
        if kind is not None:
            (cupti.activity_enable if on else cupti.activity_disable)(kind)
        elif mode == "runtime_launch":
            for c in launch:
                cupti.activity_enable_runtime_api(c, int(on))

    def window(ms: float) -> None:
        switch(True)
        timed(ms / 1000)
        switch(False)
        cupti.activity_flush_all(1)

    timed(2.0)  # warm-up
    phases = {"before": statistics.median(timed(3.0))}
    for i in range(3):
        n0 = len(kernel_records)
        window(50)
        out[f"window{i}_kernel_records"] = len(kernel_records) - n0
        phases[f"after{i}"] = statistics.median(timed(3.0))
    out["step_s"] = phases
    out["lasting_ratio"] = statistics.median([phases[f"after{i}"] for i in range(3)]) / phases["before"]
    if kernel_records:
        durs = sorted(e - s for s, e in kernel_records)
        out["kernel_ns_median"] = durs[len(durs) // 2]
    out["api_records"] = len(records)
    return out


def main() -> None:
    path, what, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    result = oom(mode) if what == "oom" else windows(mode)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result)[:3000])


if __name__ == "__main__":
    main()
