"""Probe overhead: step-time ratios against no instrumentation, interleaved A/B.

Each configuration lives in its own worker process (started once, so start-up
costs are not measured); the parent runs rounds. ``--interleave step`` (the
default since run 12, 2026-12-02 20:21 UTC): within a round the workers take turns step
by step, in a fresh random order for every step, so all configurations of a
round share the same seconds of the machine. ``--interleave round``: each
worker times all its steps of the round in one turn (runs 1 to 11). Ratios
compare a configuration with the uninstrumented worker of the same round, so
drift of the machine hits both sides; the median ratio comes with a bootstrap
95 % interval over rounds.

  python bench/overhead.py --rounds 12 --out results.json

Workloads: (a) a transformer training step (6 layers, d=1024, bf16, batch
16x512); (b) a loop of 100 tiny ``add_`` launches per step. Configurations:
none; probe (the probe's default settings, daemon listening); the probe_*
variants in PROBE_CONFIGS (delivery, flush mode, GIL-free flush, bulk packing, CUPTI
buffer size; probe_daemon_away: socket missing, records dropped and counted);
torch_profiler (torch.profiler(profile_memory=True) around each round);
memory_history (torch.cuda.memory._record_memory_history); cupti_floor (CUPTI's own cost: the
kinds the probe enables, its flush period and forced-flush cadence, every buffer handed back
unread, no socket: what any CUPTI-based tool pays before it reads a record). ``--alloc`` picks
PyTorch's allocator: caching (its default: almost no records once warm), async
(``backend:cudaMallocAsync``, about 850 memory records a step) or nocache
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, about 520). Each probed
configuration has a daemon (IngestServer) of its own, so the records it applied
late (behind its reorder window) are counted per configuration.

Every worker reports the cyclic garbage collector's time inside its timed steps; with
``GPUFOOTPRINT_BENCH_THREAD_CPU=1`` in the environment also each of its threads' CPU time
inside them, by thread name (the program's, CUPTI's, the probe's sender, the floor's), read
from /proc/self/task/*/schedstat between steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_PERIOD = {"flush_mode": "period", "flush_nogil": True, "bulk_pack": True, "cupti_buffer_bytes": 64 << 10}
_FORCED_OLD = {"flush_mode": "forced", "flush_nogil": False, "bulk_pack": False, "cupti_buffer_bytes": 4 << 20}
PROBE_CONFIGS: dict[str, dict[str, Any]] = {
    "probe": {},  # the defaults of ProbeSettings
    # The default until 2026-12-02: forced flush through cupti-python (GIL held) every 100 ms.
    "probe_gil_flush": _FORCED_OLD,
    "probe_nogil": {**_FORCED_OLD, "flush_nogil": True, "bulk_pack": True},
    "probe_period": _PERIOD,
    "probe_period_gil": {**_PERIOD, "flush_nogil": False},
    "probe_period_nobulk": {**_PERIOD, "bulk_pack": False},
    "probe_period_4m": {**_PERIOD, "cupti_buffer_bytes": 4 << 20},
    "probe_forced_bulk": {**_FORCED_OLD, "bulk_pack": True},
    "probe_copies_off": {"copies": "off"},  # no MEMCPY/MEMSET records: the default since run 8
    # MEMCPY/MEMCPY2/MEMSET always on: the default until run 8
    "probe_copies_always": {"copies": "always"},
    # One copy kind each, always on (with MEMORY2 and MEMORY_POOL): which one costs on the launch path?
    "probe_k_memcpy": {"copies": "always", "copy_kinds": "memcpy"},
    "probe_k_memcpy2": {"copies": "always", "copy_kinds": "memcpy2"},
    "probe_k_memset": {"copies": "always", "copy_kinds": "memset"},
    # The default until the raw delivery: cupti-python's record objects on CUPTI's thread.
    "probe_objects": {"delivery": "objects"},
    "probe_daemon_away": {},  # the defaults, socket missing
    # Without driver-API hooks (the default until 2026-12-02 19:10 UTC: mappings on other threads lost).
    "probe_no_hooks": {"driver_hooks": False},
    # The same end through cuptiActivityEnableDriverApi(cuMemMap/cuMemUnmap): no subscriber
    # (run 12; the default since run 13).
    "probe_hooks_activity": {"driver_hooks_via": "activity"},
    "probe_hooks_subscriber": {"driver_hooks_via": "subscriber"},  # the default of run 10
    # Without the API records of the allocation calls that catch OOMs (docs/oom.md; on by default
    # since 2026-12-03): "probe" against this one is what those records cost.
    "probe_no_oom_records": {"oom_records": False},
    # The stream-ordered allocation calls' API records too (opt-in: a record per cudaMallocAsync).
    "probe_oom_async": {"oom_records_async": True},
    "probe_b": {},  # a second worker with the defaults (see REPLICAS)
    # CUPTI's buffers read in the workload's process (the default until 2026-12-03): the daemon gets
    # BATCH frames; the default now forwards buffers of memory records unread.
    "probe_packed": {"forward_buffers": False},
    # The probe's defaults; only the daemon's kernel windows differ (DAEMON_SAMPLER).
    "probe_kernel_windows_off": {},
    "probe_kernel_windows": {},
    "probe_kernel_windows_serial": {"kernel_window_kind": "serial"},
    "probe_kernel_windows_dense": {},
    "probe_launch_windows_dense": {},
    "probe_kernel_windows_off_b": {},  # a second worker without windows (a replica, as probe_b)
    # Levers, one each (the cost table of docs/performance.md): no launch-call priming at CUDA's start
    # (and so no launch windows); a 10x slower sender (drains, watermarks and heartbeats); no PyTorch
    # hooks (the profiler hand-over and the OOM observer); no device discovery at all (since 2026-12-07
    # the probe never calls cuInit before the workload, and looks its devices up once CUDA is up).
    "probe_no_launch_windows": {"launch_windows": False},
    # A launch window's switches made on the sender's thread, as before 2026-12-06 (bench/launch_toggle.py)
    "probe_switch_sender": {"launch_switch_on_main": False},
    # Heartbeats and forced flushes each on their own wake, as before 2026-12-06 (probe.coalesce_wakes off)
    "probe_uncoalesced": {"coalesce_wakes": False},
    # Launch windows as before 2026-12-05: closed only when the daemon has read enough steps (a watermark
    # and a control round trip after them), not by the probe's own count (the worker turns that off).
    "probe_windows_uncounted": {},
    "probe_quiet": {"flush_ms": 1000, "watermark_ms": 5000, "heartbeat_ms": 5000},
    "probe_no_torch_hooks": {"torch_hook": False, "oom_torch_observer": False},
    "probe_no_discover": {},
    # Launch windows at every burst (a 1 s gap only), as before 2026-12-06: kernel_window_burst_gap_seconds 0.
    "probe_windows_every_burst": {},
    # CUPTI buffers of 256 KiB (64 of them: the same 16 MiB bound) instead of 64 KiB: a quarter of the
    # completions, wakes and GIL hand-overs under churn (run 26, 2026-12-06). Not the default: CUPTI 13
    # holds a buffer per recording thread, and 64 run out at 65 threads.
    "probe_big_buffers": {"cupti_buffer_bytes": 256 << 10, "raw_buffers": 64},
    # Launch windows, the (b) workload's cost in runs 28-31 (2026-12-06): half as often (every 60 s, and a
    # burst's window at most once a minute), or over 2 steps instead of 4. The probe's defaults; the daemon's
    # sampler differs (DAEMON_SAMPLER).
    "probe_windows_60s": {},
    "probe_windows_2steps": {},
    # PyTorch's allocator figures, opt-in since 2026-12-06 (probe.torch_numbers): read after optimizer steps
    # once a heartbeat, one nested statistics call a device.
    "probe_torch_numbers": {"torch_numbers": True},
    # The same read as the probe meant to before 2026-12-06 (the worker patches the reading): at most every
    # 0.5 s, by memory_allocated and memory_reserved, each of which builds, flattens and sorts the whole
    # memory_stats table. (Before 28c275f the hook never registered on a real torch: no reading was made.)
    "probe_torch_numbers_old": {"torch_numbers": True},
    # No NVML poll for the untracked kind (nor the forced flush before it) within a run.
    "probe_no_untracked": {"untracked_ms": 600_000},
    # The raw delivery's buffer callbacks as ctypes thunks (Python, the GIL taken on CUPTI's threads), the
    # default before the C ones (2026-12-06 evening). Its floor is cupti_floor_python_callbacks.
    "probe_python_callbacks": {"native_callbacks": False},
    # The sender's walk of buffers of mixed kinds in Python (before 2026-12-06 evening), not in C.
    "probe_python_walk": {"native_walk": False},
    # The sender's read of a forwarded buffer in numpy after the C walk (before 2026-12-07 evening), not in one
    # C call (the walk, the MEMORY2 structs copied into the table's queue, the API records' return values).
    "probe_python_read": {"native_read": False},
    # The table's watermark pairing by numpy's sort by address and time (before 2026-12-07 night), not in one
    # pass of C with the GIL let go (under churn the sort held the GIL milliseconds a watermark).
    "probe_python_pair": {"native_pair": False},
    # The sender's wait for its socket's room in Python's poll, the GIL won back at each wait (before 2026-12-07
    # night), not in one C call that lets it go for the whole wait.
    "probe_python_pump": {"native_pump": False},
    # CUPTI's buffers read, framed and queued by the probe's C forwarder thread, the sender waking for the frames in
    # bulk (off by default until measured here: docs/performance.md, "The C forwarder").
    "probe_native_forward": {"native_forward": True},
}
# Arguments of probe.start beside the settings.
START_ARGS: dict[str, dict[str, Any]] = {"probe_no_discover": {"discover_devices": False}}
# The floor's variants: what CuptiFloor switches on, by the probe's settings ("bare": the floor of earlier runs).
FLOOR_CONFIGS: dict[str, dict[str, Any]] = {
    "cupti_floor": {}, "cupti_floor_b": {},
    "cupti_floor_unprimed": {"launch_windows": False},  # the floor of probe_no_launch_windows
    "cupti_floor_bare": {"bare": True},
    "cupti_floor_python_callbacks": {"native_callbacks": False},  # the floor of probe_python_callbacks
}
# probe_*_windows*: the daemon's sampler.kernel_window_* per configuration. Every other probed
# configuration runs the default daemon: since 2026-12-03 launch windows, 50 ms of the host's launch
# and wait calls every 30 s per process (the first 5 s in) and at bursts. "probe_kernel_windows_off":
# no window at all (what the goal of 1 % compares the default with). "probe_kernel_windows": the same
# schedule with windows of kernel records, CUPTI's CONCURRENT_KERNEL; "_serial": the serial KERNEL
# kind (the probe's kernel_window_kind); "_dense": 50 ms every 1 s, 30 times the duty cycle, of kernel
# or launch records.
_KERNELS: dict[str, Any] = {"kernel_window_ms": 50, "kernel_window_records": "kernels"}
# dense: every second all run long (no back-off: what 30 times the default's duty cycle cost)
_DENSE: dict[str, Any] = {"kernel_window_every_seconds": 1.0, "kernel_window_first_seconds": 1.0,
                          "kernel_window_every_max_seconds": 0.0}
DAEMON_SAMPLER: dict[str, dict[str, Any]] = {
    "probe_kernel_windows_off": {"kernel_window_ms": 0},
    "probe_kernel_windows_off_b": {"kernel_window_ms": 0},
    "probe_kernel_windows": _KERNELS,
    "probe_kernel_windows_serial": _KERNELS,
    "probe_kernel_windows_dense": {**_KERNELS, **_DENSE},
    "probe_launch_windows_dense": {"kernel_window_ms": 50, **_DENSE},
    "probe_windows_every_burst": {"kernel_window_burst_gap_seconds": 0.0},
    "probe_windows_60s": {"kernel_window_every_seconds": 60.0, "kernel_window_burst_gap_seconds": 60.0},
    "probe_windows_2steps": {"kernel_window_steps": 2},
}
# Workers that run the same configuration as another. Run 12 read 1.016 between two
# uninstrumented workers on (a) with a 95 % interval of [1.006, 1.026]: each process carries a
# bias of its own, so a ratio of two single workers cannot resolve 1 %. The summary's "pooled"
# part compares the geometric means of the replica groups (none, none_b, none_c against probe,
# probe_b) round by round, which averages that bias down.
REPLICAS: dict[str, str] = {"none_b": "none", "none_c": "none", "probe_b": "probe",
                            "probe_kernel_windows_off_b": "probe_kernel_windows_off", "cupti_floor_b": "cupti_floor",
                            "aa": "aa", "aa_b": "aa"}
# Groups also compared with others, round by round: the default's launch windows against none, against the
# probe that opens none, and against windows that close only when the daemon says so.
VERSUS: dict[str, list[str]] = {"probe": ["probe_kernel_windows_off", "probe_no_launch_windows", "probe_windows_uncounted",
                                         "probe_windows_every_burst", "probe_big_buffers", "probe_windows_60s",
                                         "probe_windows_2steps", "probe_switch_sender", "probe_uncoalesced",
                                         "probe_torch_numbers", "probe_torch_numbers_old", "probe_no_untracked",
                                         "probe_python_callbacks", "probe_python_walk", "probe_python_read",
                                         "probe_python_pair", "probe_python_pump", "probe_native_forward"],
                          "cupti_floor": ["cupti_floor_python_callbacks"],
                          "probe_python_callbacks": ["cupti_floor_python_callbacks"]}
# none_b: a second uninstrumented worker. Its ratio to none is what the method reads with no
# instrumentation at all (A/A): the noise and bias floor for every other ratio.
# aa, aa_b: two more uninstrumented workers, pooled like the probe's pair: the A/A row of the verdict table
# (what the method reads between two groups of the same code).
CONFIGS = ["none", "none_b", "none_c", "aa", "aa_b", "none_discover", "none_det", *PROBE_CONFIGS, *FLOOR_CONFIGS, "torch_profiler",
           "memory_history"]
# The verdict table's set (--configs verdict): four workers each of the baseline, the A/A group, the probe and
# the floor. Run 21 (2026-12-03) found each worker's own bias (two bands 3 % apart on the transformer step)
# larger than the 0.5 % to resolve: only more workers a group average it down, not more rounds.
VERDICT_SPEC = "none*4,aa*4,probe*4,cupti_floor*4"
LEVERS = ["none", "none_b", "aa", "aa_b", "probe", "probe_b", "cupti_floor", "cupti_floor_b", "cupti_floor_unprimed", "probe_no_launch_windows", "probe_no_oom_records", "probe_daemon_away",
          "probe_quiet", "probe_no_discover", "probe_no_torch_hooks", "probe_packed"]
ALLOCATORS = {"caching": {}, "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
              "nocache": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}}


class CuptiFloor:
    """A CUPTI consumer that switches on exactly what the probe switches on and reads nothing: the floor.

    Built from the probe's own ``CuptiArming`` with the probe's default settings, in
    ``Probe.start``'s order: CUPTI's device buffers, the per-thread buffer attribute, the raw
    callbacks, the activity kinds, the driver-API switch, the OOM records' per-API switches,
    CUPTI's flush period, CONCURRENT_KERNEL where ``kernels`` is set, and the launch calls'
    per-API switches while CUDA starts (off at the first completed buffer of records, as the
    probe's sender turns them off). A thread of its own forces a flush every ``watermark_ms``
    as the sender does. Each completed buffer goes straight back to the pool, unread. What a
    probe costs above this is its own work (tests/unit/test_bench_overhead.py checks that the
    switches are the probe's, call for call).

    ``bare=True``: the floor of runs before 2026-12-04 (kinds, driver-API switch, flush
    period and forced flushes only: no OOM records, no launch-call priming)."""

    def __init__(self, backend: Any = None, *, bare: bool = False, settings: Any = None) -> None:
        from collections import Counter

        from gpufootprint.probe.arming import CuptiArming
        from gpufootprint.probe.backend import FOOTPRINT_ONLY, CuptiBackend
        from gpufootprint.probe.settings import ProbeSettings
        from gpufootprint.wire.cupti_layout import CONCURRENT_KERNEL

        s = settings if settings is not None else ProbeSettings()
        self.settings = s
        self.counters: Counter[str] = Counter()
        self.records_seen = threading.Event()
        # The probe's sender wakes on this (the C callbacks write to it), and so does the floor's thread
        from gpufootprint.probe.wakeup import Wakeup

        self.wakeup = Wakeup()
        self.arming = CuptiArming(s, self.counters, self._completed, self.wakeup)
        self.backend = backend if backend is not None else CuptiBackend(s.flush_nogil)
        self.arming.backend = self.backend
        self.backend.configure(s.device_buffer_bytes, s.device_buffer_pool_limit)
        self.priming = False
        if bare:
            from gpufootprint.probe.rawcallbacks import RawDelivery

            delivery = RawDelivery(s.cupti_buffer_bytes, s.raw_buffers, self._completed)
            self.arming.raw = delivery
            if not self.backend.register_raw(delivery):
                raise SystemExit(f"cupti_floor: raw callbacks not registered: {self.backend.errors}")
            for kind in FOOTPRINT_ONLY:
                self.backend.enable(kind)
            self.backend.driver_api_records(True)
            self.backend.flush_period(s.flush_ms)
        else:
            self.backend.per_thread_buffer({"on": True, "off": False}.get(s.per_thread_buffer))
            self.arming.arm(self._objects_requested, self._objects_completed, s.flush_ms / 1000)
            if self.arming.raw is None:
                raise SystemExit(f"cupti_floor: raw callbacks not registered: {self.backend.errors}")
            if s.kernels:
                self.backend.enable(CONCURRENT_KERNEL)
            if s.launch_windows and self.backend.launch_api_records(True):
                self.priming = True
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="cupti-floor")
        self.thread.start()

    @property
    def delivery(self) -> Any:
        return self.arming.raw

    def _completed(self, address: int, valid: int) -> None:
        """A buffer of records (the ctypes callbacks, on CUPTI's thread): back to the pool, unread."""
        self.records_seen.set()
        self.arming.raw.give_back(address)  # type: ignore[union-attr]

    def _take(self) -> None:
        """The buffers the C callbacks queued (the floor's thread, as the probe's sender): back, unread."""
        raw = self.arming.raw
        if raw is not None and raw.native:
            taken = raw.take()
            if taken:
                self.records_seen.set()
            for address, _ in taken:
                raw.give_back(address)

    @staticmethod
    def _objects_requested(*_: Any) -> Any:  # never registered: the floor needs raw delivery
        raise AssertionError("cupti_floor registers raw callbacks only")

    _objects_completed = _objects_requested

    def _run(self) -> None:
        s = self.settings
        next_flush = time.monotonic() + s.watermark_ms / 1000
        while not self._stop.is_set():
            self._take()
            now = time.monotonic()
            if self.priming and self.records_seen.is_set():
                self.priming = False
                self.backend.launch_api_records(False)
            if now >= next_flush:
                self.backend.flush(True)
                next_flush = now + s.watermark_ms / 1000
            wait = next_flush - time.monotonic()
            if self.priming:
                wait = min(wait, s.flush_ms / 1000)  # the sender looks for records at its drain cadence
            self.wakeup.wait(max(0.0005, wait))
            self.wakeup.clear()
        self.arming.retire_wakeup()

    def stop(self) -> None:
        self._stop.set()
        self.wakeup.set()
        self.thread.join(2)


HERE = Path(__file__).resolve()


# --- worker ---------------------------------------------------------------------


def base_of(config: str) -> str:
    """``probe#3`` -> ``probe``: any configuration can be run by several workers, one process each."""
    return config.split("#", 1)[0]


def group_of(config: str) -> str:
    base = base_of(config)
    return REPLICAS.get(base, base)


def pin_all_threads(cpus: set[int]) -> None:
    """Every thread of this process on ``cpus`` (sched_setaffinity moves only the thread it names)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile


def _count_gc_time() -> list[float]:
    """[seconds] the cyclic garbage collector has run in this process since now (gc.callbacks): a probe that
    left more objects for each full collection to walk would show here, whatever thread it lands on."""
    import gc

    total = [0.0]
    started: list[float | None] = [None]

    def note(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif started[0] is not None:  # not the end of a collection that began before the clock
            total[0] += time.perf_counter() - started[0]
            started[0] = None

    gc.callbacks.append(note)
    return total


def _threads_cpu_ns() -> dict[int, int]:
    """{thread id: CPU nanoseconds it has run} for every thread of this process (the first field of
    /proc/self/task/TID/schedstat: the scheduler's own clock, nanoseconds, unlike utime's ticks)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return out


def _thread_name(tid: int, names: dict[int, str]) -> str:
    """A Python thread's own name (before 3.14 CPython does not give it to the OS), else the OS's (comm:
    CUPTI's and PyTorch's native threads name themselves)."""
    if tid not in names:
        for t in threading.enumerate():
            if t.native_id == tid:
                names[tid] = t.name
                return names[tid]
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[tid] = f.read().strip()
        except OSError:
            names[tid] = "?"
    return names[tid]


T_ORIGIN = time.perf_counter()


def _note_windows() -> list[list[float]]:
    """[[open, close], ...] of the probe's kernel and launch windows in this process, seconds on the
    worker's clock (T_ORIGIN): the probe's Windows class wrapped, nothing else changed."""
    from gpufootprint.probe.windows import Windows

    seen: list[list[float]] = []
    opened, closed = Windows.open_kernel_window, Windows.close_kernel_window

    def open_(self: Any, *args: Any, **kwargs: Any) -> Any:
        was = self.kernel_window
        out = opened(self, *args, **kwargs)
        if was is None and self.kernel_window is not None:
            seen.append([round(time.perf_counter() - T_ORIGIN, 5), -1.0])
        return out

    def close_(self: Any, *args: Any, **kwargs: Any) -> Any:
        was = self.kernel_window
        out = closed(self, *args, **kwargs)
        if was is not None and seen and seen[-1][1] < 0:
            seen[-1][1] = round(time.perf_counter() - T_ORIGIN, 5)
        return out

    Windows.open_kernel_window = open_  # type: ignore[method-assign]
    Windows.close_kernel_window = close_  # type: ignore[method-assign]
    return seen


def p99_outside_windows(raw: dict[str, Any], w: str) -> tuple[float, float, int]:
    """(p99 of every step, p99 of the steps that overlap no window, steps that overlap one), seconds."""
    steps = raw["steps"][w]
    wins = [(o, c if c >= 0 else float("inf")) for o, c in raw["windows"]]
    inside = [s for s in steps if any(s[0] < c and s[0] + s[1] > o for o, c in wins)]
    outside = [s[1] for s in steps if s not in inside]
    return pct([s[1] for s in steps], 99), pct(outside, 99) if outside else float("nan"), len(inside)


def _old_torch_numbers(p: Any) -> None:
    """PyTorch's allocator figures read as the probe read them before 2026-12-06 (probe_torch_numbers_old)."""
    from gpufootprint.probe import torchnumbers

    def read_now() -> dict[str, Any]:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return {}
        n = torch.cuda.device_count()
        return {"allocated": {str(d): int(torch.cuda.memory_allocated(d)) for d in range(n)},
                "reserved": {str(d): int(torch.cuda.memory_reserved(d)) for d in range(n)}}

    torchnumbers.read_now = read_now  # type: ignore[assignment]
    if p is not None:
        p.sender.torch_numbers.min_interval_s = 0.5


def _commands() -> Any:
    """The parent's commands, a line at a time. Waiting for the next, the main thread wakes every 5 ms
    (select, then back to Python), as a training loop's main thread never sits in C for long: the probe
    switches a launch window on the main thread when it comes within 0.25 s (probe/mainthread.py), and a
    worker blocked on its pipe for 15 other workers' steps of the transformer would not come."""
    import select

    fd, buf = sys.stdin.fileno(), b""
    while True:
        while b"\n" not in buf:
            if select.select([fd], [], [], 0.005)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return
                buf += chunk
        line, buf = buf.split(b"\n", 1)
        yield line.decode()


def worker(config: str, socket_path: str, steps_a: int, steps_b: int, cpus: str) -> None:
    config = base_of(config)
    if config == "none_discover":
        # Uninstrumented, but the probe's device discovery of before 2026-12-07 first (cuInit and device
        # queries through cuda-bindings before the workload's own first CUDA call): does that alone move
        # the step? (Today's probe looks its devices up only once the workload has started CUDA.)
        from gpufootprint.probe import hostinfo

        hostinfo.cuda_devices()
    floor = None
    if config in FLOOR_CONFIGS:
        from gpufootprint.probe.settings import ProbeSettings

        opts = dict(FLOOR_CONFIGS[config])
        bare = bool(opts.pop("bare", False))
        floor = CuptiFloor(bare=bare, settings=ProbeSettings(**opts))
    windows_seen = _note_windows() if config.startswith("probe") else []
    if config == "probe_windows_uncounted":
        from gpufootprint.probe.windows import Windows

        Windows.counted_enough = lambda self: False  # type: ignore[method-assign]
    gc_seconds = _count_gc_time()
    if config.startswith("probe"):
        from gpufootprint import probe

        ok = probe.start(socket=socket_path + ".absent" if config == "probe_daemon_away" else socket_path,
                         **START_ARGS.get(config, {}), **PROBE_CONFIGS[config])
        if not ok:
            print(json.dumps({"error": "probe did not start", "status": probe.status()}), flush=True)
        if config == "probe_torch_numbers_old":
            _old_torch_numbers(probe.current())
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    if config == "memory_history":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    from _workloads import transformer_step  # bench/, this script's directory

    step_a = transformer_step(16, 512)
    tiny = torch.zeros(256, device="cuda")

    def step_b() -> None:
        for _ in range(100):
            tiny.add_(1.0)

    in_steps = {"a": 0.0, "b": 0.0}  # the cyclic collector's time inside timed steps
    # GPUFOOTPRINT_BENCH_THREAD_CPU=1: each thread's CPU time inside the timed steps, by thread name (read
    # between steps, outside the timed part): whose work a step pays for, the program's threads, CUPTI's or
    # the probe's sender
    thread_cpu = os.environ.get("GPUFOOTPRINT_BENCH_THREAD_CPU") == "1"
    cpu_in_steps: dict[str, dict[str, int]] = {"a": {}, "b": {}}
    names: dict[int, str] = {}

    # Every timed step after warm-up as (start, seconds) on this worker's clock, and its probe's windows
    # (open, close) on the same clock: which steps a p99 is made of (the parent writes them beside --out)
    raw: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    recording = [False]

    def timed(fn: Any, n: int) -> list[float]:
        out = []
        w = "a" if fn is step_a else "b"
        for _ in range(n):
            torch.cuda.synchronize()
            c0 = _threads_cpu_ns() if thread_cpu else {}
            g0 = gc_seconds[0]
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
            if recording[0]:
                raw[w].append((round(t0 - T_ORIGIN, 5), round(out[-1], 7)))
            in_steps[w] += gc_seconds[0] - g0
            if thread_cpu:
                for tid, ns in _threads_cpu_ns().items():
                    name = _thread_name(tid, names)
                    cpu_in_steps[w][name] = cpu_in_steps[w].get(name, 0) + ns - c0.get(tid, 0)
        return out

    for _ in range(3):
        step_a()
    timed(step_b, 20)
    if cpus:
        # Every worker on the same CPUs (they take turns): a worker's place on the machine no longer
        # differs from another's (A/A read 0.95-1.04 unpinned, runs 4 and 5). Pinned once warm, every
        # thread (the probe's and CUPTI's included): start-up runs on all CPUs, many workers at once.
        pin_all_threads({int(c) for c in cpus.split(",")})
    recording[0] = True
    print(json.dumps({"ready": config}), flush=True)
    prof: Any = None
    for line in _commands():
        cmd = line.strip()
        if cmd in ("a", "b"):  # one step, timed (--interleave step)
            print(json.dumps({"t": timed(step_a if cmd == "a" else step_b, 1)[0]}), flush=True)
            continue
        if cmd == "begin":  # a round starts (--interleave step)
            if config == "torch_profiler":
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True)
                prof.__enter__()
            print(json.dumps({"ok": 1}), flush=True)
            continue
        if cmd == "end":
            if prof is not None:
                prof.__exit__(None, None, None)
                prof = None
            print(json.dumps({"ok": 1}), flush=True)
            continue
        if cmd != "round":
            break
        if config == "torch_profiler":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True):
                a = timed(step_a, steps_a)
                b = timed(step_b, steps_b)
        else:
            a = timed(step_a, steps_a)
            b = timed(step_b, steps_b)
        print(json.dumps({"a": a, "b": b}), flush=True)
    import gc

    extra: dict[str, Any] = {"gc": {"seconds": round(gc_seconds[0], 6), "seconds_in_a": round(in_steps["a"], 6),
                                    "seconds_in_b": round(in_steps["b"], 6),
                                    "collections": [g["collections"] for g in gc.get_stats()],
                                    "tracked_objects": len(gc.get_objects())}}
    extra["raw"] = {"steps": raw, "windows": windows_seen}
    if thread_cpu:
        extra["thread_cpu_ms_in_steps"] = {w: {k: round(v / 1e6, 3) for k, v in sorted(d.items())}
                                           for w, d in cpu_in_steps.items()}
    if floor is not None:
        extra["cupti_floor"] = {"buffers_completed": floor.delivery.completed, "buffers_refused": floor.delivery.refused,
                                "priming_ended": not floor.priming, "counters": dict(floor.counters),
                                "callbacks": "c" if floor.delivery.native else "python"}
    if config.startswith("probe"):
        from gpufootprint import probe

        extra["probe"] = probe.status()
    print(json.dumps({"done": config, **extra}), flush=True)


# --- parent -----------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """Where and when this ran: host, GPU (name, UUID), driver, the code's commit, UTC time."""
    out: dict[str, Any] = {"host": os.uname().nodename, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "cpus": len(os.sched_getaffinity(0))}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20, check=False)
        out["gpus"] = [line.strip() for line in q.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        out["gpus"] = []
    out["commit"] = os.environ.get("GPUFOOTPRINT_COMMIT")  # the device's copy of the tree has no .git
    try:
        out["commit"] = out["commit"] or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=HERE.parent, timeout=10, check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def ask(p: subprocess.Popen[str], cmd: str) -> Any:
    """One command to a worker, its one-line JSON answer."""
    p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
    p.stdin.flush()  # type: ignore[union-attr]
    return json.loads(p.stdout.readline())  # type: ignore[union-attr]


def p99_ratio_ci(steps: dict[str, dict[str, list[list[float]]]], members: list[str], other: list[str], w: str,
                 seed: int, n: int = 1000) -> tuple[float, float]:
    """95 % interval of the ratio of two groups' p99 steps, resampling rounds with replacement (the same rounds
    for both: they shared the machine's seconds). Slow steps cluster in rounds (a noisy neighbour, the
    daemon's watermark), so the interval is wider than one over steps would be."""
    import numpy as np

    def by_round(group: list[str]) -> np.ndarray:  # rounds x (workers' steps of that round)
        return np.concatenate([np.asarray(steps[c][w], dtype=float) for c in group], axis=1)

    mine, theirs = by_round(members), by_round(other)
    rng = np.random.default_rng(seed)
    k = len(mine)
    ratios = sorted(float(np.percentile(mine[i], 99) / np.percentile(theirs[i], 99))
                    for i in (rng.integers(0, k, k) for _ in range(n)))
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def bootstrap_ci(ratios: list[float], seed: int, n: int = 2000) -> tuple[float, float]:
    """95 % interval of the median of ``ratios``, resampling rounds with replacement."""
    rng = random.Random(seed)
    k = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=k)) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def geo(steps: dict[str, dict[str, list[list[float]]]], group: list[str], w: str, rnd: int) -> float:
    """Geometric mean over a group of workers of their median step in one round."""
    return math.exp(statistics.fmean(math.log(statistics.median(steps[c][w][rnd])) for c in group))


