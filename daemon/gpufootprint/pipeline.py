"""The pipeline every source feeds: live probes, recorded files, the demo.

It sits at the top of the package, not in a stage's folder, because it is the
spine that joins the stages rather than one of them: the ingest server, replay,
the demo and abtest feed it records; it owns every process's state and applies
records to the footprint (``footprint/``), hands what was applied, the level
changes included, to the feature hub (``hub.py``: the feature frames and the
samplers), and builds the immutable snapshot the engines and the exporter read. It imports the
stages after it (footprint, feature hub, snapshot) and none of them imports it;
the sources before it (``ingest/``, replay) import it to feed it.

Why about 530 lines in one module: the reorder buffer, the watermark and its coalescing, the
application to the footprint and the snapshot all read and move the same per-process state
(``ProcessState``) in one order; split, each part would reach into the others' fields.

Records arrive in delivery order, which is not timestamp order. Each process has
a reorder buffer: records wait until the process's watermark passes them, then
are applied to the footprint in timestamp order. The watermark moves when

* a probe (or a trace mark) says every earlier record was delivered,
* the newest timestamp seen is more than ``reorder_window`` ahead of it,
* the daemon's clock says so (``tick``), or the stream ends.

So the state "as of T" is exactly the state of all records with timestamps <= T
once T is below the watermark. A stream that sends WATERMARK frames (every probe,
and its recordings) is advanced by them alone: under allocation churn CUPTI hands
over one thread's full buffers while another thread's half-full buffer waits for
the next forced flush, so "newest record minus the reorder window" would overtake
records still on their way. A record older than the watermark (which a correct
probe never sends) is applied at once, counted as late, and the process is marked
for a resync: its probe's own table then replaces ours, which repairs the state.

A probe also sends, with each watermark, the totals of its own live table; they
are compared with the footprint as of the same watermark (``verify``), so
exactness is measured wherever the daemon runs, not only in tests.

Why about 480 lines in one module: it is the one owner of every process's state and
of the order records apply in; the footprint, the feature hub and the snapshot types
went to their own rooms, and what is left reads and moves the reorder buffers and the
watermarks together.
"""

from __future__ import annotations

import heapq
import logging
import operator
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpufootprint.config import FootprintConfig
from gpufootprint.footprint.device_snapshot import device_snapshot, live_table, mark_state
from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.footprint.table import DeviceFootprint, IngestErrors
from gpufootprint.hub import FeatureHub
from gpufootprint.probecounters import ProbeCounters
from gpufootprint.records import DTYPES, MEMORY_KIND_NAMES, TIME_FIELD, RecordKind, join, select, take
from gpufootprint.snapshot import DeviceSnapshot, PipelineSnapshot, ProcessSnapshot

log = logging.getLogger(__name__)

_NO_KERNELS = np.zeros(0, DTYPES[RecordKind.KERNEL])
_NO_KERNELS.flags.writeable = False
_NO_LAUNCHES = np.zeros(0, DTYPES[RecordKind.API])
_NO_LAUNCHES.flags.writeable = False


