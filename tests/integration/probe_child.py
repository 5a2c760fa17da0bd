"""A workload child for the probe's CPU integration tests.

It runs the real probe (``gpufootprint.probe.start``) over the fake CUPTI of
tests/probe_fakes.py, the one fake, standing in for the GPU. Steps come from
the command line; ``wait:NAME`` waits for a file in the sync directory, so the
test can stop and restart the daemon at known points.

  python probe_child.py SYNC_DIR STEP [STEP ...]
  steps: alloc:ADDR:SIZE[:KIND[:DEV]]  free:ADDR:SIZE  copy:N  kernel:NAME  mark:LABEL
         wait:NAME  touch:NAME  sleep:SECONDS  burst:N (N allocations and frees)  connected
         until:COUNTER:N (waits, up to 30 s, until the probe's status counts N of COUNTER)
         launch_loop:SECONDS (a launch-bound training loop: steps of 10 tiny kernels and a wait, 1 ms
                              apart; CUPTI keeps the kernels only while the kernel activity is on,
                              the launch and wait calls only in a launch window)
         long_steps:SECONDS:STEP_MS (a training loop of long kernels: 10 launches, then a synchronize that
                                     waits STEP_MS for the GPU, per step)
         reuse_inverted:N (two threads: one reuses N addresses of 64 KiB the other frees, each old
                           release stamped up to 0.5 ms after the reuse; 4 KiB each before)
         forwarding (waits, up to 20 s, until the daemon has asked for CUPTI's buffers unread; the wait in "waited")
         stream:SECONDS:MB_PER_S[:SPINNERS] (whole 64 KiB buffers of allocations and their frees handed over ten times a
                                  second, as CUPTI's own thread does under churn: MB_PER_S of them; ends freed;
                                  SPINNERS Python threads hold the GIL meanwhile, as a framework's do)
         apicall:CBID:RET (a driver call's API record)  faketorch (a stand-in torch module with
         CUDA initialised)  torchoom:SIZE (that module's OOM observer called, as PyTorch does)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import probe_fakes
from gpufootprint import probe


def churn(fake: probe_fakes.FakeCupti, seconds: float) -> None:
    """Two threads on one address space, as an allocator without a cache makes them: a busy one
    (stream 1) allocates and frees all the time, reusing every address as soon as it is free; a
    quiet one (stream 2) frees, now and then, allocations the busy one handed it, each release
    stamped when its call began and written up to 3 ms later (the call waited for the device).
    Addresses move between the threads, so records applied out of time order break the table."""
    import random
    import threading

    rng = random.Random(7)
    lock = threading.Lock()
    free_addrs = [0x5000_0000 + i * 0x10000 for i in range(64)]
    handed: list[tuple[int, int]] = []
    stop = time.monotonic() + seconds

    def quiet() -> None:
        while time.monotonic() < stop or handed:
            with lock:
                item = handed.pop(0) if handed else None
            if item is None:
                time.sleep(0.001)
                continue
            stamped = time.time_ns()
            time.sleep(rng.random() * 0.003)
            fake.emit(probe_fakes.memory_record(2, item[0], item[1], ts=stamped, stream=2))
            with lock:
                free_addrs.append(item[0])

    t = threading.Thread(target=quiet)
    t.start()
    n = 0
    while time.monotonic() < stop:
        with lock:
            addr = free_addrs.pop(0) if free_addrs else None
        if addr is None:
            time.sleep(0.0002)
            continue
        size = 512 * (1 + n % 7)
        fake.emit(probe_fakes.memory_record(1, addr, size, ts=time.time_ns(), stream=1))
        n += 1
        if n % 5 == 0:
            with lock:
                handed.append((addr, size))
        else:
            fake.emit(probe_fakes.memory_record(2, addr, size, ts=time.time_ns(), stream=1))
            with lock:
                free_addrs.append(addr)
        if n % 50 == 0:
            time.sleep(0.0005)
    t.join()


def reuse_inverted(fake: probe_fakes.FakeCupti, n: int) -> None:
    """The H200's four-thread churn in small: a freeing thread and a reallocating thread around the
    driver's lock, the release stamped after the reuse of its address. Live at the end: n x 64 KiB."""
    import random
    import threading

    rng = random.Random(11)
    addrs = [0x6000_0000 + i * 0x10_0000 for i in range(n)]
    for a in addrs:
        fake.alloc(a, 4096)
    # CUPTI numbers a process's API calls in call order: each free's call (corr 2i + 1) came before
    # the reuse of its address (2i + 2), though its record is stamped later.
    plan = [(a, time.time_ns() + i * 50_000, rng.randint(1, 500_000), 1000 + 2 * i) for i, a in enumerate(addrs)]

    def freer() -> None:
        for a, t, late, corr in plan:
            fake.emit(probe_fakes.memory_record(2, a, 4096, ts=t + late, stream=2, corr=corr + 1))

    t = threading.Thread(target=freer)
    t.start()
    for a, ts, _, corr in plan:
        fake.emit(probe_fakes.memory_record(1, a, 65536, ts=ts, stream=1, corr=corr + 2))
    t.join()


