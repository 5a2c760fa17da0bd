"""The exact footprint of one process on one device.

Records arrive here already in time order (the reorder buffer in ingest sees to
that). Every allocation enters the live table keyed by address; every release
leaves it. Live bytes by memory kind, the stream-ordered pool sizes and the
per-frame peaks all follow from that table, so the numbers are exact to the byte.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.records import DEVICE_RESIDENT_KINDS, MemoryOp, PoolOp

log = logging.getLogger(__name__)

_N_KINDS = 32  # memory kinds are small integers; indexes into the per-kind arrays
_RESIDENT = np.zeros(_N_KINDS, dtype=bool)
_RESIDENT[list(DEVICE_RESIDENT_KINDS)] = True


class IngestErrors:
    """Counts records that break the model, and logs each reason once."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, reason: str, detail: str, n: int = 1) -> None:
        if reason not in self.counts:
            log.warning("ingest error reason=%s %s (further ones are counted, not logged)", reason, detail)
        self.counts[reason] += n


@dataclass(slots=True)
class LiveAllocation:
    bytes: int
    kind: int
    ts: int  # allocation time, for leak suspicion
    is_async: bool


@dataclass
class DeviceFootprint:
    pid: int
    dev: int
    peaks: FramePeaks
    live: dict[int, LiveAllocation] = field(default_factory=dict)
    live_by_kind: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    async_device_bytes: int = 0
    pools: dict[int, tuple[int, int]] = field(default_factory=dict)  # pool addr -> (reserved, used)
    allocations: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    releases: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    allocated_bytes: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    released_bytes: list[int] = field(default_factory=lambda: [0] * _N_KINDS)
    memcpy_count: Counter[int] = field(default_factory=Counter)  # by copy kind
    memcpy_bytes: Counter[int] = field(default_factory=Counter)
    memcpy_ns: Counter[int] = field(default_factory=Counter)
    memset_count: int = 0
    memset_bytes: int = 0
    kernel_count: int = 0
    kernel_ns: int = 0
    um_count: Counter[int] = field(default_factory=Counter)  # by UM counter kind
    um_value: Counter[int] = field(default_factory=Counter)
    last_ts: int = 0

    # --- memory -------------------------------------------------------------

    def apply_memory(self, recs: np.ndarray, errors: IngestErrors) -> None:
        """Apply MEMORY records of this (pid, dev), sorted by timestamp."""
        live = self.live
        by_kind = self.live_by_kind
        ts_list = recs["ts"].tolist()
        ops = recs["op"].tolist()
        addrs = recs["addr"].tolist()
        sizes = recs["bytes"].tolist()
        kinds = recs["mk"].tolist()
        asyncs = recs["is_async"].tolist()
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
                    # A second allocation at a live address: the release was lost.
                    # Replace the old entry so the table stays one-per-address.
                    errors.add("double_allocation", f"pid={self.pid} dev={self.dev} addr={addr:#x}")
                    by_kind[old.kind] -= old.bytes
                    if old.is_async:
                        self.async_device_bytes -= old.bytes
                    if _RESIDENT[old.kind]:
                        deltas[i] -= old.bytes
                live[addr] = LiveAllocation(size, kind, ts_list[i], bool(asyncs[i]))
                by_kind[kind] += size
                self.allocations[kind] += 1
                self.allocated_bytes[kind] += size
                if asyncs[i]:
                    self.async_device_bytes += size
                if _RESIDENT[kind]:
                    deltas[i] += size
            elif op == release_op:
                entry = live.pop(addr, None)
                if entry is None:
                    errors.add("release_without_allocation", f"pid={self.pid} dev={self.dev} addr={addr:#x}")
                    continue
                if entry.bytes != sizes[i] and sizes[i]:
                    errors.add("release_size_mismatch",
                               f"pid={self.pid} addr={addr:#x} allocated {entry.bytes} released {sizes[i]}")
                kind = entry.kind
                by_kind[kind] -= entry.bytes
                self.releases[kind] += 1
                self.released_bytes[kind] += entry.bytes
                if entry.is_async:
                    self.async_device_bytes -= entry.bytes
                if _RESIDENT[kind]:
                    deltas[i] -= entry.bytes
            else:
                errors.add("unknown_memory_op", f"pid={self.pid} memory operation {op}")
        self.peaks.add(recs["ts"], np.asarray(deltas, dtype=np.int64))
        if ts_list:
            self.last_ts = max(self.last_ts, ts_list[-1])

    def replace_live(self, recs: np.ndarray, ts: int, errors: IngestErrors) -> None:
        """A resync: the probe's whole live table replaces ours as of ``ts``."""
        self.live.clear()
        self.live_by_kind = [0] * _N_KINDS
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
            self.live[addr] = LiveAllocation(size, kind, rts, bool(is_async))
            self.live_by_kind[kind] += size
            if is_async:
                self.async_device_bytes += size
        self.peaks.reset(ts, self.device_bytes)

    @property
    def device_bytes(self) -> int:
        """Bytes resident on the GPU: the quantity whose window peak is tracked."""
        return sum(b for k, b in enumerate(self.live_by_kind) if _RESIDENT[k])

    def release_all(self, ts: int) -> None:
        """The process exited: the driver freed everything it held."""
        self.live.clear()
        self.live_by_kind = [0] * _N_KINDS
        self.async_device_bytes = 0
        self.pools.clear()
        self.peaks.reset(ts, 0)

    # --- pools, copies, sets, kernels, unified memory ---------------------------

    def apply_pool(self, recs: np.ndarray, errors: IngestErrors) -> None:
        for op, addr, size, used in zip(recs["op"].tolist(), recs["addr"].tolist(),
                                        recs["size"].tolist(), recs["used"].tolist()):
            if op in (PoolOp.CREATED, PoolOp.TRIMMED):
                self.pools[addr] = (size, used)
            elif op == PoolOp.DESTROYED:
                self.pools.pop(addr, None)
            else:
                errors.add("unknown_pool_op", f"pid={self.pid} pool operation {op}")

    def note_pool_config(self, recs: np.ndarray) -> None:
        """MEMORY2 records of stream-ordered allocations carry their pool's size and use."""
        mask = (recs["pool_addr"] != 0) & (recs["pool_size"] != 0)
        if mask.any():
            for addr, size, used in zip(recs["pool_addr"][mask].tolist(), recs["pool_size"][mask].tolist(),
                                        recs["pool_used"][mask].tolist()):
                self.pools[addr] = (size, used)

    def apply_memcpy(self, recs: np.ndarray) -> None:
        ck = recs["ck"]
        dur = (recs["end"].astype(np.int64) - recs["start"].astype(np.int64)).clip(min=0)
        kinds = np.unique(ck)
        for k in kinds.tolist():
            sel = ck == k
            self.memcpy_count[k] += int(sel.sum())
            self.memcpy_bytes[k] += int(recs["bytes"][sel].sum())
            self.memcpy_ns[k] += int(dur[sel].sum())

    def apply_memset(self, recs: np.ndarray) -> None:
        self.memset_count += len(recs)
        self.memset_bytes += int(recs["bytes"].sum())

    def apply_kernel(self, recs: np.ndarray) -> None:
        self.kernel_count += len(recs)
        self.kernel_ns += int((recs["end"].astype(np.int64) - recs["start"].astype(np.int64)).clip(min=0).sum())

    def apply_unified(self, recs: np.ndarray) -> None:
        ck = recs["ck"]
        for k in np.unique(ck).tolist():
            sel = ck == k
            self.um_count[k] += int(sel.sum())
            self.um_value[k] += int(recs["value"][sel].sum())

    @property
    def pool_reserved_bytes(self) -> int:
        return sum(r for r, _ in self.pools.values())

    @property
    def pool_used_bytes(self) -> int:
        return sum(u for _, u in self.pools.values())
