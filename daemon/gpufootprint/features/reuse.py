"""Allocation reuse ratio: one definition for the live daemon and ``abtest``.

The share of *device* allocations (``cudaMalloc`` and friends; not pinned host
memory, not module globals) made at an address and size that an earlier
release freed: a CUDA graph replays fixed addresses, so a step that keeps
reusing the same blocks is one a graph can capture.

The advisor reads it over the steady part of the run: allocations from
``since`` on (the median start of the kernels it judges, so warm-up segments
do not dilute it). A process that made *no* device allocation then, after
having made some before (a warmed-up caching allocator serves every step from
its own segments), has a fully static footprint: 1.0. No device allocation at
all: unknown (None).

``ReuseTracker`` counts per (pid, device) as batches arrive (the feature hub
owns one per frame builder; ``abtest`` replays through the same hub), and keeps
the newest allocations' (time, reused) pairs so ``steady_ratio`` can answer for
any ``since`` at engine time from an immutable snapshot. CUPTI's release records
carry their size; for traces whose releases omit it, the size last allocated at
the address is used, remembered from the first batch with such a release on.

Where the daemon's C core is built (gpufootprint/native), a batch is one call into it
(``gfp_reuse_add``: the freed keys and remembered sizes live in C, the events are
written straight into the tracker's buffer). The numpy and Python paths below stay,
unchanged, for installs without it and as the reference its tests compare it with.
"""

from __future__ import annotations

import operator
from itertools import compress

import numpy as np

from gpufootprint.features.keyset import KeySet
from gpufootprint.native import ReuseCore, core
from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp, select

REUSE_EVENT_DTYPE = np.dtype([("ts", "<i8"), ("reused", "?")])
# core.c writes events as 9 packed bytes, the time then the flag: the C core is used only with that layout
_C_EVENTS = REUSE_EVENT_DTYPE.itemsize == 9 and REUSE_EVENT_DTYPE.fields["reused"][1] == 8  # type: ignore[index]
_NO_EVENTS = np.zeros(0, REUSE_EVENT_DTYPE)
_NO_EVENTS.flags.writeable = False


_DEVICE = MemoryKind.DEVICE.value
_MIX = 0x9E3779B97F4A7C15
_MIX_U64 = np.uint64(_MIX)
_U64 = (1 << 64) - 1
#: Batches of at most this many records are taken one record at a time in Python (``_add_small``):
#: below it the numpy path's few dozen calls of fixed cost outweigh a loop over the records.
SMALL_BATCH = 96
#: From this many records of a batch on, allocations and releases are looked up together (``_probe_together``).
_PROBE_TOGETHER_MIN = 256


def reuse_keys(addr: np.ndarray, size: np.ndarray) -> np.ndarray:
    """One 64-bit key per (address, size): cheap to hash in sets. A collision needs two pairs
    with equal mixed values (about n^2 / 2^64): it could only nudge the reuse ratio."""
    # Arrays: numpy wraps integer arrays silently (only scalar arithmetic warns of overflow), so no errstate
    # context (two calls into numpy's error state) and no copies of columns that are uint64 already.
    return addr.astype(np.uint64, copy=False) ^ (size.astype(np.uint64, copy=False) * _MIX_U64)


