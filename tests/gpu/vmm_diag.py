"""Diagnostic (not a test): which CUDA virtual-memory mappings reach CUPTI's MEMORY2 activity, and
whether a driver-API callback on cuMemMap/cuMemUnmap sees them instead.

Found on the H200 (docs/probe.md, "Lost records"): mappings made by cuMemMap on a thread other
than the main one never arrived as MEMORY2 records. This maps 2 MiB pieces on the main thread and
on new threads (no context, context set, a runtime call first), records what MEMORY2 and the
callback each saw, with no subscriber, with subscribers that enable nothing or only the resource
domain, and with cuMemMap/cuMemUnmap enabled; runs a torch.profiler session while subscribed; times
a loop of tiny launches with the subscription on and off (in-process, alternated: a rough figure,
not a bench); and after a profiler session with no subscription of ours, maps again.
Run at 19:02 UTC without the resource-domain, empty-subscriber and after-profiler parts; with
them at 19:50 UTC (bench/results/h200_2026-12-02T1950Z_vmm_diag.json); the MODES at 20:19 UTC.
Refactored afterwards (helpers shared by the whole-run and the MODES paths; not run since).

    python tests/gpu/vmm_diag.py OUT.json            # the subscriber comparison above (19:02, 19:50 UTC)
    python tests/gpu/vmm_diag.py OUT.json MODE       # one of MODES, each in a fresh process

The MODES ask whether CUPTI's per-API activity switch (``cuptiActivityEnableDriverApi`` for
cuMemMap/cuMemUnmap, no subscriber) keeps the mappings recorded as the subscriber does, whether
it lets a torch.profiler session keep its CUDA events, and what a torch.profiler session that ran
first (with no subscriber of ours, as after the probe's hand-over) leaves behind.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time
from typing import Any

from cupti import cupti

MiB = 1 << 20
seen_activity: list[tuple[int, int, int]] = []  # (op, addr, bytes)
seen_callback: list[tuple[str, int, int, str]] = []  # (api, addr, bytes, thread)
seen_driver: list[int] = []  # cbids of DRIVER activity records
MODES = ("none", "driver_api", "driver_api_profiler", "profiler_first", "profiler_first_driver_api")


def requested() -> tuple[int, int]:
    return 1 << 20, 0


def completed(records: list[Any]) -> None:
    for r in records:
        if r.kind == cupti.ActivityKind.MEMORY2:
            seen_activity.append((int(r.memory_operation_type), int(r.address), int(r.bytes)))
        elif r.kind == cupti.ActivityKind.DRIVER:
            seen_driver.append(int(r.cbid))


def on_api(userdata: Any, domain: int, cbid: int, data: Any) -> None:
    if data.callback_site != cupti.ApiCallbackSite.API_EXIT:
        return
    params = ctypes.c_void_p.from_address(int(data.ptr) + 16).value  # CUpti_CallbackData.functionParams
    if not params:
        return
    ptr = ctypes.c_uint64.from_address(params).value
    size = ctypes.c_uint64.from_address(params + 8).value
    name = "map" if cbid == cupti.driver_api_trace_cbid.cuMemMap else "unmap"
    seen_callback.append((name, ptr, size, threading.current_thread().name))


def main(out: str, mode: str = "") -> None:
    cupti.activity_register_callbacks(requested, completed)
    cupti.activity_enable(cupti.ActivityKind.MEMORY2)
    import torch
    from cuda.bindings import driver as cu
    from cuda.bindings import runtime as cudart

    torch.zeros(1, device="cuda")

    def ok(result: Any) -> Any:
        err, *rest = result
        assert int(err) == 0, err
        return rest[0] if len(rest) == 1 else rest

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    primary = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    maps: dict[str, tuple[int, int, Any]] = {}

    def vmm(where: str, first: str = "") -> None:
        if first == "ctx":
            ok(cu.cuCtxSetCurrent(primary))
        elif first == "runtime":
            ok(cudart.cudaFree(0))
        elif first == "torch":
            torch.empty(1, device="cuda")
        size = 2 * MiB
        handle = ok(cu.cuMemCreate(size, prop, 0))
        va = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
        ok(cu.cuMemMap(va, size, 0, handle, 0))
        ok(cu.cuMemSetAccess(va, size, [access], 1))
        maps[where] = (int(va), size, handle)

    def on_thread(where: str, first: str) -> None:
        t = threading.Thread(target=vmm, args=(where, first), name=where)
        t.start()
        t.join()

    def mapping_round() -> dict[str, dict[str, bool]]:
        """Map 2 MiB on the main thread and on new threads; which of them did MEMORY2 and the callback see?"""
        maps.clear()
        seen_activity.clear()
        seen_callback.clear()
        vmm("main")
        for where, first in (("thread_none", ""), ("thread_ctx", "ctx"), ("thread_runtime", "runtime"),
                             ("thread_torch", "torch")):
            on_thread(where, first)
        vmm("main_again")
        cupti.activity_flush_all(1)
        act = {a for op, a, _ in seen_activity if op == 1}
        cb = {a for n, a, _s, _t in seen_callback if n == "map"}
        seen = {w: {"memory2": va in act, "callback": va in cb} for w, (va, _s, _h) in maps.items()}
        for va, size, handle in maps.values():
            ok(cu.cuMemUnmap(va, size))
            ok(cu.cuMemAddressFree(va, size))
            ok(cu.cuMemRelease(handle))
        return seen

    result: dict[str, Any] = {}
    if mode:
        run_mode(mode, result, mapping_round, torch)
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(json.dumps(result, indent=1))
        return
    for subscribed in (False, True):  # no subscriber first: nothing before it may have changed CUPTI's state
        sub = None
        if subscribed:
            # Which subscriber is enough: one with no callback enabled, or one with only the resource
            # domain (what a profiler typically keeps)? Not yet run on the GPU (written after 19:02 UTC).
            for kind in ("no_callbacks", "resource_domain"):
                other = cupti.subscribe(on_api, None)
                if kind == "resource_domain":
                    cupti.enable_domain(1, other, cupti.CallbackDomain.RESOURCE)
                result[f"subscribed_{kind}"] = mapping_round()
                cupti.unsubscribe(other)
            sub = cupti.subscribe(on_api, None)
            for cbid in (cupti.driver_api_trace_cbid.cuMemMap, cupti.driver_api_trace_cbid.cuMemUnmap):
                cupti.enable_callback(1, sub, cupti.CallbackDomain.DRIVER_API, cbid)
        result[f"subscribed={subscribed}"] = mapping_round()
        if sub is not None:
            cupti.activity_flush_all(1)
            result["unmap_callbacks"] = sum(1 for n, *_ in seen_callback if n == "unmap")
            # A torch.profiler session while our subscription exists (its CUDA-event count is not
            # meaningful here: it read 0 with no subscriber of ours too, 20:19 UTC).
            result["profiler_while_subscribed"] = profiler_session(torch)
            seen_callback.clear()
            on_thread("after_profiler", "")
            result["callback_after_profiler"] = len(seen_callback)
            # Tiny launches with the subscription and without it, alternated (one process: rough).
            a = torch.zeros(1, device="cuda")
            times: dict[str, list[float]] = {"subscribed": [], "unsubscribed": []}
            for rnd in range(20):
                for state in ("subscribed", "unsubscribed") if rnd % 2 == 0 else ("unsubscribed", "subscribed"):
                    on = state == "subscribed"
                    for cbid in (cupti.driver_api_trace_cbid.cuMemMap, cupti.driver_api_trace_cbid.cuMemUnmap):
                        cupti.enable_callback(int(on), sub, cupti.CallbackDomain.DRIVER_API, cbid)
                    if not on:
                        cupti.unsubscribe(sub)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(50):
                        for _ in range(100):
                            a.add_(1)
                        torch.cuda.synchronize()
                    times[state].append((time.perf_counter() - t0) / 50)
                    if not on:
                        sub = cupti.subscribe(on_api, None)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            result["launch_loop_step_s"] = med
            result["launch_loop_ratio_subscribed"] = med["subscribed"] / med["unsubscribed"]
    # After a torch.profiler session with no subscription of ours (Kineto kept its own on the H200):
    # are mappings on new threads recorded? Our activity callbacks are registered again first, as
    # the probe's hand-back does.
    if sub is not None:
        cupti.unsubscribe(sub)
    session = profiler_session(torch, 256)
    if "error" in session:
        result["after_profiler_unsubscribed"] = session
    else:
        try:
            rearm()
            result["subscribe_after_profiler"] = try_subscribe()
            result["after_profiler_unsubscribed"] = mapping_round()
        except Exception as exc:  # noqa: BLE001 - what happened is the result
            result["after_profiler_unsubscribed"] = {"error": repr(exc)}
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


def profiler_session(torch: Any, n: int = 512) -> dict[str, Any]:
    """A short torch.profiler session; how many of its events carry CUDA time."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            x = torch.randn(n, n, device="cuda")
            (x @ x).sum().item()
        events = prof.key_averages()
        return {"events": len(events),
                "cuda_events": sum(1 for e in events if getattr(e, "device_time_total", 0) > 0)}
    except Exception as exc:  # noqa: BLE001 - what happened is the result
        return {"error": repr(exc)}


