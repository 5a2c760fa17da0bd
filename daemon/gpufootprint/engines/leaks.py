"""Leak suspicion: sustained growth of the footprint, made of allocations that stay.

Per process and GPU, from the GPU-resident footprint sampled at each snapshot
(against the process's own watermark, so replays judge by trace time):

* **warm-up**: no verdict in the process's first ``warmup_seconds`` (start-up
  allocations, a caching allocator filling its pool);
* **sustained growth**: the trailing ``growth_window_seconds`` are cut into
  ``growth_segments``; the *floor* (lowest sample) of each segment must rise from
  one segment to the next in at least ``min_rising_share`` of the steps, and the
  least-squares slope must be at least ``min_growth_bytes_per_second``. A single
  step up (a second model loaded) raises one floor, not most of them; spiky
  training raises peaks, not floors;
* **onset**: the start of the first segment whose floor the growth raised; it is
  kept while the growth lasts and forgotten when it stops;
* **suspect allocations**: live allocations (device, array, managed) made at or
  after the onset and at least ``min_age_seconds`` old: the growth is made of
  them and they stayed. At least ``min_suspect_bytes`` of them make a suspect.

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
        self.first_seen: dict[tuple[int, int], int] = {}  # trace ns of the first snapshot with the process
        self.onsets: dict[tuple[int, int], int] = {}  # trace ns where the current growth began
        # Devices whose growth had an onset within the last growth window (trace ns of the latest): only their
        # allocation ages are read. The daemon's pipeline builds the live tables of these alone
        # (``wants_table``), so a table may come one snapshot after a first onset. Kept a window after the
        # latest onset: a growth whose test passes only now and then (a slope at the threshold) is judged at
        # every passing snapshot, as with every table built.
        self.wanted: dict[tuple[int, int], int] = {}

    def wants_table(self, pid: int, dev: int) -> bool:
        """Whether the next snapshot should carry ``pid``'s live table on ``dev`` (its growth had an onset
        within the last growth window)."""
        return (pid, dev) in self.wanted

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
                trend = self.trends.get(key)
                if trend is None:  # (not setdefault: its argument, a new Trend, would be built at every call)
                    trend = self.trends[key] = Trend(cfg.growth_window_seconds)
                if now_ns:
                    trend.add(now_ns / 1e9, float(dev.device_bytes))
                    self.first_seen.setdefault(key, now_ns)
                out.append(self._judge(proc.pid, proc.source, dev.dev, dev.live_table, trend, now_ns, key))
        for key in list(self.trends):
            if key not in keep:
                del self.trends[key]
                self.first_seen.pop(key, None)
                self.onsets.pop(key, None)
                self.wanted.pop(key, None)
        return tuple(out)

    def _judge(self, pid: int, source: str, dev: int, table: np.ndarray | None, trend: Trend, now_ns: int,
               key: tuple[int, int]) -> LeakStatus:
        cfg = self.cfg
        slope = trend.slope(cfg.min_trend_points)
        age = (now_ns - self.first_seen.get(key, now_ns)) / 1e9
        if age < cfg.warmup_seconds:
            self.onsets.pop(key, None)
            self.wanted.pop(key, None)
            return LeakStatus(pid, source, dev, False, 0, 0, slope,
                              (f"warm-up: no verdict in the first {cfg.warmup_seconds:g} s (at {age:.0f} s)",))
        reasons: list[str] = []
        covered = trend.covered_seconds >= cfg.growth_window_seconds * (1 - 1 / cfg.growth_segments)
        onset: int | None = None
        if not covered or slope is None:
            sustained = False
            reasons.append(f"fail: footprint trend needs {cfg.min_trend_points} samples over "
                           f"{cfg.growth_window_seconds * (1 - 1 / cfg.growth_segments):g} s (have "
                           f"{len(trend)} over {trend.covered_seconds:.1f} s)")
        elif slope < cfg.min_growth_bytes_per_second:
            # Too slow whatever the floors do: not walked (most devices, at every snapshot, past the warm-up).
            sustained = False
            reasons.append(f"fail: footprint grows {slope:.0f} B/s (threshold {cfg.min_growth_bytes_per_second:g} "
                           f"B/s)")
        else:
            rising, steps, onset = _rising_floors(trend, cfg.growth_window_seconds, cfg.growth_segments)
            sustained = steps > 0 and rising / steps >= cfg.min_rising_share
            reasons.append(f"{'pass' if sustained else 'fail'}: footprint grows {slope:.0f} B/s with its floor "
                           f"rising in {rising} of {steps} segments (thresholds {cfg.min_growth_bytes_per_second:g} "
                           f"B/s, {cfg.min_rising_share:.0%})")
        if sustained and onset is not None:
            onset = min(onset, self.onsets.get(key, onset))
            self.onsets[key] = onset
        else:
            self.onsets.pop(key, None)
            onset = None
        if onset is None:
            if now_ns - self.wanted.get(key, now_ns) > cfg.growth_window_seconds * 1e9:
                del self.wanted[key]
            return LeakStatus(pid, source, dev, False, 0, 0, slope, tuple(reasons))
        self.wanted[key] = now_ns
        if table is None:  # not built for this snapshot: asked for from the next one on
            reasons.append("allocation ages unknown (the live table is not in this snapshot)")
            return LeakStatus(pid, source, dev, False, 0, 0, slope, tuple(reasons))
        cutoff = now_ns - int(cfg.min_age_seconds * 1e9)
        ts = table["ts"].astype(np.int64)
        old = table[(ts >= onset) & (ts <= cutoff) & np.isin(table["mk"], _LEAK_KINDS)]
        old_bytes = int(old["bytes"].sum())
        big = old_bytes >= cfg.min_suspect_bytes and old_bytes > 0
        reasons.append(f"{'pass' if big else 'fail'}: {old_bytes} B in {len(old)} allocations made since the "
                       f"growth began {(now_ns - onset) / 1e9:.0f} s ago and older than {cfg.min_age_seconds:g} s "
                       f"(threshold {cfg.min_suspect_bytes} B)")
        return LeakStatus(pid, source, dev, big, old_bytes, len(old), slope, tuple(reasons),
                          _sites(old, cfg.top_sites))


def _rising_floors(trend: Trend, window: float, segments: int) -> tuple[int, int, int | None]:
    """(steps whose floor rose, steps, onset ns): segment floors over the trailing window.

    The onset is the start of the segment before the first rise of the trailing
    run in which the floor rose in most steps; None when it never rose.
    """
    if len(trend) < 2:
        return 0, 0, None
    t, v = trend.times, trend.values
    end = float(t[-1])
    start = end - window
    width = window / segments
    # Each sample's segment (times rise, so each segment's samples lie together), then each segment's floor.
    # (The ufuncs, not ``np.clip`` and ``np.flatnonzero``: their wrappers cost more than the work at every snapshot.)
    seg = ((t - start) / width).astype(np.int64)
    np.maximum(seg, 0, out=seg)
    np.minimum(seg, segments - 1, out=seg)
    first = np.concatenate(([0], (seg[1:] != seg[:-1]).nonzero()[0] + 1))
    floors = np.minimum.reduceat(v, first)
    ups = floors[1:] > floors[:-1]
    onset = None
    if ups.any():
        onset = int((start + int(seg[first[int(np.argmax(ups))]]) * width) * 1e9)
    return int(np.count_nonzero(ups)), len(ups), onset


def _sites(old: np.ndarray, top: int) -> tuple[LeakSite, ...]:
    if len(old) == 0:
        return ()
    keys = np.stack([old["mk"].astype(np.uint64), old["bytes"].astype(np.uint64)], axis=1)
    uniq, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    totals = np.bincount(inverse.ravel(), weights=old["bytes"].astype(np.float64), minlength=len(uniq))
    order = np.lexsort((uniq[:, 1], -totals))[:top]
    return tuple(LeakSite(MEMORY_KIND_NAMES.get(int(uniq[i, 0]), str(int(uniq[i, 0]))), int(uniq[i, 1]),
                          int(counts[i]), int(totals[i])) for i in order)