def _first_positions(keys: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``keys`` in ascending order, and the smallest of ``pos`` of each. Sorted with numpy's
    default (unstable) sort, a quarter of a stable sort's time for 64-bit keys; where a key repeats, its
    positions are reduced to their minimum, so the order among equal keys does not matter."""
    order = keys.argsort()
    keys, pos = keys[order], pos[order]
    if len(keys) > 1:
        change = keys[1:] != keys[:-1]
        if not change.all():
            starts = np.concatenate(([True], change)).nonzero()[0]
            keys, pos = keys[starts], np.minimum.reduceat(pos, starts)
    return keys, pos


class ReuseTracker:
    """Reuse of one (pid, device)'s device allocations. Feed MEMORY batches in time order."""

    def __init__(self, capacity: int = 100_000, history: int = 65_536, native: bool = True) -> None:
        """``native``: use the C core where it loads (``False``: the Python paths, the reference)."""
        lib = core() if native and _C_EVENTS else None
        self._core = None if lib is None else ReuseCore(
            lib, MEMORY_DTYPE, _DEVICE, MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value)
        self._freed = KeySet()  # these three: the Python paths' memory (the C core keeps its own)
        self._live: dict[int, int] = {}  # address -> last allocated size: a release record may omit it
        self._sizeless = False  # a release without its size was seen: keep ``_live``
        self._capacity = capacity
        self._history = history
        self._full = (capacity, history)
        # The newest allocations' events, ``_buf[_lo:_hi]``. Appended after ``_hi`` and never written where
        # they lie: a full buffer is replaced by a new one holding the newest ``_history``. So a view handed
        # out (``events``, which every snapshot of a changed device takes) stays as it was, and taking it
        # costs nothing (it was a join of the whole history, 65,536 events, at every snapshot).
        self._buf = _NO_EVENTS
        self._buf_at = 0  # its address, for the C core's writes
        self._lo = 0
        self._hi = 0
        self._events: np.ndarray | None = None  # the view handed out, read-only
        self.allocations = 0
        self.reused = 0

    def share(self, part: float) -> None:
        """Remember ``part`` of the configured pairs and events (at least 256 of each)."""
        capacity, history = self._full
        self._capacity = max(256, int(capacity * part))
        self._history = max(256, int(history * part))
        if self._core is not None:
            self._core.trim(self._capacity)
        if len(self._freed) >= self._capacity:
            self._freed.clear()
        if len(self._live) >= self._capacity:
            self._live.clear()
        self._lo = max(self._lo, self._hi - self._history)
        self._events = None

    def add(self, recs: np.ndarray) -> None:
        if self._core is not None:
            self._add_native(recs)
            return
        if len(recs) <= SMALL_BATCH:
            self._add_small(recs)
            return
        device = recs["mk"] == _DEVICE  # a plain int: numpy compares with an IntEnum member several times slower
        # (np.count_nonzero for all/any: no Python wrapper or reduction setup, about 0.3 us less a call.)
        sel = recs if np.count_nonzero(device) == len(device) else select(recs, device)  # as recs[device], rows of words at once
        if len(sel) == 0:
            return
        ts = sel["ts"]
        if len(sel) > 1 and np.count_nonzero(ts[1:] < ts[:-1]):
            sel = sel[sel["ts"].argsort(kind="stable")]
        freed, live = self._freed, self._live
        alloc, release = MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value
        ops, addr, size = sel["op"], sel["addr"], sel["bytes"]
        is_alloc = ops == alloc
        if len(live) >= self._capacity:
            live.clear()
        if len(freed) >= self._capacity:
            freed.clear()  # bounded memory: start remembering afresh (the ratio dips, briefly)
        if self._sizeless or (int(size.min()) == 0 and np.count_nonzero((ops == release) & (size == 0))):
            # CUPTI's release records carry the size; a trace that omits it gets each release the
            # size last allocated at its address, remembered from the first such batch on (one pass
            # in Python; the common case never pays for it).
            self._sizeless = True
            size = size.copy()
            for i, (op, a, b) in enumerate(zip(ops.tolist(), addr.tolist(), size.tolist())):
                if op == alloc:
                    live[a] = b
                elif op == release and b == 0:
                    size[i] = live.get(a, 0)
        # Whole-batch lookups in a numpy hash set (features.keyset): an allocation is a reuse when its key
        # was freed by an earlier batch, or by a release earlier in this batch. The second test runs only
        # for allocations the first missed whose key a release of this batch holds.
        keys = reuse_keys(addr, size)
        is_rel = ops == release
        # The allocations by their positions, found once: a boolean mask copies run by run of True, and
        # allocations and releases interleave (about 6 us a 1,563-record batch for each of the two columns
        # taken, against 2.5 us for the positions and 1 us a column gathered by them).
        alloc_pos = is_alloc.nonzero()[0]
        alloc_keys = keys[alloc_pos]
        rel_pos = is_rel.nonzero()[0]
        if len(alloc_keys) == 0:
            if len(rel_pos):
                freed.add(keys[rel_pos])
            return
        if len(rel_pos) and len(keys) >= _PROBE_TOGETHER_MIN:
            hit, _, new = self._probe_together(alloc_keys, keys[rel_pos])
            rel_pos = rel_pos[new]  # the releases that may match a miss below
        else:
            hit = freed.contains(alloc_keys)
            if len(rel_pos):
                freed.add(keys[rel_pos])
        if len(rel_pos):
            miss = (~hit).nonzero()[0]
            if len(miss):
                # A missed allocation was freed only by this batch's releases, if by any: its key is one
                # of theirs. Matched by key against each release key's first position in the batch
                # (no second probe of the set: under churn most misses are such keys).
                rel_keys, first_pos = _first_positions(keys[rel_pos], rel_pos)
                miss_keys = alloc_keys[miss]
                at = rel_keys.searchsorted(miss_keys)
                at[at == len(rel_keys)] = 0
                here = rel_keys[at] == miss_keys
                if here.any():
                    miss, at = miss[here], at[here]
                    hit[miss] = first_pos[at] < alloc_pos[miss]
        ts_out = sel["ts"][alloc_pos]
        ev = np.empty(len(ts_out), REUSE_EVENT_DTYPE)
        ev["ts"], ev["reused"] = ts_out, hit
        self.allocations += len(ev)
        self.reused += int(np.count_nonzero(hit))
        self._append(ev)

    def _probe_together(self, alloc_keys: np.ndarray,
                        rel_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Which allocations' keys were freed before this batch, each release's slot, and which releases
        added a key the set did not hold (positions among the releases).

        One lookup for the allocations and the releases together, then only the keys new to the set are
        added: under churn most releases free a key freed before, so the lookup and the add of every
        release key (two passes of probe rounds) were mostly the same search twice. An allocation that
        missed can only have been freed by this batch through a key new to the set: only those releases
        are searched for it."""
        freed = self._freed
        n = len(alloc_keys)
        slots = freed.find(np.concatenate((alloc_keys, rel_keys)))
        hit = slots[:n] != -1
        rel_slots = slots[n:]  # a view of find's fresh answer: written into below, read nowhere else
        new = (rel_slots == -1).nonzero()[0]
        if len(new):
            rel_slots[new] = freed.add(rel_keys[new])
        return hit, rel_slots, new

    def _add_small(self, recs: np.ndarray) -> None:
        """``add`` for a few records, one at a time: what the batch path decides for the whole batch
        (a reuse is a key freed by an earlier batch or by an earlier release of this one) is what
        walking the records in time order decides. A unit test holds the two equal."""
        kinds = recs["mk"].tolist()
        ts, ops, addrs, sizes = recs["ts"].tolist(), recs["op"].tolist(), recs["addr"].tolist(), recs["bytes"].tolist()
        # Column lists walked together (no list of row tuples made first); other memory kinds take no part.
        if kinds.count(_DEVICE) != len(kinds):
            keep = [k == _DEVICE for k in kinds]
            ts, ops, addrs, sizes = (list(compress(c, keep)) for c in (ts, ops, addrs, sizes))
            if not ts:
                return
        if not all(map(operator.le, ts, ts[1:])):
            order = sorted(range(len(ts)), key=ts.__getitem__)  # stable, as the batch path's argsort
            ts, ops, addrs, sizes = ([c[i] for i in order] for c in (ts, ops, addrs, sizes))
        freed, live = self._freed, self._live
        alloc, release = MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value
        if len(live) >= self._capacity:
            live.clear()
        if len(freed) >= self._capacity:
            freed.clear()
        n_rel = ops.count(release)
        if not self._sizeless and n_rel and 0 in sizes and any(
                op == release and b == 0 for op, b in zip(ops, sizes)):
            self._sizeless = True
        if n_rel:
            freed.reserve(n_rel)
        times: list[int] = []
        hits: list[bool] = []
        sizeless = self._sizeless
        has, add_one = freed.has, freed.add_one
        for t, op, a, b in zip(ts, ops, addrs, sizes):
            if sizeless:
                if op == alloc:
                    live[a] = b
                elif op == release and b == 0:
                    b = live.get(a, 0)
            key = a ^ ((b * _MIX) & _U64)
            if op == alloc:
                times.append(t)
                hits.append(has(key))
            elif op == release:
                add_one(key)
        if not times:
            return
        ev = np.empty(len(times), REUSE_EVENT_DTYPE)
        ev["ts"], ev["reused"] = times, hits
        self.allocations += len(ev)
        self.reused += sum(hits)
        self._append(ev)

    def _add_native(self, recs: np.ndarray) -> None:
        """``add`` as one call into the C core: ``_add_small``'s walk over the records where they lie
        (their fields at MEMORY_DTYPE's offsets, any stride), the events written after ``_hi``."""
        c = self._core
        assert c is not None
        if recs.dtype is not MEMORY_DTYPE and recs.dtype != MEMORY_DTYPE:
            recs = _as_memory(recs)
        n = len(recs)
        if self._hi + n > len(self._buf):
            self._room(n)  # at most one event a record
        got = c.add(c.handle, recs.ctypes.data, n, recs.strides[0], self._capacity,
                    self._buf_at + self._hi * REUSE_EVENT_DTYPE.itemsize, c.hits_at)
        if got <= 0:
            if got < 0:
                raise MemoryError("gfp_reuse_add")
            return
        self.allocations += got
        self.reused += c.hits[0]
        hi = self._hi + got
        self._lo, self._hi = max(self._lo, hi - self._history), hi
        self._events = None

    def _room(self, n: int) -> None:
        """Room for ``n`` more events after ``_hi``: a full buffer is replaced by a new one holding the
        newest ``_history`` (views handed out keep the old one as it was)."""
        lo, hi = self._lo, self._hi
        keep = min(hi - lo, self._history)
        buf = np.empty(max(2 * self._history, keep + n, 256), REUSE_EVENT_DTYPE)
        _put(buf, 0, self._buf[hi - keep:hi])
        self._buf, self._buf_at = buf, buf.ctypes.data
        self._lo, self._hi = 0, keep

    def _append(self, ev: np.ndarray) -> None:
        n = len(ev)
        if self._hi + n > len(self._buf):
            self._room(n)
        hi = self._hi
        _put(self._buf, hi, ev)
        hi += n
        self._lo, self._hi = max(self._lo, hi - self._history), hi
        self._events = None

    @property
    def ratio(self) -> float | None:
        """Over every device allocation seen (the exported gauge)."""
        return self.reused / self.allocations if self.allocations else None

    def events(self) -> np.ndarray:
        """The newest allocations' (ts, reused), oldest first, read-only: a view that stays as it is."""
        if self._events is None:
            if self._hi == self._lo:
                return _NO_EVENTS
            self._events = self._buf[self._lo:self._hi]
            self._events.flags.writeable = False
        return self._events


def _as_memory(recs: np.ndarray) -> np.ndarray:
    """Records of another dtype with the fields the tracker reads, as MEMORY_DTYPE records (the C core
    reads them at MEMORY_DTYPE's offsets). The daemon's MEMORY batches are MEMORY_DTYPE already."""
    names = ("ts", "addr", "bytes", "op", "mk")
    for name in names:
        if not np.can_cast(recs.dtype[name], MEMORY_DTYPE[name], "safe"):
            # (a signed time of -1 would become 2**64 - 1 and sort last, where the Python paths sort it first)
            raise TypeError(f"reuse: field {name!r} of {recs.dtype[name]} does not cast safely to {MEMORY_DTYPE[name]}")
    out = np.zeros(len(recs), MEMORY_DTYPE)
    for name in names:
        out[name] = recs[name]
    return out


def _put(dst: np.ndarray, at: int, src: np.ndarray) -> None:
    """``dst[at:at + len(src)] = src`` as bytes (numpy assigns a structured dtype field by field)."""
    size = dst.dtype.itemsize
    dst.view(np.uint8)[at * size:(at + len(src)) * size] = np.ascontiguousarray(src).view(np.uint8)


def steady_ratio(events: np.ndarray, allocations: int, since: int | None) -> float | None:
    """Reuse over the allocations at or after ``since`` (ns; None: all kept ones).

    ``allocations``: how many device allocations the process made in all (the
    kept ``events`` may be fewer). None when it made none.
    """
    if allocations <= 0:
        return None
    recent = events if since is None else events[events["ts"] >= since]
    if len(recent) == 0:
        return 1.0
    return float(np.count_nonzero(recent["reused"])) / len(recent)
