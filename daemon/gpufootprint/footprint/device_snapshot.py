"""How one device's footprint reads in a snapshot: ``DeviceSnapshot`` and its live table.

The footprint owns these conversions (the pipeline only decides when to take a
snapshot), so the snapshot's picture of a device is written next to the table
it copies.
"""

from __future__ import annotations

from itertools import compress

import numpy as np

from gpufootprint.footprint.table import LIVE_BYTES, LIVE_KIND, LIVE_TS, DeviceFootprint
from gpufootprint.records import MEMORY_KIND_NAMES
from gpufootprint.snapshot import DeviceSnapshot

LIVE_TABLE_DTYPE = np.dtype([("ts", "<u8"), ("bytes", "<u8"), ("mk", "u1")])


def live_table(fp: DeviceFootprint) -> np.ndarray:
    """The live allocations as an array (``DeviceSnapshot.live_table``: leak suspicion reads their ages)."""
    n = len(fp.live)
    table = np.empty(n, LIVE_TABLE_DTYPE)
    if n:
        entries = fp.live.values()
        table["ts"] = np.fromiter((a[LIVE_TS] for a in entries), np.uint64, n)
        table["bytes"] = np.fromiter((a[LIVE_BYTES] for a in entries), np.uint64, n)
        table["mk"] = np.fromiter((a[LIVE_KIND] for a in entries), np.uint8, n)
    table.flags.writeable = False
    return table


#: Each memory kind's label by its number (the per-kind lists hold 32), read by index.
_LABELS = [MEMORY_KIND_NAMES.get(k, str(k)) for k in range(32)]


def by_kind_name(values: list[int]) -> dict[str, int]:
    """A per-kind list (indexed by memory kind) as {kind name: value} of the kinds whose value is not 0,
    in kind order. The zeros (most of the 32 kinds) are skipped by ``compress`` in C, not one by one in
    a comprehension: a MARK reads the live bytes so, and every snapshot five such lists a device."""
    labels = _LABELS if len(values) <= len(_LABELS) else [MEMORY_KIND_NAMES.get(k, str(k)) for k in range(len(values))]
    return {labels[k]: v for k, v in compress(enumerate(values), values)}


def live_bytes(fp: DeviceFootprint) -> dict[str, int]:
    """Live bytes by memory kind name, the kinds holding any: ``DeviceSnapshot.live_bytes``."""
    return by_kind_name(fp.live_by_kind)


def mark_state(fp: DeviceFootprint, as_of: int, window_ns: int) -> tuple[dict[str, int], int, int]:
    """What a MARK reports of the device (live bytes by kind, pool reserved bytes, window peak): the
    snapshot's figures, without the rest of the snapshot (about 13 us a mark, for three of its fields)."""
    return live_bytes(fp), fp.pool_reserved_bytes, fp.peaks.window_peak(as_of, window_ns)


def device_snapshot(fp: DeviceFootprint, as_of: int, window_ns: int,
                     live_table: np.ndarray | None = None) -> DeviceSnapshot:
    live = live_bytes(fp)
    return DeviceSnapshot(
        dev=fp.dev,
        live_bytes=live,
        device_bytes=fp.device_bytes,
        async_device_bytes=fp.async_device_bytes,
        pool_reserved_bytes=fp.pool_reserved_bytes,
        pool_used_bytes=fp.async_device_bytes,
        window_peak_bytes=fp.peaks.window_peak(as_of, window_ns),
        live_allocations=len(fp.live),
        allocations=by_kind_name(fp.allocations),
        releases=by_kind_name(fp.releases),
        allocated_bytes=by_kind_name(fp.allocated_bytes),
        released_bytes=by_kind_name(fp.released_bytes),
        memcpy_count=dict(fp.memcpy_count),
        memcpy_bytes=dict(fp.memcpy_bytes),
        memcpy_seconds={k: v / 1e9 for k, v in fp.memcpy_ns.items()},
        peer_copy_bytes=dict(fp.peer_copy_bytes),
        memset_count=fp.memset_count,
        memset_bytes=fp.memset_bytes,
        kernel_count=fp.kernel_count,
        kernel_seconds=fp.kernel_ns / 1e9,
        um_count=dict(fp.um_count),
        um_value=dict(fp.um_value),
        live_table=live_table,
    )