def pooled(steps: dict[str, dict[str, list[list[float]]]], configs: list[str], seed: int) -> dict[str, Any]:
    """Every configuration (a replica group or a single worker) against the uninstrumented group,
    round by round (geometric means of the workers' round medians); p99 over all the steps."""
    groups: dict[str, list[str]] = {}
    for c in configs:
        groups.setdefault(group_of(c), []).append(c)
    base = groups.get("none", [])
    out: dict[str, Any] = {}
    if len(base) < 2:
        return out
    for name, members in groups.items():
        if name == "none":
            continue
        row: dict[str, Any] = {"workers": members, "baseline_workers": base}
        for w in ("a", "b"):
            ratios = [geo(steps, members, w, r) / geo(steps, base, w, r) for r in range(len(steps[base[0]][w]))]
            lo, hi = bootstrap_ci(ratios, seed)
            flat = [t for c in members for r in steps[c][w] for t in r]
            bflat = [t for c in base for r in steps[c][w] for t in r]
            row[w] = {"median_ratio": round(statistics.median(ratios), 4),
                      "median_ratio_ci95": [round(lo, 4), round(hi, 4)],
                      "p99_ratio": round(pct(flat, 99) / pct(bflat, 99), 4)}
            for versus in VERSUS.get(name, []):
                other = groups.get(versus)
                if not other:
                    continue
                vs = [geo(steps, members, w, r) / geo(steps, other, w, r) for r in range(len(steps[base[0]][w]))]
                vlo, vhi = bootstrap_ci(vs, seed)
                row[w]["vs_" + versus] = round(statistics.median(vs), 4)
                row[w]["vs_" + versus + "_ci95"] = [round(vlo, 4), round(vhi, 4)]
            floor = groups.get("cupti_floor")
            if floor and name != "cupti_floor":
                vs = [geo(steps, members, w, r) / geo(steps, floor, w, r) for r in range(len(steps[base[0]][w]))]
                flo, fhi = bootstrap_ci(vs, seed)
                row[w]["vs_cupti_floor"] = round(statistics.median(vs), 4)
                row[w]["vs_cupti_floor_ci95"] = [round(flo, 4), round(fhi, 4)]
                fflat = [t for c in floor for r in steps[c][w] for t in r]
                row[w]["p99_vs_cupti_floor"] = round(pct(flat, 99) / pct(fflat, 99), 4)
                row[w]["p99_vs_cupti_floor_ci95"] = [round(x, 4) for x in p99_ratio_ci(steps, members, floor, w, seed)]
        out[name] = row
    return out


