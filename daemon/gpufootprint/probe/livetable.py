"""The probe's own live allocation table, sent whole after every (re)connect.

CUPTI delivers records out of timestamp order, and stream-ordered allocators
free and reuse an address quickly, so records wait in ``pending`` until a forced
flush says every earlier one has arrived, then apply in timestamp order (as the
daemon's pipeline does). Entries built from PyTorch's segment
list after a profiler gap may cover several CUPTI allocations (expandable
segments map in chunks); a release inside such a range shrinks it.

An allocation at an address the table still holds follows the daemon's rule
(records.LATE_RELEASE_NS, footprint/table.py): the old entry goes, and a release of that
address within the window is the old entry's late release, not the new one's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from gpufootprint.records import (
    DEVICE_RESIDENT_KINDS,
    MEMORY_DTYPE,
    MemoryKind,
    MemoryOp,
    ReusedAddresses,
    copy_records,
    join,
    select,
    take,
)
from gpufootprint.wire import cupti_layout

if TYPE_CHECKING:
    from gpufootprint.probe.nativecallbacks import Paired

Row = tuple[Any, ...]  # one MEMORY_DTYPE record as a tuple
_ALLOC: Final = int(MemoryOp.ALLOCATION)
_RELEASE: Final = int(MemoryOp.RELEASE)
_BULK_MIN: Final = 64  # below this many records the loop is faster than numpy's fixed costs

# Field positions in a MEMORY_DTYPE row tuple.
TS, ADDR, BYTES = 0, 1, 2
PID, DEV, CORR = 7, 8, 11
OP, MK, IS_ASYNC = 12, 13, 14


@dataclass
class LiveTable:
    rows: dict[int, Row] = field(default_factory=dict)  # addr -> MEMORY row (op = allocation)
    ranges: dict[int, Row] = field(default_factory=dict)  # synthetic entries (torch segments) by start addr
    pending: list[np.ndarray] = field(default_factory=list)  # delivered, not yet applied (time order)
    # MEMORY2 records as CUPTI wrote them (cupti_layout.RAW_DTYPES[MEMORY2]), from buffers forwarded
    # to the daemon unread: converted here only for the allocations that stay live.
    pending_raw: StructQueue = field(default_factory=lambda: StructQueue(cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2]))
    raw_pid: int = 0
    stale_releases: int = 0
    _untracked: dict[int, Row] = field(default_factory=dict)  # device -> the UNTRACKED entry declared last
    range_splits: int = 0  # releases that cut a synthetic range: the daemon needs a fresh resync
    # Addresses allocated again while live, for their old entries' late releases (the daemon's rule).
    reused: ReusedAddresses = field(default_factory=ReusedAddresses)
    late_release_repairs: int = 0  # releases taken as the late release of a reused address's old entry
    lost_releases: int = 0  # reused addresses whose old entry's release never came
    # (device, memory kind) -> [bytes, entries] over ``rows``, kept as rows come and go: the daemon asks for the
    # table's totals with every watermark, and a walk of every live row (2,000 rows: 0.4 ms on the development
    # VM, the GIL held) landed in a workload's step once a second. ``ranges`` are few and walked.
    _sums: dict[tuple[int, int], list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    # The pairing of a watermark's structs by address in one pass of C (nativecallbacks.Pairer), where the probe's
    # library loaded: numpy's sort by address and time took 2.0-3.2 ms a watermark of 56,000 records on the
    # development VM (6.3-6.9 beside a busy thread), most of it with the GIL held, once a second in whatever step
    # the workload was in. None: numpy.
    pairer: Callable[[np.ndarray, int, int, int], Paired | None] | None = field(default=None, repr=False,
                                                                                compare=False)
    paired_in_c: int = 0  # watermarks whose structs the C pass paired and this table applied as it answered

    def __post_init__(self) -> None:
        self._recount()  # a table made with rows already in it

    def _came(self, row: Row) -> None:
        pair = self._sums.get((row[DEV], row[MK]))
        if pair is None:
            self._sums[(row[DEV], row[MK])] = [row[BYTES], 1]
        else:
            pair[0] += row[BYTES]
            pair[1] += 1

    def _gone(self, row: Row) -> None:
        pair = self._sums[(row[DEV], row[MK])]
        pair[0] -= row[BYTES]
        pair[1] -= 1

    def _recount(self) -> None:
        """The sums from every row (after a change of many rows at once, rare: the profiler hand-over)."""
        self._sums = {}
        for row in self.rows.values():
            self._came(row)

    def add(self, recs: np.ndarray) -> None:
        """Queue MEMORY records as CUPTI delivered them; ``advance`` applies them in time order."""
        if len(recs):
            self.pending.append(copy_records(recs))

    def add_raw(self, structs: np.ndarray, pid: int) -> None:
        """Queue MEMORY2 structs (a view of a CUPTI buffer: copied here) for ``advance``."""
        if len(structs):
            self.pending_raw.append(structs)
            self.raw_pid = pid

    def _raw_as_records(self) -> None:
        if len(self.pending_raw):
            self.pending.append(cupti_layout.convert(cupti_layout.MEMORY2, self.pending_raw.view(), self.raw_pid))
            self.pending_raw.clear()

    def _advance_raw(self, ts: int) -> None:
        """``advance`` for structs only: applied where they lie in the queue (sorted by index, not
        copied: under churn a watermark's structs are about 7 MB and almost all of them are due)."""
        raw = self.pending_raw.view()
        if self.pairer is not None and not self.ranges and len(raw) >= _BULK_MIN:
            paired = self.pairer(raw, ts, _ALLOC, _RELEASE)
            if paired is not None:
                self._advance_paired(raw, ts, paired)
                return
        stamps = raw["timestamp"]
        due = stamps <= ts
        every = bool(due.all())
        waiting = int(np.argmin(due)) if not every else len(raw)  # the first record not due
        if every or not bool(due[waiting:].any()):
            # What waits is the queue's tail (records come in time order but for CUPTI's thread buffers
            # and calls in flight): only the due head is sorted and applied, and the tail stays in place.
            if waiting:
                self._apply_raw(raw[:waiting], None)
        else:
            self._apply_raw(raw, due)
        if every:
            self.pending_raw.clear()
        else:
            self.pending_raw.keep(~due)

    def _apply_raw(self, raw: np.ndarray, due: np.ndarray | None) -> None:
        """Apply the structs of ``raw`` (those where ``due``; None: all) in time order."""
        n = len(raw) if due is None else int(np.count_nonzero(due))
        if n < _BULK_MIN or self.ranges:
            self._apply_raw_each(raw if due is None else select(raw, due))
            return
        addrs = raw["address"]
        order = np.lexsort((raw["timestamp"], addrs))
        if due is not None:
            order = order[due[order]]
        stay = self._apply_by_address(addrs, raw["op"], order)
        if stay is None:  # a reused address: the record-by-record rule
            self._apply_raw_each(raw if due is None else select(raw, due))
        elif len(stay):
            recs = cupti_layout.convert(cupti_layout.MEMORY2, take(raw, stay), self.raw_pid)
            self._stay(recs["addr"].tolist(), recs.tolist(), recs)

    def _advance_paired(self, raw: np.ndarray, ts: int, paired: Paired) -> None:
        """``_advance_raw`` with the pairing done in C (``pairer``, over the whole queue): the same rule as
        ``_apply_by_address``, its answers by address, and the look at what waits in the same pass."""
        due = None if paired.due_after_waiting == 0 else raw["timestamp"] <= ts
        part = raw[:paired.first_waiting] if due is None else raw
        if paired.due < _BULK_MIN:
            if paired.due:
                self._apply_raw(part, due)  # the record-by-record rule
        elif paired.twice or self._paired_conflicts(paired):
            self._apply_raw_each(part if due is None else select(raw, due))
        else:
            self._apply_paired(raw, paired)
            self.paired_in_c += 1
        if due is None:
            self.pending_raw.drop_front(paired.first_waiting)
        else:
            self.pending_raw.keep(~due)

    def _paired_conflicts(self, paired: Paired) -> bool:
        """An address first allocated here that the table holds live, or one allocated again while live before
        (``reused``): the record-by-record rule decides (``_apply_by_address`` answers None for the same)."""
        firsts = paired.first_allocations.tolist()
        return (not self.rows.keys().isdisjoint(firsts)
                or bool(self.reused) and not self.reused.addresses().isdisjoint(firsts + paired.first_releases.tolist()))

    def _apply_paired(self, raw: np.ndarray, paired: Paired) -> None:
        rows = self.rows
        stale = 0
        for x in paired.first_releases.tolist():
            old = rows.get(x)
            if old is None:
                stale += 1
            else:
                self._gone(old)
        self.stale_releases += stale + paired.repeated_releases
        for x in paired.last_releases.tolist():
            rows.pop(x, None)
        stay = paired.stay
        if len(stay):
            # by address, as the numpy path leaves them (the rows' order is their insertion order)
            stay = stay[np.argsort(raw["address"][stay], kind="stable")]
            recs = cupti_layout.convert(cupti_layout.MEMORY2, take(raw, stay), self.raw_pid)
            self._stay(recs["addr"].tolist(), recs.tolist(), recs)

    def _apply_raw_each(self, ready: np.ndarray) -> None:
        recs = cupti_layout.convert(cupti_layout.MEMORY2, ready, self.raw_pid)
        self._apply_each(take(recs, np.argsort(recs["ts"], kind="stable")))

    def advance(self, ts: int) -> None:
        """Apply every queued record with a timestamp <= ``ts``, in timestamp order.

        Delivery order is not time order, and stream-ordered allocators reuse an
        address within microseconds; in time order allocation and release of an
        address alternate exactly (measured on the H200), so the table stays exact.
        """
        if len(self.pending_raw):
            if not self.pending:
                self._advance_raw(ts)
                return
            self._raw_as_records()  # packed records too: put them all in one time order
        if not self.pending:
            return
        recs = join(self.pending)
        due = recs["ts"] <= ts
        if due.all():
            self.pending = []
            ready = recs
        else:
            self.pending = [select(recs, ~due)]
            ready = select(recs, due)
        if len(ready):
            self.apply(take(ready, np.argsort(ready["ts"], kind="stable")))

    def pending_array(self) -> np.ndarray:
        """Records queued and not yet applied (stamped after the table's watermark)."""
        self._raw_as_records()
        if not self.pending:
            return np.zeros(0, dtype=MEMORY_DTYPE)
        return join(self.pending)

    def totals(self) -> dict[int, dict[int, list[int]]]:
        """device -> memory kind -> [bytes, live allocations], over the whole table (rows by their kept sums)."""
        out: dict[int, dict[int, list[int]]] = {}
        for (dev, mk), (nbytes, entries) in self._sums.items():
            if entries:
                out.setdefault(dev, {})[mk] = [nbytes, entries]
        for row in self.ranges.values():
            pair = out.setdefault(row[DEV], {}).setdefault(row[MK], [0, 0])
            pair[0] += row[BYTES]
            pair[1] += 1
        return out

    def apply(self, recs: np.ndarray) -> None:
        """Apply MEMORY records in the given order (callers sort them by time).

        A large batch is applied by address with numpy: per address only its last record
        decides whether it stays live (under churn most allocations are freed within the
        batch, so the table barely changes); a loop over every record, holding the GIL in
        the workload's process, cost about 0.75 us per record (bench/probe_sender.py).
        Synthetic ranges (after a profiler gap) need the record-by-record path.
        """
        if len(recs) >= _BULK_MIN and not self.ranges:
            self._apply_bulk(recs)
        else:
            self._apply_each(recs)

    def _apply_bulk(self, recs: np.ndarray) -> None:
        # by address, then in the given (time) order
        stay = self._apply_by_address(recs["addr"], recs["op"], np.argsort(recs["addr"], kind="stable"))
        if stay is None:
            self._apply_each(recs)
            return
        if len(stay):
            rows = recs[stay]
            self._stay(rows["addr"].tolist(), rows.tolist(), rows)

    def _stay(self, addrs: list[int], rows: list[Row], recs: np.ndarray) -> None:
        """The allocations ``_apply_by_address`` left live (``rows``, the records ``recs`` as tuples), into the
        table; the rows they replace, if any, were taken out of the sums there. Many at once (a model loading)
        are summed by (device, kind) with numpy rather than one by one."""
        self.rows.update(zip(addrs, rows))
        if len(rows) < _BULK_MIN:
            for row in rows:
                self._came(row)
            return
        key = recs["dev"].astype(np.int64) << 32 | recs["mk"].astype(np.int64)
        order = np.argsort(key, kind="stable")
        key = key[order]
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        sizes = np.add.reduceat(recs["bytes"][order].astype(np.int64), starts).tolist()
        counts = np.diff(np.r_[starts, len(key)]).tolist()
        for k, nbytes, entries in zip(key[starts].tolist(), sizes, counts):
            pair = self._sums.setdefault((k >> 32, k & 0xFFFF_FFFF), [0, 0])
            pair[0] += nbytes
            pair[1] += entries

    def _apply_by_address(self, addrs: np.ndarray, ops: np.ndarray, order: np.ndarray) -> np.ndarray | None:
        """Apply records given in ``order`` (by address, then time): per address only its last record
        decides whether it stays live. Releases leave the table here; returns the indexes of the
        allocations that stay, for the caller to store in its own form. None, with nothing applied,
        where an address is allocated while live (the record-by-record rule decides those)."""
        o = ops[order]
        released = o == _RELEASE
        applied = released | (o == _ALLOC)  # two comparisons: np.isin costs several times more here
        if not applied.all():
            order, released = order[applied], released[applied]
        if len(order) == 0:
            return order
        a = addrs[order]
        new_addr = np.empty(len(a), dtype=bool)
        new_addr[0] = True
        new_addr[1:] = a[1:] != a[:-1]
        last = np.empty(len(a), dtype=bool)
        last[-1] = True
        last[:-1] = new_addr[1:]
        rows = self.rows
        first_alloc = new_addr & ~released
        if (bool((~released[1:] & ~released[:-1] & ~new_addr[1:]).any())
                or not rows.keys().isdisjoint(a[first_alloc].tolist())
                or (self.reused and not self.reused.addresses().isdisjoint(a[new_addr].tolist()))):
            return None
        # Releases of nothing: a first release of an address the table does not hold, or a release
        # right after another release of the same address. A first release of a held one ends its row (popped
        # below, or replaced by the address's last allocation): out of the sums here.
        stale = 0
        for x in a[new_addr & released].tolist():
            old = rows.get(x)
            if old is None:
                stale += 1
            else:
                self._gone(old)
        self.stale_releases += stale + int((released[1:] & released[:-1] & ~new_addr[1:]).sum())
        for x in a[last & released].tolist():
            rows.pop(x, None)
        stay: np.ndarray = order[last & ~released]
        return stay

    def _apply_each(self, recs: np.ndarray) -> None:
        rows = self.rows
        reused = self.reused
        sums = self._sums
        for row in recs.tolist():
            op, addr = row[OP], row[ADDR]
            if op == _ALLOC:
                old = rows.get(addr)
                if old is not None:
                    self.lost_releases += reused.reused(addr, row[TS], row[CORR])
                    self._gone(old)
                rows[addr] = row
                pair = sums.get((row[DEV], row[MK]))  # _came, inline: this loop runs a step a record
                if pair is None:
                    sums[(row[DEV], row[MK])] = [row[BYTES], 1]
                else:
                    pair[0] += row[BYTES]
                    pair[1] += 1
            elif op == _RELEASE:
                if reused:
                    late, lost = reused.release(addr, row[TS], row[CORR])
                    self.lost_releases += lost
                    if late:
                        self.late_release_repairs += 1
                        continue
                old = rows.pop(addr, None)
                if old is not None:
                    pair = sums[(old[DEV], old[MK])]  # _gone, inline
                    pair[0] -= old[BYTES]
                    pair[1] -= 1
                elif not (self.ranges and self._cut_range(addr, row[BYTES])):
                    self.stale_releases += 1
        if reused and len(recs):
            self.lost_releases += reused.expire(int(recs["ts"].max()))

    def _cut_range(self, addr: int, size: int) -> bool:
        for start, row in self.ranges.items():
            end = start + row[BYTES]
            if start <= addr < end:
                del self.ranges[start]
                head = addr - start
                tail = end - (addr + size)
                if head > 0:
                    self.ranges[start] = _with(row, start, head)
                if tail > 0:
                    self.ranges[addr + size] = _with(row, addr + size, tail)
                if head > 0 or tail > 0:
                    self.range_splits += 1
                return True
        return False

    def untracked_records(self, dev: int, nbytes: int, ts: int, pid: int) -> np.ndarray:
        """Records that make the synthetic UNTRACKED entry of ``dev`` hold ``nbytes`` from ``ts`` on
        (a release of the one declared before, an allocation of the new one), queued like any record:
        the table and the daemon apply them at the same watermark. Empty when nothing changes."""
        addr = untracked_address(dev)
        old = self._untracked.get(dev)
        rows: list[Row] = []
        if old is not None and old[BYTES] == nbytes:
            return np.zeros(0, dtype=MEMORY_DTYPE)
        if old is not None:
            rows.append((ts, *old[1:OP], _RELEASE, *old[OP + 1:]))
        if nbytes > 0:
            self._untracked[dev] = (ts, addr, nbytes, 0, 0, 0, 0, pid, dev, 0, 0, 0, _ALLOC,
                                    int(MemoryKind.UNTRACKED), 0, 0)
            rows.append(self._untracked[dev])
        else:
            self._untracked.pop(dev, None)
        arr = np.array(rows, dtype=MEMORY_DTYPE)
        self.add(arr)
        return arr

    def resident_bytes_now(self, dev: int) -> int:
        """``resident_bytes`` with every queued record applied (what the GPU holds now, as far as seen)."""
        total = self.resident_bytes(dev)
        for recs in self.pending:
            total += _resident_change(recs["dev"], recs["mk"], recs["op"], recs["bytes"], dev)
        if len(self.pending_raw):
            structs = self.pending_raw.view()
            total += _resident_change(structs["dev"], structs["mk"] & 0xFF, structs["op"], structs["bytes"], dev)
        return total

    def resident_bytes(self, dev: int, *, exclude_untracked: bool = True) -> int:
        """GPU-resident bytes of ``dev`` in the table (rows by their kept sums: the untracked poll asks every
        ``untracked_ms``, and a walk of every live row held the GIL for it)."""
        def counted(mk: int) -> bool:
            return mk in DEVICE_RESIDENT_KINDS and not (exclude_untracked and mk == MemoryKind.UNTRACKED)

        total = sum(nbytes for (d, mk), (nbytes, _) in self._sums.items() if d == dev and counted(mk))
        for row in self.ranges.values():
            if row[DEV] == dev and counted(row[MK]):
                total += row[BYTES]
        return total

    def live_by_kind(self, dev: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self._all():
            if row[DEV] == dev:
                name = MemoryKind(row[MK]).name.lower() if row[MK] in MemoryKind._value2member_map_ else str(row[MK])
                out[name] = out.get(name, 0) + row[BYTES]
        return {k: v for k, v in out.items() if v}

    def device_bytes_outside(self, dev: int, segments: list) -> int:  # type: ignore[type-arg]
        """Non-async DEVICE bytes of ``dev`` not inside any (dev, addr, size) segment."""
        spans = [(int(a), int(a) + int(s)) for d, a, s in segments if int(d) == dev]
        total = 0
        for row in self._all():
            if (row[DEV] == dev and row[MK] == MemoryKind.DEVICE and not row[IS_ASYNC]
                    and not any(lo <= row[ADDR] < hi for lo, hi in spans)):
                total += row[BYTES]
        return total

    def _all(self) -> list[Row]:
        return [*self.rows.values(), *self.ranges.values()]

    def to_array(self, ts: int) -> np.ndarray:
        """The whole table as allocation records (for RESYNC)."""
        rows = self._all()
        arr = np.zeros(len(rows), dtype=MEMORY_DTYPE)
        for i, row in enumerate(rows):
            arr[i] = row
        return arr

    # --- profiler gap --------------------------------------------------------------

    def split_torch_owned(self, segments: list[tuple[int, int, int]]) -> None:
        """Drop the entries PyTorch's allocator owns (inside ``segments`` = (dev, addr, size))."""
        spans = sorted((a, a + s) for _, a, s in segments)
        starts = [a for a, _ in spans]
        import bisect

        def inside(addr: int) -> bool:
            i = bisect.bisect_right(starts, addr) - 1
            return i >= 0 and addr < spans[i][1]

        self.rows = {a: r for a, r in self.rows.items()
                     if not (r[MK] == MemoryKind.DEVICE and not r[IS_ASYNC] and inside(a))}
        self._recount()
        self.ranges.clear()

    def add_torch_segments(self, segments: list[tuple[int, int, int]], ts: int, pid: int) -> None:
        for dev, addr, size in segments:
            row = (ts, addr, size, 0, 0, 0, 0, pid, dev, 0, 0, 0, _ALLOC, int(MemoryKind.DEVICE), 0, 0)
            old = self.rows.get(addr)
            if old is not None:
                self.rows[addr] = row  # a CUPTI record of it came in after re-arming
                self._gone(old)
                self._came(row)
            else:
                self.ranges[addr] = row


class StructQueue:
    """Structured records back to back in one array that grows by doubling: appending copies a
    CUPTI buffer's structs once, and a watermark reads them all as one view (a list of per-buffer
    copies cost a second copy of every record at each watermark, to concatenate them).

    The queued records are ``_buf[_start:_end]``. What a watermark leaves waiting is, in time order,
    the records of the last flush period, the queue's tail: keeping it moves ``_start``, and the tail
    is moved to the front within the array (a memmove, no new memory) only once the space before it is
    the larger. A copy of all kept records into a fresh array at every watermark (about half a
    watermark's records, 3-7 MB under churn, and its new pages) cost about as much as applying the
    records."""

    _MIN = 1024  # records: the first allocation, and the size it shrinks back towards
    _SHRINK_EVERY = 32  # watermarks: how often a peak far below the array's size lets it shrink

    def __init__(self, dtype: np.dtype) -> None:
        self._buf = np.zeros(0, dtype=dtype)
        self._start = 0
        self._end = 0
        self._peak = 0  # the most records held since the last look at shrinking
        self._emptied = 0  # watermarks (clear or keep) since then

    def __len__(self) -> int:
        return self._end - self._start

    def append(self, structs: np.ndarray) -> None:
        self._make_room(len(structs))
        end = self._end + len(structs)
        if structs.dtype == self._buf.dtype and structs.flags.c_contiguous:
            # as bytes (numpy copies a structured dtype with gaps field by field, about 10x slower), through
            # memoryviews: CPython's copy keeps the GIL, numpy's lets it go past 500 elements, and the sender,
            # behind busy Python threads, would wait a switch interval (5 ms) a buffer to win it back
            size = self._buf.dtype.itemsize
            self._buf.view(np.uint8).data[self._end * size:end * size] = structs.view(np.uint8).data
        else:
            self._buf[self._end:end] = structs
        self._end = end

    def spare(self) -> int:
        """Structs that fit after the queue's end as it is (no move, no growth)."""
        return len(self._buf) - self._end

    def room(self, n: int) -> int:
        """The address of free room for ``n`` more structs at the queue's end, for a writer outside numpy
        (the probe's C read of a buffer); ``commit`` then takes what it wrote into the queue. Valid until
        the next change."""
        self._make_room(n)
        return int(self._buf.ctypes.data) + self._end * int(self._buf.dtype.itemsize)

    def commit(self, n: int) -> np.ndarray:
        """Take ``n`` structs written at ``room``'s address into the queue; returns them (a view)."""
        if self._end + n > len(self._buf):
            raise ValueError(f"StructQueue.commit: {n} structs past the room made ({len(self._buf) - self._end})")
        self._end += n
        return self._buf[self._end - n:self._end]

    def _make_room(self, more: int) -> None:
        n = len(self)
        if self._end + more > len(self._buf):
            if self._start and n + more <= len(self._buf):
                self._move_to_front()
            else:
                grown = np.zeros(max(n + more, 2 * len(self._buf), self._MIN), dtype=self._buf.dtype)
                grown[:n].view(np.uint8)[:] = self._buf[self._start:self._end].view(np.uint8)
                self._buf, self._start, self._end = grown, 0, n

    def _move_to_front(self) -> None:
        if self._start:
            size = self._buf.dtype.itemsize
            data = self._buf.view(np.uint8).data
            # CPython's memoryview copy is a memmove where the two overlap, and keeps the GIL
            data[:(self._end - self._start) * size] = data[self._start * size:self._end * size]
            self._start, self._end = 0, self._end - self._start

    def view(self) -> np.ndarray:
        """Every queued struct, in the order appended (valid until the next change)."""
        return self._buf[self._start:self._end]

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the structs where ``mask`` (over ``view()``), in their order."""
        first = int(np.argmax(mask)) if len(mask) else 0
        if not len(mask) or not mask[first]:
            self.clear()
        elif bool(mask[first:].all()):
            self.drop_front(first)
        else:
            held = len(self)
            rest = select(self.view(), mask)  # as words: numpy takes a struct's 15 fields one by one
            self._start = self._end = 0
            self.append(rest)
            self._after_watermark(held)

    def drop_front(self, n: int) -> None:
        """Drop the first ``n`` structs (a watermark's, applied), keeping the rest where they are."""
        held = len(self)
        if n >= held:
            self._start = self._end = 0
        else:
            self._start += n  # the tail stays where it is
            if self._start > len(self._buf) - self._end:
                # the space before it is the larger: taken back now, while the queue holds only the tail
                # (at the next append it would also move the records queued meanwhile)
                self._move_to_front()
        self._after_watermark(held)

    def clear(self) -> None:
        held = len(self)
        self._start = self._end = 0
        self._after_watermark(held)

    def _after_watermark(self, held: int) -> None:
        # The array is kept between watermarks (growing it again each time costs copies and fresh
        # pages), but after a burst it may be far larger than what now passes through it: every
        # _SHRINK_EVERY watermarks it shrinks to twice the most it held meanwhile.
        self._peak = max(self._peak, held)
        self._emptied += 1
        if self._emptied >= self._SHRINK_EVERY:
            if len(self._buf) > 4 * max(self._peak, self._MIN):
                n = len(self)
                smaller = np.zeros(max(2 * self._peak, self._MIN), dtype=self._buf.dtype)
                smaller[:n].view(np.uint8)[:] = self._buf[self._start:self._end].view(np.uint8)
                self._buf, self._start, self._end = smaller, 0, n
            self._peak = self._emptied = 0


#: Memory kinds that hold GPU memory and that CUPTI reports (the synthetic UNTRACKED one aside).
_SEEN_RESIDENT = np.zeros(256, dtype=bool)
_SEEN_RESIDENT[[int(k) for k in DEVICE_RESIDENT_KINDS if k != MemoryKind.UNTRACKED]] = True


def _resident_change(devs: np.ndarray, kinds: np.ndarray, ops: np.ndarray, sizes: np.ndarray, dev: int) -> int:
    """Bytes by which records (columns of either layout) change ``dev``'s resident memory."""
    mine = (devs == dev) & _SEEN_RESIDENT[kinds]
    sign = np.where(ops[mine] == _ALLOC, 1, np.where(ops[mine] == _RELEASE, -1, 0))
    return int((sign * sizes[mine].astype(np.int64)).sum())


def untracked_address(dev: int) -> int:
    """A fixed address no allocation can have (the top of the 64-bit space)."""
    return 0xFFFF_FFFF_FFFF_0000 | (dev & 0xFFFF)


def _with(row: Row, addr: int, size: int) -> Row:
    r = list(row)
    r[ADDR], r[BYTES] = addr, size
    return tuple(r)
