"""The daemon's tick: what moves the pipeline on when no record does.

Each tick advances the watermarks of probes that have gone quiet by the daemon's clock, keeps the
number of processes bounded, and builds the snapshot, dropping (quarantining) a process whose own
state breaks it rather than failing everyone's tick. ``TickRecord`` remembers how the ticks went,
for /readyz and the snapshot's age at scrape time. The ingest loop (``server.py``) calls these.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpufootprint.ingest.tenants import share
from gpufootprint.pipeline import Pipeline
from gpufootprint.serverstats import TickHealth
from gpufootprint.snapshot import GpuState, NvmlSnapshot, PipelineSnapshot

#: A probe that sends watermarks is advanced by the daemon's clock only after this long without one
#: (at least; five of its declared watermark periods when longer): it has hung or stopped flushing.
SILENT_PROBE_S = 10.0

Quarantine = Callable[[int, BaseException], None]


def _declared_watermark_ms(hello: dict[str, Any]) -> float | None:
    declared = hello.get("watermark_ms")
    if isinstance(declared, (int, float)) and not isinstance(declared, bool) and 0 < declared <= 60_000:
        return declared
    return None


def clock_lag_ns(hello: dict[str, Any], reorder_window_ms: int) -> int:
    """How far behind the daemon's clock a live probe's records are applied without its word.

    A probe's WATERMARK frames move its watermark as soon as it sends them. The clock is the
    fallback for a probe that has gone quiet; it must not overtake records still on their
    way, so it waits for the reorder window or, for a probe whose HELLO says it sends a
    watermark only every ``watermark_ms``, for two and a half of those.
    """
    lag = reorder_window_ms
    declared = _declared_watermark_ms(hello)
    if declared is not None:
        lag = max(lag, int(2.5 * declared))
    return lag * 1_000_000


def silent_after_s(hello: dict[str, Any]) -> float:
    """How long a probe that sends watermarks may go without one before the clock advances it."""
    declared = _declared_watermark_ms(hello)
    if declared is not None:
        return max(SILENT_PROBE_S, 5 * declared / 1000)
    return SILENT_PROBE_S


def advance_by_clock(pipeline: Pipeline, now_ns: int, mono: float, reorder_window_ms: int,
                     quarantine: Quarantine) -> None:
    """Advance each live probe's watermark by the clock, unless its own watermarks are recent."""
    for pid, proc in list(pipeline.processes.items()):
        if proc.source == "probe" and proc.exited_at is None:
            if proc.watermarked and mono - proc.watermark_at < silent_after_s(proc.info):
                continue  # its watermarks say when records are complete; the clock cannot know
            try:
                pipeline.advance(pid, now_ns - clock_lag_ns(proc.info, reorder_window_ms))
            except Exception as exc:  # noqa: BLE001 - one process's state must not stop everyone's tick
                quarantine(pid, exc)


def bound_processes(pipeline: Pipeline, max_processes: int,
                    tenant: Callable[[int], str] = lambda pid: "") -> None:
    """Past daemon.max_processes, forget exited processes: each time one of the tenant that holds the
    most processes (live and exited) past its share of the bound, the one that exited longest ago. A
    tenant that starts and ends processes by the thousand then forgets its own, never those of a tenant
    within its share (whose exited processes keep their final footprint for
    ``footprint.process_grace_seconds``); while its processes are still alive, the table waits over the
    bound for them to exit."""
    procs = pipeline.processes
    excess = len(procs) - max_processes
    if excess <= 0:
        return
    held: Counter[str] = Counter()
    exited: dict[str, list[tuple[float, int]]] = {}
    for pid, p in procs.items():
        t = tenant(pid)
        held[t] += 1
        if p.exited_at is not None:
            exited.setdefault(t, []).append((p.exited_at, pid))
    heaps = {t: sorted(v, reverse=True) for t, v in exited.items()}  # oldest exit last: popped first
    fair = share(max_processes, len(held))
    forgotten = 0
    while forgotten < excess:
        # Only a tenant past its share gives up its exited processes: one whose live processes fill the
        # table waits until they exit, and takes nobody else's room meanwhile.
        over = [t for t in heaps if held[t] > fair]
        if not over:
            break
        t = max(over, key=lambda k: (held[k], -heaps[k][-1][0]))
        _, pid = heaps[t].pop()
        if not heaps[t]:
            del heaps[t]
        held[t] -= 1
        del procs[pid]
        pipeline.hub.forget(pid)
        forgotten += 1
    pipeline.errors.add("process_limit", f"more than daemon.max_processes={max_processes} processes: "
                        f"{forgotten} exited ones forgotten early", forgotten)


