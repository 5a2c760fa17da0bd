"""The one record model: numpy structured dtypes, one per activity kind.

Every stage (probe packing, wire framing, trace readers, ingest, footprint) speaks
these dtypes. They are little-endian and packed, so a batch on the wire is simply
``array.tobytes()`` and decoding is ``np.frombuffer`` with no per-record Python.
Field names follow the CUPTI-JSONL v1 interchange format (shared/traces/README.md)
where one exists, so conversion is a column copy.
"""

from __future__ import annotations

import enum
from collections.abc import KeysView
from typing import Final

import numpy as np


class RecordKind(enum.IntEnum):
    """Activity kinds carried in a record batch (the wire's batch tag)."""

    MEMORY = 1  # CUPTI MEMORY2
    MEMORY_POOL = 2
    MEMCPY = 3  # MEMCPY and MEMCPY2 (peer copies carry src_dev/dst_dev)
    MEMSET = 4
    KERNEL = 5  # CONCURRENT_KERNEL
    UNIFIED_MEMORY = 6  # UNIFIED_MEMORY_COUNTER
    API = 7  # a kernel launch or a synchronisation call, on the host (CUPTI's per-API DRIVER/RUNTIME records)


class ApiRole(enum.IntEnum):
    """What a host-side API record (``RecordKind.API``) was: the CUDA Graph advisor's launch evidence."""

    LAUNCH = 1  # a kernel launch (cudaLaunchKernel, cuLaunchKernel, ...)
    SYNC = 2  # the host waited for the GPU (cudaStreamSynchronize, cudaDeviceSynchronize, cudaMemcpy, ...)
    GRAPH_LAUNCH = 3  # a captured CUDA graph replayed (cudaGraphLaunch, cuGraphLaunch)


API_ROLE_NAMES: Final[dict[int, str]] = {r.value: r.name.lower() for r in ApiRole}


class LaunchSteps:
    """Whole steps among a launch window's calls, counted the same way in the probe and the daemon.

    A step ends at a wait for the GPU (``ApiRole.SYNC``) with at least one launch since the wait
    before it; waits with nothing launched in between (a synchronize right after another) end none.
    The part before the first such wait may be the end of a step that began before the window
    opened, so it is not a whole step. Calls are counted in the order they are added: per CUPTI
    buffer in the probe, per applied batch in the daemon."""

    __slots__ = ("launches", "launches_at_wait", "records", "waits")

    def __init__(self) -> None:
        self.records = 0
        self.waits = 0  # waits for the GPU with a launch since the previous one: each ends a step
        self.launches = 0
        self.launches_at_wait = 0

    def add(self, role: np.ndarray) -> None:
        """``role``: the calls' ``ApiRole`` values, in call order."""
        launch = (role == ApiRole.LAUNCH) | (role == ApiRole.GRAPH_LAUNCH)
        sync_idx = np.flatnonzero(role == ApiRole.SYNC)
        if len(sync_idx):
            at = self.launches + np.cumsum(launch)[sync_idx]
            before = np.r_[self.launches_at_wait, at[:-1]]
            self.waits += int(np.count_nonzero(at > before))
            self.launches_at_wait = int(at[-1])
        self.launches += int(np.count_nonzero(launch))
        self.records += len(role)

    @property
    def steps(self) -> int:
        return max(0, self.waits - 1)


#: CUPTI's unified-memory counter kind whose ``value`` is not a count: for CPU page faults
#: it is the program counter of the faulting instruction (CUPTI docs), so each record is one fault.
UM_CPU_PAGE_FAULT_COUNT: Final = 3


def um_counter_values(ck: np.ndarray, value: np.ndarray) -> np.ndarray:
    """What each unified-memory record adds to its counter: bytes, fault groups, or 1 per CPU fault."""
    return np.where(ck == UM_CPU_PAGE_FAULT_COUNT, 1, value.astype(np.int64))


class MemoryOp(enum.IntEnum):
    ALLOCATION = 1
    RELEASE = 2


#: A release stamped at most this long after an allocation that reused its (still live) address, and
#: whose CUDA call came before that allocation's (a lower correlation id: CUPTI numbers the API calls
#: of a process in the order they are made), is the late release of the allocation that held the
#: address before, not of the new one. The driver hands out an address only once it is free, so the
#: earlier allocation was released before the new one began; with two threads freeing and allocating
#: around the driver's lock, its record can be stamped later than the new allocation. Without that
#: evidence (a correlation id of 0, or a higher one: the new allocation's own release) the release is
#: the new allocation's, and the old one's release counts as lost. The probe's table and the daemon's
#: follow this one rule (footprint/table.py says how).
LATE_RELEASE_NS: Final = 100_000_000
#: Reused addresses remembered at once for that rule, per table (a bound on what a hostile process can
#: make a table hold beside its live allocations); past it the oldest is judged lost.
MAX_DISPLACED: Final = 64


