"""Packing cupti-python record objects into the record dtypes.

This runs inside CUPTI's buffer-completed callback, on CUPTI's thread, holding
the GIL: it must be short and must never raise. Each record is read duck-typed
(dispatch on ``rec.kind``, never on class names, which change between
cupti-python releases) and written as one tuple into a preallocated structured
array. Full arrays are handed to the sender through ``sink`` and replaced from a
free list the sender refills, so the steady state allocates nothing.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np

from gpufootprint.probe import launches
from gpufootprint.records import DTYPES, LaunchSteps, RecordKind
from gpufootprint.wire import cupti_layout
from gpufootprint.wire.cupti_layout import RAW_DTYPES

# CUPTI_ActivityKind numbers (stable C ABI values; see notes/cupti-api.md).
CUPTI_MEMCPY: Final = cupti_layout.MEMCPY
CUPTI_MEMSET: Final = cupti_layout.MEMSET
CUPTI_KERNEL: Final = cupti_layout.KERNEL
CUPTI_CONCURRENT_KERNEL: Final = cupti_layout.CONCURRENT_KERNEL
CUPTI_MEMCPY2: Final = cupti_layout.MEMCPY2
CUPTI_UNIFIED_MEMORY_COUNTER: Final = cupti_layout.UNIFIED_MEMORY_COUNTER
CUPTI_MEMORY2: Final = cupti_layout.MEMORY2
CUPTI_MEMORY_POOL: Final = cupti_layout.MEMORY_POOL

_POOL_LOCAL: Final = cupti_layout.POOL_LOCAL
_UM_DTOH: Final = cupti_layout.UM_DTOH
_U32: Final = 0xFFFFFFFF

#: (RecordKind, array) handed from the callback to the sender.
Chunk = tuple[RecordKind, np.ndarray]

#: Kinds the object path reads as raw structs through each record's ``ptr``.
_BULK_KINDS: Final = frozenset((CUPTI_MEMORY2, CUPTI_MEMCPY, CUPTI_MEMSET))


class Packer:
    """Owns one partly filled array per record kind; called from CUPTI's thread."""

    def __init__(self, pid: int, sink: Callable[[Chunk], None], *, capacity: int = 4096,
                 spare_arrays: int = 2, bulk: bool = False) -> None:
        self.pid = pid
        # Bulk: read MEMORY2/MEMCPY/MEMSET records as raw structs through their
        # ``ptr`` (one numpy conversion per kind and buffer) instead of ~15
        # attribute reads each. Off for good after the first batch that fails.
        self.bulk = bulk
        self.bulk_records = 0
        self.bulk_fallbacks = 0
        self.capacity = capacity
        self._sink = sink
        self._free: dict[RecordKind, deque[np.ndarray]] = {
            k: deque(np.zeros(capacity, dtype=DTYPES[k]) for _ in range(spare_arrays)) for k in RecordKind
        }
        self._arr: dict[RecordKind, np.ndarray] = {k: self._take(k) for k in RecordKind}
        self._n: dict[RecordKind, int] = {k: 0 for k in RecordKind}
        self._lock = threading.Lock()  # completed() may run on CUPTI's thread and a flushing thread at once
        self.names: dict[str, int] = {}  # kernel name -> id (sent in STRINGS frames)
        self.new_names: list[tuple[int, str]] = []
        self.records_packed = 0
        self.unknown_kinds = 0
        self.api_records = 0  # DRIVER and RUNTIME API records: counted, not sent
        # API records are also handed here (raw bytes with their kind, or cupti-python's objects):
        # failed allocations, probe/oom.py.
        self.on_api_rows: Callable[[np.ndarray, Sequence[int], int], None] | None = None
        self.on_api_objects: Callable[[list[Any]], None] | None = None
        # A launch window's calls (probe/launches.py) go on as RecordKind.API records, stamped with
        # the device the process last allocated on (CUPTI's API record names none).
        self.api_dev = 0
        self.launch_records = 0
        # The open (or closing) launch window's span in CUPTI's clock, (start, end or None while open): its
        # calls go on; calls outside it (at start-up, or while CUPTI is still switching off) do not.
        self.launch_span: tuple[int, int | None] | None = None
        self.launch_records_outside = 0
        # The open launch window's whole steps, counted as its calls are packed (Windows.counted_enough).
        self.launch_steps: LaunchSteps | None = None
        self.bad_records = 0
        self.arrays_allocated = 0
        self._dispatch: dict[int, Callable[[Any], None]] = {
            CUPTI_MEMORY2: self._memory,
            CUPTI_MEMORY_POOL: self._pool,
            CUPTI_MEMCPY: self._memcpy,
            CUPTI_MEMCPY2: self._memcpy2,
            CUPTI_MEMSET: self._memset,
            CUPTI_CONCURRENT_KERNEL: self._kernel,
            CUPTI_KERNEL: self._kernel,
            CUPTI_UNIFIED_MEMORY_COUNTER: self._unified,
        }

    @property
    def host_bytes(self) -> int:
        """Bytes held by the packing arrays (part of the probe's own host cost)."""
        return sum(DTYPES[k].itemsize * self.capacity * (len(self._free[k]) + 1) for k in RecordKind)

    def _take(self, kind: RecordKind) -> np.ndarray:
        free = self._free[kind]
        if free:
            return free.popleft()
        self.arrays_allocated += 1
        return np.zeros(self.capacity, dtype=DTYPES[kind])

    def give_back(self, kind: RecordKind, arr: np.ndarray) -> None:
        """The sender is done with an array: reuse it (called from the sender thread)."""
        if len(arr) == self.capacity and len(self._free[kind]) < 16:
            self._free[kind].append(arr)

    # --- the callback's body -----------------------------------------------------

    def pack(self, records: list[Any]) -> int:
        """Pack every record we know; returns how many were packed. Never raises."""
        done = 0
        with self._lock:
            if self.bulk:
                done = self._pack_bulk(records)
                self.records_packed += done
                return done
            dispatch = self._dispatch
            for rec in records:
                try:
                    fn = dispatch.get(rec.kind)
                    if fn is None:
                        self._skip(rec.kind, 1, rec)
                        continue
                    fn(rec)
                    done += 1
                except Exception:  # noqa: BLE001 - a malformed record must not reach CUPTI
                    self.bad_records += 1
            self.records_packed += done
        return done

    def _pack_bulk(self, records: list[Any]) -> int:
        done = 0
        dispatch = self._dispatch
        groups: dict[int, list[Any]] = {}
        for rec in records:
            try:
                k = rec.kind
                if k in _BULK_KINDS:
                    g = groups.get(k)
                    if g is None:
                        groups[k] = g = []
                    g.append(rec)
                    continue
                fn = dispatch.get(k)
                if fn is None:
                    self._skip(k, 1, rec)
                    continue
                fn(rec)
                done += 1
            except Exception:  # noqa: BLE001
                self.bad_records += 1
        for k, group in groups.items():
            rows = self._convert(k, group) if self.bulk else None
            if rows is None:
                for rec in group:
                    try:
                        dispatch[k](rec)
                        done += 1
                    except Exception:  # noqa: BLE001
                        self.bad_records += 1
                continue
            self._put_rows(cupti_layout.RECORD_KIND[k], rows)
            done += len(rows)
            self.bulk_records += len(rows)
        return done

    def _skip(self, kind: int, n: int, rec: Any = None) -> None:
        if kind in cupti_layout.API_KINDS:
            self.api_records += n
            if rec is not None:
                if self.on_api_objects is not None:
                    self.on_api_objects([rec])
                if self.launch_span is not None:  # nothing to convert while no launch window is open
                    self._put_launches(launches.api_objects([rec], self.pid, self.api_dev))
        else:
            self.unknown_kinds += n

    def launch_window_open(self) -> bool:
        """Whether a launch window takes API records now (``put_launch_rows`` converts none otherwise)."""
        return self.launch_span is not None

    def put_launch_rows(self, u8: np.ndarray, offsets: Sequence[int], kind: int) -> int:
        """A launch window's calls among a forwarded (not packed) buffer's API records (sender thread)."""
        with self._lock:
            return self._launch_rows(u8, offsets, kind)

    def _launch_rows(self, u8: np.ndarray, offsets: Sequence[int], kind: int) -> int:
        # Buffers hold API records with no window open (the OOM records, the mapping hooks, the start-up's
        # launch calls): none of them is converted then.
        if self.launch_span is None:
            return 0
        return self._put_launches(launches.api_records(u8, offsets, kind, self.pid, self.api_dev))

    def _put_launches(self, rows: np.ndarray) -> int:
        span = self.launch_span
        if span is None:
            self.launch_records_outside += len(rows)
            return 0
        inside = rows["start"] >= np.uint64(span[0])
        if span[1] is not None:
            inside &= rows["start"] <= np.uint64(span[1])
        if not inside.all():
            self.launch_records_outside += int(np.count_nonzero(~inside))
            rows = rows[inside]
        if len(rows):
            self._put_rows(RecordKind.API, rows)
            self.launch_records += len(rows)
            counted = self.launch_steps  # read once: with object delivery this runs on CUPTI's thread
            if counted is not None:
                counted.add(rows["role"])
        return len(rows)

    def _put_rows(self, kind: RecordKind, rows: np.ndarray) -> None:
        i, n_rows = 0, len(rows)
        while i < n_rows:
            n = self._n[kind]
            take = min(self.capacity - n, n_rows - i)
            self._arr[kind][n:n + take] = rows[i:i + take]
            i += take
            self._n[kind] = n + take
            if n + take == self.capacity:
                self._handoff(kind)

    def pack_raw(self, buf: memoryview, valid: int, offsets: Mapping[int, Sequence[int]]) -> int:
        """Records of one CUPTI buffer, already walked (sender thread); returns how many were packed."""
        u8 = np.frombuffer(buf, dtype=np.uint8, count=valid)
        done = 0
        with self._lock:
            # API records last: they are stamped with the device this buffer's allocations name
            for k, offs in sorted(offsets.items(), key=lambda kv: kv[0] in cupti_layout.API_KINDS):
                if k not in cupti_layout.RECORD_KIND:
                    self._skip(k, len(offs))
                    if k in cupti_layout.API_KINDS:
                        try:
                            if self.on_api_rows is not None:
                                self.on_api_rows(u8, offs, k)
                            done += self._launch_rows(u8, offs, k)
                        except Exception:  # noqa: BLE001 - a malformed record must not stop the buffer
                            self.bad_records += len(offs)
                    continue
                try:
                    src = cupti_layout.gather(u8, k, offs)
                    names: dict[int, int] = {}  # name pointer -> id, this buffer only
                    # The lambda sees this iteration's ``names``: convert() calls it before the loop moves on.
                    name_id = (lambda p: self._name_id(names, p)) if k in _KERNEL_KINDS else None  # noqa: B023
                    rows = cupti_layout.convert(k, src, self.pid, name_id)
                except Exception:  # noqa: BLE001 - a malformed buffer loses its records, counted
                    self.bad_records += len(offs)
                    continue
                self._put_rows(cupti_layout.RECORD_KIND[k], rows)
                if k == CUPTI_MEMORY2 and len(rows):
                    self.api_dev = int(rows["dev"][-1])
                done += len(rows)
            self.records_packed += done
        return done

    def _name_id(self, cache: dict[int, int], address: int) -> int:
        nid = cache.get(address)
        if nid is None:
            cache[address] = nid = self._intern(c_string(address))
        return nid

    def _intern(self, name: str) -> int:
        nid = self.names.get(name)
        if nid is None:
            nid = len(self.names) + 1
            self.names[name] = nid
            self.new_names.append((nid, name))
        return nid

    def _convert(self, k: int, group: list[Any]) -> np.ndarray | None:
        """Raw structs -> our dtype, or None (and bulk off) when they disagree with the attributes."""
        raw_dt = RAW_DTYPES[k]
        try:
            size = raw_dt.itemsize
            src = np.frombuffer(b"".join([ctypes.string_at(r.ptr, size) for r in group]), dtype=raw_dt)
            first, last = group[0], group[-1]
            if k == CUPTI_MEMORY2:
                ok = all(int(src[j]["timestamp"]) == r.timestamp and int(src[j]["address"]) == r.address
                         and int(src[j]["bytes"]) == r.bytes for j, r in ((0, first), (-1, last)))
            else:
                ok = all(int(src[j]["start"]) == r.start and int(src[j]["bytes"]) == r.bytes
                         for j, r in ((0, first), (-1, last)))
            if not ok:
                raise ValueError("raw struct disagrees with the record's attributes")
            return cupti_layout.convert(k, src, self.pid)
        except Exception:  # noqa: BLE001 - no ptr (fakes), another layout: attributes from now on
            self.bulk = False
            self.bulk_fallbacks += 1
            return None

    def flush(self) -> None:
        """Hand every partly filled array to the sink (sender thread, under the lock)."""
        with self._lock:
            for kind in RecordKind:
                self._handoff(kind)

    def _handoff(self, kind: RecordKind) -> None:
        n = self._n[kind]
        if n == 0:
            return
        arr = self._arr[kind]
        self._arr[kind] = self._take(kind)
        self._n[kind] = 0
        self._sink((kind, arr[:n] if n < self.capacity else arr))

    def _put(self, kind: RecordKind, row: tuple[Any, ...]) -> None:
        n = self._n[kind]
        self._arr[kind][n] = row
        n += 1
        self._n[kind] = n
        if n == self.capacity:
            self._handoff(kind)

    def _memory(self, r: Any) -> None:
        is_async = r.is_async
        pool_type = pool_addr = pool_thresh = pool_size = pool_used = 0
        if is_async:
            cfg = r.memory_pool_config
            pool_type = cfg.memory_pool_type
            if pool_type:
                pool_addr = cfg.address
                pool_thresh = cfg.release_threshold
                pool_used = cfg.utilized_size
                if pool_type == _POOL_LOCAL:
                    pool_size = cfg.pool.size_
        self._put(RecordKind.MEMORY, (
            r.timestamp, r.address, r.bytes, pool_addr, pool_thresh, pool_size, pool_used,
            self.pid, r.device_id, r.context_id & _U32, r.stream_id & _U32, r.correlation_id,
            r.memory_operation_type, r.memory_kind, 1 if is_async else 0, pool_type,
        ))

    def _pool(self, r: Any) -> None:
        local = r.memory_pool_type == _POOL_LOCAL
        self._put(RecordKind.MEMORY_POOL, (
            r.timestamp, r.address, r.size_ if local else 0, r.utilized_size if local else 0,
            r.release_threshold if local else 0, r.min_bytes_to_keep, self.pid, r.device_id,
            r.correlation_id, r.memory_pool_operation_type, r.memory_pool_type, 0,
        ))

    def _memcpy(self, r: Any) -> None:
        dev = r.device_id
        self._put(RecordKind.MEMCPY, (
            r.start, r.end, r.bytes, self.pid, dev, dev, dev, r.context_id & _U32, r.stream_id & _U32,
            r.correlation_id, r.graph_id, r.copy_kind, r.src_kind, r.dst_kind, 0,
        ))

    def _memcpy2(self, r: Any) -> None:
        self._put(RecordKind.MEMCPY, (
            r.start, r.end, r.bytes, self.pid, r.device_id, r.src_device_id, r.dst_device_id,
            r.context_id & _U32, r.stream_id & _U32, r.correlation_id, r.graph_id,
            r.copy_kind, r.src_kind, r.dst_kind, 0,
        ))

    def _memset(self, r: Any) -> None:
        self._put(RecordKind.MEMSET, (
            r.start, r.end, r.bytes, self.pid, r.device_id, r.stream_id & _U32, r.correlation_id,
            r.memory_kind, 0,
        ))

    def _kernel(self, r: Any) -> None:
        nid = self._intern(r.name)
        self._put(RecordKind.KERNEL, (
            r.start, r.end, r.graph_node_id, self.pid, r.device_id, r.stream_id & _U32,
            r.correlation_id, r.graph_id, nid,
        ))

    def _unified(self, r: Any) -> None:
        ck = r.counter_kind
        src, dst = r.src_id & _U32, r.dst_id & _U32
        self._put(RecordKind.UNIFIED_MEMORY, (
            r.start, r.end, r.value, r.address, self.pid, src if ck == _UM_DTOH else dst, src, dst, ck, 0,
        ))

    def take_new_names(self) -> list[tuple[int, str]]:
        with self._lock:
            names, self.new_names = self.new_names, []
        return names


_KERNEL_KINDS: Final = frozenset((CUPTI_CONCURRENT_KERNEL, CUPTI_KERNEL))


def c_string(address: int) -> str:
    """A NUL-terminated C string CUPTI owns (a kernel's name); '' for NULL."""
    if not address:
        return ""
    return ctypes.string_at(address).decode("utf-8", "replace")