def expand(spec: str) -> list[str]:
    """``none*3,probe*2`` -> ``none, none#2, none#3, probe, probe#2``: N workers (processes) of a configuration."""
    out: list[str] = []
    for item in spec.split(","):
        name, _, n = item.strip().partition("*")
        out += [name if k == 1 else f"{name}#{k}" for k in range(1, int(n or 1) + 1)]
    return out


def run_steps(out_json: str) -> dict[str, dict[str, list[list[float]]]]:
    """A finished run's steps by configuration, workload and round, from its summary (the rounds, the steps a round)
    and its steps file (every step of every worker in order, each round's ``steps_a`` and ``steps_b`` in turn)."""
    summary = json.loads(Path(out_json).read_text())
    with gzip.open(out_json + ".steps.json.gz", "rt") as f:
        raws = json.load(f)
    rounds = summary["rounds"]
    steps: dict[str, dict[str, list[list[float]]]] = {}
    for c, raw in raws.items():
        steps[c] = {}
        for w in ("a", "b"):
            durations = [s[1] for s in raw["steps"][w]]
            per = summary["steps_" + w]
            if len(durations) != per * rounds:
                raise SystemExit(f"{out_json}: {c} has {len(durations)} steps of {w}, not {rounds} rounds of {per}")
            steps[c][w] = [durations[r * per:(r + 1) * per] for r in range(rounds)]
    return steps


