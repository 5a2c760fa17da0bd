"""Range checks and resource bounds at the wire boundary, before the pipeline sees a record.

Every field that later becomes a dictionary key, a signed 64-bit number or a sum is
checked here, per record, with numpy (one vectorised comparison per field): sizes and
byte counts, device numbers, durations. A record out of range is dropped and counted
under its reason; the rest of its batch goes on. The footprint code can then add and
subtract in int64 without ever overflowing (``max_record_bytes`` times the most records
a process may hold stays far below 2**63).

For live probes a ``Guard`` also bounds what one process, and all of them together,
can make the daemon hold: devices, live allocations, records waiting in the reorder
buffer. The totals are recounted at every tick and moved by each admitted batch, so a flood
between two ticks is bounded too (docs/known-issues.md says where the count between ticks is an
estimate, and how pairs that a watermark splits can pass the live share up to the waiting share).
docs/reliability.md gives the memory each bound implies.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpufootprint.config import DaemonConfig
from gpufootprint.ingest.tenants import Census, Offenders, Room
from gpufootprint.pipeline import ProcessState
from gpufootprint.records import (
    DTYPES,
    MAX_TIMESTAMP_NS,
    TIME_FIELD,
    UM_CPU_PAGE_FAULT_COUNT,
    ApiRole,
    MemoryOp,
    RecordKind,
)

#: Longest kernel, copy or set the daemon believes (end - start): a sum of a batch of them
#: stays far inside int64.
MAX_DURATION_NS = 3600 * 10**9

Problem = Callable[[str, str, int], None]  # (reason, detail, records)


@dataclass(frozen=True)
class Limits:
    max_record_bytes: int = 1 << 42
    max_devices_per_process: int = 16
    max_live_allocations_per_process: int = 100_000
    max_live_allocations: int = 250_000
    max_pending_records_per_process: int = 250_000
    max_pending_records: int = 400_000
    max_device_footprints: int = 2048
    max_metadata_bytes: int = 8 * 1024
    max_retained_kernels: int = 500_000
    max_string_bytes: int = 16 * 1024 * 1024  # kernel names held for all live connections (charged)
    max_resync_records: int = 400_000  # records in open resyncs of all connections

    @classmethod
    def from_config(cls, dc: DaemonConfig) -> Limits:
        return cls(max_record_bytes=dc.max_record_bytes, max_devices_per_process=dc.max_devices_per_process,
                   max_live_allocations_per_process=dc.max_live_allocations_per_process,
                   max_live_allocations=dc.max_live_allocations,
                   max_pending_records_per_process=dc.max_pending_records_per_process,
                   max_pending_records=dc.max_pending_records,
                   max_device_footprints=dc.max_device_footprints, max_metadata_bytes=dc.max_metadata_bytes,
                   max_retained_kernels=dc.max_retained_kernels, max_string_bytes=dc.max_string_bytes,
                   max_resync_records=dc.max_resync_records)


# Per kind: fields that are byte counts (bounded by max_record_bytes), fields that are device
# numbers (bounded by max_devices_per_process), and whether (start, end) is an interval.
# A pool's release threshold is not among them: UINT64_MAX is its usual "never release" (PyTorch sets
# it), and nothing adds it up.
_BYTES: dict[RecordKind, tuple[str, ...]] = {
    RecordKind.MEMORY: ("bytes", "pool_size", "pool_used"),
    RecordKind.MEMORY_POOL: ("size", "used"),
    RecordKind.MEMCPY: ("bytes",),
    RecordKind.MEMSET: ("bytes",),
    RecordKind.KERNEL: (),
    RecordKind.UNIFIED_MEMORY: ("value",),
    RecordKind.API: (),
}
_DEVICES: dict[RecordKind, tuple[str, ...]] = {
    RecordKind.MEMCPY: ("dev", "src_dev", "dst_dev"),
}
_API_ROLES = np.array([r.value for r in ApiRole], dtype=np.uint8)
_API_DOMAINS = np.array([4, 5], dtype=np.uint8)  # CUPTI's DRIVER and RUNTIME activity kinds
_INTERVAL = frozenset({RecordKind.MEMCPY, RecordKind.MEMSET, RecordKind.KERNEL, RecordKind.UNIFIED_MEMORY,
                       RecordKind.API})


#: At most this many records are checked in Python (``in_range``): below it a few ``tolist`` calls
#: cost less than a numpy comparison per field.
FEW_RECORDS = 64
_API_ROLE_SET = frozenset(_API_ROLES.tolist())
_API_DOMAIN_SET = frozenset(_API_DOMAINS.tolist())


def in_range(kind: RecordKind, recs: np.ndarray, limits: Limits) -> bool:
    """Whether the session's timestamp check and ``check_fields`` would both keep every record: asked
    first, so that the common case costs one numpy comparison (a MEMORY or pool batch seen as u64 words)
    or one pass over a few records in Python. False says only "look closer": the full checks then
    find and count what is out of range."""
    n = len(recs)
    if n == 0:
        return False
    tiled = _time_word_limits(kind, limits)
    if tiled is not None and recs.flags.c_contiguous and recs.dtype == DTYPES[kind]:
        # The records as one flat run of words against their limits repeated record by record: one
        # contiguous comparison (the limits broadcast over (records, words) made numpy loop ten words at a
        # time: 24 against 11 us for 3,686 MEMORY records). count_nonzero: one C loop, where ndarray.any
        # goes through a Python wrapper and a ufunc reduction's setup (every batch is asked).
        words = recs.view(np.uint64)
        step = len(tiled)
        if len(words) <= step:
            return not np.count_nonzero(words > tiled[:len(words)])
        return not any(np.count_nonzero(words[at:at + step] > tiled[:len(words) - at])
                       for at in range(0, len(words), step))
    return n <= FEW_RECORDS and _few_in_range(kind, recs, limits)


#: Records whose words ``in_range`` compares at once: its limits are kept repeated this many times.
TILE_RECORDS = 4096


def _few_in_range(kind: RecordKind, recs: np.ndarray, limits: Limits) -> bool:
    """``in_range`` for a few records of any kind, field by field in Python (the same comparisons as
    the session's timestamp check and ``check_fields``)."""
    if max(recs[TIME_FIELD[kind]].tolist()) >= MAX_TIMESTAMP_NS:
        return False
    cap = limits.max_record_bytes
    for name in _BYTES[kind]:
        if kind is RecordKind.UNIFIED_MEMORY:
            if any(v > cap and c != UM_CPU_PAGE_FAULT_COUNT for v, c in zip(recs[name].tolist(),
                                                                             recs["ck"].tolist())):
                return False
        elif max(recs[name].tolist()) > cap:
            return False
    for name in _DEVICES.get(kind, ("dev",)):
        if max(recs[name].tolist()) >= limits.max_devices_per_process:
            return False
    if kind is RecordKind.API and not (_API_ROLE_SET.issuperset(recs["role"].tolist())
                                       and _API_DOMAIN_SET.issuperset(recs["domain"].tolist())):
        return False
    if kind in _INTERVAL:
        return not any(e > s and e - s > MAX_DURATION_NS for s, e in zip(recs["start"].tolist(),
                                                                         recs["end"].tolist()))
    return True


def _time_word_limits(kind: RecordKind, limits: Limits) -> np.ndarray | None:
    """The largest value each u64 word of a record of ``kind`` may hold for ``in_range``, repeated for
    ``TILE_RECORDS`` records, or None when its checks cannot be put that way (a duration, a set of roles,
    a field across words)."""
    # Keyed by the Limits object itself: hashing a dataclass of eleven fields costs a microsecond a batch.
    key = (kind, id(limits))
    known = _TIME_WORD_LIMITS.get(key)
    if known is not None and known[0] is limits:
        return known[1]
    dtype = DTYPES[kind]
    fields = dtype.fields
    lim: np.ndarray | None = None
    if fields is not None and dtype.itemsize % 8 == 0 and kind not in _INTERVAL and kind is not RecordKind.API \
            and kind is not RecordKind.UNIFIED_MEMORY:
        lim = np.full(dtype.itemsize // 8, np.iinfo(np.uint64).max, np.uint64)
        bounds = [(TIME_FIELD[kind], MAX_TIMESTAMP_NS - 1)] + [(b, limits.max_record_bytes) for b in _BYTES[kind]]
        for name, most in bounds:
            ftype, offset = fields[name][0], fields[name][1]
            if ftype.itemsize != 8 or offset % 8:
                return _keep(key, limits, None)
            lim[offset // 8] = min(int(lim[offset // 8]), most)
        for name in _DEVICES.get(kind, ("dev",)):
            ftype, offset = fields[name][0], fields[name][1]
            if ftype.itemsize != 4 or offset % 8 != 4:
                return _keep(key, limits, None)
            # A u32 in the upper half of its word (the lower half unbounded): the word below (n << 32).
            lim[offset // 8] = min(int(lim[offset // 8]), (limits.max_devices_per_process << 32) - 1)
    return _keep(key, limits, lim)


_TIME_WORD_LIMITS: dict[tuple[RecordKind, int], tuple[Limits, np.ndarray | None]] = {}


#: The repeated limits by their values: Limits objects with the same values share one (320 KiB for MEMORY).
_TILES: dict[bytes, np.ndarray] = {}


def _keep(key: tuple[RecordKind, int], limits: Limits, lim: np.ndarray | None) -> np.ndarray | None:
    if len(_TIME_WORD_LIMITS) > 1024:  # Limits objects come and go in tests; the daemon keeps one
        _TIME_WORD_LIMITS.clear()
    if len(_TILES) > 64:
        _TILES.clear()
    tiled = None if lim is None else _TILES.setdefault(lim.tobytes(), np.tile(lim, TILE_RECORDS))
    _TIME_WORD_LIMITS[key] = (limits, tiled)  # the object kept alive: its id stays its own
    return tiled


def check_fields(kind: RecordKind, recs: np.ndarray, limits: Limits, problem: Problem) -> np.ndarray:
    """``recs`` without the records whose fields are out of range; each reason counted once per batch."""
    if len(recs) == 0:
        return recs
    bad = np.zeros(len(recs), dtype=bool)
    cap = np.uint64(limits.max_record_bytes)
    # Each check first asks a bound of the whole column (its largest value, the batch's span): a batch
    # inside it has no record to flag, and its per-record comparisons are skipped.
    for name in _BYTES[kind]:
        if int(recs[name].max()) <= limits.max_record_bytes:
            continue
        over = recs[name] > cap
        if kind is RecordKind.UNIFIED_MEMORY:
            over &= recs["ck"] != UM_CPU_PAGE_FAULT_COUNT  # its value is an address, counted as one fault
        if over.any():
            problem("bad_size", f"{int(over.sum())} {kind.name} records with {name} above "
                                f"daemon.max_record_bytes={limits.max_record_bytes}", int((over & ~bad).sum()))
            bad |= over
    devs = np.uint32(limits.max_devices_per_process)
    for name in _DEVICES.get(kind, ("dev",)):
        if int(recs[name].max()) < limits.max_devices_per_process:
            continue
        over = recs[name] >= devs
        if over.any():
            problem("bad_device", f"{int(over.sum())} {kind.name} records with {name} >= "
                                  f"daemon.max_devices_per_process={limits.max_devices_per_process}",
                    int((over & ~bad).sum()))
            bad |= over
    if kind is RecordKind.API:
        unknown = ~np.isin(recs["role"], _API_ROLES) | ~np.isin(recs["domain"], _API_DOMAINS)
        if unknown.any():
            problem("bad_role", f"{int(unknown.sum())} API records with a role or domain the daemon does not know",
                    int((unknown & ~bad).sum()))
            bad |= unknown
    if kind in _INTERVAL and int(recs["end"].max()) - int(recs["start"].min()) > MAX_DURATION_NS:
        start, end = recs["start"], recs["end"]
        # end < start is clipped to a zero duration downstream; a huge one would overflow a sum
        long = (end > start) & ((end - start) > np.uint64(MAX_DURATION_NS))
        if long.any():
            problem("bad_duration", f"{int(long.sum())} {kind.name} records lasting over "
                                    f"{MAX_DURATION_NS // 10**9} s", int((long & ~bad).sum()))
            bad |= long
    return recs[~bad] if bad.any() else recs


class Guard:
    """The per-process bounds and the fair shares of the node-wide ones for live probes
    (``tenants.py``). One per daemon, used on the ingest thread."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.census = Census()
        # Recounted from the pipeline at each tick, moved by admitted batches in between.
        self.devices = Room("device_footprints")
        self.live = Room("live_allocations")
        self.pending = Room("pending_records")
        self.kernels = Room("retained_kernels")
        # Held by the sessions themselves (not in the pipeline): moved by them only.
        self.strings = Room("kernel_names")
        self.metadata = Room("metadata")  # HELLO and META fields, charged (``metadata_charge``)
        self._metadata_of: dict[int, int] = {}  # pid -> its charged fields
        self.resyncs = Room("resync_records")
        self.quarantined: dict[int, str] = {}  # pid -> why its state was dropped
        self.offenders = Offenders()
        # pid -> devices admitted whose tables are not opened yet (their records wait for the watermark)
        self._new_devices: dict[int, set[int]] = {}
        # The allocations in each waiting chunk of MEMORY records, counted once: id(chunk) -> (a weak
        # reference to it, the count). While the loop is busy a chunk waits up to a second, ten ticks.
        self._allocations_in: dict[int, tuple[weakref.ref[np.ndarray], int]] = {}
        # pid -> (its process, the newest waiting chunk read, the (device, address) keys waiting records
        # touch): kept between ticks only (``_waiting_keys``).
        self._touched: dict[int, tuple[ProcessState, int, set[tuple[int, int]]]] = {}

    @property
    def string_bytes(self) -> int:
        return self.strings.used

    def take_strings(self, pid: int, n: int) -> bool:
        """Reserve ``n`` charged characters of kernel names for ``pid`` (negative: give back);
        False when past its share (``max_string_bytes`` shared by tenant, then by process)."""
        if n > 0 and n > self.strings.room(pid, self.limits.max_string_bytes, self.census):
            return False
        self.strings.add(pid, n, self.census)
        return True

    def take_metadata(self, pid: int, charge: int, force: bool = False) -> bool:
        """``pid``'s fields would now be charged ``charge``: taken if the growth fits its share of the
        node's metadata (``max_metadata_bytes`` for each of ``METADATA_PROCESSES`` processes, shared by
        tenant, then process); ``force``: taken whatever the share (a process's identity)."""
        held = self._metadata_of.get(pid, 0)
        total = self.limits.max_metadata_bytes * METADATA_PROCESSES
        if not force and charge > held and charge - held > self.metadata.room(pid, total, self.census):
            return False
        self.metadata.add(pid, charge - held, self.census)
        self._metadata_of[pid] = charge
        return True

    def take_resync(self, pid: int, n: int) -> int:
        """How many of ``n`` records an open resync of ``pid`` may still hold; taken."""
        lim = self.limits
        keep = min(n, self.resyncs.room(pid, lim.max_resync_records, self.census,
                                        lim.max_live_allocations_per_process))
        self.resyncs.add(pid, keep, self.census)
        return keep

    def _waiting_allocations(self, chunk: np.ndarray, counted: dict[int, tuple[weakref.ref[np.ndarray], int]]) -> int:
        """The allocations among a waiting chunk's records: counted at the first tick it waits, then kept (in
        ``counted``, this tick's) while it is the same array."""
        known = self._allocations_in.get(id(chunk))
        if known is None or known[0]() is not chunk:
            known = (weakref.ref(chunk), int(np.count_nonzero(chunk["op"] == _ALLOCATION)))
        counted[id(chunk)] = known
        return known[1]

    def recount(self, processes: dict[int, ProcessState]) -> None:
        counted: dict[int, tuple[weakref.ref[np.ndarray], int]] = {}
        devices: dict[int, int] = {}
        live: dict[int, int] = {}
        pending: dict[int, int] = {}
        kernels: dict[int, int] = {}
        for pid in [p for p in self._new_devices if p not in processes]:
            del self._new_devices[pid]
        for pid in [p for p in self._metadata_of if p not in processes]:
            del self._metadata_of[pid]  # a forgotten process's fields are gone with it
        for pid, proc in processes.items():
            waiting = self._new_devices.get(pid)
            if waiting:
                waiting.difference_update(proc.devices)
            devices[pid] = len(proc.devices) + (len(waiting) if waiting else 0)
            # Waiting allocations become live ones: counted with them, so a flush adds nothing.
            live[pid] = _held(proc) + sum(
                self._waiting_allocations(chunk[2], counted) for chunk in proc.pending.get(RecordKind.MEMORY, ()))
            pending[pid] = proc.pending_records
            kernels[pid] = (len(proc.kernels.array()) if proc.kernels is not None else 0) \
                + (len(proc.launches.array()) if proc.launches is not None else 0)
        self._allocations_in = counted  # the chunks that no longer wait are forgotten
        self._touched.clear()
        for room, usage in ((self.devices, devices), (self.live, live), (self.pending, pending),
                            (self.kernels, kernels), (self.metadata, self._metadata_of)):
            room.recount(usage, self.census)
        self.census.forget(processes)

    def refuse(self, pid: int, reason: str, n: int, room: Room | None = None, total: int = 0,
               per_process: int | None = None) -> None:
        """Count a refusal against ``pid``'s uid and log it (once a minute per tenant)."""
        level = room.at_share(pid, total, self.census, per_process) if room is not None else "process"
        self.offenders.note(self.census.uid_of.get(pid, -1), self.census.tenant(pid), pid, reason, n, level)

    def admit_kernels(self, proc: ProcessState, kind: RecordKind, recs: np.ndarray, retention: int,
                      problem: Problem) -> np.ndarray:
        """KERNEL (or API) records a process may add to what the graph advisor retains for all processes."""
        if retention <= 0 or len(recs) == 0:
            return recs
        ring = proc.kernels if kind is RecordKind.KERNEL else proc.launches
        held = len(ring.array()) if ring is not None else 0
        growth = min(retention, held + len(recs)) - held  # a full ring replaces, it does not grow
        total = self.limits.max_retained_kernels
        room = self.kernels.room(proc.pid, total, self.census)
        if growth > room:
            # At its share the process's records replace its oldest, as a full ring does: the graph advisor
            # reads the newest windows, and a process that keeps to its windows is not an offender. Only a
            # batch larger than the whole share loses records (its oldest).
            cap = max(0, held + room)
            if len(recs) > cap:
                problem("kernel_limit", f"pid={proc.pid}: {kind.name} records past its share of "
                                        f"daemon.max_retained_kernels={total}: dropped", len(recs) - cap)
                self.refuse(proc.pid, "kernel_limit", len(recs) - cap, self.kernels, total)
                recs = recs[len(recs) - cap:]
            evict = held + len(recs) - cap
            if ring is not None and evict > 0:
                ring.drop_oldest(evict)
            growth = len(recs) - max(0, evict)
        self.kernels.add(proc.pid, growth, self.census)
        return recs

    def waiting_room(self, proc: ProcessState) -> int:
        """How many more records ``proc`` may hold waiting for its watermark now: its share of
        ``max_pending_records`` (which shrinks as others connect) less what it holds. What it holds is
        taken from the pipeline here, not only at the tick: records applied since then are not held."""
        lim, pid = self.limits, proc.pid
        self.pending.add(pid, proc.pending_records - self.pending.by_pid[pid], self.census)
        return self.pending.room(pid, lim.max_pending_records, self.census, lim.max_pending_records_per_process)

    def admit(self, proc: ProcessState, kind: RecordKind, recs: np.ndarray, problem: Problem,
              advance: Callable[[int], None]) -> np.ndarray:
        """The part of a live probe's batch its process may still hold. ``advance(ts)`` applies its records
        stamped at or before ``ts``: past its share, first those its watermarks made due (a busy daemon
        lets them wait), then, if it is still past, all of them at once (its reorder buffer is full: records
        after it count as late, none is lost)."""
        lim, census, pid = self.limits, self.census, proc.pid
        n = len(recs)
        if proc.pending_records and n > self.waiting_room(proc):
            if proc.due_to > proc.applied_to:
                # Past its share while a watermark waits (busy mode; the share shrinks as others connect):
                # apply what that watermark made due, as applying it when it came would have. Records past
                # it keep waiting: some of the same times may still be on their way (another thread's
                # buffer), and applying past them would make those late and ask for a resync.
                advance(proc.due_to)
            pending = proc.pending_records
            if pending and n > self.waiting_room(proc):
                # Still past: the valve. Without it a process that sends no watermark holds records
                # without bound; what it applies ahead of the watermark makes later records late.
                problem("pending_limit", f"pid={pid}: {pending} records waiting for the watermark past its share "
                                         f"(daemon.max_pending_records_per_process="
                                         f"{lim.max_pending_records_per_process}, daemon.max_pending_records="
                                         f"{lim.max_pending_records}): applied at once", pending)
                advance(max(proc.max_ts, proc.applied_to + 1))
                self.pending.add(pid, proc.pending_records - pending, census)
        recs = self.admit_devices(proc, recs, problem)
        if kind is RecordKind.MEMORY and len(recs):
            recs = self._admit_allocations(proc, recs, problem, advance)
        self.pending.add(pid, len(recs), census)
        return recs

    def _admit_allocations(self, proc: ProcessState, recs: np.ndarray, problem: Problem,
                           advance: Callable[[int], None]) -> np.ndarray:
        """A MEMORY batch's allocations within the process's live share; its count moved by the batch's
        growth: its allocations less the pairs it makes and frees itself and, at the share, less its releases
        of what the tables hold (the tick's recount makes the count exact again; docs/known-issues.md says
        where a watermark that splits the batch's pairs still lets the tables pass the share)."""
        lim, census, pid = self.limits, self.census, proc.pid
        allocs = recs["op"] == _ALLOCATION
        n_alloc = int(np.count_nonzero(allocs))
        room, growth = self._room_and_growth(proc, recs, allocs, n_alloc)
        freed = 0
        if growth > room and proc.due_to > proc.applied_to:
            # What its watermarks made due first, as a daemon keeping up would have applied it (a busy one
            # lets it wait): its releases are then in the table, counted as the tick's recount counts (where
            # few chunks wait: each is counted).
            advance(proc.due_to)
            if len(proc.pending.get(RecordKind.MEMORY, ())) <= TOUCH_SCAN_CHUNKS:
                self.live.add(pid, _held(proc) + _allocations_waiting(proc) - self.live.by_pid[pid], census)
            room, growth = self._room_and_growth(proc, recs, allocs, n_alloc)
        if growth > room:
            # At its share: releases of what the process holds now free room too, where no watermark can
            # apply the batch's allocations and leave them waiting (``_freed_from_table``).
            freed = self._freed_from_table(proc, recs)
            growth -= freed
        if growth > room:
            # Keep releases (they only shrink the table) and the first allocations that fit.
            over = allocs & (np.cumsum(allocs) > room + freed)
            dropped = int(over.sum())
            problem("allocation_limit", f"pid={pid}: {dropped} allocations past its share of "
                                        f"daemon.max_live_allocations={lim.max_live_allocations} "
                                        f"(daemon.max_live_allocations_per_process="
                                        f"{lim.max_live_allocations_per_process})", dropped)
            self.refuse(pid, "allocation_limit", dropped, self.live, lim.max_live_allocations,
                        lim.max_live_allocations_per_process)
            recs = recs[~over]
            growth = room
        self.live.add(pid, growth, census)  # pairs made and freed inside the batch leave nothing live
        return recs

    def _room_and_growth(self, proc: ProcessState, recs: np.ndarray, allocs: np.ndarray,
                         n_alloc: int) -> tuple[int, int]:
        """The process's room for live allocations and the batch's growth, before releases of its table."""
        lim, census, pid = self.limits, self.census, proc.pid
        room = self.live.room(pid, lim.max_live_allocations, census, lim.max_live_allocations_per_process)
        if not n_alloc:
            return room, 0
        return room, n_alloc - _released_here(recs, allocs, max(proc.applied_to, proc.due_to))

    def _freed_from_table(self, proc: ProcessState, recs: np.ndarray) -> int:
        """(device, address) keys whose first record in ``recs`` is a release (stamped before any allocation
        of them there) of an allocation ``proc``'s applied table holds now: each frees one live allocation,
        and whatever the batch does to the key after is counted by ``_released_here``'s bound. Counted only
        where that state is known: not a reused address (its release may be a late one, which frees
        nothing), touched by no record still waiting for the watermark (which may release it first), and
        with at most ``TOUCH_SCAN_RECORDS`` records waiting. A key allocated first in the batch is left out:
        that allocation reuses a live address, and the release after it may be absorbed as the old
        allocation's late one, the key staying live."""
        if proc.pending_records > TOUCH_SCAN_RECORDS:
            return 0
        # Only releases stamped no later than the batch's last allocation (or already due): releases stamped
        # after all of them (say a minute ahead) would wait while the allocations they made room for are
        # applied, the table growing batch after batch (review 43). Interleaved frees and reuses (a
        # stream-ordered pool) keep their credit.
        allocs = recs["op"] == _ALLOCATION
        if not np.count_nonzero(allocs):
            return 0
        times = recs["ts"]
        horizon = max(proc.applied_to, proc.due_to, int(times[allocs].max()))
        if int(times.max()) > horizon:
            recs = recs[times <= horizon]
        candidates = _released_first(recs)
        if not candidates:
            return 0
        devices = proc.devices
        held = [(dev, addr) for dev, addr in candidates
                if (fp := devices.get(dev)) is not None and addr in fp.live
                and not (fp.reused and addr in fp.reused.addresses())]
        if held and proc.pending_records:
            touched = self._waiting_keys(proc)
            if touched is None:
                return 0
            held = [key for key in held if key not in touched]
        return len(held)

    def _waiting_keys(self, proc: ProcessState) -> set[tuple[int, int]] | None:
        """Every (device, address) the process's waiting MEMORY records touch (a superset: chunks applied
        since are forgotten only at the tick's recount), or None past ``TOUCH_SCAN_CHUNKS`` waiting chunks.
        Each chunk is read once: the set is kept with the process (a restarted pid is a new one) and the
        arrival number of the newest chunk it holds, and nothing is read while none came since."""
        chunks = proc.pending.get(RecordKind.MEMORY, ())
        if len(chunks) > TOUCH_SCAN_CHUNKS:
            return None
        kept = self._touched.get(proc.pid)
        if kept is None or kept[0] is not proc:
            kept = (proc, 0, set())
        _, seen, keys = kept
        if proc.pending_seq != seen:
            for chunk in chunks:
                if chunk[1] > seen:
                    keys.update(zip(chunk[2]["dev"].tolist(), chunk[2]["addr"].tolist()))
            seen = proc.pending_seq
        self._touched[proc.pid] = (proc, seen, keys)
        return keys

    def fits(self, proc: ProcessState, kind: RecordKind, recs: np.ndarray) -> bool:
        """Whether ``admit`` would take ``recs`` whole, by a bound that cannot be wrong the other way: every
        device already open, every allocation within the live share (the batch's own releases not counted),
        all of it within the pending share. A batch that does not fit is not refused here; the session admits
        its parts one by one, as they came."""
        lim, pid = self.limits, proc.pid
        if not len(recs):
            return True
        devs = recs["dev"]
        admitted = self._new_devices.get(pid, ())  # tables admitted whose records still wait: open already
        one = int(devs[0]) if not np.count_nonzero(devs != devs[0]) else None
        if one is not None and one in proc.devices:
            pass  # one device the process has (most batches)
        elif any(d not in proc.devices and d not in admitted for d in ([one] if one is not None else
                                                                        np.unique(devs).tolist())):
            return False
        if len(recs) > self.waiting_room(proc):
            return False
        if kind is RecordKind.MEMORY:
            n_alloc = int(np.count_nonzero(recs["op"] == _ALLOCATION))
            if n_alloc and n_alloc > self.live.room(pid, lim.max_live_allocations, self.census,
                                                     lim.max_live_allocations_per_process):
                return False
        return True

    def admit_resync(self, proc: ProcessState, recs: np.ndarray, problem: Problem) -> np.ndarray:
        """The part of a completed resync that may become ``proc``'s live table: it replaces the
        tables the process holds, so their allocations are given back first (what still waits for the
        watermark stays counted, as the recount counts it: its releases' credit was for the old table)."""
        lim, pid = self.limits, proc.pid
        recs = self.admit_devices(proc, recs, problem)
        table = recs["op"] == _ALLOCATION
        if np.count_nonzero(table) != len(recs):
            # A resync is a table of live allocations: anything else in it would be made live uncounted.
            problem("bad_resync_record", f"pid={pid}: {len(recs) - int(np.count_nonzero(table))} records of a "
                                         f"resync that are not allocations: dropped", len(recs) - int(np.count_nonzero(table)))
            recs = recs[table]
        self.live.add(pid, _allocations_waiting(proc) - self.live.by_pid[pid], self.census)
        allocs = recs["op"] == _ALLOCATION
        n_alloc = int(np.count_nonzero(allocs))
        room = self.live.room(pid, lim.max_live_allocations, self.census, lim.max_live_allocations_per_process)
        if n_alloc > room:
            over = allocs & (np.cumsum(allocs) > room)
            dropped = int(over.sum())
            problem("allocation_limit", f"pid={pid}: a resync of {n_alloc} allocations past its share of "
                                        f"daemon.max_live_allocations={lim.max_live_allocations}: {dropped} dropped",
                    dropped)
            self.refuse(pid, "allocation_limit", dropped, self.live, lim.max_live_allocations,
                        lim.max_live_allocations_per_process)
            recs = recs[~over]
            n_alloc = room
        self.live.add(pid, n_alloc, self.census)
        return recs

    def admit_devices(self, proc: ProcessState, recs: np.ndarray, problem: Problem) -> np.ndarray:
        """``recs`` without those that would open a (process, device) table past the process's share."""
        lim, pid = self.limits, proc.pid
        # Tables admitted whose records still wait (not opened yet) count already.
        admitted = self._new_devices.setdefault(pid, set())
        devs = recs["dev"]
        if len(devs) and int(devs[0]) in proc.devices and not np.count_nonzero(devs != devs[0]):
            return recs  # one device the process has already (most batches): no unique of the column
        seen, first = np.unique(devs, return_index=True)
        # In the order they first came: past the share, the devices a batch named last are refused, not the
        # highest numbers.
        new_devs = [d for _, d in sorted(zip(first.tolist(), seen.tolist()))
                    if d not in proc.devices and d not in admitted]
        if not new_devs:
            return recs
        room = self.devices.room(pid, lim.max_device_footprints, self.census, lim.max_devices_per_process)
        if len(new_devs) > room:
            refused = new_devs[room:]
            drop = np.isin(recs["dev"], np.asarray(refused, dtype=recs["dev"].dtype))
            problem("device_limit", f"pid={pid}: records for {len(refused)} more devices than its share of "
                                    f"daemon.max_device_footprints={lim.max_device_footprints} allows",
                    int(drop.sum()))
            self.refuse(pid, "device_limit", int(drop.sum()), self.devices, lim.max_device_footprints,
                        lim.max_devices_per_process)
            recs = recs[~drop]
            new_devs = new_devs[:room]
        admitted.update(new_devs)
        self.devices.add(pid, len(new_devs), self.census)
        return recs


def _released_here(recs: np.ndarray, allocs: np.ndarray, applied_to: int = 0) -> int:
    """(device, address) keys that ``recs`` allocate and then release: each release stamped after an
    allocation of its key in ``recs`` frees what the batch itself added (a process that allocates and
    frees between two flushes holds none of it live). At most one per key, so a flood of releases cannot
    hide allocations; and only a release stamped after the allocation (strictly: the pipeline applies
    records of equal time in arrival order, which a sender chooses), so that "release X, then allocate
    X" of an X nobody holds, which leaves X live, frees nothing. Each key's net growth is then at most
    its allocations less this one release: never below what the table gains from the batch applied
    together (pairs a later watermark splits are met by ``Guard._room_and_growth``'s look at the tables).
    With ``applied_to`` (the process's watermark), a batch stamped on both sides of it is counted side by
    side: its records at or before it are applied at once and the rest wait, so an allocation applied now
    whose release waits is live until that release applies."""
    releases = recs["op"] == _RELEASE
    if not np.count_nonzero(releases):
        return 0
    devs, addrs, times = recs["dev"], recs["addr"], recs["ts"]
    few = len(recs) <= _FEW_PAIRS
    tl = times.tolist() if few else None
    if applied_to and (min(tl) if tl is not None else int(times.min())) <= applied_to \
            < (max(tl) if tl is not None else int(times.max())):  # (the max only where some are late)
        late = times <= applied_to
        return _released_here(recs[late], allocs[late]) + _released_here(recs[~late], allocs[~late])
    one = devs[0] == devs[-1] and np.count_nonzero(devs == devs[0]) == len(devs)
    if few or len(recs) <= (_FEW_PAIRS if one else _FEW_PAIRS_DEVICES):
        # A few records: (device, address) pairs in Python dicts and sets cost less than numpy's sorts.
        dl, al, tl = devs.tolist(), addrs.tolist(), times.tolist() if tl is None else tl
        first_made: dict[tuple[int, int], int] = {}
        for i in np.flatnonzero(allocs).tolist():
            key = (dl[i], al[i])
            if tl[i] < first_made.get(key, _NEVER):
                first_made[key] = tl[i]
        return len({key for i in np.flatnonzero(releases).tolist()
                    if tl[i] > first_made.get(key := (dl[i], al[i]), _NEVER)})
    keys = addrs if one else _keys(devs, addrs)
    # Each side by its positions: a boolean mask over a column of the records (strided) copies run by run of
    # True, and a batch's allocations and releases interleave (5.2 us a 1,563-record column under churn,
    # against 2.5 us for the positions, once a side, and 1.1 us a column gathered by them).
    rel_at, alloc_at = np.flatnonzero(releases), np.flatnonzero(allocs)
    return _freed_after(keys[rel_at], times[rel_at], keys[alloc_at], times[alloc_at])


#: Records of a batch up to which ``_released_here`` pairs them in Python sets, on one device and on
#: several (numpy costs more below these: on one device 64 records 14 us in sets and 14 us sorted, 512
#: records 61 us with numpy's unique and isin and 17 us sorted; on 8 devices 256 records about 25 us
#: either way, 512 records 206 us unique and isin device by device and 39 us ranked and sorted).
_FEW_PAIRS = 64
_FEW_PAIRS_DEVICES = 256


_NEVER = 1 << 64  # later than any record's time


def _freed_after(keys: np.ndarray, key_times: np.ndarray, among: np.ndarray, among_times: np.ndarray) -> int:
    """How many distinct values of ``keys`` are in ``among`` with a time (``key_times``) after the earliest
    time of that value there (``among_times``): ``among`` sorted once by value, then time, and every key
    looked up by binary search. Equal keys find the same (leftmost, earliest) place, so marking the places
    found counts each distinct key once, without sorting the keys (numpy's unique and isin sort each twice:
    60 us a 512-record frame, the ingest guard's largest share of a live flush)."""
    if not len(keys) or not len(among):
        return 0
    order = np.lexsort((among_times, among))  # (about 1.3 us for 256 allocations in time order, 5 us shuffled)
    among, among_times = among[order], among_times[order]
    at = np.searchsorted(among, keys)
    np.minimum(at, len(among) - 1, out=at)
    hit = (among[at] == keys) & (key_times > among_times[at])
    found = np.zeros(len(among), dtype=bool)
    found[at[hit]] = True
    return int(np.count_nonzero(found))


#: Records waiting for a process's watermark up to which ``_freed_from_table`` looks a batch's releases up
#: among them: past it, no release of the table is credited (the batch is then judged as before, by what it
#: allocates and frees itself), so a process held near its share cannot make each batch cost a long scan.
TOUCH_SCAN_RECORDS = 8192
#: Waiting MEMORY chunks up to which they are counted or looked through at a batch near the share: past it
#: (a sender of many tiny batches), the batch is judged without them, as if they released nothing.
TOUCH_SCAN_CHUNKS = 256


def _held(proc: ProcessState) -> int:
    """The live allocations ``proc``'s applied tables hold."""
    return sum(len(fp.live) for fp in proc.devices.values())


def _allocations_waiting(proc: ProcessState) -> int:
    """The allocations among ``proc``'s MEMORY records still waiting for the watermark (counted now;
    ``Guard.recount`` keeps its counts chunk by chunk)."""
    return sum(int(np.count_nonzero(c[2]["op"] == _ALLOCATION)) for c in proc.pending.get(RecordKind.MEMORY, ()))


def _released_first(recs: np.ndarray) -> list[tuple[int, int]]:
    """The distinct (device, address) keys whose first record in ``recs`` (by time; a tie counts as an
    allocation first) is a release."""
    releases = recs["op"] == _RELEASE
    if not np.count_nonzero(releases):
        return []
    ops = recs["op"]
    known = releases | (ops == _ALLOCATION)
    if np.count_nonzero(known) != len(recs):
        recs, releases = recs[known], releases[known]  # operations the table does not know change nothing
    devs, addrs, times = recs["dev"], recs["addr"], recs["ts"]
    if len(recs) <= _FEW_PAIRS:
        dl, al, tl, ol = devs.tolist(), addrs.tolist(), times.tolist(), recs["op"].tolist()
        first_gone: dict[tuple[int, int], int] = {}
        for d, a, t, o in zip(dl, al, tl, ol):
            if o == _RELEASE and t < first_gone.get((d, a), _NEVER):
                first_gone[(d, a)] = t
        for d, a, t, o in zip(dl, al, tl, ol):
            if o == _ALLOCATION and (d, a) in first_gone and t <= first_gone[(d, a)]:
                del first_gone[(d, a)]
        return list(first_gone)
    # By key, then time, releases before allocations of the same time reversed (a tie counts as the
    # allocation first): the first record of each key decides.
    keys = _keys(devs, addrs)
    order = np.lexsort((releases, times, keys))  # an allocation (False) sorts before a release at one time
    k = keys[order]
    first = np.empty(len(k), dtype=bool)
    first[0] = True
    first[1:] = k[1:] != k[:-1]
    at = order[first & releases[order]]
    return list(zip(devs[at].tolist(), addrs[at].tolist()))


def _keys(devs: np.ndarray, addrs: np.ndarray) -> np.ndarray:
    """One u64 key per (device, address): the address on one device; on several the address's rank among
    them offset by the device (a rank is below the batch's length, a device below 2**32: no overflow)."""
    if devs[0] == devs[-1] and np.count_nonzero(devs == devs[0]) == len(devs):
        return addrs
    ranked, ranks = np.unique(addrs, return_inverse=True)
    return devs.astype(np.uint64) * np.uint64(len(ranked)) + ranks.astype(np.uint64)


#: The operations as numpy scalars of the records' ``op`` type: comparing a column with the IntEnum
#: itself goes through Python's int and costs four times as much (5 against 1 us a 512-record frame).
_ALLOCATION = np.uint8(MemoryOp.ALLOCATION)
_RELEASE = np.uint8(MemoryOp.RELEASE)


#: The node's metadata in all: each of this many processes may hold its whole ``max_metadata_bytes``
#: (256 processes, a full node's, at 8 KiB: 2 MiB charged); past it, by fair shares.
METADATA_PROCESSES = 256

#: What one HELLO/META value costs beyond its JSON text (a dict entry, a Python object): many empty
#: values are not free.
METADATA_VALUE_CHARGE = 32


def metadata_charge(value: object) -> int:
    """The bytes ``value`` is charged against ``daemon.max_metadata_bytes``: its JSON text plus
    ``METADATA_VALUE_CHARGE`` for every key and value in it, nested ones included."""
    text = json.dumps(value, default=str)
    values, stack = 0, [value]
    while stack:
        item = stack.pop()
        values += 1
        if isinstance(item, dict):
            values += len(item)  # the keys
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return len(text) + METADATA_VALUE_CHARGE * values


def bounded_metadata(info: dict[str, object], update: dict[str, object], limit: int) -> bool:
    """Would ``info`` updated with ``update`` stay within ``limit`` charged bytes (``metadata_charge``)?"""
    merged = {**info, **update}
    try:
        return metadata_charge(merged) <= limit
    except (TypeError, ValueError, RecursionError):
        return False