@dataclass
class ProcessState:
    pid: int
    source: str  # "probe" (live socket) or "trace" (replayed file)
    info: dict[str, Any] = field(default_factory=dict)
    devices: dict[int, DeviceFootprint] = field(default_factory=dict)
    # Per kind: chunks waiting for the watermark, a heap of (min time, arrival number, records, max time):
    # an advance pops only the chunks that reach back to it, so its cost follows the records it applies,
    # not the chunks still waiting. The arrival number keeps records of equal time in arrival order.
    pending: dict[RecordKind, list[tuple[int, int, np.ndarray, int]]] = field(default_factory=dict)
    pending_seq: int = 0
    pending_records: int = 0
    applied_to: int = 0  # watermark: records with ts <= this are applied
    # A watermark whose records wait to be applied together with the next ones (``Pipeline.coalesce_s``):
    # records with ts <= this are complete; anything that reads or changes the state applies them first.
    due_to: int = 0
    due_since: float = 0.0  # monotonic seconds of the oldest watermark not yet applied
    max_ts: int = 0
    exited_at: float | None = None  # monotonic seconds
    # The stream sends WATERMARK frames: only they (and marks, and the stream's end) advance it.
    watermarked: bool = False
    watermark_at: float = 0.0  # monotonic seconds of the latest WATERMARK
    late_records: int = 0
    # Self-verification against the probe's own table (``Pipeline.verify``).
    drift_bytes: int = 0  # sum over devices and kinds of |ours - the probe's| at the latest check
    drift_checks: int = 0
    drift_mismatches: int = 0
    counters: ProbeCounters = field(default_factory=ProbeCounters)  # heartbeats' counters, taken in when read
    kernels: KernelRetention | None = None  # the newest KERNEL records, for the graph advisor
    launches: KernelRetention | None = None  # the newest host-side API records (launches, syncs), likewise
    # Per device: how many times its live table changed, and the snapshot array built
    # at some version, so an unchanged table is not rebuilt every tick.
    live_versions: dict[int, int] = field(default_factory=dict)
    live_tables: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)
    # Per device: the last snapshot built, with what it was built from (the table's ``changes``, the
    # watermark it is as of, its live table): kept while all three stay as they were.
    device_snapshots: dict[int, tuple[int, int, np.ndarray | None, DeviceSnapshot]] = field(default_factory=dict)

    @property
    def probe_counters(self) -> dict[str, float]:
        """The latest value of each probe counter (read it, do not keep or change it)."""
        return self.counters.values()