def reanalysed(out_jsons: str | list[str], seed: int) -> dict[str, Any]:
    """``pooled`` of one finished run, or of several runs of the same configurations and steps a round, their
    rounds one after another: a verdict of 60 rounds (or a p99 interval narrow enough for its goal) from calls that
    each hold fewer, on one machine (the workers differ from call to call: their own biases then average out too)."""
    files = [out_jsons] if isinstance(out_jsons, str) else out_jsons
    steps: dict[str, dict[str, list[list[float]]]] = {}
    # one machine and one commit: runs of different machines are a range, never pooled
    first = json.loads(Path(files[0]).read_text()).get("machine", {})
    for out_json in files[1:]:
        other = json.loads(Path(out_json).read_text()).get("machine", {})
        for key in ("gpus", "commit"):
            if other.get(key) != first.get(key):
                raise SystemExit(f"{out_json}: {key} {other.get(key)} is not {files[0]}'s {first.get(key)}")
    for out_json in files:
        one = run_steps(out_json)
        if steps and (set(one) != set(steps) or any(len(one[c][w][0]) != len(steps[c][w][0])
                                                    for c in one for w in ("a", "b"))):
            raise SystemExit(f"{out_json}: not the configurations and steps a round of {files[0]}")
        for c, by_w in one.items():
            for w, rounds in by_w.items():
                steps.setdefault(c, {}).setdefault(w, []).extend(rounds)
    return pooled(steps, list(steps), seed)


