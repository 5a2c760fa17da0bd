"""The adaptive sampler on synthetic and replayed traces: bursts, windows, back-off, control."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpufootprint.config import FootprintConfig, SamplerConfig
from gpufootprint.hub import FeatureHub
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file
from gpufootprint.sampler import state as sampler_state
from gpufootprint.sampler.state import BURST, QUIET, ProcessSampler

sys.path.insert(0, str(Path(__file__).parents[1]))
from tracegen import MS, quiet_minute_with_spike, read_jsonl, write_jsonl


def replay_lines(tmp_path: Path, lines: list[dict[str, Any]], sampler: SamplerConfig | None = None) -> Pipeline:
    path = write_jsonl(tmp_path / "trace.jsonl.gz", lines)
    pipeline = Pipeline(FootprintConfig(), hub=FeatureHub(sampler=sampler))
    assert replay_file(path, pipeline).problems == []
    return pipeline


def covering(windows: list[Any], start: int, end: int) -> list[Any]:
    return [w for w in windows if w.start_ns <= start and w.end_ns >= end]


def test_30ms_spike_in_a_quiet_minute_is_caught_in_a_burst_with_an_exact_peak(tmp_path: Path) -> None:
    # GIVEN a process that holds 1 GiB and only allocates 1 KiB twice a second for a minute,
    # except once, when it holds 256 MiB more for 30 ms
    lines, facts = quiet_minute_with_spike()
    pipeline = replay_lines(tmp_path, lines)
    hub = pipeline.hub
    windows = list(hub.windows)
    # THEN exactly one window covers the spike, and its peak is exact to the byte
    (win,) = covering(windows, facts["spike_start"], facts["spike_end"])
    assert win.reason == "footprint_change"
    assert win.peak_bytes == facts["peak"]
    assert win.gpu == 0 and win.pid == 4242
    # ... the window is tight: it opens in the 5 ms frame of the spike and closes soon after it ends
    assert facts["spike_start"] - win.start_ns < 5 * MS
    assert win.end_ns - facts["spike_end"] <= 4 * 5 * MS
    # ... and the spike's whole span was sampled in consecutive 5 ms burst frames (at least 3)
    bursts = [i for i in hub.samplers[4242].intervals() if i["mode"] == BURST]
    spike_bursts = [i for i in bursts if i["start"] <= facts["spike_start"] and i["end"] >= facts["spike_end"]]
    assert len(spike_bursts) == 1 and spike_bursts[0]["interval_ms"] == 5 and spike_bursts[0]["count"] >= 3
    # ... while the rest of the minute ran at 200 ms: no other window after the startup one
    others = [w for w in windows if w is not win]
    # (the startup window: from nothing to 1 GiB, closed once that level held for burst_settle_ms)
    assert all(w.end_ns <= facts["t0"] + 200 * MS or w.start_ns >= facts["end"] for w in others)
    assert hub.window_counts["footprint_change"] == len(windows)


def test_window_starts_at_the_change_that_made_the_interval_volatile_not_a_small_one_before(
        tmp_path: Path) -> None:
    # GIVEN 1 KiB ticks every 130 ms (off the 200 ms grid), so a tick often shares the spike's interval
    for at in (30_000, 30_150, 30_350, 30_499, 12_345):
        lines, facts = quiet_minute_with_spike(spike_at_ms=at, tick_ms=130)
        windows = list(replay_lines(tmp_path, lines).hub.windows)
        # THEN one window in the minute besides the start-up and the final release, around the spike
        middle = [w for w in windows if facts["t0"] + 200 * MS < w.start_ns < facts["end"]]
        assert len(middle) == 1, (at, [(w.start_ns - facts["t0"], w.peak_bytes) for w in middle])
        (win,) = middle
        assert facts["peak"] <= win.peak_bytes <= facts["peak"] + 1024  # a 1 KiB tick may be live in it
        assert 0 <= facts["spike_start"] - win.start_ns < 5 * MS
        # and no window's peak is just the baseline it rose from (the 1 GiB the process holds), save the
        # final release, which only went down
        assert all(w.peak_bytes > (1 << 30) for w in middle)


def test_spike_spanning_an_interval_boundary_is_still_one_covering_window(tmp_path: Path) -> None:
    for offset_ms in range(0, 200, 13):  # move the spike across the 200 ms grid
        lines, facts = quiet_minute_with_spike(spike_at_ms=20_000 + offset_ms, minute_ms=25_000)
        pipeline = replay_lines(tmp_path, lines)
        (win,) = covering(list(pipeline.hub.windows), facts["spike_start"], facts["spike_end"])
        assert win.peak_bytes == facts["peak"], offset_ms


def test_spike_of_5ms_is_caught_too(tmp_path: Path) -> None:
    lines, facts = quiet_minute_with_spike(spike_ms=5, spike=64 << 20)
    pipeline = replay_lines(tmp_path, lines)
    (win,) = covering(list(pipeline.hub.windows), facts["spike_start"], facts["spike_end"])
    assert win.peak_bytes == facts["peak"]


def test_spike_added_to_a_real_h200_trace_is_caught_when_replayed(tmp_path: Path, data_dir: Path) -> None:
    # GIVEN the real caching-allocator trace, then a quiet minute, in which the trace's own largest
    # allocation is made again (new address) and released 30 ms later
    lines = read_jsonl(data_dir / "h200_caching.jsonl.gz")
    mems = [o for o in lines if o["k"] == "mem"]
    biggest = max((o for o in mems if o["op"] == 1 and o["mk"] == 3), key=lambda o: o["bytes"])
    end = max(o.get("ts", o.get("start", 0)) for o in lines[1:])
    s0 = end + 30_000 * MS + 7_777
    s1 = s0 + 30 * MS
    extra = [dict(biggest, ts=s0, addr=0x7F00_0000_0000), dict(biggest, ts=s1, op=2, addr=0x7F00_0000_0000)]
    extra.append(dict(mems[0], ts=end + 60_000 * MS, op=1, mk=2, addr=0x7E00_0000_0000, bytes=4096))  # pinned
    # Expected peak by a plain reconstruction: the level just before the spike plus the spike.
    live: dict[int, tuple[int, int]] = {}
    for o in sorted(mems, key=lambda o: o["ts"]):
        if o["op"] == 1:
            live[o["addr"]] = (o["bytes"], o["mk"])
        else:
            live.pop(o["addr"], None)
    level = sum(b for b, k in live.values() if k in (3, 4, 6))
    pipeline = replay_lines(tmp_path, lines + extra)
    (win,) = covering(list(pipeline.hub.windows), s0, s1)
    assert win.peak_bytes == level + biggest["bytes"]
    assert win.pid == lines[0]["pid"]
    # the quiet minute before the spike backed off to 200 ms
    ivs = pipeline.hub.samplers[win.pid].intervals()
    before = [i for i in ivs if i["end"] > end + 1000 * MS and i["start"] < s0 - 1000 * MS]
    assert before and all(i["interval_ms"] == 200 and i["mode"] == QUIET for i in before)


def test_quiet_traffic_backs_off_step_by_step_to_200ms(tmp_path: Path) -> None:
    lines, facts = quiet_minute_with_spike(spike=0, minute_ms=10_000)
    lines = [o for o in lines if o.get("bytes") != 0]
    pipeline = replay_lines(tmp_path, lines)
    ivs = pipeline.hub.samplers[4242].intervals()
    after_start = [i for i in ivs if i["start"] >= facts["t0"] + 100 * MS]
    sizes = [i["interval_ms"] for i in after_start]
    # 20 (steady) -> 40 -> 80 -> 160 -> 200 and then 200 until the end
    first_quiet = sizes.index(40)
    assert sizes[first_quiet:first_quiet + 4] == [40, 80, 160, 200]
    assert all(s == 200 for s in sizes[first_quiet + 3:])
    assert sum(i["end"] - i["start"] for i in after_start if i["interval_ms"] == 200) > 9_000 * MS
    assert pipeline.hub.samplers[4242].mode == QUIET


def test_event_rate_jump_bursts_without_any_footprint_change() -> None:
    s = ProcessSampler(1, SamplerConfig())
    t0 = 1_000_000_000_000
    # a quiet second, then 400 copies in 40 ms
    s.add_levels(np.array([t0], np.int64), np.array([1 << 30], np.int64), 0)
    s.add_events(np.arange(t0 + 1000 * MS, t0 + 1040 * MS, 100_000, dtype=np.int64))
    s.advance(t0 + 2000 * MS)
    reasons = [w.reason for w in s.closed_windows]
    assert "event_rate" in reasons
    w = next(w for w in s.closed_windows if w.reason == "event_rate")
    # A rate jump is seen at interval resolution: the window may start up to one interval late.
    assert t0 + 1000 * MS <= w.start_ns <= t0 + 1020 * MS and w.end_ns >= t0 + 1040 * MS
    assert w.peak_bytes == 1 << 30


def test_feeding_watermarks_piecewise_gives_the_same_intervals_and_windows() -> None:
    rng = np.random.default_rng(3)
    t0 = 5_000_000_000_000
    ts = np.sort(t0 + rng.integers(0, 20_000 * MS, 4000)).astype(np.int64)
    deltas = rng.choice([1 << 20, -(1 << 20), 64 << 20, -(64 << 20), 0], 4000).astype(np.int64)
    whole = ProcessSampler(1, SamplerConfig())
    whole.add_levels(ts, deltas, 0)
    whole.finish(t0 + 20_001 * MS)
    parts = ProcessSampler(1, SamplerConfig())
    marks = np.sort(rng.integers(0, 20_000 * MS, 50)) + t0
    fed = 0
    for m in marks.tolist() + [t0 + 20_001 * MS]:
        upto = int(np.searchsorted(ts, m, "right"))
        if upto > fed:
            parts.add_levels(ts[fed:upto], deltas[fed:upto], 0)
            fed = upto
        parts.advance(m)
    parts.finish(t0 + 20_001 * MS)
    assert parts.intervals() == whole.intervals()
    assert parts.closed_windows == whole.closed_windows
    assert len(whole.closed_windows) > 3


def test_window_peak_equals_brute_force_max_level_inside_the_window() -> None:
    rng = np.random.default_rng(11)
    t0 = 7_000_000_000_000
    ts = np.sort(t0 + rng.integers(0, 30_000 * MS, 3000)).astype(np.int64)
    deltas = (rng.integers(-50, 51, 3000) << 20).astype(np.int64)
    deltas[0] = 10 << 30
    s = ProcessSampler(1, SamplerConfig())
    s.add_levels(ts, deltas, 0)
    s.finish(int(ts[-1]) + 1)
    assert s.closed_windows
    levels = np.cumsum(deltas)
    for w in s.closed_windows:
        before = levels[ts < w.start_ns]
        inside = levels[(ts >= w.start_ns) & (ts < w.end_ns)]
        expect = max([int(before[-1]) if len(before) else 0] + inside.tolist())
        assert w.peak_bytes == expect


def test_sampler_sends_flush_interval_and_kernel_window_to_probes_only() -> None:
    sent: list[tuple[int, dict[str, Any]]] = []
    hub = FeatureHub(sampler=SamplerConfig(kernel_window_ms=50))
    hub.control = lambda pid, body: sent.append((pid, body)) or True
    pipeline = Pipeline(FootprintConfig(), hub=hub)
    lines, facts = quiet_minute_with_spike(minute_ms=5_000, spike_at_ms=2_000)
    from gpufootprint.records import MEMORY_DTYPE, RecordKind

    for source, pid in (("probe", 10), ("trace", 11)):
        recs = np.zeros(len([o for o in lines if o["k"] == "mem"]), MEMORY_DTYPE)
        m = [o for o in lines if o["k"] == "mem"]
        for f in ("ts", "op", "mk", "addr", "bytes"):
            recs[f] = [o[f] for o in m]
        recs["pid"] = pid
        pipeline.process(pid, source)
        fed = 0
        for t in range(facts["t0"], facts["end"] + 10 * MS, 5 * MS):  # as a live probe's batches would come
            upto = int(np.searchsorted(recs["ts"], t, "right"))
            if upto > fed:
                pipeline.submit(RecordKind.MEMORY, recs[fed:upto])
                fed = upto
            pipeline.advance(pid, t)
        pipeline.finish(pid)
    assert {pid for pid, _ in sent} == {10}
    ops = [b["op"] for _, b in sent]
    assert "kernel_window" in ops
    flushes = [b["ms"] for _, b in sent if b["op"] == "flush_interval"]
    assert 5 in flushes and 200 in flushes and 20 in flushes
    assert all(a != b for a, b in itertools.pairwise(flushes))  # only on change
    assert all(1 <= ms <= 1000 for ms in flushes)


def _windows_of_a_quiet_process(cfg: SamplerConfig, seconds: int = 180) -> list[list[tuple[float, int]]]:
    """Each launch window the hub sent a probe process whose watermarks come every 100 ms for ``seconds``
    and which launches nothing: its (seconds since the first watermark, ms) CONTROLs, window by window."""
    sent: list[tuple[int, int, dict[str, Any]]] = []
    hub = FeatureHub(sampler=cfg)
    now = [0]
    hub.control = lambda pid, body: sent.append((now[0], pid, body)) or True
    pipeline = Pipeline(FootprintConfig(), hub=hub)
    from gpufootprint.records import MEMORY_DTYPE, RecordKind

    pid, t0 = 10, 10**12
    pipeline.process(pid, "probe")
    rec = np.zeros(1, MEMORY_DTYPE)
    rec["ts"], rec["op"], rec["mk"], rec["addr"], rec["bytes"], rec["pid"] = t0, 1, 3, 0x1000, 1 << 30, pid
    pipeline.submit(RecordKind.MEMORY, rec)
    for t in range(t0, t0 + seconds * 1000 * MS, 100 * MS):
        now[0] = t
        pipeline.advance(pid, t)
    windows: dict[int, list[tuple[float, int]]] = {}
    for t, _, b in sent:
        if b["op"] == "kernel_window":
            assert b["records"] == "launches"
            windows.setdefault(b["id"], []).append(((t - t0) / 1e9, b["ms"]))
    return list(windows.values())


def test_kernel_windows_open_periodically_at_a_low_duty_cycle_and_at_bursts() -> None:
    # GIVEN a hub with the default windows (50 ms of launch records) and a probe process whose
    # watermarks come every 100 ms for 3 minutes
    assert SamplerConfig().kernel_window_ms == 50 and SamplerConfig().kernel_window_records == "launches"
    windows = _windows_of_a_quiet_process(SamplerConfig())
    # THEN one window at the start-up burst (the 1 GiB allocation), then periodic ones, each held open lease by
    # lease (2 s) while it has seen no step (this process launches nothing), closed at its bound (12 s), the
    # next periodic one due 30 s after the last opened, doubled for each window the process had before it
    # (the first periodic one came after the burst's: 60 s), and at least 1 s after the last closed
    opened = [w[0][0] for w in windows]
    assert opened == pytest.approx([0.1, 13.1, 73.1], abs=0.11)
    for w in windows:
        assert w[0][1] == 2000 and all(ms <= 2000 for _, ms in w)
        if w[-1][0] < 170:
            assert w[-1][1] == 1 and w[-1][0] - w[0][0] == pytest.approx(12.0, abs=0.11)  # closed at the bound
    # AND without the back-off (kernel_window_every_max_seconds 0) every 30 s after the last opened
    flat = _windows_of_a_quiet_process(SamplerConfig(kernel_window_every_max_seconds=0))
    assert [w[0][0] for w in flat] == pytest.approx([0.1, 13.1, 43.1, 73.1, 103.1, 133.1, 163.1], abs=0.11)
    pid, t0 = 10, 10**12
    # AND a burst opens one at once, but never two within a second of the last one's close
    hub2 = FeatureHub(sampler=SamplerConfig(kernel_window_ms=50, kernel_window_max_ms=500, kernel_window_burst_gap_seconds=0))
    got: list[dict[str, Any]] = []
    hub2.control = lambda pid, body: got.append(body) or True
    s = hub2.sampler(pid)
    for i, t in enumerate(range(t0, t0 + 3000 * MS, 100 * MS)):
        s.bursts = i  # a burst starts in every step
        hub2._after_step(s, "probe", t)
    # opened at 0, closed at 0.5 s (its bound), the next at 1.5 s, closed at 2.0 s, the last at 3.0 s is past the loop
    assert [(b["id"], b["ms"]) for b in got if b["op"] == "kernel_window"] == [(1, 500), (1, 1), (2, 500), (2, 1)]
    # AND windows of kernel records say no "records" (what a probe from before launch windows reads)
    hub4 = FeatureHub(sampler=SamplerConfig(kernel_window_records="kernels"))
    kern: list[dict[str, Any]] = []
    hub4.control = lambda pid, body: kern.append(body) or True
    hub4._after_step(hub4.sampler(pid), "probe", t0)
    assert kern and all("records" not in b for b in kern if b["op"] == "kernel_window")
    # AND with windows off none is ever opened
    hub3 = FeatureHub(sampler=SamplerConfig(kernel_window_ms=0))
    off: list[dict[str, Any]] = []
    hub3.control = lambda pid, body: off.append(body) or True
    s = hub3.sampler(pid)
    for t in range(t0, t0 + 60_000 * MS, 100 * MS):
        hub3._after_step(s, "probe", t)
    assert not [b for b in off if b["op"] == "kernel_window"]


def test_a_window_the_probe_cannot_take_is_asked_again_at_the_next_due_time_not_every_step() -> None:
    # GIVEN a probe that takes no launch window (ingest refuses to send it: CUDA was up before the probe)
    hub = FeatureHub()
    refused: list[dict[str, Any]] = []
    hub.control = lambda pid, body: refused.append(body) and False
    s = hub.sampler(5)
    t0 = 10**12
    for t in range(t0, t0 + 40_000 * MS, 100 * MS):  # 40 s of steps, 100 ms apart
        hub._after_step(s, "probe", t)
    # THEN it was asked at 5 s and 35 s only (before: at every step from 5 s on, 350 failures)
    windows = [b for b in refused if b["op"] == "kernel_window"]
    assert len(windows) == 2 and hub.controls_sent["kernel_window", "failed"] == 2


def test_a_failing_control_callback_never_breaks_ingest() -> None:
    hub = FeatureHub()

    def boom(pid: int, body: dict[str, Any]) -> bool:
        raise OSError("peer gone")

    hub.control = boom
    pipeline = Pipeline(FootprintConfig(), hub=hub)
    from gpufootprint.records import MEMORY_DTYPE, RecordKind

    recs = np.zeros(2, MEMORY_DTYPE)
    recs["ts"] = [1_000_000_000_000, 1_000_050_000_000]
    recs["op"], recs["mk"], recs["bytes"], recs["pid"] = [1, 2], 3, 1 << 30, 9
    pipeline.process(9, "probe")
    pipeline.submit(RecordKind.MEMORY, recs)
    pipeline.finish(9)
    assert hub.controls_sent["flush_interval", "failed"] >= 1


def test_disabled_sampler_stays_steady_and_records_no_windows(tmp_path: Path) -> None:
    lines, _ = quiet_minute_with_spike(minute_ms=3_000, spike_at_ms=1_000)
    pipeline = replay_lines(tmp_path, lines, SamplerConfig(enabled=False))
    assert not pipeline.hub.windows
    assert {i["interval_ms"] for i in pipeline.hub.samplers[4242].intervals()} == {20}


def test_two_devices_window_reports_the_device_that_moved_and_its_own_peak() -> None:
    s = ProcessSampler(1, SamplerConfig())
    t0 = 9_000_000_000_000
    s.add_levels(np.array([t0], np.int64), np.array([8 << 30], np.int64), 0)
    s.add_levels(np.array([t0 + 1, t0 + 3000 * MS, t0 + 3030 * MS], np.int64),
                 np.array([1 << 30, 2 << 30, -(2 << 30)], np.int64), 1)
    s.finish(t0 + 6000 * MS)
    spike = [w for w in s.closed_windows if w.start_ns <= t0 + 3000 * MS <= w.end_ns]
    assert len(spike) == 1 and spike[0].gpu == 1 and spike[0].peak_bytes == 3 << 30
    assert s.last_peak == {0: 8 << 30, 1: 1 << 30}


@pytest.mark.parametrize("bad", [{"steady_ms": 0}, {"burst_min_frames": 0}, {"volatile_rel_change": -1}])
def test_sampler_config_bounds_name_the_key(bad: dict[str, Any]) -> None:
    from gpufootprint.configload import load_config
    from gpufootprint.errors import ConfigError

    key, value = next(iter(bad.items()))
    with pytest.raises(ConfigError, match=f"sampler.{key}"):
        load_config(env={}, overrides={f"sampler.{key}": value})


def test_sampler_max_ms_stays_within_what_a_probe_takes_and_above_steady_ms() -> None:
    from gpufootprint.configload import build_config, load_config
    from gpufootprint.errors import ConfigError

    # A probe cuts a flush interval to 1,000 ms (ProbeOptions.flush_ms): a longer max_ms is refused.
    with pytest.raises(ConfigError, match=r"sampler\.max_ms: 1001 is above the maximum 1000"):
        load_config(env={}, overrides={"sampler.max_ms": 1001})
    assert load_config(env={}, overrides={"sampler.max_ms": 1000}).sampler.max_ms == 1000
    with pytest.raises(ConfigError, match=r"command line: sampler\.max_ms: 10 is below sampler\.steady_ms \(20\)"):
        load_config(env={}, overrides={"sampler.max_ms": 10})
    with pytest.raises(ConfigError, match=r"policy\.yaml: sampler\.max_ms: 30 is below sampler\.steady_ms \(40\)"):
        build_config({"sampler": {"steady_ms": 40, "max_ms": 30}}, "policy.yaml")
    equal = load_config(env={}, overrides={"sampler.max_ms": 50, "sampler.steady_ms": 50}).sampler
    assert (equal.steady_ms, equal.max_ms) == (50, 50)


def test_past_history_tables_each_table_keeps_its_part_of_the_history() -> None:
    from gpufootprint.config import FeaturesConfig
    from gpufootprint.footprint.peaks import FramePeaks
    from gpufootprint.hub import FeatureHub

    hub = FeatureHub(FeaturesConfig(keep_seconds=10.0, history_tables=4, reuse_tracked_addresses=100_000))
    for pid in range(4):
        hub.open_device(pid, 0, FramePeaks(10_000_000, 10**9))
    full = hub.builders[(0, 0)]._keep_frames
    assert full == 1000 and hub.builders[(0, 0)].reuse._capacity == 100_000
    for pid in range(4, 64):
        hub.open_device(pid, 0, FramePeaks(10_000_000, 10**9))
    kept = [b._keep_frames for b in hub.builders.values()]
    assert set(kept) == {full * 4 // 64} and sum(kept) <= 4 * full
    assert {b.reuse._capacity for b in hub.builders.values()} == {100_000 * 4 // 64}
    for pid in range(4, 64):
        hub.forget(pid)
    assert hub.builders[(0, 0)]._keep_frames == full  # back to the whole history


def test_a_followed_window_counts_whole_steps_between_waits_across_batches() -> None:
    from gpufootprint.hub import _FollowedWindow
    from gpufootprint.records import API_DTYPE, ApiRole

    def api(roles: str) -> np.ndarray:
        a = np.zeros(len(roles), API_DTYPE)
        a["role"] = [ApiRole.LAUNCH if c == "L" else ApiRole.SYNC for c in roles]
        return a

    w = _FollowedWindow(1, 0, 2000)
    w.add(api("LLS"))  # the end of a step that began before the window: no whole step yet
    assert w.steps == 0
    w.add(api("LLLS"))
    w.add(api("S"))  # a second wait with no launch since (a copy, then a synchronize): the same wait
    assert w.steps == 1
    w.add(api("LL"))
    w.add(api("LSLLS"))  # split across batches: counted where the wait comes
    assert w.steps == 3 and w.records == 15


def test_a_launch_window_is_closed_once_it_has_seen_its_steps_and_the_next_waits_for_the_gap() -> None:
    from gpufootprint.records import API_DTYPE, ApiRole

    sent: list[tuple[int, dict[str, Any]]] = []
    hub = FeatureHub(sampler=SamplerConfig(kernel_window_first_seconds=0.0))
    now = [0]
    hub.control = lambda pid, body: sent.append((now[0], body)) or True
    s = hub.sampler(7)
    t0 = 10**12
    now[0] = t0
    hub._after_step(s, "probe", t0)  # opens one (periodic, due at once)
    def windows() -> list[dict[str, Any]]:
        return [b for _, b in sent if b["op"] == "kernel_window"]

    assert windows()[-1]["ms"] == 2000 and 7 in hub._followed
    for k in range(5):  # 5 waits with launches between: 4 whole steps
        a = np.zeros(3, API_DTYPE)
        a["role"] = [ApiRole.LAUNCH, ApiRole.LAUNCH, ApiRole.SYNC]
        hub.on_launches(7, a)
        now[0] = t0 + (k + 1) * 300 * MS
        hub._after_step(s, "probe", now[0])
    assert 7 not in hub._followed
    assert [b["ms"] for b in windows()] == [2000, 2000, 1]  # renewed once (1.2 s in), closed at 1.5 s


def _sampler_state(s: ProcessSampler) -> tuple[Any, ...]:
    return (s.intervals(), s.closed_windows, s.last_peak, s.level_dev, s.level, s.mode, s.interval_ns,
            s.cursor, s.bursts, s.rate_ewma, s.range_ewma, s.window)


@pytest.mark.parametrize("seed", range(16))
def test_burst_frames_judged_together_leave_what_walking_them_one_by_one_leaves(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN sparse bursty traffic over one or several devices (long calm stretches inside windows,
    # spikes, settles) fed in random watermark pieces, walked frame by frame, and judged ahead in
    # stretches both ways: with numpy only, and frame by frame in Python where few events allow
    # (short stretches of Python judgement, and few events allowed, in some seeds)
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(sampler_state, "_WALK_FRAMES", int(rng.choice([2, 5, 32])))
    monkeypatch.setattr(sampler_state, "_WALK_EVENTS", int(rng.choice([3, 64])))
    monkeypatch.setattr(sampler_state, "_WALK_MANY", int(rng.choice([0, 20, 1024])))
    cfg = SamplerConfig(burst_settle_ms=int(rng.choice([0, 30, 100])), burst_min_frames=int(rng.integers(1, 6)),
                        burst_max_ms=int(rng.choice([40, 300, 2000])))
    bulk, walk, judged = ProcessSampler(1, cfg), ProcessSampler(1, cfg), ProcessSampler(1, cfg)
    walk.bulk_bursts = False
    judged.walk_bursts = False
    samplers = (bulk, walk, judged)
    t = 10**12
    devices = 1 if seed % 2 else 3
    for _ in range(60):
        n = int(rng.integers(1, 12 if rng.random() < 0.8 else 80))
        ts = t + np.sort(rng.integers(0, int(rng.choice([5, 50, 400])) * MS, n))
        dev = int(rng.integers(0, devices))
        deltas = rng.choice([1 << 20, -(1 << 20), 64 << 20, -(64 << 20), 4 << 10], n)
        other = rng.random() < 0.2
        for s in samplers:
            s.add_levels(ts, deltas, dev)
            if other:
                s.add_events(ts[:1])
        t = int(ts[-1]) + int(rng.integers(1, 600)) * MS
        mark = t - int(rng.integers(0, 50)) * MS
        for s in samplers:
            s.advance(mark)
        # THEN after every watermark all hold the same intervals, windows, peaks, levels and mode
        assert _sampler_state(bulk) == _sampler_state(walk) == _sampler_state(judged)
    for s in samplers:
        s.finish(t + 5000 * MS)
    assert _sampler_state(bulk) == _sampler_state(walk) == _sampler_state(judged)
    assert walk.bursts > 0  # the traffic did burst (the bulk pass had frames to pass)


def _walked_one_by_one(s: ProcessSampler) -> ProcessSampler:
    """``s`` walking every empty interval of a sampler that is off on its own (the reference)."""
    s.bulk_steady = False
    return s


def test_a_disabled_sampler_passes_a_long_gap_in_a_few_steps_as_it_would_interval_by_interval() -> None:
    """With the sampler off, empty intervals are passed in bulk, as a quiet process's are: two records a
    year apart (a record stamped in 1970, then one now) were walked 20 ms at a time, hours of the ingest
    thread. The history, levels and peaks equal an interval-by-interval walk; the usual rate and range
    agree to rounding (decayed at once, not step by step)."""
    t0 = 1_000_000_000
    steps = itertools.count()
    fast = ProcessSampler(1, SamplerConfig(enabled=False))
    real_update = fast._update_usual

    def counted(*a: Any) -> None:
        next(steps)
        real_update(*a)

    fast._update_usual = counted  # type: ignore[method-assign]
    year = 365 * 86_400 * 1_000_000_000
    fast.add_levels(np.array([t0, t0 + 7 * MS], np.int64), np.array([1 << 20, 2 << 20], np.int64), 0)
    fast.add_levels(np.array([t0 + year], np.int64), np.array([-(1 << 20)], np.int64), 0)
    fast.advance(t0 + year + 1_000 * MS)
    assert next(steps) < 200  # 50 a second of its time when walked one by one: 1.6 billion for the year
    assert fast.level == 2 << 20 and sum(i["count"] for i in fast.intervals()) == (year + 1_000 * MS) // (20 * MS)
    # against the walk one by one, over 40 s (a year of 20 ms steps would take hours), watermarks anywhere
    ref = _walked_one_by_one(ProcessSampler(1, SamplerConfig(enabled=False)))
    short = ProcessSampler(1, SamplerConfig(enabled=False))
    for s in (ref, short):
        s.add_levels(np.array([t0, t0 + 7 * MS, t0 + 2_500 * MS, t0 + 31_003 * MS], np.int64),
                     np.array([1 << 20, 2 << 20, -(1 << 20), 5 << 20], np.int64), 0)
        for mark in (3_000, 3_001, 17_777, 40_000):
            s.advance(t0 + mark * MS)
    assert short.intervals() == ref.intervals()
    assert (short.level, short.level_dev, short.last_peak, short.cursor) == (ref.level, ref.level_dev, ref.last_peak,
                                                                              ref.cursor)
    assert short.rate_ewma == pytest.approx(ref.rate_ewma, rel=1e-9, abs=0)
    assert short.range_ewma == pytest.approx(ref.range_ewma, rel=1e-9, abs=0)


@pytest.mark.parametrize("seed", range(20))
def test_where_a_burst_starts_is_the_same_walked_or_with_numpy(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A few level changes are walked in Python; many with numpy's running max and min. Both must find the
    # same first change at which the interval's range meets the footprint rule, whatever the levels, the
    # level on entering, the rule's thresholds and the usual range.
    rng = np.random.default_rng(seed)
    cfg = SamplerConfig()
    walked, numpy_only = ProcessSampler(1, cfg), ProcessSampler(1, cfg)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        ts = np.sort(rng.integers(0, 10**9, n)).astype(np.int64)
        total = int(rng.integers(0, 1 << 34)) + np.cumsum(rng.choice([-1, 1], n) * rng.integers(0, 1 << 31, n))
        entering = int(rng.integers(0, 1 << 34))
        usual = [None, 0.0, float(rng.integers(0, 1 << 32))][int(rng.integers(0, 3))]
        i = int(rng.integers(0, n))
        j = int(rng.integers(i, n + 1))
        for s in (walked, numpy_only):
            s.range_ewma = usual
        monkeypatch.setattr(sampler_state, "_SMALL", 64)
        got = walked._volatile_change(ts, total.astype(np.int64), i, j, entering)
        monkeypatch.setattr(sampler_state, "_SMALL", 0)
        expect = numpy_only._volatile_change(ts, total.astype(np.int64), i, j, entering)
        assert got == expect and type(got) is int