def is_late_release(release_corr: int, reuse_corr: int) -> bool:
    """The release's call came before the allocation that reused its address (both ids known)."""
    return 0 < release_corr < reuse_corr


class ReusedAddresses:
    """The addresses a table saw allocated while still live, for the rule above: one piece of code for
    the daemon's table and the probe's, so that they cannot drift apart. Each method returns the
    reuses it judged lost (their old allocation's release never came)."""

    def __init__(self) -> None:
        self._reuses: dict[int, tuple[int, int]] = {}  # addr -> (the reuse's time, its correlation id)

    def __bool__(self) -> bool:
        return bool(self._reuses)

    def addresses(self) -> KeysView[int]:
        return self._reuses.keys()

    def reused(self, addr: int, ts: int, corr: int) -> int:
        """An allocation at ``addr`` while it was live."""
        lost = 0
        if addr in self._reuses:  # reused twice before the first late release came: that one is lost
            lost = 1
        elif len(self._reuses) >= MAX_DISPLACED:
            del self._reuses[next(iter(self._reuses))]
            lost = 1
        self._reuses[addr] = (ts, corr)
        return lost

    def release(self, addr: int, ts: int, corr: int) -> tuple[bool, int]:
        """A release of ``addr``: (whether it is a reuse's late release, to be absorbed; reuses lost)."""
        reuse = self._reuses.get(addr)
        if reuse is None:
            return False, 0
        if ts - reuse[0] > LATE_RELEASE_NS:
            return False, self.expire(ts)
        if is_late_release(corr, reuse[1]):
            del self._reuses[addr]
            return True, 0
        return False, 0

    def expire(self, now_ts: int) -> int:
        """Reuses whose late release did not come within the window: that release was lost."""
        expired = [a for a, (t, _) in self._reuses.items() if now_ts - t > LATE_RELEASE_NS]
        for addr in expired:
            del self._reuses[addr]
        return len(expired)

    def settle(self) -> int:
        """The stream ended: no late release can come any more."""
        lost = len(self._reuses)
        self._reuses.clear()
        return lost


class MemoryKind(enum.IntEnum):
    """CUPTI_ActivityMemoryKind, numbered as CUPTI numbers it."""

    UNKNOWN = 0
    PAGEABLE = 1
    PINNED = 2
    DEVICE = 3
    ARRAY = 4
    MANAGED = 5
    DEVICE_STATIC = 6
    MANAGED_STATIC = 7
    # Not a CUPTI kind: what NVML sees for the process minus what CUPTI reported
    # (the probe exports it when CUDA was initialised before it started).
    UNTRACKED = 16


#: Names used in metrics labels and in the JSONL marks (``expect_live_bytes``).
MEMORY_KIND_NAMES: Final[dict[int, str]] = {k.value: k.name.lower() for k in MemoryKind}

#: Kinds whose bytes occupy GPU memory: the "device footprint" whose window peak
#: is tracked. Pinned and pageable host memory are exported but not counted here.
DEVICE_RESIDENT_KINDS: Final[frozenset[int]] = frozenset(
    {MemoryKind.DEVICE, MemoryKind.DEVICE_STATIC, MemoryKind.ARRAY, MemoryKind.UNTRACKED}
)


class PoolOp(enum.IntEnum):
    CREATED = 1
    DESTROYED = 2
    TRIMMED = 3


class CopyKind(enum.IntEnum):
    """CUPTI_ActivityMemcpyKind."""

    UNKNOWN = 0
    HTOD = 1
    DTOH = 2
    HTOA = 3
    ATOH = 4
    ATOA = 5
    ATOD = 6
    DTOA = 7
    DTOD = 8
    HTOH = 9
    PTOP = 10


COPY_KIND_NAMES: Final[dict[int, str]] = {k.value: k.name.lower() for k in CopyKind}

_LE = "<"

MEMORY_DTYPE: Final = np.dtype(
    [
        ("ts", _LE + "u8"),
        ("addr", _LE + "u8"),
        ("bytes", _LE + "u8"),
        ("pool_addr", _LE + "u8"),
        ("pool_thresh", _LE + "u8"),
        ("pool_size", _LE + "u8"),
        ("pool_used", _LE + "u8"),
        ("pid", _LE + "u4"),
        ("dev", _LE + "u4"),
        ("ctx", _LE + "u4"),
        ("stream", _LE + "u4"),
        ("corr", _LE + "u4"),
        ("op", "u1"),
        ("mk", "u1"),
        ("is_async", "u1"),
        ("pool_type", "u1"),
    ]
)

