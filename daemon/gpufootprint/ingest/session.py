"""One stream of frames (a probe connection or a recorded file) into the pipeline.

A session turns frames into pipeline calls and keeps what belongs to the stream:
who is speaking, its kernel-name table, a resync in progress, and the problems
it met. Damage inside one frame (an unknown record kind, bad JSON) is counted and
skipped; the stream goes on, since the length prefix still tells where the next
frame starts.

Why about 510 lines in one module: every method reads and moves the same per-stream
state (the speaker's pid, the kernel-name table, the resync in progress, the problem
counts) as frames of every type arrive; what needs none of it went out already (field
and size checks to validate.py, bounds shared across streams to tenants.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gpufootprint.errors import FrameError
from gpufootprint.ingest.validate import (
    METADATA_PROCESSES,
    Guard,
    Limits,
    bounded_metadata,
    check_fields,
    in_range,
    metadata_charge,
)
from gpufootprint.pipeline import Pipeline
from gpufootprint.probecounters import clean_counters
from gpufootprint.records import DTYPES, MAX_TIMESTAMP_NS, MEMORY_DTYPE, TIME_FIELD, RecordKind, copy_records
from gpufootprint.wire import cupti_layout
from gpufootprint.wire.framing import RECORD_KINDS, Frame, FrameType, cupti_buffer

log = logging.getLogger(__name__)


MarkCallback = Callable[[dict[str, Any]], None]

# What a live probe may store about itself: any local process can connect and say anything. HELLO
# values reach reports, engine scopes (pod, namespace) and label values, so they are bounded in size and characters.
# A probe of this build sends about 61 counters plus one a connection result, a disconnect reason
# and a drop reason it met (at most 15): 96 holds all of them (test_heartbeat_counters), and a peer
# still cannot make the daemon keep an unbounded number of label values.
_MAX_COUNTERS = 96
_BATCH, _WATERMARK, _MARK, _HEARTBEAT = FrameType.BATCH, FrameType.WATERMARK, FrameType.MARK, FrameType.HEARTBEAT
_COUNTER_KEY = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_MAX_INFO_KEYS = 64
_MAX_INFO_STR = 256
_MAX_INFO_BYTES = 64 * 1024
_UNSAFE = re.compile(r"[\x00-\x1f\x7f]")
#: Records of one kind decoded at once from a forwarded CUPTI buffer (about 2 MiB of raw structs).
DECODE_CHUNK = 16_384
#: CUPTI_BUFFER frames whose walks a session keeps until it reads them: a run's (``protocol.MAX_RUN_FRAMES``)
#: and the one counted next.
WALKS_KEPT = 72
#: What a kernel name costs beyond its characters (its dict entry, its key and str objects): an
#: empty name is not free.
NAME_CHARGE = 64


def name_charge(name: str) -> int:
    return len(name) + NAME_CHARGE


def clean_info(hello: dict[str, Any]) -> dict[str, Any]:
    """A probe's HELLO as the daemon keeps it: at most 64 keys named like identifiers, strings cut
    to 256 characters without control characters, nested values kept only while small."""
    out: dict[str, Any] = {}
    for key, value in list(hello.items())[:_MAX_INFO_KEYS]:
        if not isinstance(key, str) or not _COUNTER_KEY.match(key):
            continue
        if isinstance(value, str):
            out[key] = _UNSAFE.sub("?", value[:_MAX_INFO_STR])
        # Two branches on purpose: scalars pass as they are, containers only when small.
        elif value is None or isinstance(value, (bool, int, float)):  # noqa: SIM114
            out[key] = value
        elif isinstance(value, (dict, list)) and len(json.dumps(value, default=str)) <= _MAX_INFO_BYTES:
            out[key] = value
    return out


class Session:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        source: str = "trace",
        name: str = "stream",
        peer_pid: int | None = None,
        on_mark: MarkCallback | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.source = source
        self.name = name
        self.peer_pid = peer_pid  # set for live probes: the only pid it may speak for
        # A probe in another pid namespace (a container) knows itself by another pid than the
        # kernel's SO_PEERCRED one; its HELLO says which, and that pid is mapped to the peer's.
        self.ns_pid: int | None = None
        self.on_mark = on_mark
        self.pids: set[int] = set()
        self.kernel_names: dict[int, str] = {}
        self.problems: list[str] = []
        self.frames = 0
        self.records = 0
        self._resync: list[np.ndarray] | None = None
        self._resync_ts = 0
        self._resync_pid: int | None = None  # the pid RESYNC_BEGIN names (used only without a peer)
        # For live probes, the latest credible timestamp (daemon clock + max_future_seconds);
        # later ones are clamped to it and counted, so one stepped clock cannot stall the reorder buffer.
        self.future_limit_ns: Callable[[], int] | None = None
        # Field ranges for every source; for live probes (``guard``) also what a process may hold.
        self.limits = Limits()
        self.guard: Guard | None = None
        self._string_bytes = 0  # kernel-name charge this stream holds (counted in the guard)
        # The CUPTI_BUFFER frames walked and not read yet, by identity, with what each walk found: the
        # ingest server counts a read's frames as received (``protocol.count_received``) before handing
        # them here, and a walk costs about 4 us a 512-record buffer.
        self._walked: dict[int, tuple[Frame, int, memoryview, dict[int, cupti_layout.Runs] | None]] = {}
        self._bad_buffers_said = 0  # CUPTI buffers that could not be walked, of which the first few say where
        self._resync_held = 0  # records of the open resync, counted in the guard's node-wide room

    # --- frames -----------------------------------------------------------------

    def handle(self, frame: Frame) -> None:
        self.frames += 1
        try:
            self._dispatch(frame)
        except FrameError as exc:
            self.problem("bad_frame", f"{self.name}: {exc}")

    def problem(self, reason: str, message: str, n: int = 1) -> None:
        self.pipeline.errors.add(reason, message, n)
        if len(self.problems) < 100:
            self.problems.append(message)

    def _count(self, reason: str, detail: str, n: int) -> None:
        self.problem(reason, f"{self.name}: {detail}", n)

    def _mine(self, pid: object) -> int | None:
        """For a live probe: the peer's pid when ``pid`` names it (or is absent), else None (counted):
        a connection speaks only for the process at its other end, as the kernel says (SO_PEERCRED)."""
        assert self.peer_pid is not None
        if pid is None or pid == self.peer_pid or (self.ns_pid is not None and pid == self.ns_pid):
            return self.peer_pid
        self.problem("identity", f"{self.name}: a frame speaks for pid {str(pid)[:32]}, not the peer's "
                                 f"{self.peer_pid}: dropped")
        return None

    def _credible_ts(self, ts: object, what: str) -> int | None:
        """A control frame's timestamp as an int inside the record range, clamped like records."""
        if not isinstance(ts, int) or isinstance(ts, bool) or not 0 <= ts < MAX_TIMESTAMP_NS:
            self.problem("bad_timestamp", f"{self.name}: {what} timestamp {str(ts)[:32]} out of range")
            return None
        if self.future_limit_ns is not None:
            ts = min(ts, self.future_limit_ns())
        return ts

    def _dispatch(self, frame: Frame) -> None:
        ftype = frame.type
        # The frequent types first, compared with module-level names (an enum member read off its class
        # costs about 60 ns on Python 3.11, and a heartbeat went past eight of them).
        if ftype is _BATCH:
            self._batch(frame)
        elif ftype is _WATERMARK:
            ts = frame.watermark()
            if ts >= MAX_TIMESTAMP_NS:
                self.problem("bad_timestamp", f"{self.name}: byte {frame.offset}: WATERMARK beyond the year 2262")
                return
            if self.future_limit_ns is not None:
                ts = min(ts, self.future_limit_ns())
            for pid in ([self.peer_pid] if self.peer_pid is not None else self.pids):
                self.pipeline.watermark(pid, ts)
        elif ftype is _MARK:
            self._mark(frame.json())
        elif ftype is _HEARTBEAT:
            self._counters(frame.json())
        elif ftype is FrameType.CUPTI_BUFFER:
            self._cupti_buffer(frame)
        elif ftype is FrameType.TOTALS:
            self._totals(frame.json())
        elif ftype is FrameType.META:
            meta = frame.json()
            meta_pid = meta.get("pid")
            if self.peer_pid is not None:
                if self._mine(meta_pid) is None:
                    return
                proc = self._own(self.peer_pid)
                update = clean_info({k: v for k, v in meta.items() if k not in ("k", "pid")})
                if not bounded_metadata(proc.info, update, self.limits.max_metadata_bytes) or (
                        self.guard is not None and not self.guard.take_metadata(
                            self.peer_pid, metadata_charge({**proc.info, **update}))):
                    self.problem("metadata_limit", f"{self.name}: META would take pid {self.peer_pid}'s fields past "
                                                   f"daemon.max_metadata_bytes={self.limits.max_metadata_bytes} "
                                                   f"or its share of the node's metadata: dropped")
                    if self.guard is not None:
                        self.guard.refuse(self.peer_pid, "metadata_limit", 1, self.guard.metadata,
                                          self.limits.max_metadata_bytes * METADATA_PROCESSES)
                    return
                proc.info.update(update)
            elif isinstance(meta_pid, int):
                self._own(meta_pid).info.update({k: v for k, v in meta.items() if k != "k"})
        elif ftype is FrameType.HELLO:
            self._hello(frame.json())
        elif ftype is FrameType.GOODBYE:
            body = frame.json()
            self._counters(body)
            end = self._credible_ts(body["ts"], "GOODBYE") if isinstance(body.get("ts"), int) else None
            for pid in self._speakers(body):
                self.pipeline.process_exited(pid, end)
        elif ftype is FrameType.STRINGS:
            self._strings(frame)
        elif ftype is FrameType.RESYNC_BEGIN:
            body = frame.json()
            self._give_back_resync()
            self._resync = []
            named = body.get("pid")
            self._resync_pid = named if isinstance(named, int) and not isinstance(named, bool) and named > 0 else None
            begin = self._credible_ts(body.get("ts", 0), "RESYNC_BEGIN")
            self._resync_ts = begin if begin is not None else 0
        elif ftype is FrameType.RESYNC_END:
            self._finish_resync()
        elif ftype is FrameType.CONTROL:
            self.problem("unexpected_frame", f"{self.name}: byte {frame.offset}: CONTROL frame from a probe")

    def _strings(self, frame: Frame) -> None:
        """Kernel names (id -> name), each charged its characters plus ``NAME_CHARGE`` against the
        peer's share of ``daemon.max_string_bytes``: an empty name costs the daemon a dict entry too."""
        if self.guard is not None and self.peer_pid is not None:
            # Refused before it is parsed when even its bytes cannot fit: parsing 16 MiB of empty
            # names builds over a million entries for a moment.
            entries = frame.payload.count(b'":')
            charge = len(frame.payload) + NAME_CHARGE * entries
            if charge > self.guard.strings.room(self.peer_pid, self.limits.max_string_bytes, self.guard.census):
                self._refuse_strings(entries)
                return
        for key, value in frame.json().items():
            if not (key.isdigit() and len(key) <= 20 and isinstance(value, str)):
                continue
            name = value[:512]
            nid = int(key)
            old = self.kernel_names.get(nid)
            charge = name_charge(name) - (name_charge(old) if old is not None else 0)
            if self.guard is not None and self.peer_pid is not None \
                    and not self.guard.take_strings(self.peer_pid, charge):
                self._refuse_strings(1)
                return
            self._string_bytes += charge
            self.kernel_names[nid] = name

    def _refuse_strings(self, n: int) -> None:
        assert self.guard is not None and self.peer_pid is not None
        self.problem("strings_limit", f"{self.name}: kernel names past its share of daemon.max_string_bytes="
                                      f"{self.limits.max_string_bytes}: dropped", n)
        self.guard.refuse(self.peer_pid, "strings_limit", n, self.guard.strings, self.limits.max_string_bytes)

    def _give_back_resync(self) -> None:
        if self.guard is not None and self.peer_pid is not None and self._resync_held:
            self.guard.resyncs.add(self.peer_pid, -self._resync_held, self.guard.census)
        self._resync_held = 0

    def _totals(self, body: dict[str, Any]) -> None:
        """The probe's own table at a watermark: checked against the footprint at the same time."""
        ts, pid, devices = body.get("ts"), body.get("pid"), body.get("devices")
        if self.ns_pid is not None and pid == self.ns_pid:
            pid = self.peer_pid
        if not (isinstance(ts, int) and isinstance(pid, int) and isinstance(devices, dict)) \
                or (self.peer_pid is not None and pid != self.peer_pid) or pid not in self.pids:
            self.problem("bad_totals", f"{self.name}: TOTALS without integer ts, the stream's pid and devices")
            return
        totals: dict[int, dict[int, tuple[int, int]]] = {}
        for dev, kinds in list(devices.items())[:64]:
            if not (isinstance(dev, str) and dev.isdigit() and isinstance(kinds, dict)):
                self.problem("bad_totals", f"{self.name}: TOTALS device {dev!r} is not a device number")
                return
            row: dict[int, tuple[int, int]] = {}
            for kind, pair in list(kinds.items())[:64]:
                if not (isinstance(kind, str) and kind.isdigit() and isinstance(pair, list) and len(pair) == 2
                        and all(isinstance(v, int) and 0 <= v < (1 << 63) for v in pair)):
                    self.problem("bad_totals", f"{self.name}: TOTALS device {dev} kind {kind!r}: not [bytes, count]")
                    return
                row[int(kind)] = (pair[0], pair[1])
            totals[int(dev)] = row
        self.pipeline.verify(pid, ts, totals)

    def _own(self, pid: int):  # type: ignore[no-untyped-def]
        self.pids.add(pid)
        return self.pipeline.process(pid, self.source)

    def cupti_walk(self, frame: Frame) -> tuple[int, memoryview, dict[int, cupti_layout.Runs] | None]:
        """(pid, buffer, ``cupti_layout.walk``'s offsets) of a CUPTI_BUFFER frame, walked once however
        often it is asked: kept until the session has read the frames of the read or run that holds it
        (``WALKS_KEPT`` at most)."""
        walked = self._walked.get(id(frame))
        if walked is not None and walked[0] is frame:
            return walked[1], walked[2], walked[3]
        pid, data = cupti_buffer(frame)
        offsets = cupti_layout.walk(data, len(data))
        if len(self._walked) >= WALKS_KEPT:  # frames counted and never read (a peer cut off): the oldest go
            del self._walked[next(iter(self._walked))]
        self._walked[id(frame)] = (frame, pid, data, offsets)
        return pid, data, offsets

    def cupti_buffers(self, frames: list[Frame]) -> None:
        """Consecutive CUPTI_BUFFER frames of one read, up to a watermark (``protocol.MAX_RUN_FRAMES`` at most), read as one:
        each buffer is walked and converted as alone, then each run of records of one kind, next to each other
        in the order they came, goes on as one batch (``DECODE_CHUNK`` records at most). What the daemon pays
        per batch (the fields' checks, the ingest guard, the pipeline's chunk) was paid per buffer: a 64 KiB
        buffer holds 512 allocation records, and a busy probe's flush is several (bench/cupti_runs.py).
        Records, their kinds and the buffers' own problems come in the order of the frames, as read one by
        one; a problem of a joined batch's records (a field out of range) names the byte of its first frame.
        A joined batch that would meet a share of the node's bounds goes on buffer by buffer instead
        (``Guard.fits``): what a share refuses is what it refused reading the buffers one by one. (The
        guard's count of live allocations after a joined batch also credits releases of allocations an
        earlier buffer of the run made, closer to the truth than the buffers one by one, until the tick's
        recount sets it from the tables.)"""
        # (CUPTI kind, raw structs, offset of their frame) of one of our kinds, the peer's: converted when the
        # run ends, straight into its joined batch (``_joined``).
        run: list[tuple[int, np.ndarray, int]] = []
        run_kind: RecordKind | None = None
        held = 0
        try:
            for frame in frames:
                self.frames += 1
                try:
                    for kind, ck, raw, pid, own in self._cupti_raw(frame):
                        if run and (kind is not run_kind or not own or held + len(raw) > DECODE_CHUNK):
                            self._joined(run_kind, run)
                            run, held = [], 0
                        if not own:  # another pid's: refused record by record, as alone
                            self._records(kind, cupti_layout.convert(ck, raw, pid), frame.offset, own)
                            continue
                        run.append((ck, raw, frame.offset))
                        run_kind, held = kind, held + len(raw)
                except FrameError as exc:
                    self.problem("bad_frame", f"{self.name}: {exc}")
            if run:
                self._joined(run_kind, run)
        finally:
            self._walked.clear()  # the read's frames are read (or never will be): their walks go

    def _joined(self, kind: RecordKind | None, run: list[tuple[int, np.ndarray, int]]) -> None:
        """A run of one kind's records, the peer's, from consecutive buffers: one batch if the guard would
        admit it whole, else its buffers' records one by one.

        Every buffer's structs are converted into their place in one batch, made once: converted each into its
        own array and then joined, a run of seven 512-record buffers paid seven allocations and a second copy
        of every record (``bench/cupti_runs.py``)."""
        assert kind is not None
        pid = self.peer_pid if self.peer_pid is not None else 0  # only the peer's records join a run
        if len(run) == 1:
            ck, raw, offset = run[0]
            self._records(kind, cupti_layout.convert(ck, raw, pid), offset, True)
            return
        recs = np.zeros(sum(len(raw) for _, raw, _ in run), DTYPES[kind])
        at = 0
        for ck, raw, _ in run:
            cupti_layout.convert(ck, raw, pid, out=recs[at:at + len(raw)])
            at += len(raw)
        if self.guard is None or self.peer_pid is None or (
                self._resync is None and self.guard.fits(self._own(self.peer_pid), kind, recs)):
            self._records(kind, recs, run[0][2], True)
            return
        # Buffer by buffer, each copied into an array of its own: a part of the joined batch left waiting would
        # keep the whole run alive for its few records, past what the pending share counts. A copy of the words
        # (5 us a 512-record buffer), not a second conversion (19-40 us): a peer that stays at its share sends
        # every run down this path.
        at = 0
        for _, raw, offset in run:
            self._records(kind, copy_records(recs[at:at + len(raw)]), offset, True)
            at += len(raw)

    def _cupti_buffer(self, frame: Frame) -> None:
        """A CUPTI activity buffer forwarded as CUPTI wrote it: read here, then as a BATCH of each kind."""
        try:
            for kind, recs, own in self._cupti_records(frame):
                self._records(kind, recs, frame.offset, own)
        finally:
            self._walked.clear()  # read in order: every frame counted before it is read too

    def _cupti_records(self, frame: Frame) -> Iterator[tuple[RecordKind, np.ndarray, bool]]:
        """A CUPTI buffer's records, kind by kind in chunks, with whether all are known to be the peer's."""
        for kind, ck, raw, pid, own in self._cupti_raw(frame):
            yield kind, cupti_layout.convert(ck, raw, pid), own

    def _cupti_raw(self, frame: Frame) -> Iterator[tuple[RecordKind, int, np.ndarray, int, bool]]:
        """``_cupti_records`` before conversion: (our kind, CUPTI's kind, the raw structs as
        ``cupti_layout.gather`` gives them (a view of the frame where they lie in one run), the pid they
        are converted with, whether all are known to be the peer's)."""
        pid, data, offsets = self.cupti_walk(frame)
        self._walked.pop(id(frame), None)  # read now: the frame's bytes need not outlive it
        if offsets is None:
            # Where it stops only for the first few (a record-by-record walk in Python: 112-114 ms a 16 MiB frame
            # of API records on a 2-core VM, bench/walk_hostile.py, and any peer can send one again and again);
            # the rest are counted.
            where = cupti_layout.walk_stop(data, len(data)) if self._bad_buffers_said < 5 else "not looked at"
            self._bad_buffers_said += 1
            self.problem("bad_cupti_buffer", f"{self.name}: byte {frame.offset}: a CUPTI buffer that cannot be "
                                             f"walked ({where}): dropped")
            return
        u8 = np.frombuffer(data, dtype=np.uint8)
        if self.ns_pid is not None and pid == self.ns_pid and self.peer_pid is not None:
            pid = self.peer_pid  # the probe's own pid inside its namespace: the records are the peer's
        # Every record of the buffer carries the pid its frame claims: checked once here, not record by record.
        own = self.peer_pid is not None and pid == self.peer_pid
        for ck, offs in offsets.items():
            kind = cupti_layout.RECORD_KIND.get(ck)
            if kind is None or kind is RecordKind.KERNEL:
                continue  # API records (the driver-API switch) carry nothing; kernel names need the probe
            # Kind by kind, in chunks: what is decoded at once stays a small part of the frame, whatever
            # the mix of kinds (docs/reliability.md, Limits: decoding a forwarded buffer).
            n = len(offs)
            if n <= DECODE_CHUNK:
                # One chunk (every 64 KiB buffer CUPTI fills): the offsets as walked. A slice of them is a new
                # ``Runs`` built piece by piece in Python (about 3 us a buffer on a 2-core VM).
                yield kind, ck, cupti_layout.gather(u8, ck, offs), pid, own
                continue
            for at in range(0, n, DECODE_CHUNK):
                yield kind, ck, cupti_layout.gather(u8, ck, offs[at:at + DECODE_CHUNK]), pid, own

    def _batch(self, frame: Frame) -> None:
        kind = RECORD_KINDS.get(frame.tag)
        if kind is None:
            self.problem("unknown_record_kind", f"{self.name}: byte {frame.offset}: unknown record kind {frame.tag}")
            return
        self._records(kind, frame.records(), frame.offset)

    def _records(self, kind: RecordKind, recs: np.ndarray, offset: int, own: bool = False) -> None:
        """``own``: every record is known to carry the peer's pid (a CUPTI buffer's claimed pid, checked once)."""
        if not own:
            if self.ns_pid is not None and len(recs):
                mine = recs["pid"] == self.ns_pid
                if mine.any():
                    recs = copy_records(recs)
                    recs["pid"][mine] = self.peer_pid
            if self.peer_pid is not None:
                foreign = recs["pid"] != self.peer_pid
                if foreign.any():
                    self.problem("pid_mismatch", f"{self.name}: {int(foreign.sum())} records claim another pid "
                                                 f"than the peer's {self.peer_pid}")
                    recs = recs[~foreign]
        if len(recs) == 0:
            return
        if not in_range(kind, recs, self.limits):  # the common case, every field in range, asked at once
            # Timestamps are nanoseconds since 1970 and must fit a signed 64-bit integer (until
            # 2262): larger ones are damage (or a sentinel) in any source, trace or probe.
            absurd = recs[TIME_FIELD[kind]] >= np.uint64(MAX_TIMESTAMP_NS)
            if absurd.any():
                n = int(absurd.sum())  # records, as the fields' checks count them (a joined batch counts as its parts)
                self.problem("bad_timestamp", f"{self.name}: byte {offset}: {n} {kind.name} "
                                              f"records with a timestamp beyond the year 2262: dropped", n)
                recs = recs[~absurd]
                if len(recs) == 0:
                    return
            recs = check_fields(kind, recs, self.limits, self._count)
            if len(recs) == 0:
                return
        if self.future_limit_ns is not None:
            recs = self._clamp_future(kind, recs)
        if self.guard is not None and self.peer_pid is not None:
            if self.peer_pid in self.guard.quarantined:
                self._count("quarantined", f"pid {self.peer_pid} is quarantined: records dropped", len(recs))
                return
            if self._resync is not None and kind is RecordKind.MEMORY:
                # Open resyncs share one node-wide bound (daemon.max_resync_records) by tenant.
                keep = self.guard.take_resync(self.peer_pid, len(recs))
                self._resync_held += keep
                if keep < len(recs):
                    self._count("resync_limit", f"resync past its share of daemon.max_resync_records="
                                                f"{self.limits.max_resync_records} (or daemon.max_live_allocations_"
                                                f"per_process={self.limits.max_live_allocations_per_process}): "
                                                f"dropped", len(recs) - keep)
                    self.guard.refuse(self.peer_pid, "resync_limit", len(recs) - keep, self.guard.resyncs,
                                      self.limits.max_resync_records, self.limits.max_live_allocations_per_process)
                    recs = recs[:keep]
            else:
                proc = self._own(self.peer_pid)
                pid = self.peer_pid
                recs = self.guard.admit(proc, kind, recs, self._count, lambda ts: self.pipeline.advance(pid, ts))
                if kind is RecordKind.KERNEL or kind is RecordKind.API:
                    recs = self.guard.admit_kernels(proc, kind, recs, self.pipeline.kernel_retention, self._count)
            if len(recs) == 0:
                return
        self.records += len(recs)
        if self._resync is not None and kind is RecordKind.MEMORY:
            self._resync.append(recs)
            return
        if recs["pid"][0] not in self.pids:
            for pid in np.unique(recs["pid"]).tolist():
                self._own(pid)
        self.pipeline.submit(kind, recs)

    def _clamp_future(self, kind: RecordKind, recs: np.ndarray) -> np.ndarray:
        assert self.future_limit_ns is not None
        field = TIME_FIELD[kind]
        limit = self.future_limit_ns()
        ahead = recs[field] > limit
        if not ahead.any():
            return recs
        n = int(ahead.sum())
        self.problem("future_timestamp", f"{self.name}: {n} {kind.name} records stamped more than the allowed "
                                         f"skew ahead of the daemon's clock: clamped to it", n)
        recs = copy_records(recs)
        if "end" in (recs.dtype.names or ()):  # keep durations: move the interval, not just its start
            recs["end"][ahead] = recs["end"][ahead] - recs[field][ahead] + np.uint64(limit)
        recs[field][ahead] = limit
        return recs

    def _finish_resync(self) -> None:
        if self._resync is None:
            self.problem("unexpected_frame", f"{self.name}: RESYNC_END without RESYNC_BEGIN")
            return
        chunks, self._resync = self._resync, None
        self._give_back_resync()
        recs = np.concatenate(chunks) if chunks else np.zeros(0, MEMORY_DTYPE)
        if self.guard is not None and self.peer_pid is not None and self.peer_pid not in self.guard.quarantined:
            # The live table it becomes counts against the same shares as live records.
            recs = self.guard.admit_resync(self._own(self.peer_pid), recs, self._count)
        pids = set(np.unique(recs["pid"]).tolist()) if len(recs) else set()
        if self.peer_pid is not None:
            pids.add(self.peer_pid)
        elif self._resync_pid is not None:
            # A recording (replay, the demo) has no peer: the frames name the process. An empty table
            # must clear it as a live peer's does, or what was freed during a profiler gap stays live.
            pids.add(self._resync_pid)
        for pid in pids:
            self._own(pid)
            self.pipeline.resync(pid, recs[recs["pid"] == pid], self._resync_ts)

    def _hello(self, hello: dict[str, Any]) -> None:
        pid = hello.get("pid")
        if not isinstance(pid, int):
            self.problem("bad_hello", f"{self.name}: HELLO without an integer pid")
            return
        key = self.peer_pid if self.peer_pid is not None else pid
        if self.peer_pid is not None and pid != self.peer_pid:
            self.ns_pid = pid
        known = self.pipeline.processes.get(key)
        if known is not None and known.info.get("start_time") not in (None, hello.get("start_time")):
            known = self.pipeline.restart(key, self.source)  # the pid was reused by a new process
        proc = self._own(key)
        proc.source = self.source
        if self.peer_pid is not None:
            info = clean_info(hello)
            fits = bounded_metadata({}, info, self.limits.max_metadata_bytes)
            if fits and self.guard is not None:
                fits = self.guard.take_metadata(key, metadata_charge({**proc.info, **info}))
            if not fits:
                # Keep the identity (scalars); nested values are what can be large.
                info = {k: v for k, v in info.items() if not isinstance(v, (dict, list))}
                self.problem("metadata_limit", f"{self.name}: HELLO past daemon.max_metadata_bytes="
                                               f"{self.limits.max_metadata_bytes} or its share of the node's "
                                               f"metadata: nested fields dropped")
                if self.guard is not None:
                    self.guard.take_metadata(key, metadata_charge({**proc.info, **info}), force=True)
                    self.guard.refuse(key, "metadata_limit", 1, self.guard.metadata,
                                      self.limits.max_metadata_bytes * METADATA_PROCESSES)
            proc.info.update(info)
        else:
            proc.info.update(hello)
        proc.exited_at = None

    def _counters(self, body: dict[str, Any]) -> None:
        if "torch" in body:  # allocator statistics (contract: HEARTBEAT "torch"), for allocator slack
            torch = body["torch"] if self.peer_pid is None else self._bounded_torch(body["torch"])
            for pid in self._speakers(body):
                self.pipeline.note_torch(pid, torch)
        window = body.get("kernel_window")
        if isinstance(window, dict) and window.get("closed") == "counted":
            # The probe closed a launch window at the count it was sent: stop following it (its calls
            # still come, ahead of this heartbeat, and reach the advisor as any others).
            wid, end = window.get("id"), window.get("end_ns")
            if isinstance(wid, int) and isinstance(end, int) and not isinstance(wid, bool):
                for pid in self._speakers(body):
                    self.pipeline.note_window_closed(pid, wid, end)
        counters = body.get("counters")
        if not isinstance(counters, dict):
            return
        if self.peer_pid is None:  # a recording's: checked when read (probecounters)
            for pid in self._speakers(body):
                self.pipeline.process(pid, self.source).counters.add(counters)
            return
        # A live peer chooses them, and keys become label values (connections_*, ...): checked and cut now.
        # JSON's keys are str already; a value must be a finite number a float holds (clean_counters).
        clean = {k: v for k, v in list(clean_counters(counters).items())[:_MAX_COUNTERS] if _COUNTER_KEY.match(k)}
        # The windows the probe has had, from any daemon: one restarted (a DaemonSet roll) backs its windows
        # off from there, not from none (each window may leave the process's launches a little slower)
        had = sum(v for k in ("launch_windows", "kernel_windows") if (v := clean.get(k, 0)) > 0)
        for pid in self._speakers(body):
            self.pipeline.process(pid, self.source).counters.add_clean(clean)
            if had:
                self.pipeline.note_windows_had(pid, int(had))

    def _bounded_torch(self, torch: Any) -> Any:
        """Allocator statistics keyed by device numbers in range, with integer values in range."""
        if not isinstance(torch, dict):
            return None
        out: dict[str, dict[str, int]] = {}
        for part in ("allocated", "reserved"):
            values = torch.get(part)
            if not isinstance(values, dict):
                return None
            out[part] = {k: v for k, v in list(values.items())[:self.limits.max_devices_per_process]
                         if isinstance(k, str) and k.isdigit() and int(k) < self.limits.max_devices_per_process
                         and isinstance(v, int) and 0 <= v <= self.limits.max_record_bytes}
        return out

    def _speakers(self, body: dict[str, Any]) -> set[int]:
        """The pids a HEARTBEAT/GOODBYE speaks for: its own ``pid`` when it names one
        (a recorded file can hold several probes' frames), else the whole stream's; a live
        probe's, only ever its peer's."""
        pid = body.get("pid")
        if self.peer_pid is not None:
            mine = self._mine(pid)
            if mine is None:
                return set()
            self._own(mine)
            return {mine}
        if self.ns_pid is not None and pid == self.ns_pid:
            pid = self.peer_pid
        if isinstance(pid, int) and (self.peer_pid is None or pid == self.peer_pid):
            self._own(pid)
            return {pid}
        return set(self.pids)

    def _mark(self, mark: dict[str, Any]) -> None:
        ts, pid, dev = mark.get("ts"), mark.get("pid"), mark.get("dev", 0)
        if self.ns_pid is not None and pid == self.ns_pid:
            pid = self.peer_pid
        if not (isinstance(ts, int) and isinstance(pid, int) and isinstance(dev, int)):
            self.problem("bad_mark", f"{self.name}: mark {str(mark.get('label'))[:64]!r} lacks integer ts/pid/dev")
            return
        if self.peer_pid is not None:
            if self._mine(pid) is None:
                return
            checked = self._credible_ts(ts, "MARK")
            if checked is None:
                return
            ts = checked
        self._own(pid)
        self.pipeline.advance(pid, ts)
        live, reserved, peak = self.pipeline.mark_state(pid, dev) or ({}, 0, 0)
        result: dict[str, Any] = {
            "label": mark.get("label"),
            "ts": ts,
            "pid": pid,
            "dev": dev,
            "live_bytes": live,
            "pool_reserved_bytes": reserved,
            "window_peak_bytes": peak,
        }
        if isinstance(mark.get("expect_live_bytes"), dict):
            result["expect_live_bytes"] = mark["expect_live_bytes"]
            result["matches"] = result["live_bytes"] == mark["expect_live_bytes"]
        for key in ("torch_memory_reserved", "torch_memory_allocated"):
            if key in mark:
                result[key] = mark[key]
        for key, value in mark.items():  # the workload's own figures ride along for reports and tests
            result.setdefault(key, value)
        if self.on_mark is not None:
            self.on_mark(result)

    def close(self) -> None:
        """The stream ended: apply what is pending."""
        if self._resync is not None:
            self.problem("truncated_resync", f"{self.name}: stream ended inside a resync")
            self._resync = None
            self._give_back_resync()
        if self.guard is not None and self.peer_pid is not None:  # a live stream's names die with it
            self.guard.take_strings(self.peer_pid, -self._string_bytes)
            self._string_bytes = 0
            self.kernel_names.clear()
        for pid in self.pids:
            self.pipeline.finish(pid)
