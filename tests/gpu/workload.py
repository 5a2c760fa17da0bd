"""GPU workloads for the probe's GPU tests and trace recordings (run as a child process).

``python tests/gpu/workload.py SCENARIO [SYNC_DIR]``. The probe is started by the
environment (``gpufootprint run``'s bootstrap) or, failing that, here before
torch is imported. At each synchronised point the workload calls ``mark`` with
PyTorch's own numbers, which the daemon side compares with its footprint.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from gpufootprint import probe

NO_PROBE = os.environ.get("WORKLOAD_NO_PROBE") == "1"  # the same workload unprobed (a baseline)
if not probe.status().get("started") and os.environ.get("WORKLOAD_LATE_START") != "1" and not NO_PROBE:
    probe.start()  # before torch: CUPTI must see the first allocation

# Exit-crash bisection (docs/probe.md): the probe's start-up steps one by one, without the probe.
_CUPTI_INIT = os.environ.get("WORKLOAD_CUPTI_INIT", "").split(",")
if NO_PROBE and _CUPTI_INIT != [""]:
    from gpufootprint.probe.backend import ALWAYS_ON, CuptiBackend
    from gpufootprint.probe.hostinfo import cuda_devices

    if "cudadev" in _CUPTI_INIT:
        cuda_devices()
    _b = CuptiBackend()
    _b.versions()
    _b.configure(4 << 20 if "attrs" in _CUPTI_INIT else 0, 2)
    if "register" in _CUPTI_INIT:
        _b.register(lambda: (1 << 16, 0), lambda records: None)
    if "enable" in _CUPTI_INIT:
        for _k in ALWAYS_ON:
            _b.enable(_k)
    if "um" in _CUPTI_INIT:
        _b.configure_unified_memory()

import torch

DEV = 0
MiB = 1 << 20


def mark(label: str, **extra: object) -> None:
    torch.cuda.synchronize()
    body: dict[str, object] = {"torch_memory_reserved": int(torch.cuda.memory_reserved(DEV)),
                               "torch_memory_allocated": int(torch.cuda.memory_allocated(DEV))}
    try:
        body["torch_segments"] = [[int(s["device"]), int(s["address"]), int(s["total_size"])]
                                  for s in torch.cuda.memory_snapshot()]
    except Exception:  # noqa: BLE001, S110 - cudaMallocAsync has no segment list
        pass
    body.update(extra)
    probe.mark(label, DEV, **body)


def mlp_steps(n: int, batch: int = 256) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(n):
        x = torch.randn(batch, 1024, device="cuda")
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del model, opt


def allocator_story() -> None:
    """Small and large tensors, frees, empty_cache, training steps: shared by the allocator scenarios."""
    mark("start")
    small = [torch.empty(1000 * (i + 1), device="cuda") for i in range(50)]
    big = [torch.empty(64 * MiB // 4 * (i + 1), device="cuda") for i in range(4)]
    mark("allocated")
    del small[::2], big[1]
    mark("freed_some")
    torch.cuda.empty_cache()
    mark("empty_cache")
    mlp_steps(10)
    mark("after_mlp_steps")
    del small, big
    torch.cuda.empty_cache()
    mark("end")


def scenario_caching() -> None:
    allocator_story()


def scenario_expandable() -> None:
    assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    allocator_story()


def scenario_async() -> None:
    assert "cudaMallocAsync" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    allocator_story()


def scenario_threads() -> None:
    """Allocations made on threads other than the main one, as PyTorch's autograd thread makes in every backward.

    Each new thread makes new segments (cudaMalloc, or cuMemMap with expandable segments) and
    its first cuBLAS call (module loads: device_static records) on a thread CUPTI has not seen.
    """
    import threading

    held: list[torch.Tensor] = []

    def work(i: int) -> None:
        held.append(torch.empty((i + 1) * 3 * MiB // 4, device="cuda"))
        a = torch.randn(256 * (i + 1), 256 * (i + 1), device="cuda")
        held.append(a @ a)
        torch.cuda.synchronize()

    mark("start")
    for i in range(4):
        t = threading.Thread(target=work, args=(i,))
        t.start()
        t.join()
        mark(f"thread_{i}")
    mlp_steps(3)
    mark("after_mlp_steps")
    held.clear()
    torch.cuda.empty_cache()
    mark("end")


def scenario_vmm_threads() -> None:
    """CUDA virtual-memory mappings (what expandable segments use) made by the driver API directly,
    on the main thread, on a new thread with no CUDA context current, and on a new thread that
    made the primary context current first. Each mark names the bytes mapped since the last one.
    """
    import threading

    from cuda.bindings import driver as cu

    def ok(result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        assert int(err) == 0, f"CUDA driver error {err}"
        return rest[0] if len(rest) == 1 else rest

    torch.zeros(1, device="cuda")  # the primary context, current on the main thread
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = DEV
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    primary = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(DEV))))
    mapped: list[tuple[Any, Any, int]] = []
    context_seen: dict[str, bool] = {}

    def vmm(size: int, where: str, make_current: bool = False) -> None:
        if make_current:
            ok(cu.cuCtxSetCurrent(primary))
        context_seen[where] = int(ok(cu.cuCtxGetCurrent())) != 0
        handle = ok(cu.cuMemCreate(size, prop, 0))
        va = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
        ok(cu.cuMemMap(va, size, 0, handle, 0))
        ok(cu.cuMemSetAccess(va, size, [access], 1))
        mapped.append((va, handle, size))

    def on_thread(size: int, where: str, make_current: bool) -> None:
        t = threading.Thread(target=vmm, args=(size, where, make_current))
        t.start()
        t.join()

    mark("start")
    vmm(2 * MiB, "main")
    mark("main_thread", mapped_bytes=2 * MiB)
    on_thread(4 * MiB, "thread_no_context", False)
    mark("thread_no_context", mapped_bytes=4 * MiB, context_current=context_seen.get("thread_no_context"))
    on_thread(6 * MiB, "thread_with_context", True)
    mark("thread_with_context", mapped_bytes=6 * MiB, context_current=context_seen.get("thread_with_context"))
    for va, handle, size in mapped:
        ok(cu.cuMemUnmap(va, size))
        ok(cu.cuMemAddressFree(va, size))
        ok(cu.cuMemRelease(handle))
    mark("unmapped", mapped_bytes=-12 * MiB)


def scenario_pinned_managed() -> None:
    from cuda.bindings import runtime as cudart

    mark("start")
    sizes = [1 * MiB, 4 * MiB, 16 * MiB]  # powers of two: the host caching allocator rounds up to them
    pinned = [torch.empty(s, dtype=torch.uint8, pin_memory=True) for s in sizes]
    dev = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    dev.copy_(pinned[2], non_blocking=True)
    pinned[2].copy_(dev, non_blocking=True)
    err, ptr = cudart.cudaMallocManaged(64 * MiB, 1)  # cudaMemAttachGlobal
    assert int(err) == 0, err
    # Touch it from the GPU and the CPU so unified-memory counters appear.
    cudart.cudaMemset(ptr, 1, 64 * MiB)
    torch.cuda.synchronize()
    mark("pinned_and_managed", expect_pinned_bytes=sum(sizes), expect_managed_bytes=64 * MiB)
    # The probe has seen the managed allocation (the mark flushed it) and configured the
    # unified-memory counters: pages touched by the CPU, then the GPU, now migrate and count.
    import ctypes

    for _ in range(2):
        ctypes.memset(ptr, 2, 64 * MiB)
        cudart.cudaMemset(ptr, 3, 64 * MiB)
        torch.cuda.synchronize()
    mark("managed_touched", expect_pinned_bytes=sum(sizes), expect_managed_bytes=64 * MiB)
    assert int(cudart.cudaFree(ptr)[0]) == 0
    mark("managed_freed", expect_pinned_bytes=sum(sizes), expect_managed_bytes=0)
    del pinned
    mark("end")


def scenario_profiler() -> None:
    from torch.profiler import ProfilerActivity, profile

    mark("start")
    keep = torch.empty(256 * MiB // 4, device="cuda")
    mark("before_profiler")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
        a = torch.randn(2048, 2048, device="cuda")
        b = a @ a
        inside = torch.empty(300 * MiB // 4, device="cuda")
        del a
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda_events = sum(1 for e in events if getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) > 0)
    mark("after_profiler", profiler_events=len(events), profiler_cuda_events=cuda_events)
    after = torch.empty(300 * MiB // 4, device="cuda")  # the allocation the H200 once never saw
    mark("allocated_after_profiler")
    del keep, inside, b, after
    torch.cuda.empty_cache()
    mark("end")


def _wait_for(path: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.02)


def scenario_restart(sync: str) -> None:
    mark("start")
    a = torch.empty(128 * MiB // 4, device="cuda")
    mark("before_restart")
    _wait_for(os.path.join(sync, "down"))
    b = torch.empty(512 * MiB // 4, device="cuda")  # allocated while the daemon is away
    del a
    torch.cuda.empty_cache()
    c = [torch.empty(1000 * (i + 1), device="cuda") for i in range(20)]
    mark("while_down")  # dropped: nobody listens
    open(os.path.join(sync, "did_work"), "w").close()
    _wait_for(os.path.join(sync, "up"))
    end = time.monotonic() + 20
    while probe.status().get("reconnects", 0) < 1 and time.monotonic() < end:
        time.sleep(0.02)
    time.sleep(0.3)
    mark("after_restart")
    del b, c
    torch.cuda.empty_cache()
    mark("end")


def scenario_late_start() -> None:
    """CUDA first, probe later: what CUPTI cannot see is reported as ``untracked`` (from NVML)."""
    early = torch.empty(256 * MiB // 4, device="cuda")
    torch.cuda.synchronize()
    assert probe.start(untracked_ms=200)
    late = torch.empty(64 * MiB // 4, device="cuda")
    torch.cuda.synchronize()
    time.sleep(1.0)  # a few NVML polls
    mark("after_late_start", early_bytes=256 * MiB, late_bytes=64 * MiB)
    del early, late


def scenario_kernel_window() -> None:
    """Kernels run for 3 s; the daemon opens one kernel window by CONTROL when it sees "ready"."""
    a = torch.randn(1024, 1024, device="cuda")
    mark("ready")
    end = time.monotonic() + 3.0
    launched = 0
    while time.monotonic() < end:
        b = a @ a
        torch.cuda.synchronize()
        launched += 1
        time.sleep(0.005)
    del b
    mark("end", launched=launched)


def _transformer(layers: int = 6, d: int = 1024) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(d, 16, 4 * d, batch_first=True, dropout=0.0)
    return torch.nn.TransformerEncoder(layer, layers).cuda().to(torch.bfloat16)


def scenario_kernels_train() -> None:
    model = _transformer(layers=2, d=512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mark("start")
    for step in range(5):
        x = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark(f"step_{step}")
    mark("end")


def scenario_churn() -> None:
    """Training steps under an allocator that allocates all the time (cudaMallocAsync, or no caching):
    hundreds of memory records a step, from the main thread and autograd's, for several seconds, so
    many watermarks and checks pass while memory moves; marks every 25 steps."""
    steps = int(os.environ.get("WORKLOAD_CHURN_STEPS", "150"))
    model = _transformer(layers=4, d=1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 512, 1024, device="cuda", dtype=torch.bfloat16)
    mark("start")
    for step in range(steps):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 24:
            mark(f"step_{step + 1}")
    del model, opt, x, loss
    torch.cuda.empty_cache()
    mark("end")


def scenario_kernels_graph() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
    static_x = torch.randn(64, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(s)
    mark("warmed_up")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    mark("captured")
    for i in range(20):
        static_x.copy_(torch.randn(64, 512, device="cuda"))
        graph.replay()
    mark("replayed_20", graph_replays=20)
    for _ in range(20):  # the same work launched eagerly, for comparison
        model(static_x)
    mark("eager_20")
    del graph, static_y
    mark("end")


def main() -> int:
    name = sys.argv[1]
    dump_after = os.environ.get("WORKLOAD_DUMP_AFTER")
    if dump_after:
        # Diagnostic: every thread's stack once the workload has run this long (a stall's where).
        import faulthandler

        out = os.environ.get("GPUFOOTPRINT_GPU_OUT") or "/tmp"
        faulthandler.dump_traceback_later(float(dump_after), exit=False,
                                          file=open(os.path.join(out, f"workload_stacks_{name}.txt"), "w"))  # noqa: SIM115 - dumped into at exit
    fn = globals()[f"scenario_{name}"]
    if name == "restart":
        fn(sys.argv[2])
    else:
        fn()
    torch.cuda.synchronize()
    st = probe.status()
    print(f"workload {name}: done; probe {st}", flush=True)
    return 0 if st.get("started") or NO_PROBE else 3


if __name__ == "__main__":
    rc = main()
    if os.environ.get("WORKLOAD_NO_ATEXIT") == "1" and probe.current() is not None:
        # Diagnostic: leave CUPTI as it is at exit (no final flush, no kinds off).
        import atexit

        atexit.unregister(probe.current().stop_at_exit)
    if os.environ.get("WORKLOAD_OS_EXIT") == "1":
        # Diagnostic (docs/probe.md, exit crash): the probe's own atexit work, then no C teardown.
        probe.stop()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
