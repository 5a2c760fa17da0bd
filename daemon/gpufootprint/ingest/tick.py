"""The daemon's tick: what moves the pipeline on when no record does.

Each tick advances the watermarks of probes that have gone quiet by the daemon's clock, keeps the
number of processes bounded, and builds the snapshot, dropping (quarantining) a process whose own
state breaks it rather than failing everyone's tick. ``TickRecord`` remembers how the ticks went,
for /readyz and the snapshot's age at scrape time. The ingest loop (``server.py``) calls these.
"""

from __future__ import annotations

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
    """How busy the ingest loop is: the share of wall time it spent working (not waiting in select),
    measured between ticks. Busy from ``BUSY_ON`` of the time until it falls under ``BUSY_OFF``: what
    busy mode saves must not switch it off at once."""

    BUSY_ON = 0.6
    BUSY_OFF = 0.3

    def __init__(self) -> None:
        self._work = 0.0
        self._since = time.monotonic()
        self.share = 0.0  # of the last period between ticks
        self.is_busy = False

    def worked(self, seconds: float) -> None:
        self._work += seconds

    def busy(self, now: float) -> bool:
        period = now - self._since
        if period > 0:
            self.share = min(1.0, self._work / period)
        self._work, self._since = 0.0, now
        self.is_busy = self.share >= (self.BUSY_OFF if self.is_busy else self.BUSY_ON)
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
