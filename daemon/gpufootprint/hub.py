"""Where the pipeline hands applied records to the feature frames and the samplers.

The pipeline calls these hooks, always after records were applied to the
footprint in time order: ``open_device`` (a new (pid, device): its frames read
the footprint's ``FramePeaks``), ``on_levels`` (the level changes the footprint
returned), ``on_records`` (a batch of one kind for one device), ``on_watermark``
(a process's records are complete up to a time) and ``on_finish``. Nothing here
calls back into the footprint or the pipeline. Everything works per batch;
nothing touches a record one at a time except the reuse set.

The hub also turns sampler decisions into CONTROL messages for probes
(``flush_interval`` when the interval changes, ``kernel_window`` periodically
and when a burst starts; a launch window is then kept open, lease by lease, until it
has seen ``kernel_window_steps`` steps between waits or reached its bounds:
``_follow_window``) through ``control``, a callback ``App`` wires to the ingest
server's ``send_control``; what was sent and what failed is counted (``controls_sent``,
exported as ``gpufootprint_sampler_controls_total``).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from gpufootprint.config import FeaturesConfig, SamplerConfig
from gpufootprint.features.frames import FrameBuilder
from gpufootprint.footprint.peaks import FramePeaks, LevelChanges
from gpufootprint.records import TIME_FIELD, LaunchSteps, RecordKind
from gpufootprint.sampler.state import ProcessSampler
from gpufootprint.snapshot import AnomalyWindow, DeviceFeatures, SamplerState

log = logging.getLogger(__name__)

ControlSend = Callable[[int, dict[str, Any]], bool]
_MS = 1_000_000
#: A launch window is asked to stay open this much longer each time (the probe closes it by itself when the
#: daemon stops asking: a daemon gone leaves no window open longer than this).
LEASE_MS = 2000
#: ... and asked again once less than this is left of the last lease (watermarks lag the probe's clock).
RENEW_BELOW_MS = 1000


class _FollowedWindow:
    """A launch window the hub keeps open until it has seen enough steps (``FeatureHub._follow_window``)."""

    __slots__ = ("counted", "lease_until_ns", "opened_ns", "wid")

    def __init__(self, wid: int, opened_ns: int, lease_ms: int) -> None:
        self.wid = wid
        self.opened_ns = opened_ns
        self.lease_until_ns = opened_ns + lease_ms * _MS
        self.counted = LaunchSteps()

    def add(self, api: np.ndarray) -> None:
        self.counted.add(api["role"])

    @property
    def records(self) -> int:
        return self.counted.records

    @property
    def steps(self) -> int:
        """Whole steps seen: the part before the first wait may be the end of one that began earlier."""
        return self.counted.steps


#: A probe's count of its windows past which the back-off's gaps are at their ceiling anyway (2^64 doublings).
_MAX_WINDOWS_HAD = 64


class FeatureHub:
    def __init__(self, features: FeaturesConfig | None = None, sampler: SamplerConfig | None = None) -> None:
        self.features_config = features or FeaturesConfig()
        self.config = sampler or SamplerConfig()
        self.builders: dict[tuple[int, int], FrameBuilder] = {}
        self.samplers: dict[int, ProcessSampler] = {}
        self.windows: deque[AnomalyWindow] = deque(maxlen=self.config.max_windows)
        self.window_counts: Counter[str] = Counter()
        self.control: ControlSend | None = None
        self.controls_sent: Counter[tuple[str, str]] = Counter()  # (op, "sent" | "failed")
        self._sent_interval: dict[int, int] = {}
        self._bursts_seen: dict[int, int] = {}
        self._window_due: dict[int, int] = {}  # pid -> watermark time (ns) of its next periodic kernel window
        self._window_last: dict[int, int] = {}  # pid -> watermark time of its last kernel window (its close)
        self._window_opened: dict[int, int] = {}  # pid -> watermark time its last kernel window opened
        self._windows_had: dict[int, int] = {}  # pid -> kernel windows sent so far: the back-off
        self._kernel_window_id = 0
        self._followed: dict[int, _FollowedWindow] = {}  # pid -> its open launch window
        self._torch: dict[int, dict[int, tuple[int | None, int | None]]] = {}
        self._history_part = 1.0  # of the configured history each table keeps (_share_history)
        self.taps: list[Callable[[int, int, RecordKind, np.ndarray], None]] = []
        # (pid, dev) -> (what they were built from, the features): a quiet node's devices cost a lookup a tick.
        # (builder, its changes, sampler, its steps, as of, pool reserved, pool used, the features)
        self._features_kept: dict[tuple[int, int], tuple[FrameBuilder, int, ProcessSampler | None, int, int, int, int,
                                                         DeviceFeatures]] = {}

    # --- hooks the pipeline calls -------------------------------------------------------

    def sampler(self, pid: int) -> ProcessSampler:
        s = self.samplers.get(pid)
        if s is None:
            s = self.samplers[pid] = ProcessSampler(pid, self.config)
        return s

    def open_device(self, pid: int, dev: int, peaks: FramePeaks) -> None:
        """A new (pid, device) in the footprint: its frames read the footprint's ``peaks``."""
        fc = self.features_config
        builder = FrameBuilder(pid, dev, peaks, keep_ns=int(fc.keep_seconds * 1e9),
                               migration_ns=fc.migration_window_ms * _MS, reuse_capacity=fc.reuse_tracked_addresses)
        self.builders[(pid, dev)] = builder
        if self._history_part < 1.0:
            builder.share_history(self._history_part)
        self._share_history()
        self.sampler(pid)
        torch = self._torch.get(pid, {}).get(dev)
        if torch is not None:
            builder.on_torch(*torch)

    def on_levels(self, pid: int, dev: int, levels: LevelChanges) -> None:
        """GPU-resident level changes the footprint just applied (memory records, a resync, an exit)."""
        builder = self.builders.get((pid, dev))
        if builder is None or len(levels.ts) == 0:
            return
        builder.on_levels(levels.ts, levels.deltas, levels.level_after)
        self.sampler(pid).add_levels(levels.ts, levels.deltas, dev)

    def on_records(self, pid: int, dev: int, kind: RecordKind, recs: np.ndarray) -> None:
        for tap in self.taps:  # others that want the applied records (the OOM capture's recent records)
            tap(pid, dev, kind, recs)
        builder = self.builders.get((pid, dev))
        if builder is None:
            return
        if kind is RecordKind.MEMORY:
            builder.on_memory(recs)  # its level changes came through on_levels
            return
        if kind is RecordKind.MEMCPY:
            builder.on_memcpy(recs)
        elif kind is RecordKind.MEMSET:
            builder.on_memset(recs)
        elif kind is RecordKind.UNIFIED_MEMORY:
            builder.on_unified(recs)
        self.sampler(pid).add_events(recs[TIME_FIELD[kind]])

    def on_launches(self, pid: int, api: np.ndarray) -> None:
        """A launch window's calls (RecordKind.API), applied: the open window counts its steps."""
        w = self._followed.get(pid)
        if w is not None and len(api):
            w.add(api)

    def on_watermark(self, pid: int, ts: int, source: str) -> None:
        s = self.samplers.get(pid)
        if s is None:
            return
        s.advance(ts)
        self._after_step(s, source, ts)

    def on_finish(self, pid: int, end: int, source: str) -> None:
        s = self.samplers.get(pid)
        if s is None:
            return
        s.finish(end)
        self._after_step(s, source)

    def forget(self, pid: int) -> None:
        self.samplers.pop(pid, None)
        self._sent_interval.pop(pid, None)
        self._bursts_seen.pop(pid, None)
        self._window_due.pop(pid, None)
        self._window_last.pop(pid, None)
        self._window_opened.pop(pid, None)
        self._windows_had.pop(pid, None)
        self._followed.pop(pid, None)
        self._torch.pop(pid, None)
        for key in [k for k in self.builders if k[0] == pid]:
            del self.builders[key]
            self._features_kept.pop(key, None)
        self._share_history()

    def _share_history(self) -> None:
        """Past ``features.history_tables`` tables, each keeps its part of the configured history, so
        the memory of all histories stays that of ``history_tables`` full ones (a full node has 2,048)."""
        # Divided by the next power of two of the tables: the parts change only when their number
        # doubles or halves (a full node opens 2,048 tables one by one), and never sum past the budget.
        n = len(self.builders)
        part = min(1.0, self.features_config.history_tables / (1 << (n - 1).bit_length())) if n else 1.0
        if part == self._history_part:
            return
        self._history_part = part
        for builder in self.builders.values():
            builder.share_history(part)

    def note_window_closed(self, pid: int, wid: int, end_ns: int) -> None:
        """The probe closed launch window ``wid`` at its count of steps or calls: it is followed no more, so
        the next window (periodic or at a burst) may open, rather than after ``kernel_window_max_ms`` of
        renewals the probe ignores when the daemon's own count falls short (calls refused past a bound)."""
        w = self._followed.get(pid)
        if w is not None and w.wid == wid:
            del self._followed[pid]
            self._window_last[pid] = max(end_ns, w.opened_ns)

    def note_windows_had(self, pid: int, windows: int) -> None:
        """The probe's own count of the windows it has had: after a daemon restart the back-off goes on from
        there (the count only ever raises it; this daemon's own sends count too)."""
        if windows > self._windows_had.get(pid, 0):  # a process the pipeline knows: forgotten with it
            self._windows_had[pid] = min(windows, _MAX_WINDOWS_HAD)

    def note_torch(self, pid: int, torch: Any) -> None:
        """The probe's HEARTBEAT "torch" field: {"allocated": {dev: bytes}, "reserved": {dev: bytes}}."""
        if not isinstance(torch, dict):
            return
        alloc, reserved = torch.get("allocated"), torch.get("reserved")
        if not isinstance(alloc, dict) or not isinstance(reserved, dict):
            return
        per_dev = self._torch.setdefault(pid, {})
        for key in set(alloc) | set(reserved):
            try:
                dev = int(key)
            except (TypeError, ValueError):
                continue
            a, r = alloc.get(key), reserved.get(key)
            pair = (a if isinstance(a, int) else None, r if isinstance(r, int) else None)
            per_dev[dev] = pair
            builder = self.builders.get((pid, dev))
            if builder is not None:
                builder.on_torch(*pair)

    # --- control --------------------------------------------------------------------------

    def _after_step(self, s: ProcessSampler, source: str, now_ns: int | None = None) -> None:
        for w in s.closed_windows:
            self.windows.append(w)
            self.window_counts[w.reason] += 1
        s.closed_windows.clear()
        if source != "probe" or self.control is None or not self.config.control:
            return
        iv_ms = max(1, min(1000, s.interval_ns // _MS))
        if self._sent_interval.get(s.pid) != iv_ms and self._send(s.pid, {"op": "flush_interval", "ms": iv_ms}):
            self._sent_interval[s.pid] = iv_ms
        if self.config.kernel_window_ms and now_ns is not None:
            if s.pid in self._followed:
                self._follow_window(s.pid, now_ns)
            self._kernel_windows(s, now_ns)
        else:
            self._followed.pop(s.pid, None)

    def _follow_window(self, pid: int, now_ns: int) -> None:
        """Keep an open launch window open until it has seen ``kernel_window_steps`` whole steps between
        waits (a training step lasts 50 ms to seconds; a window of fixed length holds none of the long
        ones), bounded by ``kernel_window_max_ms`` from its opening and ``kernel_window_max_records``
        calls; then close it. The probe holds it only as long as the last lease asked (``LEASE_MS``):
        each call the daemon reads costs the workload only while the window is open (no lasting cost,
        probe/launches.py), and a daemon that stops asking leaves none open."""
        cfg = self.config
        w = self._followed[pid]
        elapsed_ms = (now_ns - w.opened_ns) // _MS
        enough = (w.steps >= cfg.kernel_window_steps and elapsed_ms >= cfg.kernel_window_ms) \
            or w.records >= cfg.kernel_window_max_records or elapsed_ms >= cfg.kernel_window_max_ms
        if enough:
            del self._followed[pid]
            self._window_last[pid] = now_ns  # the gap to the next window counts from this one's end
            # 1 ms: the probe closes it at its next step (a window of the same records only moves its end)
            self._send(pid, {"op": "kernel_window", "ms": 1, "id": w.wid, "records": "launches"})
            return
        bound_ns = w.opened_ns + cfg.kernel_window_max_ms * _MS
        if w.lease_until_ns < bound_ns and (w.lease_until_ns - now_ns) // _MS < RENEW_BELOW_MS:
            ms = int(min(LEASE_MS, max(1, cfg.kernel_window_max_ms - elapsed_ms)))
            if self._send(pid, {"op": "kernel_window", "ms": ms, "id": w.wid, **self._launch_count()}):
                w.lease_until_ns = now_ns + ms * _MS

    def _launch_count(self) -> dict[str, Any]:
        """What a launch window's CONTROL says beside its lease: the probe closes the window itself once it
        has counted ``steps`` whole steps or ``max_records`` calls and been open ``min_ms``: the window then
        ends a CUPTI delivery after the last step, not a watermark and a control round trip later."""
        cfg = self.config
        return {"records": "launches", "steps": cfg.kernel_window_steps,
                "max_records": cfg.kernel_window_max_records, "min_ms": cfg.kernel_window_ms}

    def _kernel_windows(self, s: ProcessSampler, now_ns: int) -> None:
        """Open a short window of the probe's launch records (or kernel records): periodically (so every process with
        kernels gets a Graph verdict soon after it starts) and when a burst starts, never closer
        together than ``kernel_window_min_gap_seconds`` (the duty cycle stays low). A burst opens one only when
        none opened in the last ``kernel_window_burst_gap_seconds``: under allocation churn a burst starts
        every second, and while a window is open every launch costs the workload a CUPTI record; windows at
        every burst cost a loop of tiny launches 2.5-5 % (H100, 2026-12-06, docs/performance.md).

        Both gaps double with each window the process has had, up to ``kernel_window_every_max_seconds``: a
        window's per-API switches can leave the launches of threads other than the one that switched (PyTorch's
        backward runs on autograd's) slower for good, more with every window, so what a long job pays is
        bounded by the few windows a back-off gives it (ten in its first hour, then six an hour, against 120)."""
        cfg = self.config
        had = self._windows_had.get(s.pid, 0)
        due = self._window_due.get(s.pid)
        if due is None and cfg.kernel_window_every_seconds > 0:
            due = self._window_due[s.pid] = now_ns + int(cfg.kernel_window_first_seconds * 1e9)
        burst = s.bursts != self._bursts_seen.get(s.pid, 0)
        self._bursts_seen[s.pid] = s.bursts  # one window per step that saw a burst start (one is enough)
        periodic = due is not None and now_ns >= due
        opened = self._window_opened.get(s.pid)
        burst_gap_ns = self._backed_off_ns(cfg.kernel_window_burst_gap_seconds, had - 1)
        if burst and opened is not None and now_ns - opened < burst_gap_ns:
            burst = False  # under churn every second bursts: windows at each would record much of the time
        if not (burst or periodic):
            return
        last = self._window_last.get(s.pid)
        if last is not None and now_ns - last < cfg.kernel_window_min_gap_seconds * 1e9:
            return
        if s.pid in self._followed:
            return  # one is open: it follows the steps
        self._kernel_window_id += 1
        body: dict[str, Any] = {"op": "kernel_window", "ms": cfg.kernel_window_ms, "id": self._kernel_window_id}
        launches = cfg.kernel_window_records == "launches"
        if launches:
            body.update(self._launch_count())  # a probe that does not open them is not sent one (ingest)
            body["ms"] = max(cfg.kernel_window_ms, min(LEASE_MS, cfg.kernel_window_max_ms))
        # Tried, whether or not it went out: a probe that cannot take it (a launch window to one that
        # does not open them, a full socket) is asked again at the next due time, not at every step.
        sent = self._send(s.pid, body)
        if sent and launches:
            self._followed[s.pid] = _FollowedWindow(self._kernel_window_id, now_ns, body["ms"])
        self._window_last[s.pid] = now_ns
        self._window_opened[s.pid] = now_ns
        if sent:  # one that never went out switched nothing in the process: it does not back the next off
            self._windows_had[s.pid] = had + 1
        if periodic:
            self._window_due[s.pid] = now_ns + self._backed_off_ns(cfg.kernel_window_every_seconds, had)

    def _backed_off_ns(self, gap_seconds: float, doublings: int) -> int:
        """``gap_seconds`` doubled ``doublings`` times (none below 0), at most ``kernel_window_every_max_seconds``
        (0: never backed off), never below ``gap_seconds``; a gap of 0 (windows at every burst) stays 0."""
        cap = self.config.kernel_window_every_max_seconds
        if doublings <= 0 or cap <= 0 or gap_seconds <= 0:
            return int(gap_seconds * 1e9)
        return int(max(gap_seconds, min(gap_seconds * 2.0 ** min(doublings, 64), cap)) * 1e9)

    def _send(self, pid: int, body: dict[str, Any]) -> bool:
        assert self.control is not None
        try:
            ok = bool(self.control(pid, body))
        except Exception:
            log.exception("control send failed pid=%d op=%s", pid, body.get("op"))
            ok = False
        self.controls_sent[str(body["op"]), "sent" if ok else "failed"] += 1
        return ok

    def fastest_interval_s(self, pids: Iterable[int] | None = None) -> float | None:
        """The shortest current interval among ``pids`` (all when None): the NVML poll follows it."""
        chosen = self.samplers.values() if pids is None else [self.samplers[p] for p in pids if p in self.samplers]
        ivs = [s.interval_ns for s in chosen if s.cursor is not None]
        return min(ivs) / 1e9 if ivs else None

    # --- output -----------------------------------------------------------------------------

    def device_features(self, pid: int, dev: int, as_of_ns: int, pool_reserved: int,
                        pool_used: int) -> DeviceFeatures | None:
        """The device's features as of ``as_of_ns``, built again only if what they read changed: the table's
        frames and counters (``FrameBuilder.changes``), the sampler's last peaks (its steps), the watermark
        (the migration windows and rate are as of it) or the pool figures. A snapshot asks for every device at
        every tick; a process's records and peaks move only at its watermarks, one a second by default."""
        key = (pid, dev)
        builder = self.builders.get(key)
        if builder is None:
            return None
        s = self.samplers.get(pid)
        steps = s.steps if s is not None else -1
        kept = self._features_kept.get(key)
        if kept is not None:
            k_builder, k_changes, k_sampler, k_steps, k_as_of, k_reserved, k_used, features = kept
            if (k_builder is builder and k_changes == builder.changes and k_sampler is s and k_steps == steps
                    and k_as_of == as_of_ns and k_reserved == pool_reserved and k_used == pool_used):
                return features
        features = self._device_features(builder, s, pid, dev, as_of_ns, pool_reserved, pool_used)
        self._features_kept[key] = (builder, builder.changes, s, steps, as_of_ns, pool_reserved, pool_used, features)
        return features

    @staticmethod
    def _device_features(builder: FrameBuilder, s: ProcessSampler | None, pid: int, dev: int, as_of_ns: int,
                         pool_reserved: int, pool_used: int) -> DeviceFeatures:
        return DeviceFeatures(
            pid=pid, dev=dev,
            frame_peak_bytes=s.last_peak.get(dev) if s is not None else None,
            allocation_reuse_ratio=builder.reuse_ratio,
            pool_utilization_ratio=pool_used / pool_reserved if pool_reserved > 0 else None,
            allocator_slack_bytes=builder.allocator_slack_bytes,
            page_migrations=dict(builder.page_migrations),
            page_faults=dict(builder.page_faults),
            migration_rate_hz=builder.migration_rate_hz(as_of_ns),
            migration_windows=tuple(builder.recent_migration_windows(as_of_ns)),
            reuse_events=builder.reuse.events(),
            device_allocations=builder.reuse.allocations,
        )

    def sampler_states(self) -> tuple[SamplerState, ...]:
        return tuple(SamplerState(pid=s.pid, mode=s.mode, interval_s=s.interval_ns / 1e9, as_of_ns=s.cursor or 0)
                     for _, s in sorted(self.samplers.items()))

    def report(self) -> dict[str, Any]:
        """What ``replay --report-json`` adds: anomaly windows and each process's interval history."""
        return {
            "anomaly_windows": [w.to_json() for w in self.windows],
            "sampler_intervals": {str(pid): s.intervals() for pid, s in sorted(self.samplers.items())},
        }
