"""The sender thread: everything the probe does outside CUPTI's callbacks and the workload's calls.

It takes records and buffers off the intake queue (probe/intake.py) and applies MEMORY
records to the probe's live table, encodes frames to the sinks (the daemon's socket,
the tee file), forces CUPTI flushes at the cadence the daemon asks for (then sends a
watermark), sends heartbeats, opens and closes kernel windows, applies CONTROL frames,
polls NVML for untracked memory, reconnects with backoff and resyncs after every
connect. One thread owns all of this state: no locks. ``Probe`` (probe/core.py) holds
one sender and adds its lifecycle and the workload's entry points.

Why about 500 lines in one module: the jobs with their own state went out (the intake
queue, raw buffers, arming, control decoding, counters, untracked records, resync, the
kernel and launch windows); what is left reads and moves the same few things on every
step (the queue, the table's watermark, the gap state, the sinks), and split further
each part would take all of them as arguments.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from gpufootprint.probe import control, counters, forwarder, hostinfo, nativecallbacks, resync, untracked
from gpufootprint.probe.arming import CuptiArming
from gpufootprint.probe.backend import Backend
from gpufootprint.probe.intake import Intake
from gpufootprint.probe.link import FileSink, SocketLink
from gpufootprint.probe.livetable import LiveTable
from gpufootprint.probe.nativecallbacks import Delivery, Pairer, Walker
from gpufootprint.probe.oom import OomWatch
from gpufootprint.probe.rawreader import FORWARDABLE, FORWARDABLE_V1, RawBufferReader, memory_seen
from gpufootprint.probe.resync import ResyncSchedule
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.probe.torchnumbers import TorchNumbers
from gpufootprint.probe.wakeup import Wakeup
from gpufootprint.probe.windows import COUNT_FLUSH_S, Windows
from gpufootprint.records import MAX_TIMESTAMP_NS, TIME_FIELD, RecordKind
from gpufootprint.wire import cupti_layout, framing
from gpufootprint.wire.framing import Frame, FrameType

T = TypeVar("T")


def _native(wanted: bool, part: type[T]) -> T | None:
    """A part of the probe in C (the walk of CUPTI's buffers, the table's pairing), where wanted and the library
    loads; else None and the Python or numpy way (the buffer callbacks' warning says why: probe/arming.py)."""
    if not wanted:
        return None
    try:
        return part()
    except OSError:
        return None


NvmlUsed = Callable[[int, list[dict[str, Any]]], dict[int, int] | None]

#: How long the sender waits, at most, at the end of a wake for the socket to take what it holds (probe/link.py
#: ``pump``): a few times a burst of CUPTI's buffers; a mark, a stop or a new buffer waits no longer than this.
PUMP_WAIT_S = 0.02

#: What the C forwarder frames before it wakes the sender for it (eight of CUPTI's default buffers): under churn
#: about 14 wakes a second where each buffer woke the sender (about a hundred); less, the sender's own cadence.
FORWARD_WAKE_BYTES = 512 << 10

#: How long the sender waits, at most, for the forwarder to deal with the buffers CUPTI queued before a watermark,
#: a mark or a stop (it reads a 64 KiB buffer in about 10 us: only a starved CPU makes it wait long). A watermark
#: whose buffers are not all dealt with by then is not sent (a later one covers it): none may come late.
FORWARD_SYNC_S = 1.0

#: How long the sender waits, at most, after a connect for the daemon to ask for CUPTI's buffers unread (it answers
#: the HELLO within a round trip of its loop; an older daemon asks at the first watermark, and this much is lost).
CONNECT_ASK_WAIT_S = 0.1


class Sender:
    def __init__(self, settings: ProbeSettings, backend: Backend | None, pid: int, clock_ns: Callable[[], int],
                 nvml_used: NvmlUsed | None) -> None:
        self.settings = settings
        self.pid = pid
        self._backend = backend
        self._clock_ns = clock_ns
        self._nvml_used = nvml_used  # NVML's per-process used bytes by device (None: pynvml)
        self.counters: Counter[str] = Counter()
        self.dropped_by_reason: Counter[str] = Counter()
        self.intake = Intake(settings, pid, self.counters, self.dropped_by_reason)
        self.packer = self.intake.packer
        self._urgent = threading.Event()  # a mark or a profiler hand-over waits in the queue
        self.table = LiveTable(pairer=_native(settings.native_pair, Pairer))
        # Failed allocations (CUPTI's API records) and PyTorch's OOM notices: probe/oom.py.
        self.oom = OomWatch(clock_ns)
        # PyTorch's figures go out with heartbeats: a reading more often than one a heartbeat is never sent
        self.torch_numbers = TorchNumbers(min_interval_s=settings.heartbeat_ms / 1000)
        self.packer.on_api_rows = self.oom.api_rows
        self.packer.on_api_objects = self.oom.api_objects
        self.link: SocketLink | None = None
        # The probe's C library, where it loaded and C is allowed: the sender's socket and wake-up calls keep
        # the GIL through it (probe/link.py, probe/wakeup.py).
        native = nativecallbacks.load()[0] if settings.native_callbacks else None
        if settings.socket:
            self.link = SocketLink(settings.socket, buffer_bytes=settings.buffer_bytes,
                                   backoff_max_s=settings.reconnect_max_ms / 1000, on_control=self._control,
                                   native=native, native_pump=settings.native_pump)
        self.tee: FileSink | None = None
        self.table_seconds = 0.0  # CPU time applying records to the probe's own table (at watermarks)
        self.own_device_bytes = 0
        # A completed CUPTI buffer wakes the sender (raw delivery), a mark, a window, stop: through an eventfd,
        # which the C buffer callbacks write to without the GIL (probe/wakeup.py).
        self._wake = Wakeup(native)
        self.intake.wake = self._wake.set
        # Callbacks, kinds, hooks: what the probe switches on in CUPTI (probe/arming.py).
        self.cupti = CuptiArming(settings, self.counters, self.intake.raw_completed, self._wake)
        self.cupti.backend = backend
        self.flush_s = settings.flush_ms / 1000
        self.period = self.cupti.period
        self.watermark_s = max(1, settings.watermark_ms) / 1000
        self.in_gap = False
        self._gap_started_ns = 0
        self.gap_seconds = 0.0
        self.cuda_before = False
        self.devices: list[dict[str, Any]] = []
        self.discover_pending = False  # the devices wait for the workload to start CUDA (Probe.start)
        self.hello: dict[str, Any] = {}
        self.windows = Windows(self, settings.kernel_window_kind)  # kernel and launch windows (probe/windows.py)
        self.resyncs = ResyncSchedule()
        self.errors: list[str] = []
        self._raw_reader = RawBufferReader(
            pid=pid, verify_walk=settings.raw_verify_walk, packer=self.packer, table=self.table, oom=self.oom,
            cupti=self.cupti, resyncs=self.resyncs, counters=self.counters,
            dropped_by_reason=self.dropped_by_reason, clock_ns=clock_ns, walker=_native(settings.native_walk, Walker), errors=self.errors,
            native_read=settings.native_read)
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
        self._forwardable = FORWARDABLE_V1  # the kinds this daemon steps over (it says which)
        # The C forwarder (probe/forwarder.py, ``native_forward``), started once the C callbacks registered;
        # ``_epoch`` counts connections (frames it framed for an earlier one are dropped)
        self.forwarder: forwarder.Forwarder | None = None
        self._forwarder_tried = False
        self._forward_lagging = False  # the last sync ran out of time: buffers queued before it were not all read
        self._forwarder_cpu_ns = self._forwarder_handed = 0  # its counters as of the sender's last take
        self.forwarder_bytes = 0  # the memory its sides hold (part of the probe's own host bytes)
        self._epoch = 0
        self._stop = threading.Event()

    @property
    def forward_seconds(self) -> float:
        """CPU time framing forwarded buffers (part of callback_seconds)."""
        return self._raw_reader.forward_seconds

    @property
    def native_forward_seconds(self) -> float:
        """CPU time of the C forwarder's thread reading and framing buffers (not the sender's: no GIL held), as of
        the sender's last take (read here from any thread: only the sender's thread calls the forwarder)."""
        return self._forwarder_cpu_ns / 1e9

    @property
    def native_forward_handed(self) -> int:
        """Buffers the C forwarder handed to the sender to read (a kind the daemon does not read, a failed call...)."""
        return self._forwarder_handed

    @property
    def native_read_retries(self) -> int:
        """Forwarded buffers the C read took twice: their MEMORY2 structs did not fit the queue's room as it was."""
        walker = self._raw_reader.walker
        return walker.retries if walker is not None else 0

    def _raw_buffer(self, address: int, valid: int) -> None:
        """Read one CUPTI buffer (probe/rawreader.py) and give it back; its CPU time counts as callback time."""
        t0 = time.thread_time()
        try:
            link = self.link
            forward_to = link if self._forward and link is not None and link.connected else None
            self._raw_reader.read(address, valid, forward_to=forward_to, forwardable=self._forwardable, tee=self.tee,
                                  in_gap=self.in_gap)
        finally:
            self.intake.callback_seconds += time.thread_time() - t0

    @property
    def raw(self) -> Delivery | None:
        """Raw delivery, where it registered (None: cupti-python's record objects)."""
        return self.cupti.raw

    def queue_and_wait(self, op: str, body: Any, timeout: float) -> None:
        """From a workload's thread (probe/core.py): queue ``op`` behind every record already queued,
        wake the sender at once and wait up to ``timeout`` for it to be done."""
        done = threading.Event()
        self.intake.q.append((op, body, done))
        self._urgent.set()
        self._wake.set()
        done.wait(timeout)

    # --- the sender thread ------------------------------------------------------------------------

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
                hb_due = now >= next_hb
                flush_slack, hb_slack = self._wake_slack()
                flush_due = stopping or urgent or now >= next_flush
                flushed = flush_due or (hb_due and next_flush - now <= flush_slack)
                if flushed:
                    self._flush_and_drain()
                    # One made early only to share the heartbeat's wake keeps its schedule: counted from now,
                    # heartbeats more often than half the period would make forced flushes come every few.
                    next_flush = now + self._forced_every() if flush_due else next_flush + self._forced_every()
                else:
                    self._drain()
                next_drain = now + self.flush_s
                if self.oom.waiting():
                    # A failed allocation is judged once the watermark passes the end of its recovery
                    # window: forced flushes at the drain cadence until then, so its event comes about a
                    # flush after the window closes rather than up to two watermark periods later.
                    next_flush = min(next_flush, now + self.flush_s)
                if self.windows.counting():
                    # The window's calls are counted only once CUPTI hands them over: a forced flush every
                    # COUNT_FLUSH_S while it waits, so it closes a tenth of a second after its last step,
                    # not at the next watermark (its flush period delivers only full buffers).
                    next_flush = min(next_flush, now + COUNT_FLUSH_S)
                if self.windows.kernel_window is not None and (now >= self.windows.kernel_window_end or stopping
                                                               or self.windows.counted_enough()):
                    self.windows.close_kernel_window()
                if self.windows.launch_priming and (stopping or self.windows.records_seen()):
                    self.windows.end_launch_priming()
                if now >= next_untracked:
                    self._update_untracked()
                    next_untracked = now + s.untracked_ms / 1000
                if (hb_due or (flushed and next_hb - now <= hb_slack)) and not stopping:
                    if self.cupti.hooks_missing and not self.in_gap:
                        self.cupti.hooks(True)  # the tool that held CUPTI's subscriber place may have let go
                    if self.settings.oom_torch_observer and not self.oom.torch_attached:
                        self.oom.attach_torch()
                    if self.discover_pending:
                        self._discover_devices()
                    self._emit(framing.encode_json(FrameType.HEARTBEAT, self._heartbeat()), must=True)
                    # Likewise a heartbeat sent early at a flush's wake: from now, flushes every COUNT_FLUSH_S
                    # (a window's count, a waiting OOM, forced mode) would send one every half period.
                    next_hb = now + s.heartbeat_ms / 1000 if hb_due else next_hb + s.heartbeat_ms / 1000
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
                    # What the socket does not take at once is waited for (a bounded wait, with the GIL let
                    # go) rather than left for the next wake, which behind busy Python threads comes late.
                    self.link.pump(0.0 if stopping else PUMP_WAIT_S)
                    self._count_lost()
                self._update_forwarder()
            except Exception as exc:  # noqa: BLE001 - keep going; the workload must not notice
                self.counters["sender_errors"] += 1
                if len(self.errors) < 20:
                    self.errors.append(f"sender: {exc!r}")
            if stopping:
                try:
                    self._goodbye()
                finally:
                    self.cupti.retire_wakeup()  # whatever the goodbye met: no wake may reach a closed eventfd
                return
            wait = min(next_flush, next_hb, next_drain if self._drains_by_clock() else next_flush) - time.monotonic()
            if self.windows.kernel_window is not None:
                wait = min(wait, self.windows.kernel_window_end - time.monotonic())
            self._wake.wait(max(0.0005, wait))
            self._wake.clear()
            self.counters["sender_wakeups"] += 1

    def _drains_by_clock(self) -> bool:
        """Whether the sender must look at the queue every ``flush_ms`` between its forced flushes.

        With raw delivery each buffer CUPTI completes wakes the sender (``Intake.wake``), so an
        idle process's sender wakes only for its watermark and heartbeat: about 2 times a second
        instead of 10 (each wake takes the GIL from the workload). cupti-python's objects queue
        nothing until the packer's array fills, and frames the socket did not take wait for a
        pump: those keep the clock."""
        if not self.period:
            return False  # forced mode: next_flush is already every flush_ms
        return self.cupti.raw is None or (self.link is not None and self.link.buffered > 0)

    def _forced_every(self) -> float:
        return self.watermark_s if self.period else self.flush_s

    def _wake_slack(self) -> tuple[float, float]:
        """How early a forced flush, and a heartbeat, may go out to share a wake with the other (none: 0)."""
        if not self.settings.coalesce_wakes:
            return 0.0, 0.0
        return self._forced_every() / 2, self.settings.heartbeat_ms / 2000

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

    # --- records: queue -> table -> sinks ---------------------------------------------------------

    def _take_native(self) -> None:
        """Buffers the C callbacks queued go into the intake's queue behind what is there (the ctypes
        thunks append them there themselves, at completion); with a forwarder, what it framed meanwhile goes to
        the link first, once it has dealt with every buffer queued by now, and the buffers it handed over."""
        raw = self.cupti.raw
        if raw is not None and raw.native:
            if self.forwarder is not None:
                self._take_forwarded(self.forwarder)
            for address, valid in raw.take():
                self.intake.q.append(("raw", address, valid))

    def _take_forwarded(self, fwd: forwarder.Forwarder) -> None:
        self._forward_lagging = fwd.sync(FORWARD_SYNC_S) > 0
        if self._forward_lagging:
            self.counters["native_forward_lagging"] += 1
        side = fwd.swap()
        if side is None:
            self._note_forwarder(fwd)
            return
        try:
            c = self.counters
            if len(side.structs):
                self.table.pending_raw.append(side.structs)
                self.table.raw_pid = self.pid
                memory_seen(self.packer, self.cupti, side.structs, self.in_gap)
            took = forwarder.take_in(side, self.link)
            for key in ("raw_buffers", "native_forwards", "forwarded_buffers", "forwarded_unchecked"):
                c[key] += side.buffers
            c["raw_records"] += side.records
            c["records_sent"] += took.sent
            c["batches_sent"] += took.frames_sent
            c["records_dropped"] += took.away + took.full
            self.dropped_by_reason["daemon_away"] += took.away
            self.dropped_by_reason["buffer_full"] += took.full
            if took.full:
                self.resyncs.dropped(took.full_max_ts or self._clock_ns())
        finally:
            fwd.release()
        self._note_forwarder(fwd)
        self._update_forwarder()  # the room its frames left in the send buffer, at once

    def _note_forwarder(self, fwd: forwarder.Forwarder) -> None:
        """The forwarder's counters, kept for ``probe.status()`` on any thread (only this one calls the forwarder)."""
        stats = fwd.stats()
        self._forwarder_cpu_ns, self._forwarder_handed = stats["cpu_ns"], stats["to_sender"]
        self.forwarder_bytes = stats["bytes"]

    def _forwarding_wanted(self) -> bool:
        """Whether the forwarder may forward now: connected to a daemon that reads CUPTI's buffers unchecked, and
        nothing of the sender's own to read in every buffer (a tee's records, a check of the walk), outside a
        profiler's gap, not stopping."""
        link, reader = self.link, self._raw_reader
        return (self._forward and link is not None and link.connected and reader.native_read and not reader.checked
                and not reader.verify_walk and self.tee is None and not self.in_gap and not self._stop.is_set())

    def _forwarded_kinds(self, calls: bool = True) -> int:
        """The kinds a buffer may hold to be forwarded: the daemon's, less the API calls' while the sender reads
        them (a launch window's calls, a failed allocation waiting for a success on its thread), may yet (a
        buffer taken and not read: it may hold a failed call) or ``calls`` is off."""
        # (the queue as one tuple first: workload threads queue marks meanwhile, and a Python loop over the deque
        # itself can be switched out of mid-way and meet it changed)
        if (not calls or self.packer.launch_window_open() or self.oom.reads_calls(failed=False)
                or any(item[0] == "raw" for item in tuple(self.intake.q))):
            return nativecallbacks.kind_mask(self._forwardable - cupti_layout.API_KINDS)
        return nativecallbacks.kind_mask(self._forwardable)

    def _update_forwarder(self, calls: bool = True) -> None:
        """Start the forwarder once the C callbacks are registered (``native_forward``) and tell it what it may do
        (``calls`` off: no buffer with API records)."""
        fwd = self.forwarder
        if fwd is None:
            raw = self.cupti.raw
            if (self._forwarder_tried or not self.settings.native_forward or raw is None or not raw.native
                    or not self._raw_reader.native_read or self._stop.is_set()):
                return
            self._forwarder_tried = True
            fwd = self.forwarder = forwarder.start(raw, self.pid, FORWARD_WAKE_BYTES)
            if fwd is None:
                self.counters["native_forward_unavailable"] = 1
                return
        link = self.link
        room = link.buffer_bytes - link.buffered if link is not None else 0
        fwd.set(self._forwarding_wanted(), self._forwarded_kinds(calls), room, self._epoch)

    def _stop_forwarder(self) -> None:
        """At the stop, before the last flush: the forwarder's thread joined once it has dealt with what is queued,
        what it framed taken in, the buffers it handed over queued for the last drain, and every buffer from now
        on the sender's to read, as without a forwarder."""
        fwd = self.forwarder
        if fwd is None:
            return
        fwd.sync(FORWARD_SYNC_S)
        left = fwd.stop()
        try:
            self.intake.q.extend(("raw", address, valid) for address, valid in left)
            self._take_forwarded(fwd)
        finally:
            self.forwarder = None  # nothing calls it from now on, then its memory goes
            fwd.release()
            fwd.free()
            self.forwarder_bytes = 0

    def _catch_up_forwarder(self) -> None:
        """Before a mark or a profiler's hand-back, which the daemon applies as a watermark: the forwarder's reads
        of every buffer queued before it, waited for longer than a watermark waits (a starved CPU)."""
        for _ in range(4):
            if self.forwarder is None or not self._forward_lagging:
                return
            self._drain_records_only()  # waits again, then reads what it handed over meanwhile

    def _drain(self) -> None:
        self._take_native()
        q = self.intake.q
        while q:
            item = q.popleft()
            head = item[0]
            if isinstance(head, RecordKind):
                self.intake.records_out += len(item[1])
                self._records(head, item[1])
            elif head == "raw":
                self._raw_buffer(item[1], item[2])
            elif head == "mark":
                # Everything CUPTI holds from before the mark goes out ahead of it.
                if not self.in_gap and self._backend is not None:
                    self._backend.flush(True)
                self.packer.flush()
                self._drain_records_only()
                self._catch_up_forwarder()
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
        self._queue_oom_marks()

    def _queue_oom_marks(self) -> None:
        """Each OOM goes out as a MARK after a flush, like a workload's mark. A failed call is judged
        once every record up to the end of its recovery window is in (the table's watermark), or at
        stop; probe/oom.py says why it waits. A failure still waiting queues nothing and holds
        nothing back: the records and watermarks of a process that survives it stream on."""
        if not self.oom.pending():
            return
        # Stopping, or in a profiler gap (no record of ours comes then, and no watermark): judged at once.
        settled = None if self._stop.is_set() or self.in_gap else self._table_ts
        if self.discover_pending:
            self._discover_devices()  # a failure before the first heartbeat after CUDA started: one GPU or several?
        # an API record names no device: the one the newest allocation record named (packer.api_dev)
        bodies = self.oom.marks(self.pid, self.packer.api_dev, settled, only_device=len(self.devices) == 1,
                                final=self._stop.is_set())
        for body in bodies:
            self.intake.q.append(("mark", body, threading.Event()))
        if bodies:
            self._drain()

    def _drain_records_only(self) -> None:
        self._take_native()
        rest: deque[Any] = deque()
        while self.intake.q:
            item = self.intake.q.popleft()
            if isinstance(item[0], RecordKind):
                self.intake.records_out += len(item[1])
                self._records(item[0], item[1])
            elif item[0] == "raw":
                self._raw_buffer(item[1], item[2])
            else:
                rest.append(item)
        self.intake.q.extendleft(reversed(rest))

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
            memory_seen(self.packer, self.cupti, arr, self.in_gap)
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

    def _discover_devices(self) -> None:
        """CUDA's devices, once the workload has started CUDA (the probe never calls ``cuInit`` first:
        ``hostinfo.cuda_started``): in the HELLO of later connections, and to the daemon now in a META."""
        started = hostinfo.cuda_started()
        if started is None:
            self.discover_pending = False  # cuInit ran and failed (no device visible): nothing to list, ever
        if not started:
            return
        self.discover_pending = False
        devices, _active = hostinfo.cuda_devices()
        if not devices:
            return
        self.devices = devices
        self.hello["devices"] = devices
        self._emit(framing.encode_json(FrameType.META, {"pid": self.pid, "devices": devices}), must=True)

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

    def _flush_and_drain(self) -> None:
        t = self._clock_ns()
        if not self.in_gap and self._backend is not None:
            t0 = time.perf_counter()
            self._backend.flush(True)
            self.counters["flushes"] += 1
            self.counters["flush_ns"] += int((time.perf_counter() - t0) * 1e9)
        self.packer.flush()
        self._drain()
        if self.in_gap or self._forward_lagging:
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

    # --- connection, resync, the profiler's hand-back ---------------------------------------------

    def _on_connect(self) -> None:
        # What the last daemon said it reads need not hold for this one (a restart into an older
        # build): TOTALS and forwarded buffers wait until this daemon asks.
        self._verify = self._forward = False
        self._raw_reader.checked = True
        self._epoch += 1
        if self.forwarder is not None:
            # Frames it made for the last connection are dropped (their structs go to the table, and so to this
            # daemon by the resync below) before anything goes to this one.
            self._update_forwarder()
            self._take_native()
        self._emit_link(framing.encode_json(FrameType.HELLO, self.hello))
        if self.packer.names:
            self._emit_link(framing.encode_json(FrameType.STRINGS, {str(i): n for n, i in self.packer.names.items()}))
        if self.link is not None:
            # A daemon asks for buffers unread in answer to the HELLO (an older one at the first watermark):
            # waited for here, before the drain below reads what CUPTI queued meanwhile, which unasked it
            # converts itself, a path that behind busy Python threads falls behind and drops.
            self.link.await_control(CONNECT_ASK_WAIT_S, lambda: self._verify)
        # Records not yet in the table (stamped after its watermark) went to the old connection or
        # nowhere: this one gets the table as of its watermark, then those again as ordinary records,
        # then whatever CUPTI holds now (which goes to this connection only).
        pending = self.table.pending_array()
        self._resync("connect")
        if self.link is not None:
            resync.send_records(self.link, pending)
        self._flush_and_drain()
        # A window the last daemon opened is no business of this one, which numbers its windows from 1
        # again: closed here (after HELLO), and no id of the last daemon's is held against the new one.
        if self.windows.kernel_window is not None:
            self.windows.close_kernel_window()
        self.windows.counted_id = 0

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
        self._catch_up_forwarder()
        self._advance_table(self._clock_ns())
        self.table.split_torch_owned(before + after)
        self.table.add_torch_segments(after, self._clock_ns(), self.pid)
        self.gap_seconds += (time.monotonic_ns() - self._gap_started_ns) / 1e9
        self.in_gap = False
        self.counters["profiler_gaps"] += 1
        self._resync("profiler_gap")

    # --- control (the daemon's CONTROL frames: probe/control.py) ----------------------------------

    def _control(self, frame: Frame) -> None:
        forwarding = self.forwarder is not None
        if forwarding:
            # API records the sender's while a control is applied: a launch window it opens takes its calls from the
            # next buffer on, and its switch may be made on the program's main thread while this one waits.
            self._update_forwarder(calls=False)
        control.apply_control(frame, self)
        if forwarding:
            self._update_forwarder()

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
        if cupti_buffers >= 1:
            self._forward = self.settings.forward_buffers
            self._forwardable = FORWARDABLE if cupti_buffers >= 2 else FORWARDABLE_V1
            self._raw_reader.checked = cupti_buffers < framing.CUPTI_BUFFERS_UNCHECKED

    def open_kernel_window(self, ms: int, wid: int, records: str = "kernels", steps: int = 0,
                           max_records: int = 0, min_ms: int = 0) -> None:
        self.windows.open_kernel_window(ms, wid, records, steps, max_records, min_ms)

    # --- untracked memory (CUDA started before the probe) -----------------------------------------

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
        # The inner call acts (it sends), so it stays a statement, not a second condition.
        if len(arr):  # noqa: SIM102
            if self._emit(framing.encode_batch(RecordKind.MEMORY, arr)):
                self.counters["records_sent"] += len(arr)

    # --- heartbeats -------------------------------------------------------------------------------

    def _counter_values(self) -> dict[str, Any]:
        gap = self.gap_seconds + (time.monotonic_ns() - self._gap_started_ns) / 1e9 if self.in_gap else self.gap_seconds
        dropped = counters.cupti_dropped(self._backend, self.raw, self.counters) if not self.in_gap else None
        return counters.counter_values(self, gap_seconds=gap, cupti_dropped=dropped)

    def _heartbeat(self) -> dict[str, Any]:
        body: dict[str, Any] = {"ts": self._clock_ns(), "pid": self.pid, "counters": self._counter_values()}
        if self.settings.torch_numbers and self.torch_numbers.hook() and self.torch_numbers.latest:
            body["torch"] = self.torch_numbers.latest  # read on the workload's thread (torchnumbers.py)
        return body

    def _goodbye(self) -> None:
        try:
            if not self.in_gap and self._backend is not None:
                # Nothing of ours may stay inside CUPTI after this: a buffer delivered
                # while the interpreter shuts down would call into a dying Python.
                hooks = self.counters["driver_hooks"]
                self.cupti.quiesce()
                self.counters["driver_hooks"] = hooks  # GOODBYE says how the process was recorded
            self._stop_forwarder()
            self._flush_and_drain()
            if self.windows.kernel_window is not None:
                self.windows.close_kernel_window()
            self._emit(framing.encode_json(FrameType.GOODBYE, self._heartbeat()), must=True)
            if self.link is not None:
                self.link.drain(1.0)
                self.link.close("goodbye")
                self._count_lost()
        finally:
            if self.tee is not None:
                self.tee.close()
