"""The exact footprint of one process on one device.

Records arrive here already in time order (the pipeline's reorder buffer sees to
that). Every allocation enters the live table keyed by address; every release
leaves it. Live bytes by memory kind, the stream-ordered pool sizes and the
per-frame peaks all follow from that table, so the numbers are exact to the byte.

An allocation at an address that is still live means the release of the earlier one
was lost, or stamped later than the new allocation (two threads around the driver's
lock; records.LATE_RELEASE_NS). The earlier allocation is released at the new one's
time either way (the driver reuses only a free address) and remembered; a release of
that address within LATE_RELEASE_NS whose call came before the new allocation's (its
correlation id is lower) is its late release and is absorbed (a repair, counted); any
other release is the new allocation's. Remembered entries whose release never comes
are counted as ``double_allocation`` errors.

The methods that move the GPU-resident level (``apply_memory``, ``replace_live``,
``release_all``) return the ``LevelChanges`` they applied; the pipeline passes
them down to the feature frames and the sampler.

About 750 lines: several methods have a numpy path for batches and a record-by-record
path for small ones (numpy's fixed costs dominate there), kept side by side so that each pair
reads as one rule; tests/unit/test_small_batches.py holds every pair equal. A MEMORY batch's numbers
also have a path in the daemon's C core (``_apply_memory_native``, native/core.c), used where it loads;
the other two stay its reference.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from itertools import chain, repeat
from typing import Any

import numpy as np

from gpufootprint import native
from gpufootprint.changes import counted
from gpufootprint.footprint.cells import EXACT, key_sums
from gpufootprint.footprint.peaks import FramePeaks, LevelChanges
from gpufootprint.records import (
    DEVICE_RESIDENT_KINDS,
    MEMORY_DTYPE,
    CopyKind,
    MemoryOp,
    PoolOp,
    ReusedAddresses,
    select,
    sorted_positions,
    um_counter_values,
)

log = logging.getLogger(__name__)

_BULK_MIN = 192  # below this many records the per-record loop is faster than numpy's fixed costs
#: With the C core (``_apply_memory_native``), batches of at least this many records go to it: below
#: _BULK_MIN it leaves what the per-record loop leaves (its dict order and first logged mismatch), from
#: _BULK_MIN on what the numpy path leaves.
_NATIVE_MIN = 64
_SMALL_POOL_BATCH = 128  # at most this many records: pool sizes and copies are taken record by record, in Python
_N_KINDS = 32  # memory kinds are small integers; indexes into the per-kind arrays
_RESIDENT = np.zeros(_N_KINDS, dtype=bool)
_RESIDENT[list(DEVICE_RESIDENT_KINDS)] = True
_RESIDENT_LIST = _RESIDENT.tolist()  # the same, read record by record (a list item, not a numpy scalar)
_PTOP = CopyKind.PTOP.value
#: The bulk path's shortcut for a batch of one memory kind without stream-ordered allocations (off: the
#: per-record kinds and flags always, for the test that holds both equal).
_UNIFORM_FAST = True
#: ``note_pool_config``'s shortcut for a batch whose pool records are all of one pool (off: the per-pool runs
#: always, for the test that holds both equal).
_ONE_POOL_FAST = True


def _bytes_fit(col: np.ndarray) -> bool:
    """Unsigned sizes that stay the same numbers as int64 (``key_sums`` then checks their sums)."""
    return len(col) == 0 or int(col.max()) < EXACT


class IngestErrors:
    """Counts records that break the model, and logs each reason once; and the repairs made by a
    stated rule (records that look wrong alone and are right together), which are not errors."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.repairs: Counter[str] = Counter()

    def repair(self, reason: str, n: int = 1) -> None:
        self.repairs[reason] += n

    def add(self, reason: str, detail: str, n: int = 1) -> None:
        if reason not in self.counts:
            log.warning("ingest error reason=%s %s (further ones are counted, not logged)", reason, detail)
        self.counts[reason] += n


#: One live allocation: (bytes, kind, allocation time (for leak suspicion), is_async). A plain tuple, not
#: an object with named fields: a large batch enters about 900 at once, and plain tuples of numbers cost
#: a third of a slotted dataclass's to make (and the garbage collector stops tracking them after its first
#: look). Read them by unpacking, or with the indexes below.
LiveAllocation = tuple[int, int, int, bool]
LIVE_BYTES, LIVE_KIND, LIVE_TS, LIVE_ASYNC = 0, 1, 2, 3