class KernelRetention:
    """The newest ``limit`` KERNEL (or API) records of one process, in the order applied.

    Chunks are kept as they come and joined only when a snapshot asks, and only
    when something changed, so a tick without kernels costs nothing.
    """

    def __init__(self, limit: int, kind: RecordKind = RecordKind.KERNEL) -> None:
        self.limit = max(1, limit)
        self.kind = kind
        self._chunks: list[np.ndarray] = []
        self._n = 0
        self._joined: np.ndarray | None = None

    def add(self, recs: np.ndarray) -> None:
        if len(recs) == 0:
            return
        self._joined = None
        if len(recs) >= self.limit:
            self._chunks, self._n = [recs[-self.limit:]], self.limit
            return
        self._chunks.append(recs)
        self._n += len(recs)
        while self._n - len(self._chunks[0]) >= self.limit:
            self._n -= len(self._chunks.pop(0))

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest records (the process's share of the node's retention shrank or is spent)."""
        if n <= 0:
            return
        keep = self.array()[n:]  # a view of the joined records: still joined, read-only
        self._joined, self._chunks, self._n = keep, ([keep] if len(keep) else []), len(keep)

    def array(self) -> np.ndarray:
        if self._joined is None:
            if not self._chunks:
                joined = np.zeros(0, DTYPES[self.kind])
            else:
                joined = np.concatenate(self._chunks)[-self.limit:]
            joined.flags.writeable = False
            self._joined, self._chunks, self._n = joined, ([joined] if len(joined) else []), len(joined)
        return self._joined


class Pipeline:
    """Owns every process's footprint. Single-threaded: call it from one thread."""

    def __init__(self, config: FootprintConfig, monotonic: Callable[[], float] = time.monotonic,
                 *, hub: FeatureHub | None = None, kernel_retention: int = 0) -> None:
        self.config = config
        # Feature frames and adaptive sampler: fed what was applied, after it was applied in time order,
        # so they see the records in the footprint's order, not the wire's.
        self.hub = hub if hub is not None else FeatureHub()
        self.kernel_retention = kernel_retention  # KERNEL records kept per process (0: none)
        self.snapshot_live_tables = False  # leak suspicion reads allocation ages from snapshots
        # Which devices' live tables the snapshot builds, (pid, dev) -> bool; None: every device's. A table is
        # rebuilt whenever the device changed (about 0.1 us a live allocation) and only a device whose
        # footprint grows is read, so the daemon asks the leak engine (``LeakTracker.wants_table``).
        self.live_table_wanted: Callable[[int, int], bool] | None = None
        self._frame_ns = config.frame_ms * 1_000_000
        self._window_ns = int(config.window_peak_seconds * 1e9)
        self._reorder_ns = config.reorder_window_ms * 1_000_000
        self._monotonic = monotonic
        self.processes: dict[int, ProcessState] = {}
        self.errors = IngestErrors()
        self.records_ingested: Counter[str] = Counter()
        self.late_records = 0
        # By record kind: memory and pool records late would make the state wrong (and ask for a
        # resync); kernel records complete on the GPU, often after the watermark of their start.
        self.late_by_kind: Counter[str] = Counter()
        # Pids whose state a late record or a failed verification made doubtful: the ingest
        # server asks their probes for a resync (rate-limited) and clears the entry.
        self.resync_wanted: set[int] = set()
        self.verify_results: Counter[str] = Counter()  # match, mismatch, skipped
        # A watermarked stream whose probe stops sending watermarks cannot hold more than this many
        # records back (at most 80 B each: 32 MB): past it the reorder window applies to it too
        # (counted). Allocation churn on the H200 made about 60,000 records a second, and records
        # wait about two watermark periods (2 s).
        self.max_pending_records = 400_000
        self.pending_overflows = 0
        # A live probe's watermark may wait this long before its records are applied, so that the
        # batches of several flushes are applied as one (the footprint, frames and sampler cost about
        # the same per application whether it holds 2 records or 500). 0 applies at each watermark;
        # the ingest loop sets it while it is busy. A process holding ``coalesce_records`` (or half of what
        # its share lets it hold waiting, ``waiting_room``) is applied at once, and the
        # snapshot shows each process as of what was applied. 8,192: 64 probes flushing 780 records
        # each ten times a second are applied about once a second each (512 applied every flush).
        self.coalesce_s = 0.0
        self.coalesce_records = 8192
        # How many more records the ingest guard lets a process hold waiting, asked at each watermark that
        # might wait: its share shrinks whenever other tenants or processes connect, and one read at its
        # last batch let it wait past the new share (its next batch then tripped the guard's pending
        # valve). Set by the ingest server; None (replays, which never coalesce): no bound but the above.
        self.waiting_room: Callable[[ProcessState], int] | None = None
        self._due: set[int] = set()

    # --- input ----------------------------------------------------------------

    def process(self, pid: int, source: str = "trace") -> ProcessState:
        proc = self.processes.get(pid)
        if proc is None:
            proc = ProcessState(pid=pid, source=source)
            self.processes[pid] = proc
        return proc

    def submit(self, kind: RecordKind, recs: np.ndarray) -> None:
        """Accept one batch of records (any pids, any delivery order)."""
        if len(recs) == 0:
            return
        self.records_ingested[_KIND_NAMES[kind]] += len(recs)
        pids = recs["pid"]
        if len(recs) <= _FEW:
            # A few records: their pids as a list (numpy's scalar reads and comparison cost more).
            listed = pids.tolist()
            if listed.count(listed[0]) == len(listed):
                self._submit_one(self.process(listed[0]), kind, recs)
                return
        # (np.count_nonzero, not .all(): no Python wrapper or reduction setup, about 0.3 us less.)
        elif pids[0] == pids[-1] and np.count_nonzero(pids == pids[0]) == len(pids):
            self._submit_one(self.process(int(pids[0])), kind, recs)
            return
        for pid in np.unique(pids).tolist():
            self._submit_one(self.process(pid), kind, recs[pids == pid])

    def _submit_one(self, proc: ProcessState, kind: RecordKind, recs: np.ndarray) -> None:
        if kind is RecordKind.API:
            # Host calls change no state and the advisor orders them itself: kept as they come. A wait
            # that spans a watermark (its record is written when it returns) is not "late".
            self._apply(proc, kind, recs)
            return
        times = recs[TIME_FIELD[kind]]
        if len(times) <= _FEW:
            listed = times.tolist()
            oldest, newest = min(listed), max(listed)
        else:
            oldest, newest = int(times.min()), int(times.max())
        if proc.due_to > proc.applied_to and oldest <= proc.due_to:
            self.advance(proc.pid, proc.due_to)  # as if applied at its watermark: these come after
        if proc.applied_to and oldest <= proc.applied_to:
            late = times <= proc.applied_to
            n_late = int(late.sum())
            self.late_records += n_late
            self.late_by_kind[kind.name.lower()] += n_late
            proc.late_records += n_late
            if kind in _STATE_KINDS and proc.source == "probe":
                self.resync_wanted.add(proc.pid)
            self._apply(proc, kind, _sorted(kind, select(recs, late)))
            recs = select(recs, ~late)
            times = recs[TIME_FIELD[kind]]
            if len(recs) == 0:
                return
            oldest = int(times.min())
        proc.pending_seq += 1
        heapq.heappush(proc.pending.setdefault(kind, []), (oldest, proc.pending_seq, recs, newest))
        proc.pending_records += len(recs)
        proc.max_ts = max(proc.max_ts, newest)
        if proc.watermarked:
            if proc.pending_records > self.max_pending_records:
                self.pending_overflows += 1
                self.advance(proc.pid, proc.max_ts - self._reorder_ns)
        elif proc.max_ts - self._reorder_ns > proc.applied_to:
            self.advance(proc.pid, proc.max_ts - self._reorder_ns)

    def watermark(self, pid: int, ts: int) -> None:
        """A WATERMARK: every record of ``pid`` stamped at or before ``ts`` has been sent."""
        proc = self.processes.get(pid)
        if proc is None:
            return
        proc.watermarked = True
        proc.watermark_at = now = self._monotonic()
        if (self.coalesce_s > 0 and proc.source == "probe" and proc.exited_at is None
                and proc.pending_records < self.coalesce_records
                and (self.waiting_room is None or proc.pending_records < self.waiting_room(proc) // 2)):
            if ts > proc.due_to and ts > proc.applied_to:
                if proc.due_to <= proc.applied_to:
                    proc.due_since = now
                proc.due_to = ts
                self._due.add(pid)
            return
        self.advance(pid, ts)

    def apply_due(self, every: bool = False,
                  failed: Callable[[int, BaseException], None] | None = None) -> None:
        """Apply the watermarks that waited ``coalesce_s`` (``every``: all of them)."""
        now = self._monotonic()
        for pid in list(self._due):
            proc = self.processes.get(pid)
            if proc is None or proc.due_to <= proc.applied_to:
                self._due.discard(pid)
            elif every or now - proc.due_since >= self.coalesce_s:
                try:
                    self.advance(pid, proc.due_to)
                except Exception as exc:
                    if failed is None:
                        raise
                    self._due.discard(pid)
                    failed(pid, exc)

    def verify(self, pid: int, ts: int, totals: dict[int, dict[int, tuple[int, int]]]) -> str:
        """Compare ``pid``'s footprint as of ``ts`` with its probe's own table at ``ts``.

        ``totals``: device -> memory kind -> (bytes, live allocations). Returns "match",
        "mismatch" or "skipped" (our state is not as of ``ts``: records after it were applied).
        A mismatch marks the process for a resync and is logged once per process.
        """
        proc = self.processes.get(pid)
        if proc is not None and proc.due_to > proc.applied_to:
            self.advance(pid, proc.due_to)
        if proc is None or proc.applied_to != ts or proc.exited_at is not None:
            self.verify_results["skipped"] += 1
            return "skipped"
        drift = 0
        first: str | None = None
        for dev in set(totals) | set(proc.devices):
            theirs = totals.get(dev, {})
            fp = proc.devices.get(dev)
            mine_bytes = fp.live_by_kind if fp is not None else [0] * 32
            mine_counts = fp.live_counts() if fp is not None else {}
            for kind in set(theirs) | {k for k, b in enumerate(mine_bytes) if b} | set(mine_counts):
                tb, tn = theirs.get(kind, (0, 0))
                mb = mine_bytes[kind] if 0 <= kind < len(mine_bytes) else 0
                mn = mine_counts.get(kind, 0)
                if mb != tb or mn != tn:
                    drift += abs(mb - tb)
                    if first is None:
                        first = (f"gpu={dev} kind={MEMORY_KIND_NAMES.get(kind, kind)} daemon={mb} B in {mn} "
                                 f"allocations, probe={tb} B in {tn}")
        proc.drift_checks += 1
        proc.drift_bytes = drift
        if first is None:
            self.verify_results["match"] += 1
            return "match"
        self.verify_results["mismatch"] += 1
        proc.drift_mismatches += 1
        if proc.drift_mismatches == 1:
            log.warning("footprint drift pid=%d as_of_ns=%d %s: the daemon's footprint differs from the probe's "
                        "own table; a resync was asked for (further mismatches are counted, not logged)",
                        pid, ts, first)
        if proc.source == "probe":
            self.resync_wanted.add(pid)
        return "mismatch"

    def advance(self, pid: int, ts: int) -> None:
        """Apply, in time order, every pending record of ``pid`` with time <= ``ts``."""
        proc = self.processes.get(pid)
        if proc is None:
            return
        ts = max(ts, proc.due_to)  # a watermark still waiting is applied first
        self._due.discard(pid)
        if ts <= proc.applied_to:
            return
        for kind in list(proc.pending):
            heap = proc.pending[kind]
            if heap[0][0] > ts:
                continue  # nothing of this kind is due: the chunks wait whole, untouched
            # Only chunks that reach back to ``ts`` are popped; one that reaches past it is split and its
            # rest goes back. They are joined in arrival order, as they came.
            due: list[tuple[int, np.ndarray]] = []
            while heap and heap[0][0] <= ts:
                _, seq, recs, hi = heapq.heappop(heap)
                if hi <= ts:
                    due.append((seq, recs))
                    continue
                times = recs[TIME_FIELD[kind]]
                now = times <= ts
                due.append((seq, select(recs, now)))
                later = ~now
                heapq.heappush(heap, (int(times[later].min()), seq, select(recs, later), hi))
            if not heap:
                del proc.pending[kind]
            if len(due) == 1:
                ready = due[0][1]
            else:
                due.sort(key=_arrival)
                ready = join([d for _, d in due])
            proc.pending_records -= len(ready)
            self._apply(proc, kind, _sorted(kind, ready))
        proc.applied_to = ts
        self.hub.on_watermark(pid, ts, proc.source)

    def finish(self, pid: int) -> None:
        """End of a stream: nothing more will come, apply everything."""
        proc = self.processes.get(pid)
        if proc is not None:
            self.advance(pid, max(proc.max_ts, proc.applied_to + 1))
            for fp in proc.devices.values():
                fp.settle_reused(self.errors)
            self.hub.on_finish(pid, proc.applied_to, proc.source)

    def resync(self, pid: int, recs: np.ndarray, ts: int) -> None:
        """Replace ``pid``'s live tables with the probe's own (after a reconnect)."""
        proc = self.process(pid, "probe")
        self.advance(pid, ts)
        for dev in set(proc.devices) | set(np.unique(recs["dev"]).tolist()):
            proc.live_versions[dev] = proc.live_versions.get(dev, 0) + 1
            levels = self._device(proc, dev).replace_live(recs[recs["dev"] == dev], ts, self.errors)
            self.hub.on_levels(pid, dev, levels)
        # The state is now the probe's as of ``ts``. Records stamped after it that were applied
        # already (a stream that ended, the clock's fallback) are part of it no longer: the probe
        # sends those again after a reconnect, so they must apply again, not count as late.
        proc.applied_to = min(proc.applied_to, ts)
        proc.due_to = min(proc.due_to, proc.applied_to)

    def process_exited(self, pid: int, ts: int | None = None) -> None:
        proc = self.processes.get(pid)
        if proc is None or proc.exited_at is not None:
            return
        self.finish(pid)
        end = ts if ts is not None else max(proc.max_ts, proc.applied_to)
        for dev, fp in proc.devices.items():
            proc.live_versions[dev] = proc.live_versions.get(dev, 0) + 1
            self.hub.on_levels(pid, dev, fp.release_all(end))
        self.hub.on_finish(pid, max(end, proc.applied_to), proc.source)
        proc.exited_at = self._monotonic()

    def restart(self, pid: int, source: str) -> ProcessState:
        """A new process reuses ``pid`` (or a trace loops): start it from nothing."""
        self.processes.pop(pid, None)
        self.hub.forget(pid)
        return self.process(pid, source)

    def expire(self) -> list[int]:
        """Forget processes that exited more than the grace period ago."""
        now = self._monotonic()
        gone = [pid for pid, p in self.processes.items()
                if p.exited_at is not None and now - p.exited_at >= self.config.process_grace_seconds]
        for pid in gone:
            del self.processes[pid]
            self.hub.forget(pid)
        return gone

    # --- application ------------------------------------------------------------

    def _device(self, proc: ProcessState, dev: int) -> DeviceFootprint:
        fp = proc.devices.get(dev)
        if fp is None:
            fp = DeviceFootprint(pid=proc.pid, dev=dev, peaks=FramePeaks(self._frame_ns, self._window_ns))
            proc.devices[dev] = fp
            self.hub.open_device(proc.pid, dev, fp.peaks)
        return fp

    def _apply(self, proc: ProcessState, kind: RecordKind, recs: np.ndarray) -> None:
        if kind is RecordKind.API:
            # Host-side calls: no memory moved, no device footprint, nothing for the feature frames or the
            # sampler; kept for the graph advisor only.
            if self.kernel_retention > 0:
                if proc.launches is None:
                    proc.launches = KernelRetention(self.kernel_retention, RecordKind.API)
                proc.launches.add(recs)
            self.hub.on_launches(proc.pid, recs)
            return
        devs = recs["dev"]
        if len(devs) <= _FEW:
            listed = devs.tolist()
            one = listed.count(listed[0]) == len(listed)
        else:
            one = devs[0] == devs[-1] and np.count_nonzero(devs == devs[0]) == len(devs)
        if one:
            groups = [(int(devs[0]), recs)]
        else:
            groups = [(d, select(recs, devs == d)) for d in np.unique(devs).tolist()]
        for dev, sub in groups:
            fp = self._device(proc, dev)
            if kind is RecordKind.MEMORY:
                proc.live_versions[dev] = proc.live_versions.get(dev, 0) + 1
                levels = fp.apply_memory(sub, self.errors)
                fp.note_pool_config(sub)
                self.hub.on_levels(proc.pid, dev, levels)
            elif kind is RecordKind.MEMORY_POOL:
                fp.apply_pool(sub, self.errors)
            elif kind is RecordKind.MEMCPY:
                fp.apply_memcpy(sub)
            elif kind is RecordKind.MEMSET:
                fp.apply_memset(sub)
            elif kind is RecordKind.KERNEL:
                fp.apply_kernel(sub)
                if self.kernel_retention > 0:
                    if proc.kernels is None:
                        proc.kernels = KernelRetention(self.kernel_retention)
                    proc.kernels.add(sub)
            elif kind is RecordKind.UNIFIED_MEMORY:
                fp.apply_unified(sub)
            self.hub.on_records(proc.pid, dev, kind, sub)

    # --- output -------------------------------------------------------------------

    def device_state(self, pid: int, dev: int) -> DeviceSnapshot | None:
        proc = self.processes.get(pid)
        if proc is None or dev not in proc.devices:
            return None
        return device_snapshot(proc.devices[dev], proc.applied_to, self._window_ns)

    def mark_state(self, pid: int, dev: int) -> tuple[dict[str, int], int, int] | None:
        """``device_state``'s live bytes, pool reserved bytes and window peak, alone (what a MARK reports)."""
        proc = self.processes.get(pid)
        if proc is None or dev not in proc.devices:
            return None
        return mark_state(proc.devices[dev], proc.applied_to, self._window_ns)

    def snapshot(self, wall_time: float | None = None) -> PipelineSnapshot:
        procs = []
        tables, wanted = self.snapshot_live_tables, self.live_table_wanted
        for proc in self.processes.values():
            devices = tuple(self._device_snapshot(proc, fp, _cached_live_table(proc, fp)
                                                  if tables and (wanted is None or wanted(proc.pid, fp.dev)) else None)
                            for _, fp in sorted(proc.devices.items()))
            procs.append(ProcessSnapshot(
                pid=proc.pid, source=proc.source, exited=proc.exited_at is not None,
                info=dict(proc.info), devices=devices, pending_records=proc.pending_records,
                as_of_ns=proc.applied_to, probe_counters=dict(proc.probe_counters),
                recent_kernels=proc.kernels.array() if proc.kernels is not None else (
                    _NO_KERNELS if self.kernel_retention > 0 else None),
                recent_launches=proc.launches.array() if proc.launches is not None else (
                    _NO_LAUNCHES if self.kernel_retention > 0 else None),
                drift_bytes=proc.drift_bytes, drift_checks=proc.drift_checks,
                drift_mismatches=proc.drift_mismatches, late_records=proc.late_records,
            ))
        return PipelineSnapshot(
            taken_at=time.time() if wall_time is None else wall_time,
            processes=tuple(sorted(procs, key=lambda p: p.pid)),
            records_ingested=dict(self.records_ingested),
            ingest_errors=dict(self.errors.counts),
            ingest_repairs=dict(self.errors.repairs),
            late_records=self.late_records,
            late_by_kind=dict(self.late_by_kind),
            window_peak_seconds=self.config.window_peak_seconds,
            verify_results=dict(self.verify_results),
            **self._feature_fields(),
        )

    def _device_snapshot(self, proc: ProcessState, fp: DeviceFootprint, table: np.ndarray | None) -> DeviceSnapshot:
        """The device's snapshot, built again only if its table changed, its watermark moved (the window's
        peak is as of it) or its live table is another: a quiet node's devices cost a lookup a tick."""
        kept = proc.device_snapshots.get(fp.dev)
        if kept is not None and kept[0] == fp.changes and kept[1] == proc.applied_to and kept[2] is table:
            return kept[3]
        snap = device_snapshot(fp, proc.applied_to, self._window_ns, table)
        proc.device_snapshots[fp.dev] = (fp.changes, proc.applied_to, table, snap)
        return snap

    def _feature_fields(self) -> dict[str, Any]:
        """What the feature hub adds to the snapshot: features per (pid, gpu), sampler, anomaly windows."""
        features = []
        for proc in self.processes.values():
            for dev, fp in sorted(proc.devices.items()):
                f = self.hub.device_features(proc.pid, dev, proc.applied_to, fp.pool_reserved_bytes,
                                             fp.async_device_bytes)
                if f is not None:
                    features.append(f)
        return {"features": tuple(features), "sampler": self.hub.sampler_states(),
                "anomaly_windows": tuple(self.hub.windows), "anomaly_counts": dict(self.hub.window_counts),
                "sampler_controls": dict(self.hub.controls_sent)}

    def note_torch(self, pid: int, torch: Any) -> None:
        """A probe heartbeat's "torch" field (allocator statistics): feeds allocator slack."""
        self.hub.note_torch(pid, torch)

    def note_window_closed(self, pid: int, wid: int, end_ns: int) -> None:
        """A probe heartbeat's launch window, closed by the probe at its count."""
        self.hub.note_window_closed(pid, wid, end_ns)

    def note_windows_had(self, pid: int, windows: int) -> None:
        """A probe heartbeat's count of the windows it has had (from this daemon or an earlier one)."""
        self.hub.note_windows_had(pid, windows)


#: Records of a batch whose oldest and newest times are taken in Python (numpy's two reductions cost more).
_FEW = 64
_KIND_NAMES = {k: k.name.lower() for k in RecordKind}  # an enum's .name is a property, read per batch

#: Kinds whose late arrival can leave a wrong state behind (the others only add up).
_STATE_KINDS = frozenset({RecordKind.MEMORY, RecordKind.MEMORY_POOL})


def _arrival(due: tuple[int, np.ndarray]) -> int:
    return due[0]


def _sorted(kind: RecordKind, recs: np.ndarray) -> np.ndarray:
    times = recs[TIME_FIELD[kind]]
    if len(times) < 2:
        return recs
    if len(times) <= _FEW:
        listed = times.tolist()
        if all(map(operator.le, listed, listed[1:])):
            return recs
    elif not np.count_nonzero(times[1:] < times[:-1]):
        return recs
    return take(recs, times.argsort(kind="stable"))


def _cached_live_table(proc: ProcessState, fp: DeviceFootprint) -> np.ndarray:
    version = proc.live_versions.get(fp.dev, 0)
    cached = proc.live_tables.get(fp.dev)
    if cached is None or cached[0] != version:
        cached = (version, live_table(fp))
        proc.live_tables[fp.dev] = cached
    return cached[1]


__all__ = ["Pipeline", "ProcessState"]
