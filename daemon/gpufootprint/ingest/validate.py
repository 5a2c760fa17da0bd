"""Range checks and resource bounds at the wire boundary, before the pipeline sees a record.

Every field that later becomes a dictionary key, a signed 64-bit number or a sum is
checked here, per record, with numpy (one vectorised comparison per field): sizes and
byte counts, device numbers, durations. A record out of range is dropped and counted
under its reason; the rest of its batch goes on. The footprint code can then add and
subtract in int64 without ever overflowing (``max_record_bytes`` times the most records
a process may hold stays far below 2**63).

For live probes a ``Guard`` also bounds what one process, and all of them together,
can make the daemon hold: devices, live allocations, records waiting in the reorder
buffer. The totals are recounted at every tick and moved by each admitted batch, so a
flood between two ticks is bounded too. docs/reliability.md gives the memory each
bound implies.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpufootprint.config import DaemonConfig
from gpufootprint.pipeline import ProcessState
from gpufootprint.records import MEMORY_DTYPE, UM_CPU_PAGE_FAULT_COUNT, ApiRole, MemoryOp, RecordKind

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
    max_device_footprints: int = 64
    max_metadata_bytes: int = 8 * 1024
    max_retained_kernels: int = 500_000
    max_string_bytes: int = 8 * 1024 * 1024  # kernel names held for all live connections

    @classmethod
    def from_config(cls, dc: DaemonConfig) -> Limits:
        return cls(max_record_bytes=dc.max_record_bytes, max_devices_per_process=dc.max_devices_per_process,
                   max_live_allocations_per_process=dc.max_live_allocations_per_process,
                   max_live_allocations=dc.max_live_allocations,
                   max_pending_records_per_process=dc.max_pending_records_per_process,
                   max_pending_records=dc.max_pending_records,
                   max_device_footprints=dc.max_device_footprints, max_metadata_bytes=dc.max_metadata_bytes,
                   max_retained_kernels=dc.max_retained_kernels)


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


def _memory_word_limits(limits: Limits) -> np.ndarray:
    """MEMORY records seen as rows of ten little-endian u64 words: the largest value each word may hold.
    Word 2 is ``bytes``, 5 ``pool_size``, 6 ``pool_used``; word 7 is ``pid`` | ``dev`` << 32."""
    fields = MEMORY_DTYPE.fields
    assert fields is not None
    lim = np.full(MEMORY_DTYPE.itemsize // 8, np.iinfo(np.uint64).max, np.uint64)
    for name in _BYTES[RecordKind.MEMORY]:
        lim[fields[name][1] // 8] = limits.max_record_bytes
    lim[fields["dev"][1] // 8] = (limits.max_devices_per_process << 32) - 1
    return lim


def _memory_in_range(recs: np.ndarray, limits: Limits) -> bool:
    """One comparison for a whole MEMORY batch (its frame's bytes as u64 words): the common case, every
    field in range, costs one numpy call instead of one per field."""
    if not recs.flags.c_contiguous or MEMORY_DTYPE.itemsize % 8 or recs.dtype != MEMORY_DTYPE:
        return False
    lim = _WORD_LIMITS.get(limits)
    if lim is None:
        lim = _WORD_LIMITS[limits] = _memory_word_limits(limits)
    words = recs.view(np.uint8).view("<u8").reshape(len(recs), -1)
    return not bool((words > lim).any())


_WORD_LIMITS: dict[Limits, np.ndarray] = {}


def check_fields(kind: RecordKind, recs: np.ndarray, limits: Limits, problem: Problem) -> np.ndarray:
    """``recs`` without the records whose fields are out of range; each reason counted once per batch."""
    if len(recs) == 0:
        return recs
    if kind is RecordKind.MEMORY and _memory_in_range(recs, limits):
        return recs
    bad = np.zeros(len(recs), dtype=bool)
    cap = np.uint64(limits.max_record_bytes)
    for name in _BYTES[kind]:
        over = recs[name] > cap
        if kind is RecordKind.UNIFIED_MEMORY:
            over &= recs["ck"] != UM_CPU_PAGE_FAULT_COUNT  # its value is an address, counted as one fault
        if over.any():
            problem("bad_size", f"{int(over.sum())} {kind.name} records with {name} above "
                                f"daemon.max_record_bytes={limits.max_record_bytes}", int((over & ~bad).sum()))
            bad |= over
    devs = np.uint32(limits.max_devices_per_process)
    for name in _DEVICES.get(kind, ("dev",)):
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
    if kind in _INTERVAL:
        start, end = recs["start"], recs["end"]
        # end < start is clipped to a zero duration downstream; a huge one would overflow a sum
        long = (end > start) & ((end - start) > np.uint64(MAX_DURATION_NS))
        if long.any():
            problem("bad_duration", f"{int(long.sum())} {kind.name} records lasting over "
                                    f"{MAX_DURATION_NS // 10**9} s", int((long & ~bad).sum()))
            bad |= long
    return recs[~bad] if bad.any() else recs


@dataclass
class Totals:
    """What all processes hold together, recounted at each tick and moved by admitted batches."""

    live_allocations: int = 0
    pending_records: int = 0
    device_footprints: int = 0
    retained_kernels: int = 0


class Guard:
    """The per-process and total bounds for live probes. One per daemon, used on the ingest thread."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.totals = Totals()
        self.quarantined: dict[int, str] = {}  # pid -> why its state was dropped
        self.string_bytes = 0

    def take_strings(self, n: int) -> bool:
        """Reserve ``n`` characters of kernel names (negative: give back); False when past the bound."""
        if n > 0 and self.string_bytes + n > self.limits.max_string_bytes:
            return False
        self.string_bytes += n
        return True

    def recount(self, processes: dict[int, ProcessState]) -> None:
        live = pending = devices = kernels = 0
        for proc in processes.values():
            devices += len(proc.devices)
            live += sum(len(fp.live) for fp in proc.devices.values())
            pending += proc.pending_records
            kernels += len(proc.kernels.array()) if proc.kernels is not None else 0
            kernels += len(proc.launches.array()) if proc.launches is not None else 0
        self.totals = Totals(live, pending, devices, kernels)

    def admit_kernels(self, proc: ProcessState, kind: RecordKind, recs: np.ndarray, retention: int,
                      problem: Problem) -> np.ndarray:
        """KERNEL (or API) records a process may add to what the graph advisor retains for all processes."""
        if retention <= 0 or len(recs) == 0:
            return recs
        ring = proc.kernels if kind is RecordKind.KERNEL else proc.launches
        held = len(ring.array()) if ring is not None else 0
        growth = min(retention, held + len(recs)) - held  # a full ring replaces, it does not grow
        room = self.limits.max_retained_kernels - self.totals.retained_kernels
        if growth > room:  # then the ring is not full even with ``room`` more: keep just those
            keep = max(0, room)
            problem("kernel_limit", f"pid={proc.pid}: {kind.name} records past daemon.max_retained_kernels="
                                    f"{self.limits.max_retained_kernels}: dropped", len(recs) - keep)
            recs = recs[:keep]
            growth = keep
        self.totals.retained_kernels += max(0, growth)
        return recs

    def admit(self, proc: ProcessState, kind: RecordKind, recs: np.ndarray, problem: Problem,
              flush: Callable[[], None]) -> np.ndarray:
        """The part of a live probe's batch its process may still hold; ``flush`` applies its pending
        records at once (its reorder buffer is full: records after it count as late, none is lost)."""
        lim, tot = self.limits, self.totals
        n = len(recs)
        pending = proc.pending_records
        if pending and (pending + n > lim.max_pending_records_per_process
                        or tot.pending_records + n > lim.max_pending_records):
            problem("pending_limit", f"pid={proc.pid}: {pending} records waiting for the "
                                     f"watermark (bound daemon.max_pending_records_per_process="
                                     f"{lim.max_pending_records_per_process}, daemon.max_pending_records="
                                     f"{lim.max_pending_records}): applied at once", pending)
            flush()
            tot.pending_records -= pending
        devices = proc.devices
        new_devs = [d for d in np.unique(recs["dev"]).tolist() if d not in devices]
        if new_devs:
            room = min(lim.max_devices_per_process - len(devices), lim.max_device_footprints - tot.device_footprints)
            if len(new_devs) > room:
                refused = new_devs[max(0, room):]
                drop = np.isin(recs["dev"], np.asarray(refused, dtype=recs["dev"].dtype))
                problem("device_limit", f"pid={proc.pid}: records for {len(refused)} more "
                                        f"devices than daemon.max_device_footprints={lim.max_device_footprints} "
                                        f"allows", int(drop.sum()))
                recs = recs[~drop]
                new_devs = new_devs[:max(0, room)]
            tot.device_footprints += len(new_devs)
        if kind is RecordKind.MEMORY and len(recs):
            allocs = recs["op"] == MemoryOp.ALLOCATION
            n_alloc = int(allocs.sum())
            if n_alloc:
                live = sum(len(fp.live) for fp in devices.values())
                # Waiting records may be allocations too: counted at first as if all were (cheap); only
                # near the bound are the waiting MEMORY records counted exactly.
                room = min(lim.max_live_allocations_per_process - live - proc.pending_records,
                           lim.max_live_allocations - tot.live_allocations - tot.pending_records)
                if n_alloc > room:
                    # Only the waiting allocations can grow the table: under churn half of the records
                    # waiting for the watermark are releases (H200, four threads under cudaMallocAsync:
                    # 100,000+ records waiting, fewer than 20,000 allocations live).
                    waiting = sum(int(np.count_nonzero(chunk[2]["op"] == MemoryOp.ALLOCATION))
                                  for chunk in proc.pending.get(RecordKind.MEMORY, ()))
                    room = min(lim.max_live_allocations_per_process - live - waiting,
                               lim.max_live_allocations - tot.live_allocations)
                if n_alloc > room:
                    # Keep releases (they only shrink the table) and the first allocations that fit.
                    over = allocs & (np.cumsum(allocs) > max(0, room))
                    problem("allocation_limit", f"pid={proc.pid}: {int(over.sum())} allocations "
                                                f"past daemon.max_live_allocations_per_process="
                                                f"{lim.max_live_allocations_per_process} or daemon.max_live_"
                                                f"allocations={lim.max_live_allocations}", int(over.sum()))
                    recs = recs[~over]
                    n_alloc = max(0, room)
                tot.live_allocations += n_alloc
        tot.pending_records += len(recs)
        return recs


def bounded_metadata(info: dict[str, object], update: dict[str, object], limit: int) -> bool:
    """Would ``info`` updated with ``update`` stay within ``limit`` bytes of JSON?"""
    merged = {**info, **update}
    try:
        return len(json.dumps(merged, default=str)) <= limit
    except (TypeError, ValueError, RecursionError):
        return False