def _allocates_live(live: dict[int, LiveAllocation], addrs: np.ndarray) -> bool:
    """Whether any of ``addrs`` (distinct addresses in ascending order) is a key of ``live``. A table
    much smaller than the batch (a large batch of new allocations) has its keys searched in ``addrs``;
    otherwise each address is looked up in the table."""
    n = len(live)
    if 8 * n < len(addrs):
        keys = np.fromiter(live, np.uint64, n)
        at = addrs.searchsorted(keys)
        at[at == len(addrs)] = 0
        return bool((addrs[at] == keys).any())
    return not live.keys().isdisjoint(addrs.tolist())


_PLAN_HEAD = 4  # core.c gfp_bulk_plan's head: [release-first addresses, allocation-first ones, inserts, groups]
_APPLY_HEAD = 7  # core.c BULK_HEAD: [mismatches, addr, allocated, released, async+, async-, kinds moved]
_APPLY_OUT = _APPLY_HEAD + 5 * _N_KINDS
_SCRATCH_KEEP = 8192  # records: a larger batch's scratch is not kept (bounded memory), as core.c's
_DELTA_CHUNK = 16384  # deltas of batches up to a quarter of this many records are cut from chunks this long


@cache
def _laid_out(lib: Any) -> Any:
    """The C core with MEMORY_DTYPE's layout, MemoryOp's values and the resident kinds given (once)."""
    fields = MEMORY_DTYPE.fields
    assert fields is not None
    lib.gfp_bulk_layout(*(fields[f][1] for f in ("ts", "addr", "bytes", "op", "mk", "is_async")),
                        MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value,
                        sum(1 << k for k in DEVICE_RESIDENT_KINDS if k < _N_KINDS))
    return lib


class _Scratch(threading.local):
    """Per thread: the words the C core's two calls of a batch read and write (the plan's lists, the looked-up
    entries, the apply's head, inserts and deletes), with their address taken once."""

    records = 0
    words: np.ndarray
    ints: np.ndarray
    flags: np.ndarray
    at = 0

    def take(self, n: int) -> _Scratch:
        """Room for a batch of ``n`` records (10 words and a byte a record, and the heads)."""
        if n > self.records or (self.records > _SCRATCH_KEEP >= n):
            cap = max(n, 256)
            self.words = np.empty(11 * cap + _PLAN_HEAD + _APPLY_OUT, np.uint64)
            self.ints = self.words.view(np.int64)
            self.flags = self.words.view(np.bool_)
            self.at = self.words.ctypes.data
            self.records = cap
        return self

    chunk: np.ndarray
    chunk_at = 0
    used = _DELTA_CHUNK

    def deltas(self, n: int) -> tuple[np.ndarray, int]:
        """A new int64 array of ``n`` and its address: a slice of a chunk handed out once (the peaks, the
        frames and the sampler keep a batch's deltas), so that a small batch takes no array and address of
        its own (a few microseconds of its cost)."""
        if n > _DELTA_CHUNK // 4:
            out = np.empty(n, dtype=np.int64)
            return out, out.ctypes.data
        if self.used + n > _DELTA_CHUNK:
            self.chunk = np.empty(_DELTA_CHUNK, dtype=np.int64)
            self.chunk_at = self.chunk.ctypes.data
            self.used = 0
        at = self.used
        self.used = at + n
        return self.chunk[at:at + n], self.chunk_at + 8 * at


_SCRATCH = _Scratch()


