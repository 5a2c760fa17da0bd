"""Leak suspicion: old allocations while the footprint keeps growing.

Per process and GPU: the bytes of live allocations older than ``min_age_seconds``
(from the live table's allocation timestamps, measured against the process's
own watermark, so replays judge by trace time) and the least-squares growth of
the GPU-resident footprint over ``growth_window_seconds``. A process is a
suspect when both hold: old bytes >= ``min_suspect_bytes`` and growth >=
``min_growth_bytes_per_second`` over a window that is at least half covered.

Allocation sites: the record model carries no call site (CUPTI's allocation
source is not part of MEMORY2 records as the probe packs them), so a site is the
allocation's signature, memory kind and size; the largest groups are reported.
Module globals (device_static) live for the whole process by design and are
never suspects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpufootprint.config import LeaksConfig
from gpufootprint.engines import inputs
from gpufootprint.engines.trend import Trend
from gpufootprint.records import MEMORY_KIND_NAMES, MemoryKind
from gpufootprint.snapshot import PipelineSnapshot

_LEAK_KINDS = np.array([MemoryKind.DEVICE, MemoryKind.ARRAY, MemoryKind.MANAGED], dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class LeakSite:
    kind: str
    bytes_each: int
    count: int
    bytes: int

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.bytes_each}B"


@dataclass(frozen=True, slots=True)
class LeakStatus:
    pid: int
    source: str
    dev: int
    suspect: bool
    suspect_bytes: int  # live bytes older than min_age_seconds
    old_allocations: int
    growth_bytes_per_second: float | None
    reasons: tuple[str, ...]
    top_sites: tuple[LeakSite, ...] = ()


class LeakTracker:
    def __init__(self, cfg: LeaksConfig) -> None:
        self.cfg = cfg
        self.trends: dict[tuple[int, int], Trend] = {}

    def evaluate(self, snap: PipelineSnapshot) -> tuple[LeakStatus, ...]:
        cfg = self.cfg
        out: list[LeakStatus] = []
        keep: set[tuple[int, int]] = set()
        for proc in snap.processes:
            if not inputs.live(proc):
                continue  # the driver freed everything when it exited
            now_ns = proc.as_of_ns
            for dev in proc.devices:
                key = (proc.pid, dev.dev)
                keep.add(key)
                trend = self.trends.setdefault(key, Trend(cfg.growth_window_seconds))
                if now_ns:
                    trend.add(now_ns / 1e9, float(dev.device_bytes))
                slope = trend.slope(cfg.min_trend_points)
                covered = trend.covered_seconds >= cfg.growth_window_seconds / 2
                table = dev.live_table
                if table is None:
                    out.append(LeakStatus(proc.pid, proc.source, dev.dev, False, 0, 0, slope,
                                          ("allocation ages unknown (live tables are not in the snapshot)",)))
                    continue
                cutoff = now_ns - int(cfg.min_age_seconds * 1e9)
                old = table[(table["ts"].astype(np.int64) <= cutoff) & np.isin(table["mk"], _LEAK_KINDS)]
                old_bytes = int(old["bytes"].sum())
                reasons: list[str] = []
                big = old_bytes >= cfg.min_suspect_bytes and old_bytes > 0
                growing = slope is not None and covered and slope >= cfg.min_growth_bytes_per_second
                reasons.append(f"{'pass' if big else 'fail'}: {old_bytes} B in {len(old)} allocations older than "
                               f"{cfg.min_age_seconds:g} s (threshold {cfg.min_suspect_bytes} B)")
                if slope is None or not covered:
                    reasons.append(f"fail: footprint trend needs {cfg.min_trend_points} samples over at least "
                                   f"{cfg.growth_window_seconds / 2:g} s (have {len(trend.points)} over "
                                   f"{trend.covered_seconds:.1f} s)")
                else:
                    reasons.append(f"{'pass' if growing else 'fail'}: footprint grows {slope:.0f} B/s "
                                   f"(threshold {cfg.min_growth_bytes_per_second:g} B/s)")
                out.append(LeakStatus(proc.pid, proc.source, dev.dev, big and growing, old_bytes, len(old), slope,
                                      tuple(reasons), _sites(old, cfg.top_sites)))
        for key in list(self.trends):
            if key not in keep:
                del self.trends[key]
        return tuple(out)


def _sites(old: np.ndarray, top: int) -> tuple[LeakSite, ...]:
    if len(old) == 0:
        return ()
    keys = np.stack([old["mk"].astype(np.uint64), old["bytes"].astype(np.uint64)], axis=1)
    uniq, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    totals = np.bincount(inverse.ravel(), weights=old["bytes"].astype(np.float64), minlength=len(uniq))
    order = np.lexsort((uniq[:, 1], -totals))[:top]
    return tuple(LeakSite(MEMORY_KIND_NAMES.get(int(uniq[i, 0]), str(int(uniq[i, 0]))), int(uniq[i, 1]),
                          int(counts[i]), int(totals[i])) for i in order)