def pipeline_snapshot(pipeline: Pipeline, wall: float, quarantine: Quarantine) -> PipelineSnapshot:
    """The pipeline's snapshot; if building it fails, the processes whose own state fails are
    quarantined and it is built again without them (a failure that remains fails the tick)."""
    try:
        return pipeline.snapshot(wall)
    except Exception:  # find the process at fault
        found = False
        for pid, proc in list(pipeline.processes.items()):
            try:
                for dev, fp in list(proc.devices.items()):
                    pipeline.device_state(pid, dev)
                    pipeline.hub.device_features(pid, dev, proc.applied_to, fp.pool_reserved_bytes,
                                                 fp.async_device_bytes)
            except Exception as exc:  # noqa: BLE001
                quarantine(pid, exc)
                found = True
        if not found:
            raise
        return pipeline.snapshot(wall)


def gpu_states(nvml: NvmlSnapshot) -> tuple[GpuState, ...]:
    """The engines' view of each GPU (model for prices, size, utilisation for advice)."""
    return tuple(GpuState(index=g.index, model=g.model, uuid=g.uuid, total_bytes=g.memory_total_bytes,
                          utilization_ratio=g.utilization_ratio) for g in nvml.gpus)


class LoopLoad:
    """How busy the ingest loop is, measured between ticks, two ways:

    * the share of wall time it spent working (not waiting in select): busy from ``BUSY_ON`` until it
      falls under ``BUSY_OFF``. A loop starved of the CPU (or flooded) works most of its wall time;
    * the share of a core its thread used (that thread's CPU clock, ``bind_thread``), over about the
      last second (``CPU_SMOOTH_S``): busy from ``CPU_ON`` until under ``CPU_OFF``. A loop that keeps up
      but spends a third of a core on many small flushes saves most of that by applying several of
      them as one (64 probes at 500,000 records a second: 0.66 of a core eager, about 0.43 coalesced,
      docs/performance.md); a starved loop's CPU share does not grow, so only real work turns this one on.

    What busy mode saves must not switch it off at once: each rule has its own lower bound to leave. The
    CPU share is smoothed because busy mode moves work between ticks: a tick whose watermarks wait costs
    little, and the first tick after busy mode applies everything that waited. Read tick by tick, at
    200,000 records a second the cheap tick ended busy mode and the costly one began it again, at every
    tick (docs/reliability.md, "Load")."""

    BUSY_ON = 0.6
    BUSY_OFF = 0.3
    CPU_ON = 0.3
    CPU_OFF = 0.15
    CPU_SMOOTH_S = 1.0  # time constant of the CPU share's exponentially weighted mean

    def __init__(self, thread_time: Callable[[], float] | None = None) -> None:
        self._work = 0.0
        self._since = time.monotonic()
        # The loop thread's CPU clock (``bind_thread``): ticks may also run on other threads (a replay
        # driving the pipeline, tests), whose own CPU time is not the loop's. None: the wall rule alone.
        self._thread_time = thread_time
        self._cpu_since: float | None = None
        self.share = 0.0  # of the last period between ticks: wall time working
        self.cpu_share = 0.0  # the loop thread's CPU time, over about the last CPU_SMOOTH_S
        self.is_busy = False

    def bind_thread(self, ident: int) -> None:
        """Measure the CPU time of the thread ``ident`` (the ingest loop's, called from it)."""
        try:
            clock = time.pthread_getcpuclockid(ident)
        except (AttributeError, OSError):  # not on this platform: the wall-time rule alone
            return
        self._thread_time = lambda: time.clock_gettime(clock)
        self._cpu_since = None

    def worked(self, seconds: float) -> None:
        self._work += seconds

    def busy(self, now: float) -> bool:
        period = now - self._since
        cpu = None
        if self._thread_time is not None:
            try:
                cpu = self._thread_time()
            except OSError:  # the bound thread has ended (a tick after the loop stopped): the wall rule alone
                self._thread_time, self._cpu_since, self.cpu_share = None, None, 0.0
        if period > 0:
            self.share = min(1.0, self._work / period)
            if cpu is not None and self._cpu_since is not None:
                used = min(1.0, max(0.0, cpu - self._cpu_since) / period)
                # Weighted by the period's length, so a late tick counts for the time it covers.
                self.cpu_share += (1.0 - math.exp(-period / self.CPU_SMOOTH_S)) * (used - self.cpu_share)
        self._work, self._since, self._cpu_since = 0.0, now, cpu
        if self.is_busy:
            self.is_busy = self.share >= self.BUSY_OFF or self.cpu_share >= self.CPU_OFF
        else:
            self.is_busy = self.share >= self.BUSY_ON or self.cpu_share >= self.CPU_ON
        return self.is_busy


class TickRecord:
    """How the ticks went: failures counted, the time of the last one that published."""

    def __init__(self) -> None:
        self.errors = 0
        self.last_failed = False
        self._last_ok_wall = 0.0
        self._last_ok_mono = 0.0

    def failed(self) -> None:
        self.errors += 1
        self.last_failed = True

    def succeeded(self) -> None:
        self.last_failed = False
        self._last_ok_wall = time.time()
        self._last_ok_mono = time.monotonic()

    def health(self, loop_errors: int = 0) -> TickHealth:
        age = time.monotonic() - self._last_ok_mono if self._last_ok_mono else float("inf")
        return TickHealth(self._last_ok_wall, age, self.errors, self.last_failed, loop_errors)
