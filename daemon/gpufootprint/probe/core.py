"""The probe: CUPTI callbacks -> packer -> queue -> sender thread -> socket/file.

Threads and their duties:

* CUPTI's thread (or whichever thread CUPTI flushes on) runs ``_completed``:
  pack records into preallocated arrays, append full arrays to a deque, return.
  No locks held across CUPTI, no I/O, no flush, never raises.
* The sender thread owns everything else: it applies MEMORY records to the live
  table, encodes frames, forces CUPTI flushes at the cadence the daemon asks
  for (then sends a watermark), heartbeats, kernel windows, control messages,
  reconnects with backoff and resyncs after every connect.
* The workload's threads only call ``mark`` (optional) and, through the
  torch.profiler hook, hand CUPTI over and take it back.

Jobs kept elsewhere: arming.py (what is switched on in CUPTI, and off again),
control.py (the daemon's CONTROL frames), counters.py (HEARTBEAT counters),
untracked.py (memory CUDA held before the probe), resync.py (the table sent
whole, to either sink). Why this module is still about 700 lines: what is left
is the sender thread's record path (queue drain, raw buffers, batches, marks,
watermarks, connects, the profiler gap), and every part of it reads and moves
the same few things (the queue, the table's watermark, the gap state, the
sinks); split further, each part would take all of them as arguments.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gpufootprint.probe import arming, control, counters, hostinfo, resync, untracked
from gpufootprint.probe.arming import CuptiArming
from gpufootprint.probe.backend import Backend
from gpufootprint.probe.link import FileSink, SocketLink
from gpufootprint.probe.livetable import LiveTable
from gpufootprint.probe.oom import OomWatch
from gpufootprint.probe.packing import Packer
from gpufootprint.probe.rawdelivery import RawDelivery, view
from gpufootprint.probe.resync import ResyncSchedule
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.records import MAX_TIMESTAMP_NS, MEMORY_DTYPE, TIME_FIELD, MemoryKind, RecordKind
from gpufootprint.wire import cupti_layout, framing
from gpufootprint.wire.cupti_layout import CONCURRENT_KERNEL, KERNEL
from gpufootprint.wire.framing import Frame, FrameType

log = logging.getLogger(__name__)



class Probe:
    def __init__(self, settings: ProbeSettings, backend: Backend | None = None, *,
                 discover_devices: bool = True, clock_ns: Callable[[], int] = time.time_ns,
                 nvml_used: Callable[[int, list[dict[str, Any]]], dict[int, int] | None] | None = None) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self._backend = backend
        self._discover = discover_devices
        self._clock_ns = clock_ns
        self._nvml_used = nvml_used  # NVML's per-process used bytes by device (None: pynvml)
        self._q: deque[Any] = deque()
        # Written by one thread each (no lost updates without a lock): queued = in - out.
        self._records_in = 0  # CUPTI's thread
        self._records_out = 0  # the sender
        self._urgent = threading.Event()  # a mark or a profiler hand-over waits in the queue
        self._max_queued = max(1024, settings.buffer_bytes // MEMORY_DTYPE.itemsize)
        self.packer = Packer(self.pid, self._sink, capacity=settings.capacity, bulk=settings.bulk_pack)
        self.table = LiveTable()
        # Failed allocations (CUPTI's API records) and PyTorch's OOM notices: probe/oom.py.
        self.oom = OomWatch(clock_ns)
        self.packer.on_api_rows = self.oom.api_rows
        self.packer.on_api_objects = self.oom.api_objects
        self._last_dev = 0  # the device of the newest allocation record: an OOM record names none
        self.link: SocketLink | None = None
        if settings.socket:
            self.link = SocketLink(settings.socket, buffer_bytes=settings.buffer_bytes,
                                   backoff_max_s=settings.reconnect_max_ms / 1000, on_control=self._control)
        self.tee: FileSink | None = None
        self.counters: Counter[str] = Counter()
        self.dropped_by_reason: Counter[str] = Counter()
        self.callback_seconds = 0.0
        self.table_seconds = 0.0  # CPU time applying records to the probe's own table (at watermarks)
        self.forward_seconds = 0.0  # CPU time framing forwarded buffers (part of callback_seconds)
        self.own_device_bytes = 0
        self.buffers_requested = 0
        self.buffers_completed = 0
        # Callbacks, kinds, hooks: what the probe switches on in CUPTI (probe/arming.py).
        self.cupti = CuptiArming(settings, self.counters, self._raw_completed)
        self.flush_s = settings.flush_ms / 1000
        self.period = self.cupti.period
        self.watermark_s = max(1, settings.watermark_ms) / 1000
        self.libcupti: list[str] = []
        self.in_gap = False
        self._gap_started_ns = 0
        self.gap_seconds = 0.0
        self.cuda_before = False
        self.devices: list[dict[str, Any]] = []
        self.versions: dict[str, Any] = {}
        self.hello: dict[str, Any] = {}
        self._kernel_window: dict[str, Any] | None = None
        self._kernel_window_end = 0.0
        self._window_kind = KERNEL if settings.kernel_window_kind == "serial" else CONCURRENT_KERNEL
        self.resyncs = ResyncSchedule()
        # Ordering: a WATERMARK says every record stamped at or before it was sent. The one sent
        # after a forced flush is the time of the forced flush before it, not this one's: a record
        # stamped just before a flush can still be on its way into CUPTI's buffer (an API call in
        # flight on another thread) when the flush runs; one whole flush period later it is in.
        self._flushed_ns = 0  # clock time taken just before the latest forced flush
        self._table_ts = 0  # the probe's table holds every record stamped at or before this
        self._verify = False  # the daemon asked for TOTALS with each watermark
        # The daemon reads CUPTI buffers itself (it said so): buffers of memory and pool records go to
        # it as CUPTI wrote them, and this process only keeps the MEMORY2 structs for its own table.
        self._forward = False
        self._forwardable = _FORWARDABLE_V1  # the kinds this daemon steps over (it says which)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = False
        self.errors: list[str] = []

    @property
    def raw(self) -> RawDelivery | None:
        """Raw delivery, where it registered (None: cupti-python's record objects)."""
        return self.cupti.raw

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> bool:
        """Arm CUPTI and start the sender. False (and the workload untouched) on any failure."""
        if self.started:
            return True
        try:
            if self._backend is None:
                from gpufootprint.probe.backend import CuptiBackend

                self._backend = CuptiBackend(self.settings.flush_nogil)
            self.cupti.backend = self._backend
            if self._discover:
                self.devices, self.cuda_before = hostinfo.cuda_devices()
            # configure() is the first CUPTI call (cupti-python maps its libcupti); the
            # versions are read from that copy afterwards.
            self.own_device_bytes = self._backend.configure(self.settings.device_buffer_bytes,
                                                            self.settings.device_buffer_pool_limit)
            self.versions = self._backend.versions()
            want = {"on": True, "off": False}.get(self.settings.per_thread_buffer)
            self.versions["cupti_per_thread_buffer"] = self._backend.per_thread_buffer(want)
            self.libcupti = self._backend.libcupti_paths()
            self.cupti.arm(self._requested, self._completed, self.flush_s)
            if self.settings.kernels and self._backend.enable(CONCURRENT_KERNEL):
                self.cupti.kernels_always = True
        except Exception as exc:  # noqa: BLE001 - no CUPTI, no driver: the workload runs unprobed
            self.errors.append(f"start: {exc}")
            log.warning("gpufootprint probe not started: %s", exc)
            return False
        self.hello = hostinfo.hello(self.pid, self.versions, self.devices, self.cuda_before)
        # How often this probe promises a watermark: a daemon that advances probes by its
        # own clock must wait at least this long (docs/performance.md, late records).
        self.hello["flush_mode"] = self.settings.flush_mode
        self.hello["delivery"] = "raw" if self.raw is not None else "objects"
        self.hello["copies"] = "always" if self.cupti.copy_kinds else "off"
        self.hello["watermark_ms"] = (self.settings.watermark_ms if self.period else self.settings.flush_ms)
        if self.settings.tee:
            try:
                self.tee = FileSink(self.settings.tee)
            except OSError as exc:
                self.errors.append(f"tee: {exc}")
            else:
                self.tee.put(framing.encode_json(FrameType.HELLO, self.hello))
        self.started = True
        self._thread = threading.Thread(target=self._run, name="gpufootprint-probe", daemon=True)
        self._thread.start()
        return True

    def _raw_completed(self, address: int, valid: int) -> None:
        # CUPTI's thread: queue the buffer for the sender, nothing else.
        self._q.append(("raw", address, valid))

    def _raw_buffer(self, address: int, valid: int) -> None:
        """Read one CUPTI buffer's records into batches and give the buffer back (sender thread)."""
        raw = self.raw
        assert raw is not None
        t0 = time.thread_time()
        try:
            buf = view(address, valid)
            if self._forward and not self.settings.raw_verify_walk and self.link is not None and self.link.connected \
                    and cupti_layout.uniform_kind(buf, valid) == cupti_layout.MEMORY2:
                # Allocation churn fills whole buffers with MEMORY2 records: no walk needed.
                self._forward_buffer(buf, valid, None)
                self.counters["raw_buffers"] += 1
                return
            offsets: Mapping[int, Sequence[int]] | None = cupti_layout.walk(buf, valid)
            if self.settings.raw_verify_walk or offsets is None:
                reference = self._backend.walk_raw(address, valid) if self._backend is not None else None
                if offsets is None:
                    self.counters["raw_walk_fallbacks"] += 1
                    offsets = reference
                elif reference is not None:
                    self.counters["raw_walks_verified"] += 1
                    if reference != {k: list(v) for k, v in offsets.items()}:
                        self.counters["raw_walk_mismatches"] += 1
                        offsets = reference
            if offsets is None:
                self.counters["raw_buffers_unreadable"] += 1
            elif self._forward and offsets.keys() <= self._forwardable and self.link is not None \
                    and self.link.connected:
                self._forward_buffer(buf, valid, offsets)
            else:
                n = self.packer.pack_raw(buf, valid, offsets)
                self.counters["raw_records"] += n
                self.packer.flush()
            self.counters["raw_buffers"] += 1
        finally:
            raw.give_back(address)
            self.callback_seconds += time.thread_time() - t0

    def _forward_buffer(self, buf: memoryview, valid: int, offsets: Mapping[int, Sequence[int]] | None) -> None:
        """One CUPTI buffer to the daemon as it is (sender thread): no conversion in the workload's process.

        ``offsets`` None: the buffer holds MEMORY2 records only, back to back."""
        u8 = np.frombuffer(buf, dtype=np.uint8, count=valid)
        size = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2].itemsize
        if offsets is None:
            offsets = {cupti_layout.MEMORY2: range(0, valid, size)}
        n = sum(len(v) for k, v in offsets.items() if k in cupti_layout.RECORD_KIND)
        for api_kind in cupti_layout.API_KINDS:  # failed allocations are found here, before the buffer leaves
            api = offsets.get(api_kind)
            if api:
                self.oom.api_rows(u8, api, api_kind)
        mem = offsets.get(cupti_layout.MEMORY2)
        if mem:
            structs = cupti_layout.gather(u8, cupti_layout.MEMORY2, mem)
            self.table.add_raw(structs, self.pid)
            if self.cupti.um_wanted and bool((structs["mk"] == MemoryKind.MANAGED).any()):
                self.cupti.configure_unified_memory(self.in_gap)
        if self.tee is not None:  # recordings keep the plain BATCH frames every reader knows
            for ck, offs in offsets.items():
                kind = cupti_layout.RECORD_KIND.get(ck)
                if kind is not None:
                    recs = cupti_layout.convert(ck, cupti_layout.gather(u8, ck, offs), self.pid)
                    try:
                        self.tee.put(framing.encode_batch(kind, recs))
                    except OSError:
                        self.counters["tee_errors"] += 1
        self.counters["raw_records"] += n
        self.counters["forwarded_buffers"] += 1
        assert self.link is not None
        t0 = time.thread_time()
        frame = framing.encode_cupti_buffer(self.pid, buf[:valid])
        self.forward_seconds += time.thread_time() - t0
        if self.link.put(frame, records=n):
            self.counters["records_sent"] += n
            self.counters["batches_sent"] += 1
        else:
            self.counters["records_dropped"] += n
            self.dropped_by_reason["buffer_full"] += n
            if mem:
                self.resyncs.dropped(int(structs["timestamp"].max()))
            elif n:
                self.resyncs.dropped(self._clock_ns())

    def stop(self, timeout: float = 3.0) -> None:
        """Final flush, GOODBYE, close. Safe to call twice and from atexit."""
        if not self.started or self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def stop_at_exit(self) -> None:
        """``stop`` from the interpreter's atexit; after a profiler session, skip the C teardown too."""
        self.stop()
        if self.settings.skip_c_teardown_after_profiler and self.counters["profiler_gaps"] > 0:
            if arming.skip_c_teardown():
                self.counters["c_teardown_skipped"] += 1

    # --- CUPTI callbacks (CUPTI's thread; never raise, never block) ---------------------

    def _requested(self) -> tuple[int, int]:
        self.buffers_requested += 1
        return self.settings.cupti_buffer_bytes, 0

    def _completed(self, records: list[Any]) -> None:
        # CPU time of this thread: the callback's own cost, not time spent waiting for the GIL.
        t0 = time.thread_time()
        try:
            self.buffers_completed += 1
            self.packer.pack(records)
        except Exception:  # noqa: BLE001
            self.counters["callback_errors"] += 1
        self.callback_seconds += time.thread_time() - t0

    def _sink(self, chunk: tuple[RecordKind, np.ndarray]) -> None:
        kind, arr = chunk
        if kind is not RecordKind.MEMORY and self._records_in - self._records_out > self._max_queued:
            self.counters["records_dropped"] += len(arr)  # the sender is far behind: shed volume, keep memory
            self.dropped_by_reason["queue_full"] += len(arr)
            return
        self._records_in += len(arr)
        self._q.append(chunk)

    # --- the workload's API --------------------------------------------------------------

    def mark(self, label: str, dev: int = 0, timeout: float = 5.0, **extra: Any) -> dict[str, Any] | None:
        """A synchronised point: flush, then a MARK frame after every earlier record.

        Call it after ``torch.cuda.synchronize()``. Blocks the caller up to ``timeout``
        (marks are for tests and traces, not hot loops). Returns the mark as sent.
        """
        if not self.started:
            return None
        body: dict[str, Any] = {"label": label, "ts": self._clock_ns(), "pid": self.pid, "dev": dev, **extra}
        done = threading.Event()
        self._q.append(("mark", body, done))
        self._urgent.set()
        self._wake.set()
        done.wait(timeout)
        return body

    def status(self) -> dict[str, Any]:
        return {"started": self.started, "connected": bool(self.link and self.link.connected),
                "in_gap": self.in_gap, "flush_mode": self.settings.flush_mode, "libcupti": self.libcupti,
                "delivery": "raw" if self.raw is not None else "objects",
                **self._counter_values()}

    # --- torch.profiler hand-over (workload thread) ----------------------------------------

    def takeover_begin(self) -> None:
        if not self.started or self.in_gap:
            return
        done = threading.Event()
        self._q.append(("gap_begin", None, done))
        self._urgent.set()
        self._wake.set()
        done.wait(2.0)
        self.in_gap = True  # even if the sender was slow: no CUPTI calls from it now
        self._gap_started_ns = time.monotonic_ns()

    def takeover_end(self, before: list[tuple[int, int, int]], after_fn: Callable[[], list[tuple[int, int, int]]]) -> None:
        if not self.started or not self.in_gap:
            return
        try:
            assert self._backend is not None
            # Hand every buffer still inside CUPTI to the callbacks registered now (the
            # profiler's): a buffer the profiler allocated must never reach ours.
            self._backend.flush(True)
            self.cupti.arm(self._requested, self._completed, self.flush_s)
            if self.cupti.um_configured:
                self._backend.configure_unified_memory()
            if self.cupti.kernels_always:
                self._backend.enable(CONCURRENT_KERNEL)
            elif self._kernel_window is not None:
                self._backend.enable(self._window_kind)
            self.counters["rearms"] += 1
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"re-arm: {exc}")
            self.counters["rearm_failures"] += 1
        after = after_fn()
        done = threading.Event()
        self._q.append(("gap_end", (before, after), done))
        self._urgent.set()
        self._wake.set()
        done.wait(2.0)

    # --- the sender thread ----------------------------------------------------------

    def _run(self) -> None:
        s = self.settings
        now = time.monotonic()
        next_flush = now + self._forced_every()
        next_drain = now + self.flush_s
        next_hb = now + s.heartbeat_ms / 1000
        next_untracked = now if self.cuda_before else float("inf")
        while True:
            stopping = self._stop.is_set()
            try:
                if self.link is not None and not stopping and self.link.try_connect():
                    self._on_connect()
                now = time.monotonic()
                urgent = self._urgent.is_set()
                self._urgent.clear()
                if stopping or urgent or now >= next_flush:
                    self._flush_and_drain()
                    next_flush = now + self._forced_every()
                else:
                    self._drain()
                next_drain = now + self.flush_s
                if self._kernel_window is not None and (now >= self._kernel_window_end or stopping):
                    self._close_kernel_window()
                if now >= next_untracked:
                    self._update_untracked()
                    next_untracked = now + s.untracked_ms / 1000
                if now >= next_hb and not stopping:
                    if self.cupti.hooks_missing and not self.in_gap:
                        self.cupti.hooks(True)  # the tool that held CUPTI's subscriber place may have let go
                    if self.settings.oom_torch_observer and not self.oom.torch_attached:
                        self.oom.attach_torch()
                    self._emit(framing.encode_json(FrameType.HEARTBEAT, self._heartbeat()), must=True)
                    next_hb = now + s.heartbeat_ms / 1000
                if self.table.range_splits:
                    self.table.range_splits = 0
                    self.resyncs.requested = True
                connected = self.link is not None and self.link.connected
                if self.resyncs.take_requested(connected):
                    self._resync("requested")
                if self.link is not None and self.resyncs.take_dropped(
                        now, self._table_ts, connected, room=self.link.buffered < self.link.buffer_bytes // 2):
                    self.counters["drop_resyncs"] += 1
                    self._resync("dropped")
                if self.link is not None:
                    self.link.pump()
                    self._count_lost()
            except Exception as exc:  # noqa: BLE001 - keep going; the workload must not notice
                self.counters["sender_errors"] += 1
                if len(self.errors) < 20:
                    self.errors.append(f"sender: {exc!r}")
            if stopping:
                self._goodbye()
                return
            wait = min(next_flush, next_hb, next_drain if self.period else next_flush) - time.monotonic()
            if self._kernel_window is not None:
                wait = min(wait, self._kernel_window_end - time.monotonic())
            self._wake.wait(max(0.0005, wait))
            self._wake.clear()

    def _forced_every(self) -> float:
        return self.watermark_s if self.period else self.flush_s

    def _count_lost(self) -> None:
        """Frames buffered for a connection that broke before they were sent (sender thread)."""
        link = self.link
        if link is not None and (link.lost_records or link.lost_marks):
            c = self.counters
            c["records_dropped"] += link.lost_records
            c["records_sent"] -= link.lost_records
            self.dropped_by_reason["disconnect"] += link.lost_records
            c["marks_dropped"] += link.lost_marks
            link.lost_records = link.lost_marks = 0

    def _flush_and_drain(self) -> None:
        t = self._clock_ns()
        if not self.in_gap and self._backend is not None:
            t0 = time.perf_counter()
            self._backend.flush(True)
            self.counters["flushes"] += 1
            self.counters["flush_ns"] += int((time.perf_counter() - t0) * 1e9)
        self.packer.flush()
        self._drain()
        if self.in_gap:
            return
        safe, self._flushed_ns = self._flushed_ns, t
        if safe > self._table_ts:
            self._advance_table(safe)
            self._emit(framing.encode_watermark(safe))
            if self._verify or self.tee is not None:
                self._emit_totals(safe)

    def _advance_table(self, ts: int) -> None:
        """Apply queued records up to ``ts`` (or the table's watermark, if later: a record stamped
        before it that came late is applied too)."""
        t0 = time.thread_time()
        ts = max(ts, self._table_ts)
        self.table.advance(ts)
        self._table_ts = ts
        self.table_seconds += time.thread_time() - t0

    def _emit_totals(self, ts: int) -> None:
        """The table's totals as of the watermark ``ts`` just sent, for the daemon to check itself against."""
        body = {"ts": ts, "pid": self.pid, "devices": {str(d): {str(k): v for k, v in kinds.items()}
                                                      for d, kinds in self.table.totals().items()}}
        if self.tee is not None:
            try:
                self.tee.put(framing.encode_json(FrameType.TOTALS, body))
            except OSError:
                self.counters["tee_errors"] += 1
        if self._verify and self.link is not None:
            self.link.put(framing.encode_json(FrameType.TOTALS, body), must=True)

    def _drain(self) -> None:
        q = self._q
        while q:
            item = q.popleft()
            head = item[0]
            if isinstance(head, RecordKind):
                self._records_out += len(item[1])
                self._records(head, item[1])
            elif head == "raw":
                self._raw_buffer(item[1], item[2])
            elif head == "mark":
                # Everything CUPTI holds from before the mark goes out ahead of it.
                if not self.in_gap and self._backend is not None:
                    self._backend.flush(True)
                self.packer.flush()
                self._drain_records_only()
                self._advance_table(item[1]["ts"])
                self._mark(item[1])
                item[2].set()
            elif head == "gap_begin":
                if self._backend is not None:
                    # Stop producing records: buffers CUPTI fills after the profiler
                    # registers its callbacks belong to the profiler, not to us.
                    # Kinds off first, then the flush: no record of ours is left behind.
                    self.cupti.quiesce()
                    self._backend.flush(True)
                self.packer.flush()
                self.in_gap = True
                item[2].set()
            elif head == "gap_end":
                self._gap_end(*item[1])
                item[2].set()
        if self.oom.pending():  # each OOM goes out as a MARK after a flush, like a workload's mark
            for body in self.oom.marks(self.pid, self._last_dev):
                q.append(("mark", body, threading.Event()))
            self._drain()

    def _records(self, kind: RecordKind, arr: np.ndarray) -> None:
        owned = arr.base if arr.base is not None and len(arr) < self.packer.capacity else arr
        # CUPTI delivered a few copies/memsets stamped beyond 2^63 on the H200 (5-6 in 68,894):
        # no time to place them at. Counted here, so the daemon's ingest errors mean damage only.
        bad = arr[TIME_FIELD[kind]] >= np.uint64(MAX_TIMESTAMP_NS)
        if bad.any():
            self.counters["cupti_bad_timestamps"] += int(bad.sum())
            arr = arr[~bad]
            if len(arr) == 0:
                self.packer.give_back(kind, owned)
                return
        if kind is RecordKind.MEMORY:
            self.table.add(arr)
            self._last_dev = int(arr["dev"][-1])
            if self.cupti.um_wanted and (arr["mk"] == MemoryKind.MANAGED).any():
                self.cupti.configure_unified_memory(self.in_gap)
        if kind is RecordKind.KERNEL:
            names = self.packer.take_new_names()
            if names:
                self._emit(framing.encode_json(FrameType.STRINGS, {str(i): n for i, n in names}), must=True)
        frame = framing.encode_batch(kind, arr)
        n = len(arr)
        if self._emit(frame, records=n):
            self.counters["records_sent"] += n
            self.counters["batches_sent"] += 1
        else:
            self.counters["records_dropped"] += n
            connected = bool(self.link and self.link.connected)
            self.dropped_by_reason["buffer_full" if connected else "daemon_away"] += n
            if connected and kind in (RecordKind.MEMORY, RecordKind.MEMORY_POOL):
                # The daemon's table now misses these: a resync once the table holds them.
                self.resyncs.dropped(int(arr[TIME_FIELD[kind]].max()))
        self.packer.give_back(kind, owned)

    def _emit(self, frame: bytes, *, must: bool = False, records: int = 0, mark: bool = False) -> bool:
        """To the tee (always) and the socket (when connected). True if the socket took it."""
        if self.tee is not None:
            try:
                self.tee.put(frame)
            except OSError:
                self.counters["tee_errors"] += 1
        if self.link is None:
            return self.tee is not None
        return self.link.put(frame, must=must, records=records, mark=mark)

    def _mark(self, body: dict[str, Any]) -> None:
        dev = body.get("dev", 0)
        dev = dev if isinstance(dev, int) else 0
        body.setdefault("expect_live_bytes", self.table.live_by_kind(dev))
        segs = body.get("torch_segments")
        if isinstance(segs, list):
            # DEVICE bytes outside PyTorch's segments: CUDA libraries' own memory.
            body["expect_library_device_bytes"] = self.table.device_bytes_outside(dev, segs)
        if not self._emit(framing.encode_json(FrameType.MARK, body), must=True, mark=True):
            self.counters["marks_dropped"] += 1

    # --- connection -------------------------------------------------------------------

    def _on_connect(self) -> None:
        # What the last daemon said it reads need not hold for this one (a restart into an older
        # build): TOTALS and forwarded buffers wait until this daemon asks, at the first watermark.
        self._verify = self._forward = False
        self._emit_link(framing.encode_json(FrameType.HELLO, self.hello))
        if self.packer.names:
            self._emit_link(framing.encode_json(FrameType.STRINGS, {str(i): n for n, i in self.packer.names.items()}))
        # Records not yet in the table (stamped after its watermark) went to the old connection or
        # nowhere: this one gets the table as of its watermark, then those again as ordinary records,
        # then whatever CUPTI holds now (which goes to this connection only).
        pending = self.table.pending_array()
        self._resync("connect")
        if self.link is not None:
            resync.send_records(self.link, pending)
        self._flush_and_drain()

    def _emit_link(self, frame: bytes) -> None:
        if self.link is not None:
            self.link.put(frame, must=True)

    def _resync(self, reason: str) -> None:
        """RESYNC_BEGIN, the whole live table as MEMORY batches, RESYNC_END (socket only).

        The table is sent as of its own watermark, which the daemon has reached too (the frames
        that moved it went first): records stamped later follow as usual and apply after it.
        """
        ts = self._table_ts  # 0 before the first watermark: an empty table, nothing applied yet
        self._advance_table(ts)
        arr = self.table.to_array(ts)
        if self.link is not None:
            resync.send_table(self.link, arr, ts=ts, reason=reason, pid=self.pid)
        self.counters["resyncs"] += 1
        if self.tee is not None and reason != "connect":
            # A file has no reconnects, but a gap resync changes the table: record it too.
            resync.send_table(self.tee, arr, ts=ts, reason=reason, pid=self.pid)

    def _gap_end(self, before: list[tuple[int, int, int]], after: list[tuple[int, int, int]]) -> None:
        if self._backend is not None:
            self._backend.flush(True)
        self.packer.flush()
        # Apply what arrived before the hand-back was queued, then rebuild PyTorch's part.
        self._drain_records_only()
        self._advance_table(self._clock_ns())
        self.table.split_torch_owned(before + after)
        self.table.add_torch_segments(after, self._clock_ns(), self.pid)
        self.gap_seconds += (time.monotonic_ns() - self._gap_started_ns) / 1e9
        self.in_gap = False
        self.counters["profiler_gaps"] += 1
        self._resync("profiler_gap")

    def _drain_records_only(self) -> None:
        rest: deque[Any] = deque()
        while self._q:
            item = self._q.popleft()
            if isinstance(item[0], RecordKind):
                self._records_out += len(item[1])
                self._records(item[0], item[1])
            elif item[0] == "raw":
                self._raw_buffer(item[1], item[2])
            else:
                rest.append(item)
        self._q.extendleft(reversed(rest))

    # --- control (the daemon's CONTROL frames: probe/control.py; sender thread) -----------------

    def _control(self, frame: Frame) -> None:
        control.apply_control(frame, self)

    def set_flush_interval(self, ms: int) -> None:
        self.flush_s = min(1000, max(1, ms)) / 1000
        if self.period and not self.in_gap:
            self.cupti.set_period(self.flush_s)  # CUPTI's thread delivers sooner; no forced flushes

    def request_resync(self) -> None:
        self.resyncs.requested = True

    def send_totals(self, cupti_buffers: int) -> None:
        """TOTALS with each watermark from now on; with ``cupti_buffers`` 1 or 2, CUPTI's buffers forwarded
        unread (1: the daemon steps over DRIVER records in them; 2: over RUNTIME records too)."""
        self._verify = True
        if cupti_buffers in (1, 2):
            self._forward = self.settings.forward_buffers
            self._forwardable = _FORWARDABLE if cupti_buffers == 2 else _FORWARDABLE_V1

    def open_kernel_window(self, ms: int, wid: int) -> None:
        ms = max(1, min(ms, 60_000))
        if self._kernel_window is None:
            if self.in_gap or self._backend is None or not self._backend.enable(self._window_kind):
                self.counters["kernel_windows_refused"] += 1
                return
            self._kernel_window = {"id": wid, "start_ns": self._clock_ns()}
            self.counters["kernel_windows"] += 1
        else:
            self._kernel_window["id"] = wid
        self._kernel_window_end = time.monotonic() + ms / 1000
        self._wake.set()

    def _close_kernel_window(self) -> None:
        window, self._kernel_window = self._kernel_window, None
        if window is None:
            return
        if not self.in_gap and self._backend is not None and not self.cupti.kernels_always:
            self._backend.disable(self._window_kind)
        self._flush_and_drain()
        window["end_ns"] = self._clock_ns()
        body = self._heartbeat()
        body["kernel_window"] = window
        self._emit(framing.encode_json(FrameType.HEARTBEAT, body), must=True)

    # --- untracked memory (CUDA started before the probe) ---------------------------------

    def _update_untracked(self) -> None:
        if self._nvml_used is None:
            self._nvml_used = untracked.nvml_used_bytes
        used = self._nvml_used(self.pid, self.devices)
        if used is None:
            return
        if self.period and not self.in_gap:
            # NVML minus what CUPTI saw: everything CUPTI holds must be in, up to now.
            self._flush_and_drain()
        # Queued like any record (the table and the daemon apply it at the same watermark).
        arr = untracked.untracked_records(self.table, used, self._clock_ns(), self.pid)
        if len(arr):
            if self._emit(framing.encode_batch(RecordKind.MEMORY, arr)):
                self.counters["records_sent"] += len(arr)

    # --- heartbeats ---------------------------------------------------------------------------

    def _counter_values(self) -> dict[str, Any]:
        gap = self.gap_seconds + (time.monotonic_ns() - self._gap_started_ns) / 1e9 if self.in_gap else self.gap_seconds
        return counters.counter_values(self, gap_seconds=gap, cupti_dropped=self._cupti_dropped())

    def _cupti_dropped(self) -> int:
        if self._backend is None or self.in_gap:
            return int(self.counters["cupti_dropped_records"])
        queues = {(0, 0)} | (self.raw.queues if self.raw is not None else set())  # the global one, and each seen
        try:
            for ctx, stream in queues:
                self.counters["cupti_dropped_records"] += int(self._backend.dropped_records(ctx, stream))
        except Exception:  # noqa: BLE001
            pass
        return int(self.counters["cupti_dropped_records"])

    def _heartbeat(self) -> dict[str, Any]:
        body: dict[str, Any] = {"ts": self._clock_ns(), "pid": self.pid, "counters": self._counter_values()}
        torch_numbers = counters.torch_numbers()
        if torch_numbers:
            body["torch"] = torch_numbers
        return body

    def _goodbye(self) -> None:
        try:
            if not self.in_gap and self._backend is not None:
                # Nothing of ours may stay inside CUPTI after this: a buffer delivered
                # while the interpreter shuts down would call into a dying Python.
                hooks = self.counters["driver_hooks"]
                self.cupti.quiesce()
                self.counters["driver_hooks"] = hooks  # GOODBYE says how the process was recorded
            self._flush_and_drain()
            if self._kernel_window is not None:
                self._close_kernel_window()
            self._emit(framing.encode_json(FrameType.GOODBYE, self._heartbeat()), must=True)
            if self.link is not None:
                self.link.drain(1.0)
                self.link.close("goodbye")
                self._count_lost()
        finally:
            if self.tee is not None:
                self.tee.close()


#: CUPTI record kinds a forwarded buffer may hold (memory, pool, and the per-API records of the
#: mapping hooks and the allocation calls, which the daemon skips): anything else (kernels, whose
#: names are pointers into this process; copies) is read here as before. A daemon that says
#: ``cupti_buffers: 1`` steps over DRIVER records only; ``2`` over RUNTIME records too.
_FORWARDABLE_V1 = frozenset({cupti_layout.MEMORY2, cupti_layout.MEMORY_POOL, cupti_layout.DRIVER})
_FORWARDABLE = _FORWARDABLE_V1 | {cupti_layout.RUNTIME}