def rearm() -> None:
    """After a profiler session: flush what CUPTI holds, register our callbacks again, MEMORY2 on
    (as the probe's hand-back does)."""
    cupti.activity_flush_all(1)
    cupti.activity_register_callbacks(requested, completed)
    cupti.activity_enable(cupti.ActivityKind.MEMORY2)


def try_subscribe() -> str:
    """Can we subscribe (and at once unsubscribe) now? "ok" or CUPTI's error."""
    try:
        cupti.unsubscribe(cupti.subscribe(on_api, None))
        return "ok"
    except Exception as exc:  # noqa: BLE001 - what happened is the result
        return repr(exc)


def driver_api_switch(on: bool) -> list[str]:
    """cuptiActivityEnableDriverApi for cuMemMap and cuMemUnmap; the errors it gave."""
    errors = []
    for cbid in (cupti.driver_api_trace_cbid.cuMemMap, cupti.driver_api_trace_cbid.cuMemUnmap):
        try:
            cupti.activity_enable_driver_api(cbid, int(on))
        except Exception as exc:  # noqa: BLE001 - what happened is the result
            errors.append(repr(exc))
    return errors


def run_mode(mode: str, result: dict[str, Any], mapping_round: Any, torch: Any) -> None:
    if mode not in MODES:
        raise SystemExit(f"vmm_diag.py: mode {mode!r} is not one of {', '.join(MODES)}")
    result["mode"] = mode
    if mode.startswith("profiler_first"):
        result["profiler"] = profiler_session(torch)
        rearm()
        result["subscribe_after_profiler"] = try_subscribe()
    if mode.endswith("driver_api") or mode == "driver_api_profiler":
        result["driver_api_errors"] = driver_api_switch(True)
    seen_driver.clear()
    result["mappings"] = mapping_round()
    result["driver_records"] = len(seen_driver)
    if mode == "driver_api_profiler":
        result["profiler"] = profiler_session(torch)
        rearm()
        result["driver_api_errors_after"] = driver_api_switch(True)
        seen_driver.clear()
        result["mappings_after_profiler"] = mapping_round()
        result["driver_records_after"] = len(seen_driver)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