def verdict_table(pooled_rows: dict[str, Any]) -> str:
    """One line per group: median step ratio against the uninstrumented pair with its 95 % interval, p99
    ratio, and the same against the floor; the A/A group (aa) first: the noise any other ratio sits in."""
    head = (f"{'config (workers)':28s} {'wl':2s} {'vs none':>8s} {'ci95':>17s} {'p99':>7s} | {'vs floor':>8s} "
            f"{'ci95':>17s} {'p99':>7s} {'p99 ci95':>17s}")
    lines = [head, "-" * len(head)]
    order = sorted(pooled_rows, key=lambda n: (n != "aa", not n.startswith("cupti_floor"), n != "probe", n))
    for name in order:
        row = pooled_rows[name]
        label = f"{name} ({len(row['workers'])})"
        for w in ("a", "b"):
            r = row[w]
            ci = "[{:.4f}, {:.4f}]".format(*r["median_ratio_ci95"])
            fci = "[{:.4f}, {:.4f}]".format(*r["vs_cupti_floor_ci95"]) if "vs_cupti_floor_ci95" in r else ""
            lines.append(f"{label if w == 'a' else '':28s} {w:2s} {r['median_ratio']:8.4f} {ci:>17s} {r['p99_ratio']:7.3f} | "
                         f"{r.get('vs_cupti_floor', float('nan')):8.4f} {fci:>17s} "
                         f"{r.get('p99_vs_cupti_floor', float('nan')):7.3f} "
                         + ("[{:.3f}, {:.3f}]".format(*r["p99_vs_cupti_floor_ci95"])
                            if "p99_vs_cupti_floor_ci95" in r else ""))
    for name in order:  # the group-against-group comparisons (VERSUS), round by round
        for w in ("a", "b"):
            for key, value in pooled_rows[name][w].items():
                if key.startswith("vs_") and key.endswith("_ci95") and key != "vs_cupti_floor_ci95":
                    other = key[3:-5]
                    lines.append(f"{name} vs {other} {w}: {pooled_rows[name][w]['vs_' + other]:.4f} "
                                 "[{:.4f}, {:.4f}]".format(*value))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--socket", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps-a", type=int, default=15)
    ap.add_argument("--steps-b", type=int, default=100)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated names, NAME*N for N workers of one (pooled), or 'verdict' (four "
                         "workers each of none, aa, probe, cupti_floor) or 'levers' (pairs of those and one "
                         "worker per lever: run 21)")
    ap.add_argument("--progress", action="store_true", help="a line per round on stderr")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="stop starting rounds after this many seconds of rounds and summarise those done "
                         "(a lent machine's call has a time limit)")
    ap.add_argument("--out", default="-")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interleave", choices=("step", "round"), default="step",
                    help="workers take turns every step (step) or every round (round)")
    ap.add_argument("--alloc", choices=tuple(ALLOCATORS), default="caching",
                    help="PyTorch's allocator in every worker: caching (default), async (cudaMallocAsync), "
                         "nocache (PYTORCH_NO_CUDA_MEMORY_CACHING=1)")
    ap.add_argument("--pin", type=int, default=2,
                    help="run every worker on the same N CPUs, the parent on the others (0: no pinning)")
    ap.add_argument("--reanalyse", metavar="OUT_JSON", nargs="+",
                    help="print the verdict table of a finished run again from its --out file and the steps beside "
                         "it (OUT_JSON.steps.json.gz), with today's analysis (e.g. the p99's interval); several runs "
                         "of the same configurations on one machine: their rounds pooled")
    args = ap.parse_args()
    if args.reanalyse:
        rows = reanalysed(args.reanalyse, args.seed)
        print(verdict_table(rows))
        rounds = [json.loads(Path(f).read_text())["rounds"] for f in args.reanalyse]
        print(f"rounds: {sum(rounds)} ({' + '.join(map(str, rounds))}, pooled from {len(rounds)} run(s))")
        return 0
    if args.worker:
        worker(args.worker, args.socket, args.steps_a, args.steps_b, args.cpus)
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    worker_cpus = cpus[-args.pin:] if 0 < args.pin < len(cpus) else []
    if worker_cpus:
        os.sched_setaffinity(0, set(cpus) - set(worker_cpus))  # the daemons stay off the workers' CPUs

    configs = LEVERS if args.configs == "levers" else expand(VERDICT_SPEC if args.configs == "verdict" else args.configs)
    if args.alloc == "async" and "memory_history" in configs:
        # torch.cuda.memory._record_memory_history raises under cudaMallocAsync (H200, 2026-12-03).
        configs.remove("memory_history")
        print("memory_history left out: PyTorch refuses it under cudaMallocAsync", file=sys.stderr)
    worker_env = {**os.environ, **ALLOCATORS[args.alloc]}
    tmp = tempfile.mkdtemp(prefix="gpufootprint-bench-")
    from gpufootprint.configload import load_config
    from gpufootprint.hub import FeatureHub
    from gpufootprint.ingest.server import IngestServer
    from gpufootprint.pipeline import Pipeline

    cfg = load_config(env={})
    servers: dict[str, IngestServer] = {}
    for c in configs:
        if c.startswith("probe") and base_of(c) != "probe_daemon_away":
            hub = FeatureHub(cfg.features, dataclasses.replace(cfg.sampler, **DAEMON_SAMPLER.get(base_of(c), {})))
            servers[c] = IngestServer(cfg, Pipeline(cfg.footprint, hub=hub),
                                      socket_path=os.path.join(tmp, f"{c}.sock"))
            hub.control = servers[c].send_control  # as App wires it
            servers[c].open()
            threading.Thread(target=servers[c].run, daemon=True).start()

    procs: dict[str, subprocess.Popen[str]] = {}
    for c in configs:
        sock = os.path.join(tmp, f"{c}.sock")
        env = worker_env
        prefix: list[str] = []
        if base_of(c) == "none_det":
            # The same uninstrumented worker with Python's string hashing fixed and address-space
            # randomisation off: is a worker's own bias (module above REPLICAS) set by either?
            env = {**worker_env, "PYTHONHASHSEED": "0"}
            prefix = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
        procs[c] = subprocess.Popen([*prefix, sys.executable, str(HERE), "--worker", c, "--socket", sock,
                                     "--steps-a", str(args.steps_a), "--steps-b", str(args.steps_b),
                                     "--cpus", ",".join(map(str, worker_cpus))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for c, p in procs.items():
        line = p.stdout.readline()  # type: ignore[union-attr]
        if "ready" not in line:
            raise SystemExit(f"worker {c} failed to start: {line!r}")
    rng = random.Random(args.seed)
    steps: dict[str, dict[str, list[list[float]]]] = {c: {"a": [], "b": []} for c in configs}
    t_start = time.time()
    for rnd in range(args.rounds):
        if args.max_seconds and rnd > 0 and time.time() - t_start > args.max_seconds:
            print(f"stopped after {rnd} rounds: --max-seconds {args.max_seconds}", file=sys.stderr, flush=True)
            break
        if args.progress:
            print(f"round {rnd} at {time.time() - t_start:.1f} s", file=sys.stderr, flush=True)
        if args.interleave == "round":
            order = configs[:]
            rng.shuffle(order)
            for c in order:
                res = ask(procs[c], "round")
                steps[c]["a"].append(res["a"])
                steps[c]["b"].append(res["b"])
            continue
        for c in configs:
            ask(procs[c], "begin")
        for w, n in (("a", args.steps_a), ("b", args.steps_b)):
            times: dict[str, list[float]] = {c: [] for c in configs}
            for _ in range(n):
                order = configs[:]
                rng.shuffle(order)
                for c in order:
                    times[c].append(ask(procs[c], w)["t"])
            for c in configs:
                steps[c][w].append(times[c])
        for c in configs:
            ask(procs[c], "end")
    finals = {}
    raws = {}
    for c, p in procs.items():
        finals[c] = ask(p, "stop")
        raws[c] = finals[c].pop("raw", None)
        p.wait(30)
    time.sleep(0.5)
    daemons = {}
    for c, server in servers.items():
        pl = server.pipeline
        daemons[c] = {"late_records": pl.late_records, "records_ingested": dict(pl.records_ingested),
                      "errors": dict(pl.errors.counts), "checks": dict(pl.verify_results),
                      "drift_bytes_max": max((p.drift_bytes for p in pl.processes.values()), default=0),
                      "drift_mismatches": sum(p.drift_mismatches for p in pl.processes.values()),
                      "resync_requests": server.resync_requests}
        server.stop()

    summary: dict[str, Any] = {"machine": machine(), "rounds": len(steps[configs[0]]["a"]), "steps_a": args.steps_a, "steps_b": args.steps_b,
                               "alloc": args.alloc,
                               "interleave": args.interleave,
                               "worker_cpus": worker_cpus,
                               "wall_seconds": round(time.time() - t_start, 1), "configs": {}}
    base = steps.get("none")
    for c in configs:
        row: dict[str, Any] = {}
        for w in ("a", "b"):
            meds = [statistics.median(r) for r in steps[c][w]]
            flat = [t for r in steps[c][w] for t in r]
            row[w] = {"median_step_ms": round(statistics.median(flat) * 1e3, 4),
                      "p99_step_ms": round(pct(flat, 99) * 1e3, 4)}
            if base is not None:
                bmeds = [statistics.median(r) for r in base[w]]
                bflat = [t for r in base[w] for t in r]
                ratios = [m / b for m, b in zip(meds, bmeds)]
                row[w]["median_ratio"] = round(statistics.median(ratios), 4)
                row[w]["round_ratio_min"] = round(min(ratios), 4)
                row[w]["round_ratio_max"] = round(max(ratios), 4)
                lo, hi = bootstrap_ci(ratios, args.seed)
                row[w]["median_ratio_ci95"] = [round(lo, 4), round(hi, 4)]
                row[w]["round_ratios"] = [round(r, 4) for r in ratios]
                row[w]["p99_ratio"] = round(pct(flat, 99) / pct(bflat, 99), 4)
        row["final"] = finals.get(c)
        row["settings"] = PROBE_CONFIGS.get(base_of(c))
        row["daemon"] = daemons.get(c)
        summary["configs"][c] = row
    summary["pooled"] = pooled(steps, configs, args.seed)
    text = json.dumps(summary, indent=1)
    if args.out == "-":
        print(text)
        return 0
    Path(args.out).write_text(text + "\n")
    # Every timed step of every worker, with its probe's windows: out.steps.json.gz
    with gzip.open(args.out + ".steps.json.gz", "wt") as f:
        json.dump(raws, f)
    for c, r in raws.items():
        if r and r["windows"]:
            cells = []
            for w in ("a", "b"):
                p_all, p_out, n_in = p99_outside_windows(r, w)
                cells.append(f"{w}: p99 {p_all * 1e3:.3f} ms, outside windows {p_out * 1e3:.3f} ms ({n_in} steps in "
                             f"{len(r['windows'])} windows)")
            print(f"{c:20s}", " | ".join(cells))
    for c, row in summary["configs"].items():  # a short table; the whole summary is in --out
        cells = [f"{w}: med {row[w]['median_step_ms']} ms x{row[w].get('median_ratio')} "
                 f"ci95 {row[w].get('median_ratio_ci95')} "
                 f"[{row[w].get('round_ratio_min')}..{row[w].get('round_ratio_max')}] "
                 f"p99 {row[w]['p99_step_ms']} ms x{row[w].get('p99_ratio')}" for w in ("a", "b")]
        print(f"{c:20s}", " | ".join(cells))
        st = (row.get("final") or {}).get("probe") or {}
        if st:
            print(" " * 21, {k: st.get(k) for k in ("flush_mode", "delivery", "callbacks", "flushes", "flush_seconds",
                                                     "callback_seconds", "raw_buffers", "raw_buffers_refused",
                                                     "cupti_dropped_records",
                                                     "buffers_completed", "records_sent", "bulk_records",
                                                     "bulk_fallbacks", "records_dropped", "resyncs",
                                                     "drop_resyncs", "forwarded_buffers", "table_seconds",
                                                     "forward_seconds", "torch_readings", "torch_read_seconds",
                                                     "sender_wakeups", "native_reads", "native_pairs",
                                                     "native_pairs_unordered")}, row.get("daemon"))
        gc_row = (row.get("final") or {}).get("gc")
        if gc_row:
            print(" " * 21, "gc", gc_row)
        cpu_row = (row.get("final") or {}).get("thread_cpu_ms_in_steps")
        if cpu_row:
            print(" " * 21, "CPU ms in steps by thread", cpu_row)
    print(verdict_table(summary["pooled"]))
    done = summary["rounds"]
    # A run cut by --max-seconds is easy to take for the verdict it was meant to be (issue 27 asks for 60)
    print(f"rounds: {done} of {args.rounds} asked" + ("" if done == args.rounds else
                                                      f" (stopped by --max-seconds {args.max_seconds:g})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