POOL_DTYPE: Final = np.dtype(
    [
        ("ts", _LE + "u8"),
        ("addr", _LE + "u8"),
        ("size", _LE + "u8"),
        ("used", _LE + "u8"),
        ("thresh", _LE + "u8"),
        ("keep", _LE + "u8"),
        ("pid", _LE + "u4"),
        ("dev", _LE + "u4"),
        ("corr", _LE + "u4"),
        ("op", "u1"),
        ("ptype", "u1"),
        ("_pad", "u2"),
    ]
)

MEMCPY_DTYPE: Final = np.dtype(
    [
        ("start", _LE + "u8"),
        ("end", _LE + "u8"),
        ("bytes", _LE + "u8"),
        ("pid", _LE + "u4"),
        ("dev", _LE + "u4"),
        ("src_dev", _LE + "u4"),  # MEMCPY2 (peer): the devices at both ends
        ("dst_dev", _LE + "u4"),
        ("ctx", _LE + "u4"),
        ("stream", _LE + "u4"),
        ("corr", _LE + "u4"),
        ("graph", _LE + "u4"),
        ("ck", "u1"),
        ("src", "u1"),
        ("dst", "u1"),
        ("_pad", "u1"),
    ]
)

MEMSET_DTYPE: Final = np.dtype(
    [
        ("start", _LE + "u8"),
        ("end", _LE + "u8"),
        ("bytes", _LE + "u8"),
        ("pid", _LE + "u4"),
        ("dev", _LE + "u4"),
        ("stream", _LE + "u4"),
        ("corr", _LE + "u4"),
        ("mk", "u1"),
        ("_pad", "u1", (7,)),
    ]
)

KERNEL_DTYPE: Final = np.dtype(
    [
        ("start", _LE + "u8"),
        ("end", _LE + "u8"),
        ("node", _LE + "u8"),  # graph node id, 0 when not launched from a graph
        ("pid", _LE + "u4"),
        ("dev", _LE + "u4"),
        ("stream", _LE + "u4"),
        ("corr", _LE + "u4"),
        ("graph", _LE + "u4"),  # non-zero: replayed from a captured CUDA graph
        ("name_id", _LE + "u4"),  # index into the connection's string table
    ]
)

UNIFIED_MEMORY_DTYPE: Final = np.dtype(
    [
        ("start", _LE + "u8"),
        ("end", _LE + "u8"),
        ("value", _LE + "u8"),  # bytes transferred, or fault count, by counter kind
        ("addr", _LE + "u8"),
        ("pid", _LE + "u4"),
        ("dev", _LE + "u4"),
        ("src", _LE + "u4"),
        ("dst", _LE + "u4"),
        ("ck", "u1"),
        ("_pad", "u1", (7,)),
    ]
)

#: CUPTI's API record names no device: the probe stamps the device its process last allocated on.
API_DTYPE: Final = np.dtype(
    [
        ("start", _LE + "u8"),  # host time the call began
        ("end", _LE + "u8"),  # and returned
        ("pid", _LE + "u4"),
        ("dev", _LE + "u4"),
        ("tid", _LE + "u4"),  # the calling thread (CUPTI's threadId)
        ("corr", _LE + "u4"),
        ("cbid", _LE + "u4"),  # in the numbering of ``domain``
        ("domain", "u1"),  # 4: driver API, 5: runtime API (CUPTI's activity kind of the record)
        ("role", "u1"),  # ApiRole
        ("_pad", "u1", (2,)),
    ]
)

DTYPES: Final[dict[RecordKind, np.dtype]] = {
    RecordKind.MEMORY: MEMORY_DTYPE,
    RecordKind.MEMORY_POOL: POOL_DTYPE,
    RecordKind.MEMCPY: MEMCPY_DTYPE,
    RecordKind.MEMSET: MEMSET_DTYPE,
    RecordKind.KERNEL: KERNEL_DTYPE,
    RecordKind.UNIFIED_MEMORY: UNIFIED_MEMORY_DTYPE,
    RecordKind.API: API_DTYPE,
}

#: Timestamps are nanoseconds since 1970 in a signed 64-bit integer (until 2262): a record
#: stamped at or past this is damage or a sentinel, in any source (trace, probe, CUPTI).
MAX_TIMESTAMP_NS: Final = 1 << 63

#: The field that orders each kind in time (records are applied "as of" it).
TIME_FIELD: Final[dict[RecordKind, str]] = {
    RecordKind.MEMORY: "ts",
    RecordKind.MEMORY_POOL: "ts",
    RecordKind.MEMCPY: "start",
    RecordKind.MEMSET: "start",
    RecordKind.KERNEL: "start",
    RecordKind.UNIFIED_MEMORY: "start",
    RecordKind.API: "start",
}


def empty(kind: RecordKind, n: int = 0) -> np.ndarray:
    """A zeroed batch of ``n`` records of ``kind``."""
    return np.zeros(n, dtype=DTYPES[kind])