def stream(fake: probe_fakes.FakeRawCupti, seconds: float, mb_per_s: float) -> None:
    """CUPTI's period thread under heavy churn (the H100's four PyTorch threads under cudaMallocAsync wrote
    about 14 MB of MEMORY2 structs a second): every 100 ms a burst of full buffers, completed one after the
    other by a C thread that never takes the GIL (tests/native/cupti_threads.c, built by the test and named
    in STREAM_SHIM), as CUPTI's is. Each buffer holds allocations and their frees, so every record counts
    and the footprint ends where it began."""
    import ctypes

    import numpy as np

    dt = probe_fakes._struct_dtype(probe_fakes.MEMORY2)
    per_buffer = (64 << 10) // dt.itemsize // 2 * 2
    rows = np.zeros(per_buffer, dtype=dt)
    rows["kind"] = probe_fakes.MEMORY2
    rows["memory_operation_type"] = np.tile([1, 2], per_buffer // 2)  # allocation, release
    rows["memory_kind"] = 3  # device
    rows["bytes"] = 4096
    rows["device_id"], rows["context_id"], rows["stream_id"] = 0, 1, 7
    rows["address"] = 0x2_0000_0000 + np.repeat(np.arange(per_buffer // 2), 2) * 4096
    rows["correlation_id"] = 10_000 + np.arange(per_buffer)
    template = rows.tobytes()
    per_burst = max(1, round(mb_per_s * (1 << 20) / 10 / len(template)))
    bursts = max(1, round(seconds * 10))
    lib = ctypes.CDLL(os.environ["STREAM_SHIM"])  # CDLL: the call lets the GIL go, like CUPTI's own thread
    refused = lib.stream_bursts(fake.delivery._req, fake.delivery._cmp, template,
                                ctypes.c_size_t(len(template)), ctypes.c_size_t(dt.itemsize),
                                ctypes.c_size_t(dt.fields["timestamp"][1]), per_burst, bursts, 100_000)
    fake.buffers_delivered += per_burst * bursts - refused
    fake.refused_records += refused * per_buffer  # CUPTI's count, which the probe reads (and resets)
    fake.stream_refused_buffers = getattr(fake, "stream_refused_buffers", 0) + refused  # the test's own


SPUN: list[int] = []  # each spinner's loops (bench/probe_forwarder.py: how far the "workload" got)
CPU_AT: dict[str, dict[str, float]] = {}  # the "cpu:NAME" steps' readings


def _spin(seconds: float) -> None:
    """A Python thread that holds the GIL whenever it runs, as a framework's threads do between calls."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += sum(range(200)) > 0
    SPUN.append(n)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads (Linux): Python's by their names (the sender's is
    ``gpufootprint-probe``), the others by the kernel's (``gfp-forwarder``, the C forwarder's)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
            name = names.get(int(tid)) or stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    except OSError:
        pass
    return out


def main() -> int:
    sync, steps = sys.argv[1], sys.argv[2:]
    # The raw delivery (CUPTI's buffers as bytes) is the probe's default; FAKE_DELIVERY=objects
    # drives cupti-python's record-object callbacks instead.
    cls = probe_fakes.FakeCupti if os.environ.get("FAKE_DELIVERY") == "objects" else probe_fakes.FakeRawCupti
    if os.environ.get("FAKE_STREAMS") == "1":
        cls = probe_fakes.StreamBufferedCupti
    fake = cls(shuffle=os.environ.get("FAKE_SHUFFLE", "1") == "1", buffer_records=int(os.environ.get("FAKE_BUFFER_RECORDS", "16")))
    fake.walk_disagrees = os.environ.get("FAKE_WALK_DISAGREES") == "1"
    t0 = time.perf_counter()
    ok = probe.start(backend=fake, discover_devices=False)
    start_s = time.perf_counter() - t0
    if not ok:
        print(json.dumps({"error": probe.current().errors if probe.current() else None}), flush=True)
        return 3
    workload_s = 0.0
    waited: dict[str, float] = {}  # seconds each waiting step waited (forwarding)
    for step in steps:
        op, _, arg = step.partition(":")
        t = time.perf_counter()
        if op == "alloc":
            parts = arg.split(":")
            fake.alloc(int(parts[0], 0), int(parts[1]), mk=int(parts[2]) if len(parts) > 2 else 3,
                       dev=int(parts[3]) if len(parts) > 3 else 0)
        elif op == "free":
            a, s = arg.split(":")
            fake.free(int(a, 0), int(s))
        elif op == "copy":
            fake.emit(probe_fakes.memcpy_record(int(arg)))
        elif op == "odd":  # a record no walk can size, in the next buffer
            fake.emit(probe_fakes.odd_record())
        elif op == "kernel":
            fake.launch(arg)
        elif op == "burst":
            for i in range(int(arg)):
                fake.alloc(0x7000_0000 + i * 4096, 4096)
                fake.free(0x7000_0000 + i * 4096, 4096)
        elif op == "reuse_inverted":
            reuse_inverted(fake, int(arg))
        elif op == "churn":
            churn(fake, float(arg))
        elif op == "stream":
            secs, rate, *spinners = arg.split(":")
            spin = [threading.Thread(target=_spin, args=(float(secs),)) for _ in range(int(spinners[0]) if spinners else 0)]
            for th in spin:
                th.start()
            stream(fake, float(secs), float(rate))
            for th in spin:
                th.join()
        elif op == "launch_loop":
            end = time.monotonic() + float(arg)
            while time.monotonic() < end:
                for i in range(10):
                    t = time.time_ns()
                    fake.emit(probe_fakes.kernel_record(f"tiny_{i}"))
                    fake.host_call(211, start=t, end=t + 4_000)  # cudaLaunchKernel, 4 us on the host
                t = time.time_ns()
                fake.host_call(131, start=t, end=t + 20_000)  # cudaStreamSynchronize: 20 us waiting for the GPU
                time.sleep(0.001)
        elif op == "long_steps":
            secs, step_ms = arg.split(":")
            end = time.monotonic() + float(secs)
            while time.monotonic() < end:
                for _ in range(10):
                    t = time.time_ns()
                    fake.emit(probe_fakes.kernel_record("sgemm_128x128"))
                    fake.host_call(211, start=t, end=t + 10_000)  # cudaLaunchKernel
                t = time.time_ns()
                time.sleep(float(step_ms) / 1000)  # the host waits for the GPU's long kernels
                fake.host_call(165, start=t, end=time.time_ns())  # cudaDeviceSynchronize
        elif op == "mark":
            probe.mark(arg)
        elif op == "apicall":
            cbid, ret = arg.split(":")
            fake.api_call(int(cbid), int(ret))
        elif op == "rtcall":  # a runtime call (cudaMalloc) that returned ret
            cbid, ret = arg.split(":")
            fake.runtime_call(int(cbid), int(ret))
        elif op == "faketorch":
            sys.modules["torch"] = probe_fakes.fake_torch()
        elif op == "torchoom":
            torch = sys.modules["torch"]
            end = time.monotonic() + 20
            while not torch._C.observers and time.monotonic() < end:  # attached at a heartbeat
                time.sleep(0.01)
            for fn in torch._C.observers:
                fn(0, int(arg), 80 << 30, 1 << 20)
        elif op == "wait":
            end = time.monotonic() + 30
            while not os.path.exists(os.path.join(sync, arg)) and time.monotonic() < end:
                time.sleep(0.01)
        elif op == "touch":
            open(os.path.join(sync, arg), "w").close()
        elif op == "sleep":
            time.sleep(float(arg))
        elif op == "until":  # until:COUNTER:N waits (up to 30 s) for the probe's status to count N of COUNTER
            key, n = arg.split(":")
            end = time.monotonic() + 30
            while probe.status().get(key, 0) < int(n) and time.monotonic() < end:
                time.sleep(0.01)
        elif op == "forwarding":  # until the daemon has asked for CUPTI's buffers unread (at the HELLO)
            end = time.monotonic() + 20
            while not probe.current().sender._forward and time.monotonic() < end:
                time.sleep(0.01)
            waited[op] = time.perf_counter() - t
        elif op == "cpu":  # the threads' CPU seconds now, kept under the step's name (bench/probe_forwarder.py)
            CPU_AT[arg] = _thread_cpu()
        elif op == "connected":
            end = time.monotonic() + 20
            before = probe.status()["resyncs"]
            while time.monotonic() < end and not (probe.status()["connected"] and probe.status()["resyncs"] > before - 1
                                                  and probe.status()["reconnects"] >= 1):
                time.sleep(0.01)
            time.sleep(0.1)
        workload_s += time.perf_counter() - t
    # The final flush and GOODBYE before the status is read: probe.stop() waits 3 s for them, which a
    # busy machine (a suite run on every core) can outlast; the status would then be read mid-way.
    cur = probe.current()
    cpu = _thread_cpu()  # before the stop joins the sender
    if cur is not None:
        cur.stop(timeout=60)
    print(json.dumps({"status": probe.status(), "errors": cur.errors if cur is not None else [], "start_s": start_s, "workload_s": workload_s, "waited": waited,
                      "spun": sum(SPUN), "thread_cpu": cpu, "cpu_at": CPU_AT,
                      "lost_while_disabled": fake.lost_while_disabled, "enabled_ever": sorted(fake.enabled_ever),
                      "fake": {k: getattr(fake, k) for k in ("full_buffers", "partial_buffers", "flushes",
                                                             "buffers_delivered", "refused_records",
                                                             "stream_refused_buffers")
                               if hasattr(fake, k)}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