@dataclass
class DeviceFootprint:
    pid: int
    dev: int
    peaks: FramePeaks
    live: dict[int, LiveAllocation] = field(default_factory=dict)
    live_by_kind: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    # Live allocations by kind, kept as ``live`` changes: the probe's TOTALS, checked at every watermark of every
    # process, ask for them, and a walk of every live allocation of a device for each check cost a node's daemon
    # its processes' whole tables once a second.
    live_count_by_kind: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    async_device_bytes: int = 0
    pools: dict[int, tuple[int, int]] = field(default_factory=dict)  # pool addr -> (reserved, used)
    allocations: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    releases: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    allocated_bytes: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    released_bytes: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    memcpy_count: Counter[int] = field(default_factory=Counter)  # by copy kind
    memcpy_bytes: Counter[int] = field(default_factory=Counter)
    memcpy_ns: Counter[int] = field(default_factory=Counter)
    # Peer copies (MEMCPY2): bytes by (source device, destination device), so both ends show.
    peer_copy_bytes: Counter[tuple[int, int]] = field(default_factory=Counter)
    memset_count: int = 0
    memset_bytes: int = 0
    kernel_count: int = 0
    kernel_ns: int = 0
    um_count: Counter[int] = field(default_factory=Counter)  # by UM counter kind
    um_value: Counter[int] = field(default_factory=Counter)
    last_ts: int = 0
    # Bytes a stream-ordered pool must hold at least: CUPTI reports a pool's size at its creation
    # and trims only, while the pool grows silently as allocations need it; it cannot hold less than
    # what is allocated from it. The highest pool use since the last reported size (a lower bound).
    pool_floor: int = 0
    # Addresses allocated again while live, for their old allocations' late releases (module doc).
    reused: ReusedAddresses = field(default_factory=ReusedAddresses)
    # Every call of a method that changes the table (``changes.counted``): the pipeline keeps a device's snapshot
    # while this and its process's watermark stay as they were (most devices of a quiet node, most ticks).
    changes: int = 0
    # Whether to use the daemon's C core for MEMORY batches where it loads (False: the numpy and per-record
    # paths, the reference). Asked once, when the footprint is made (GPUFOOTPRINT_DAEMON_NATIVE=0 too).
    native: bool = True
    _core: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lib = native.core() if self.native else None
        self._core = None if lib is None else _laid_out(lib)

    # --- memory -------------------------------------------------------------

    @counted
    def apply_memory(self, recs: np.ndarray, errors: IngestErrors) -> LevelChanges:
        """Apply MEMORY records of this (pid, dev), sorted by timestamp.

        The batch is applied with numpy when it is well-formed (per address,
        allocations and releases alternate, and agree with the live table);
        otherwise record by record, which counts each anomaly. Both give the
        same state; a test holds them to that. Where the daemon's C core loads,
        batches from _NATIVE_MIN records take ``_apply_memory_native`` instead,
        which leaves what the path it stands for leaves (tests/unit/test_footprint_native.py).
        """
        n = len(recs)
        if self._core is not None and n >= _NATIVE_MIN:
            levels = self._apply_memory_native(recs, errors, n < _BULK_MIN)
        else:
            levels = self._apply_memory_bulk(recs, errors) if n >= _BULK_MIN else None
        if levels is None:
            levels = self._apply_memory_each(recs, errors)
        if self.reused:
            self._lost(self.reused.expire(self.last_ts), errors)
        self.pool_floor = max(self.pool_floor, self.async_device_bytes)
        return levels

    def live_counts(self) -> dict[int, int]:
        """Live allocations by memory kind (kinds with none left out)."""
        return {k: n for k, n in enumerate(self.live_count_by_kind) if n}

    def _apply_memory_bulk(self, recs: np.ndarray, errors: IngestErrors) -> LevelChanges | None:
        """The numpy path; None (nothing changed) when the batch needs the per-record loop."""
        ops = recs["op"]
        kinds = recs["mk"]
        k_hi = int(kinds.max())
        # np.count_nonzero for any/all here and below: one C loop, where ndarray.any/all pass through a
        # Python wrapper and a ufunc reduction's setup (about 0.3 us more a call, several calls a batch).
        if k_hi >= _N_KINDS or np.count_nonzero((ops == 1) | (ops == 2)) != len(ops):
            return None
        n = len(recs)
        order, a = sorted_positions(recs["addr"])  # by address, then time
        o = ops[order]
        first = np.empty(n, dtype=bool)  # (np.ones: a Python wrapper that fills what is written again below)
        first[0] = True
        first[1:] = a[1:] != a[:-1]
        if np.count_nonzero((o[1:] == o[:-1]) & ~first[1:]):
            return None  # two allocations or two releases in a row at one address
        fpos = first.nonzero()[0]
        lpos = np.empty_like(fpos)
        lpos[:-1] = fpos[1:] - 1
        lpos[-1] = n - 1
        f_op = o[fpos]
        f_addr = a[fpos]
        live = self.live
        if live and _allocates_live(live, f_addr[f_op == 1]):
            return None  # an allocation at an address that is already live (none is, in an empty table)
        if self.reused and not self.reused.addresses().isdisjoint(f_addr.tolist()):
            return None  # perhaps the late release of an allocation whose address was reused
        rel_first = fpos[f_op == 2]
        matched = [live.get(x) for x in a[rel_first].tolist()]
        if None in matched:
            return None  # a release of an address that is not live
        # Effective (bytes, kind, async) of each record: a release takes its allocation's.
        # A batch of one memory kind whose releases free allocations of that kind, and one without
        # stream-ordered allocations (the common cases), need no per-record kind or async flag to be
        # gathered and carried to the releases: they are the same for every record.
        one_kind = _UNIFORM_FAST and k_hi == int(kinds.min()) and all(m[LIVE_KIND] == k_hi for m in matched)  # type: ignore[index]
        raw_async = recs["is_async"]
        no_async = _UNIFORM_FAST and not np.count_nonzero(raw_async) and not any(m[LIVE_ASYNC] for m in matched)  # type: ignore[index]
        size = recs["bytes"][order].astype(np.int64)
        kind = np.full(n, k_hi, np.int64) if one_kind else kinds[order].astype(np.int64)
        is_async = np.zeros(n, bool) if no_async else raw_async[order].astype(bool)
        claimed = size.copy()
        rel_inner = ((o == 2) & ~first).nonzero()[0]
        size[rel_inner] = size[rel_inner - 1]
        if not one_kind:
            kind[rel_inner] = kind[rel_inner - 1]
        if not no_async:
            is_async[rel_inner] = is_async[rel_inner - 1]
        if matched:
            size[rel_first] = [m[LIVE_BYTES] for m in matched]  # type: ignore[index]
            if not one_kind:
                kind[rel_first] = [m[LIVE_KIND] for m in matched]  # type: ignore[index]
            if not no_async:
                is_async[rel_first] = [m[LIVE_ASYNC] for m in matched]  # type: ignore[index]
        is_rel = o == 2
        mismatch = is_rel & (claimed != 0) & (claimed != size)
        if np.count_nonzero(mismatch):
            i = int(np.flatnonzero(mismatch)[0])
            errors.add("release_size_mismatch",
                       f"pid={self.pid} addr={int(a[i]):#x} allocated {int(size[i])} released {int(claimed[i])}",
                       int(mismatch.sum()))
        signed = np.where(is_rel, -size, size)
        # Per-kind sums with bincount (float64 weights: exact while a batch moves < 2**53 bytes).
        moved = int(size.sum())
        exact = moved < (1 << 53)
        kinds_moved: range | tuple[int] = range(_N_KINDS)
        if one_kind and exact:
            # One kind: its sums are the batch's (bytes allocated + released, and their difference).
            net = int(signed.sum())
            n_alloc, n_rel = [0] * _N_KINDS, [0] * _N_KINDS
            b_alloc, b_rel = [0] * _N_KINDS, [0] * _N_KINDS
            n_rel[k_hi] = int(np.count_nonzero(is_rel))
            n_alloc[k_hi] = n - n_rel[k_hi]
            b_alloc[k_hi], b_rel[k_hi] = (moved + net) // 2, (moved - net) // 2
            kinds_moved = (k_hi,)
        else:
            # Allocations count in bins 0..31 and releases in 32..63 of one bincount: no selection per side.
            cell = kind + _N_KINDS * is_rel
            counts = np.bincount(cell, minlength=2 * _N_KINDS).tolist()
            n_alloc, n_rel = counts[:_N_KINDS], counts[_N_KINDS:]
            if exact:
                sums = np.bincount(cell, weights=size, minlength=2 * _N_KINDS).tolist()
                b_alloc, b_rel = sums[:_N_KINDS], sums[_N_KINDS:]
        for k in kinds_moved:
            if not (n_alloc[k] or n_rel[k]):
                continue
            if exact:
                ab, rb = int(b_alloc[k]), int(b_rel[k])
            else:
                ab = int(size[(kind == k) & ~is_rel].sum())
                rb = int(size[(kind == k) & is_rel].sum())
            self.live_by_kind[k] += ab - rb
            self.live_count_by_kind[k] += n_alloc[k] - n_rel[k]
            self.allocations[k] += n_alloc[k]
            self.releases[k] += n_rel[k]
            self.allocated_bytes[k] += ab
            self.released_bytes[k] += rb
        if np.count_nonzero(is_async):
            self.async_device_bytes += int(signed[is_async].sum())
        # The table: addresses whose last record allocates hold that allocation;
        # addresses that started live and end released leave it.
        l_op = o[lpos]
        ins = lpos[l_op == 1]
        if len(ins):
            # Only the inserted records' times are gathered; a kind or async flag that is the same for the
            # whole batch is repeated, not made into a list of ~900 equal ints.
            live.update(zip(a[ins].tolist(), zip(size[ins].tolist(),
                                                 repeat(k_hi) if one_kind else kind[ins].tolist(),
                                                 recs["ts"][order[ins]].tolist(),
                                                 repeat(False) if no_async else is_async[ins].tolist())))
        for addr in a[lpos[(l_op == 2) & (f_op == 2)]].tolist():
            del live[addr]
        deltas = np.empty(n, dtype=np.int64)
        if one_kind:
            deltas[order] = signed if _RESIDENT[k_hi] else 0
        else:
            deltas[order] = np.where(_RESIDENT[kind], signed, 0)
        levels = self.peaks.add(recs["ts"], deltas)
        self.last_ts = max(self.last_ts, int(recs["ts"][-1]))
        return levels

    def _apply_memory_native(self, recs: np.ndarray, errors: IngestErrors, each_order: bool) -> LevelChanges | None:
        """``_apply_memory_bulk`` with its numbers in the C core (native/core.c says how): the same state, the
        same None (nothing changed) where the per-record loop must take the batch; where the C declines a
        batch (a size of 2**63 or more, sums that would reach it) the numpy path takes it. ``each_order``:
        leave what ``_apply_memory_each`` leaves instead (its dict order, its first mismatch logged), for
        batches below _BULK_MIN; there the C declining means the per-record loop."""
        lib = self._core
        n = len(recs)
        if n == 0 or recs.ndim != 1 or (recs.dtype is not MEMORY_DTYPE and recs.dtype != MEMORY_DTYPE):
            return None if each_order else self._apply_memory_bulk(recs, errors)
        s = _SCRATCH.take(n)
        words, at = s.words, s.at
        rec_at, stride = recs.ctypes.data, recs.strides[0]
        # words: [0, n) the plan's first addresses, then its head, the apply's out, the looked-up entries
        # (4n), the inserts (4n), the deletes (n), the inserts' async flags (n bytes)
        o_head = n
        o_out = o_head + _PLAN_HEAD
        o_matched = o_out + _APPLY_OUT
        o_ins = o_matched + 4 * n
        o_dels = o_ins + 4 * n
        o_flags = o_dels + n
        rc = lib.gfp_bulk_plan(rec_at, n, stride, at, at + 8 * o_head)
        if rc:
            if rc == 1:
                return None  # the numpy path's None: the per-record loop counts what is wrong
            return None if each_order else self._apply_memory_bulk(recs, errors)
        r, a, k, _ = words[o_head:o_out].tolist()
        live = self.live
        if live and a:
            if 8 * len(live) < a:  # a table much smaller than the batch: its keys looked up in the batch
                keys = np.fromiter(live, np.uint64, len(live))
                hit = lib.gfp_bulk_hit(keys.ctypes.data, len(keys), 1)
            else:
                hit = not live.keys().isdisjoint(words[n - a:n].tolist())
            if hit:
                return None  # an allocation at an address that is already live
        if self.reused:
            keys = np.fromiter(self.reused.addresses(), np.uint64, len(self.reused.addresses()))
            if lib.gfp_bulk_hit(keys.ctypes.data, len(keys), 0):
                return None  # perhaps the late release of an allocation whose address was reused
        if r:
            matched = [live.get(x) for x in words[:r].tolist()]
            if None in matched:
                return None  # a release of an address that is not live
            try:
                s.ints[o_matched:o_matched + 4 * r] = list(chain.from_iterable(matched))  # type: ignore[arg-type]
            except OverflowError:  # a size of 2**63 or more in the table (the numpy path says what it does)
                return None if each_order else self._apply_memory_bulk(recs, errors)
        deltas, deltas_at = s.deltas(n)
        d = lib.gfp_bulk_apply(rec_at, n, stride, at + 8 * o_matched, each_order, deltas_at, at + 8 * o_out,
                               at + 8 * o_ins, at + 8 * o_flags, at + 8 * o_dels)
        if d < 0:
            if d == -2:
                return None if each_order else self._apply_memory_bulk(recs, errors)
            raise RuntimeError(f"gfp_bulk_apply: {d}")
        mm, mm_addr, mm_size, mm_claimed, async_in, async_out, m = words[o_out:o_out + _APPLY_HEAD].tolist()
        if mm:
            errors.add("release_size_mismatch",
                       f"pid={self.pid} addr={mm_addr:#x} allocated {mm_size} released {mm_claimed}", mm)
        rows = words[o_out + _APPLY_HEAD:o_out + _APPLY_HEAD + 5 * m].tolist()
        for j in range(0, 5 * m, 5):
            kd, n_alloc, n_rel, ab, rb = rows[j:j + 5]
            self.live_by_kind[kd] += ab - rb
            self.live_count_by_kind[kd] += n_alloc - n_rel
            self.allocations[kd] += n_alloc
            self.releases[kd] += n_rel
            self.allocated_bytes[kd] += ab
            self.released_bytes[kd] += rb
        self.async_device_bytes += async_in - async_out
        dels = words[o_dels:o_dels + d].tolist() if d else ()
        if each_order:
            for addr in dels:  # as the per-record loop: an address live before the batch left it, ...
                del live[addr]
        if k:
            addrs, sizes, kinds, times = words[o_ins:o_ins + 4 * k].reshape(4, k).tolist()
            flags = s.flags[8 * o_flags:8 * o_flags + k].tolist()
            live.update(zip(addrs, zip(sizes, kinds, times, flags)))  # ... and entered again at its end
        if not each_order:
            for addr in dels:
                del live[addr]
        levels = self.peaks.add(recs["ts"], deltas)
        self.last_ts = max(self.last_ts, int(recs["ts"][-1]))
        return levels

    def _apply_memory_each(self, recs: np.ndarray, errors: IngestErrors) -> LevelChanges:
        live = self.live
        by_kind = self.live_by_kind
        count_by_kind = self.live_count_by_kind
        allocations, allocated_bytes = self.allocations, self.allocated_bytes
        releases, released_bytes = self.releases, self.released_bytes
        resident = _RESIDENT_LIST
        ts_list = recs["ts"].tolist()
        ops = recs["op"].tolist()
        addrs = recs["addr"].tolist()
        sizes = recs["bytes"].tolist()
        kinds = recs["mk"].tolist()
        asyncs = recs["is_async"].tolist()
        corrs = recs["corr"].tolist()
        deltas = [0] * len(ops)
        alloc_op, release_op = MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value
        for i, op in enumerate(ops):
            addr = addrs[i]
            if op == alloc_op:
                size, kind = sizes[i], kinds[i]
                if kind >= _N_KINDS:
                    errors.add("unknown_memory_kind", f"pid={self.pid} memory kind {kind}")
                    continue
                old = live.get(addr)
                if old is not None:
                    # A second allocation at a live address: the old one was released first (the
                    # driver reuses only free addresses), its release lost or still to come stamped
                    # later. Released now, and remembered for its late release (module doc).
                    self._lost(self.reused.reused(addr, ts_list[i], corrs[i]), errors)
                    old_bytes, old_kind, _, old_async = old
                    by_kind[old_kind] -= old_bytes
                    count_by_kind[old_kind] -= 1
                    releases[old_kind] += 1
                    released_bytes[old_kind] += old_bytes
                    if old_async:
                        self.async_device_bytes -= old_bytes
                    if resident[old_kind]:
                        deltas[i] -= old_bytes
                is_async = asyncs[i] != 0
                live[addr] = (size, kind, ts_list[i], is_async)
                by_kind[kind] += size
                count_by_kind[kind] += 1
                allocations[kind] += 1
                allocated_bytes[kind] += size
                if is_async:
                    self.async_device_bytes += size
                if resident[kind]:
                    deltas[i] += size
            elif op == release_op:
                if self.reused:
                    late, lost = self.reused.release(addr, ts_list[i], corrs[i])
                    self._lost(lost, errors)
                    if late:
                        errors.repair("late_release_of_reused_address")
                        continue
                entry = live.pop(addr, None)
                if entry is None:
                    errors.add("release_without_allocation", f"pid={self.pid} dev={self.dev} addr={addr:#x}")
                    continue
                e_bytes, kind, _, e_async = entry
                if e_bytes != sizes[i] and sizes[i]:
                    errors.add("release_size_mismatch",
                               f"pid={self.pid} addr={addr:#x} allocated {e_bytes} released {sizes[i]}")
                by_kind[kind] -= e_bytes
                count_by_kind[kind] -= 1
                releases[kind] += 1
                released_bytes[kind] += e_bytes
                if e_async:
                    self.async_device_bytes -= e_bytes
                if resident[kind]:
                    deltas[i] -= e_bytes
            else:
                errors.add("unknown_memory_op", f"pid={self.pid} memory operation {op}")
        levels = self.peaks.add(recs["ts"], np.asarray(deltas, dtype=np.int64))
        if ts_list:
            self.last_ts = max(self.last_ts, ts_list[-1])
        return levels

    def _lost(self, n: int, errors: IngestErrors) -> None:
        """Reuses whose old allocation's release never came: a lost release each."""
        if n:
            errors.add("double_allocation", f"pid={self.pid} dev={self.dev}: an address allocated again "
                                            "while live, its release never came", n)

    @counted
    def settle_reused(self, errors: IngestErrors) -> None:
        """The stream ended: no late release can come any more for the reused addresses."""
        self._lost(self.reused.settle(), errors)

    @counted
    def replace_live(self, recs: np.ndarray, ts: int, errors: IngestErrors) -> LevelChanges:
        """A resync: the probe's whole live table replaces ours as of ``ts``. Reused addresses stay
        remembered, as the probe's table keeps its own: a late release may still come after it."""
        self.live.clear()
        self.live_by_kind = [0] * _N_KINDS
        self.live_count_by_kind = [0] * _N_KINDS
        self.async_device_bytes = 0
        for addr, size, kind, rts, is_async in zip(recs["addr"].tolist(), recs["bytes"].tolist(),
                                                   recs["mk"].tolist(), recs["ts"].tolist(),
                                                   recs["is_async"].tolist()):
            if kind >= _N_KINDS:
                errors.add("unknown_memory_kind", f"pid={self.pid} memory kind {kind}")
                continue
            if addr in self.live:
                errors.add("double_allocation", f"pid={self.pid} resync addr={addr:#x}")
                continue
            self.live[addr] = (size, kind, rts, bool(is_async))
            self.live_by_kind[kind] += size
            self.live_count_by_kind[kind] += 1
            if is_async:
                self.async_device_bytes += size
        return self.peaks.reset(ts, self.device_bytes)

    @property
    def device_bytes(self) -> int:
        """Bytes resident on the GPU: the quantity whose window peak is tracked."""
        return sum(b for k, b in enumerate(self.live_by_kind) if _RESIDENT[k])

    @counted
    def release_all(self, ts: int) -> LevelChanges:
        """The process exited: the driver freed everything it held."""
        self.reused.settle()  # counted already: the pipeline settles a stream before its exit
        self.live.clear()
        self.live_by_kind = [0] * _N_KINDS
        self.live_count_by_kind = [0] * _N_KINDS
        self.async_device_bytes = 0
        self.pools.clear()
        self.pool_floor = 0
        return self.peaks.reset(ts, 0)

    # --- pools, copies, sets, kernels, unified memory ---------------------------

    @counted
    def apply_pool(self, recs: np.ndarray, errors: IngestErrors) -> None:
        for op, addr, size, used in zip(recs["op"].tolist(), recs["addr"].tolist(),
                                        recs["size"].tolist(), recs["used"].tolist()):
            if op in (PoolOp.CREATED, PoolOp.TRIMMED):
                self.pools[addr] = (size, used)
                self.pool_floor = self.async_device_bytes
            elif op == PoolOp.DESTROYED:
                self.pools.pop(addr, None)
            else:
                errors.add("unknown_pool_op", f"pid={self.pid} pool operation {op}")

    @counted
    def note_pool_config(self, recs: np.ndarray) -> None:
        """MEMORY2 records of stream-ordered allocations carry their pool's size and use.

        The same as taking the records one by one (each sets its pool's (size, used); a size other
        than the pool's last one restarts the floor at the current async bytes), per pool with numpy:
        under cudaMallocAsync every record carries its pool, so a Python loop would run per record;
        a batch of a few records is walked in Python all the same (numpy's fixed costs dominate there)."""
        if len(recs) <= _SMALL_POOL_BATCH:
            self._note_pool_config_small(recs)
            return
        mask = (recs["pool_addr"] != 0) & (recs["pool_size"] != 0)
        if _ONE_POOL_FAST:
            # The usual batch under cudaMallocAsync: every stream-ordered record of one pool (the default
            # one). Its last record's (size, used) and whether a size moved are read from the pool columns
            # at the records' positions, with no copy of whole records and no per-pool runs.
            at = mask.nonzero()[0]
            if not len(at):
                return
            pool = recs["pool_addr"][at]
            if np.count_nonzero(pool == pool[0]) == len(pool):
                sizes = recs["pool_size"][at]
                a = int(pool[0])
                if self.pools.get(a, (None,))[0] != int(sizes[0]) or np.count_nonzero(sizes[1:] != sizes[:-1]):
                    self.pool_floor = self.async_device_bytes  # a new reported size: the bound starts over
                self.pools[a] = (int(sizes[-1]), int(recs["pool_used"][at[-1]]))
                return
        elif not mask.any():
            return
        sel = recs if bool(mask.all()) else select(recs, mask)  # as recs[mask], rows of words at once
        addr, size, used = sel["pool_addr"], sel["pool_size"], sel["pool_used"]
        if addr[0] != addr[-1] or not bool((addr == addr[0]).all()):
            order = np.argsort(addr, kind="stable")  # by pool, then in time order
            addr, size, used = addr[order], size[order], used[order]
        first = np.ones(len(addr), dtype=bool)
        first[1:] = addr[1:] != addr[:-1]
        last = np.ones(len(addr), dtype=bool)
        last[:-1] = first[1:]
        # A new size inside the batch (against the same pool's previous record), or against the table.
        changed = bool(((size[1:] != size[:-1]) & ~first[1:]).any())
        for a, s in zip(addr[first].tolist(), size[first].tolist()):
            if self.pools.get(a, (None,))[0] != s:
                changed = True
        for a, s, u in zip(addr[last].tolist(), size[last].tolist(), used[last].tolist()):
            self.pools[a] = (s, u)
        if changed:
            self.pool_floor = self.async_device_bytes  # a new reported size: the bound starts over

    def _note_pool_config_small(self, recs: np.ndarray) -> None:
        pools, sizes, used = recs["pool_addr"].tolist(), recs["pool_size"].tolist(), recs["pool_used"].tolist()
        n = len(pools)
        if n and pools[0] and pools.count(pools[0]) == n and 0 not in sizes:
            # Every record of one pool (a process on cudaMallocAsync's default pool): the walk below
            # leaves its last (size, used), and a new size where one differs from the one before it.
            a = pools[0]
            if self.pools.get(a, (None,))[0] != sizes[0] or sizes.count(sizes[0]) != n:
                self.pool_floor = self.async_device_bytes
            self.pools[a] = (sizes[-1], used[-1])
            return
        last: dict[int, tuple[int, int]] = {}  # pool -> its latest (size, used) in the batch
        changed = False
        for a, s, u in zip(pools, sizes, used):
            if a == 0 or s == 0:
                continue
            prev = last.get(a)
            if (prev[0] if prev is not None else self.pools.get(a, (None,))[0]) != s:
                changed = True
            last[a] = (s, u)
        if not last:
            return
        # In the batch path's order: one pool as it is, several sorted by address.
        for a in (sorted(last) if len(last) > 1 else last):
            self.pools[a] = last[a]
        if changed:
            self.pool_floor = self.async_device_bytes

    @counted
    def apply_memcpy(self, recs: np.ndarray) -> None:
        if len(recs) <= _SMALL_POOL_BATCH:
            self._apply_memcpy_small(recs)
            return
        ck = recs["ck"]
        dur = (recs["end"].astype(np.int64) - recs["start"].astype(np.int64)).clip(min=0)
        # Per kind with one bincount a column (``footprint.cells``); a selection per kind where the sums
        # could pass float64's exact range.
        sums = key_sums(ck, [recs["bytes"].astype(np.int64), dur]) if _bytes_fit(recs["bytes"]) else None
        if sums is not None:
            for k, n, b, ns in zip(sums[0], sums[1], sums[2][0], sums[2][1]):
                self.memcpy_count[k] += n
                self.memcpy_bytes[k] += b
                self.memcpy_ns[k] += ns
        else:
            for k in np.unique(ck).tolist():
                sel = ck == k
                self.memcpy_count[k] += int(sel.sum())
                self.memcpy_bytes[k] += int(recs["bytes"][sel].sum())
                self.memcpy_ns[k] += int(dur[sel].sum())
        peer = ck == _PTOP  # a plain int: numpy compares with an IntEnum member several times slower
        if peer.any():
            pairs = np.stack([recs["src_dev"][peer], recs["dst_dev"][peer]], axis=1)
            sizes = recs["bytes"][peer]
            for (src, dst), size in zip(pairs.tolist(), sizes.tolist()):
                self.peer_copy_bytes[(src, dst)] += size

    def _apply_memcpy_small(self, recs: np.ndarray) -> None:
        """``apply_memcpy`` record by record; the sums are added in the batch path's order (kinds ascending)."""
        sums: dict[int, list[int]] = {}
        ptop = CopyKind.PTOP.value
        for kind, start, end, size, src, dst in zip(recs["ck"].tolist(), recs["start"].tolist(),
                                                    recs["end"].tolist(), recs["bytes"].tolist(),
                                                    recs["src_dev"].tolist(), recs["dst_dev"].tolist()):
            row = sums.get(kind)
            if row is None:
                row = sums[kind] = [0, 0, 0]
            row[0] += 1
            row[1] += size
            row[2] += max(end - start, 0)
            if kind == ptop:
                self.peer_copy_bytes[(src, dst)] += size
        for kind in sorted(sums):
            n, size, ns = sums[kind]
            self.memcpy_count[kind] += n
            self.memcpy_bytes[kind] += size
            self.memcpy_ns[kind] += ns

    @counted
    def apply_memset(self, recs: np.ndarray) -> None:
        self.memset_count += len(recs)
        self.memset_bytes += int(recs["bytes"].sum())

    @counted
    def apply_kernel(self, recs: np.ndarray) -> None:
        self.kernel_count += len(recs)
        self.kernel_ns += int((recs["end"].astype(np.int64) - recs["start"].astype(np.int64)).clip(min=0).sum())

    @counted
    def apply_unified(self, recs: np.ndarray) -> None:
        ck = recs["ck"]
        values = um_counter_values(ck, recs["value"])
        for k in np.unique(ck).tolist():
            sel = ck == k
            self.um_count[k] += int(sel.sum())
            self.um_value[k] += int(values[sel].sum())

    @property
    def pool_reserved_bytes(self) -> int:
        """Reported pool sizes, or the pools' use when that is higher (growth CUPTI does not report)."""
        reported = sum(r for r, _ in self.pools.values())
        return max(reported, self.pool_floor) if (self.pools or self.pool_floor) else 0