def join(chunks: list[np.ndarray]) -> np.ndarray:
    """Record arrays of one dtype end to end. ``np.concatenate`` promotes structured dtypes field by
    field at every call (about 25 us a chunk here, more than the copy of a small batch); their bytes
    joined and viewed back cost a tenth of that."""
    if len(chunks) == 1:
        return chunks[0]
    dtype = chunks[0].dtype
    if any(c.dtype != dtype for c in chunks):
        return np.concatenate(chunks)
    raw = np.concatenate([np.ascontiguousarray(c).view(np.uint8) for c in chunks])
    return raw.view(dtype)


#: ``sorted_positions`` leaves values in fewer runs than this (descents less one) to the stable sort.
_FEW_RUNS = 8


def sorted_positions(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.argsort(values, kind="stable")`` and the values in that order, for unsigned 64-bit values.

    numpy's stable sort of 64-bit integers is a merge sort of the runs already in order: nearly free for
    a few runs (a batch of addresses allocated in order), about 1.2 ms for 14,000 addresses in no order.
    Its default sort is a vectorised one about ten times faster there, but not stable. For values in more
    than a few runs whose span (largest less smallest) leaves room below bit 64 for a record's position,
    each value less the smallest is shifted up and its position put in the bits below: the keys are then
    distinct and their order is (value, position), the stable order, whichever sort gives it. Otherwise
    the stable sort itself."""
    n = len(values)
    if n < 2 or int(np.count_nonzero(values[1:] < values[:-1])) < _FEW_RUNS:
        order = values.argsort(kind="stable")
        return order, values[order]
    bits = max(1, (n - 1).bit_length())
    lo = int(values.min())
    if (int(values.max()) - lo) >> (64 - bits):
        order = values.argsort(kind="stable")
        return order, values[order]
    shift = np.uint64(bits)
    keys = values.astype(np.uint64)
    if lo:
        keys -= np.uint64(lo)
    keys <<= shift
    keys |= np.arange(n, dtype=np.uint64)
    keys.sort()
    order = (keys & np.uint64((1 << bits) - 1)).astype(np.intp)
    keys >>= shift
    if lo:
        keys += np.uint64(lo)
    return order, keys


def take(recs: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``recs[order]`` (a new array) for a 1-D record array and integer positions: numpy copies a
    structured dtype field by field and record by record (about 90 us for 1,300 MEMORY records), rows
    of plain words at memory speed (5 us), so the records are taken as rows of their words and viewed
    back. Faster from a handful of records on."""
    rows = _rows(recs)
    if rows is None:
        fancy: np.ndarray = recs[order]
        return fancy
    taken: np.ndarray = rows.take(order, axis=0).view(recs.dtype).reshape(len(order))
    return taken


def select(recs: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``recs[mask]`` (a new array) for a 1-D record array and a boolean mask of its length, as
    ``take`` does it: the records chosen as rows of their words."""
    rows = _rows(recs)
    if rows is None:
        fancy: np.ndarray = recs[mask]
        return fancy
    chosen: np.ndarray = rows.compress(mask, axis=0)
    return chosen.view(recs.dtype).reshape(len(chosen))


def copy_records(recs: np.ndarray) -> np.ndarray:
    """``recs.copy()`` for a 1-D record array, as ``take`` does it: numpy copies a structured dtype field by
    field (about 25 us for 390 MEMORY records, 170 us for 3,000), their words at memory speed (3 and 10 us)."""
    rows = _rows(recs)
    if rows is None:
        copied: np.ndarray = recs.copy()
        return copied
    return rows.copy().view(recs.dtype).reshape(len(recs))


def holds_only_itself(recs: np.ndarray) -> bool:
    """Whether keeping ``recs`` keeps no other bytes alive: it owns its data, or it views the whole of an
    array that does (what ``join``, ``take`` and ``select`` return). A view into a frame's bytes
    (``np.frombuffer``), into part of a larger array, or in another order does not. It cannot see who else
    holds the owning array: callers keep without copying only arrays nobody writes afterwards (the
    pipeline's applied chunks; a reused buffer, such as the probe's struct queue, must be copied)."""
    base = recs.base
    while isinstance(base, np.ndarray):
        if base.base is None:
            return base.nbytes == recs.nbytes and bool(recs.flags.c_contiguous)
        base = base.base
    return base is None


def _rows(recs: np.ndarray) -> np.ndarray | None:
    """The records as a 2-D array of their little-endian words (a view), or None where they cannot be."""
    dtype = recs.dtype
    if recs.ndim != 1 or not recs.flags.c_contiguous or dtype.itemsize == 0:
        return None
    word = 8 if dtype.itemsize % 8 == 0 else 4 if dtype.itemsize % 4 == 0 else 1
    return recs.view(f"<u{word}").reshape(len(recs), dtype.itemsize // word)
