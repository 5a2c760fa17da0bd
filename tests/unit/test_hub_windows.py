"""The hub's launch windows: what it asks a probe for, and when it stops following a window."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from gpufootprint.config import SamplerConfig
from gpufootprint.hub import FeatureHub
from gpufootprint.records import API_DTYPE, ApiRole

S = 1_000_000_000


def _hub() -> tuple[FeatureHub, list[dict[str, Any]]]:
    hub = FeatureHub(sampler=SamplerConfig())
    sent: list[dict[str, Any]] = []
    hub.control = lambda pid, body: sent.append(body) is None
    return hub, sent


def _open(hub: FeatureHub, sent: list[dict[str, Any]], pid: int, t0: int) -> dict[str, Any]:
    hub.sampler(pid)
    hub.on_watermark(pid, t0, "probe")
    hub.on_watermark(pid, t0 + 6 * S, "probe")  # past kernel_window_first_seconds (5)
    (opened,) = [b for b in sent if b["op"] == "kernel_window"]
    return opened


def test_a_launch_window_asks_the_probe_to_close_it_at_the_daemons_step_count() -> None:
    hub, sent = _hub()
    opened = _open(hub, sent, 7, 100 * S)
    cfg = hub.config
    assert opened["records"] == "launches" and opened["steps"] == cfg.kernel_window_steps
    assert opened["max_records"] == cfg.kernel_window_max_records and opened["min_ms"] == cfg.kernel_window_ms


def test_a_window_the_probe_closed_at_its_count_is_followed_no_more() -> None:
    # GIVEN a window the daemon follows, whose calls it cannot count to the end (refused past a bound, say)
    hub, sent = _hub()
    t0 = 100 * S
    opened = _open(hub, sent, 7, t0)
    api = np.zeros(3, API_DTYPE)
    api["role"] = [ApiRole.LAUNCH, ApiRole.SYNC, ApiRole.LAUNCH]
    hub.on_launches(7, api)
    # WHEN the probe's heartbeat says it closed the window at its count
    hub.note_window_closed(7, opened["id"], t0 + 6 * S + 300_000_000)
    # THEN no renewal goes out for it, and the next window may open after the usual gap, not after
    # kernel_window_max_ms (12 s) of renewals the probe would ignore
    sent.clear()
    hub.on_watermark(7, t0 + 7 * S + 500_000_000, "probe")  # where its 2 s lease would be renewed
    assert not [b for b in sent if b["op"] == "kernel_window"], sent
    hub.on_watermark(7, t0 + 37 * S, "probe")  # the next periodic window (every 30 s)
    later = [b for b in sent if b["op"] == "kernel_window"]
    assert later and later[0]["id"] != opened["id"] and later[0]["ms"] > 1, later


def test_a_close_of_another_window_leaves_the_followed_one_alone() -> None:
    hub, sent = _hub()
    opened = _open(hub, sent, 7, 100 * S)
    hub.note_window_closed(7, opened["id"] + 1, 107 * S)  # not the one it follows (an old daemon's)
    sent.clear()
    hub.on_watermark(7, 107 * S + 500_000_000, "probe")  # its 2 s lease nearly spent: renewed
    assert [b["id"] for b in sent if b["op"] == "kernel_window"] == [opened["id"]], sent


def _churn(burst_gap_s: float, seconds: int = 120, *, bursts: bool = True, every_ms: int = 100,
           **cfg: Any) -> list[tuple[int, int]]:
    """A process whose every ``every_ms`` watermark starts a burst (allocation churn under a stream-ordered
    allocator; ``bursts=False``: none) and which runs ten steps (a launch and a wait) between watermarks;
    each launch window it is sent records them. Returns each window's (opened, closed) watermark times in ms."""
    hub = FeatureHub(sampler=SamplerConfig(kernel_window_burst_gap_seconds=burst_gap_s, **cfg))
    now = [0]
    sent: list[tuple[int, dict[str, Any]]] = []
    hub.control = lambda pid, body: sent.append((now[0], body)) is None
    s = hub.sampler(7)
    steps = np.zeros(20, API_DTYPE)
    steps["role"] = [ApiRole.LAUNCH, ApiRole.SYNC] * 10
    for i in range(seconds * 1000 // every_ms):
        now[0] = i * every_ms
        if 7 in hub._followed:
            hub.on_launches(7, steps)  # what the open window recorded since the last watermark
        if bursts:
            s.bursts = i + 1  # a burst starts in every step
        hub._after_step(s, "probe", i * every_ms * 1_000_000)
    spans: dict[int, list[int]] = {}
    for t, b in sent:
        if b["op"] == "kernel_window":
            spans.setdefault(b["id"], []).append(t)
    return [(ts[0], ts[-1]) for ts in spans.values()]


def test_under_churn_a_burst_opens_a_window_only_past_the_burst_gap() -> None:
    # GIVEN a process bursting at every watermark, whose launch windows each record its steps
    # WHEN the hub opens windows for two minutes with the default burst gap (30 s)
    assert SamplerConfig().kernel_window_burst_gap_seconds == 30.0
    windows = _churn(30.0)
    # THEN each window closes at its steps (100 ms: the next watermark); the first burst opens one at once, the
    # periodic schedule one 5 s in (past start-up), then 60 s later (30 s doubled: the process had a window
    # before it), and no burst opens any other (the burst gap doubles with the windows too)
    assert [b - a for a, b in windows[:-1]] == [100] * (len(windows) - 1)
    assert [a for a, _ in windows] == [0, 5_000, 65_000]
    # AND without the back-off every 30 s
    assert [a for a, _ in _churn(30.0, kernel_window_every_max_seconds=0)] == [0, 5_000, 35_000, 65_000, 95_000]
    # AND with a gap of 0 a window opens at the first burst past the 1 s gap from the last close: every 1.1 s
    every = _churn(0.0)
    assert len(every) >= 100 and [b[0] - a[1] for a, b in itertools.pairwise(every)][:3] == [1000] * 3


def test_a_long_job_gets_a_few_windows_an_hour_not_one_every_30_s() -> None:
    # GIVEN a process that runs two hours without a burst, every launch window closed at its steps
    cfg = SamplerConfig()
    assert (cfg.kernel_window_every_seconds, cfg.kernel_window_every_max_seconds) == (30.0, 600.0)
    opened = [a // 1000 for a, _ in _churn(30.0, 7200, bursts=False, every_ms=1000)]
    # THEN the periodic gap doubles after each window (30, 60, 120, 240, 480 s), then stays at 600 s: ten
    # windows in the first hour, six in the second, where every 30 s gives 120 an hour
    assert opened[:8] == [5, 35, 95, 215, 455, 935, 1535, 2135]
    assert [b - a for a, b in itertools.pairwise(opened)][6:] == [600] * (len(opened) - 7)
    assert sum(t < 3600 for t in opened) == 10 and sum(3600 <= t < 7200 for t in opened) == 6
    flat = _churn(30.0, 7200, bursts=False, every_ms=1000, kernel_window_every_max_seconds=0)
    assert sum(a < 3_600_000 for a, _ in flat) == 120


def test_under_churn_the_burst_gap_backs_off_with_the_periodic_one() -> None:
    # GIVEN a process bursting at every 1 s watermark for two hours (allocation churn), default windows
    opened = [a // 1000 for a, _ in _churn(30.0, 7200, every_ms=1000)]
    # THEN the first burst opens one at once and the periodic schedule one 5 s in; after that each window's
    # gap (burst or periodic, whichever comes first) is at least the doubled one, up to 600 s: 16 windows in
    # two hours, where the fixed 30 s burst gap opened one every 30 s
    assert opened[:6] == [0, 5, 65, 185, 425, 905]
    gaps = [b - a for a, b in itertools.pairwise(opened)]
    assert all(g >= min(30 * 2 ** i, 600) for i, g in enumerate(gaps[1:])), gaps
    assert len(opened) == 16, opened
    assert len(_churn(30.0, 7200, every_ms=1000, kernel_window_every_max_seconds=0)) >= 7200 // 30
    # AND a burst gap of 0 (a window at every burst, as asked) is not backed off
    assert len(_churn(0.0, 120, every_ms=1000)) >= 50


def test_a_window_the_probe_was_never_sent_does_not_back_off_the_next() -> None:
    # GIVEN a quiet process whose probe cannot take a launch window for its first 200 s (its control socket
    # full, say), then can; each window it gets records its steps and closes at the next watermark
    hub = FeatureHub(sampler=SamplerConfig())
    now = [0]
    went: list[int] = []

    def control(pid: int, body: dict[str, Any]) -> bool:
        if body["op"] != "kernel_window" or body["ms"] == 1:
            return True
        if now[0] < 200 * S:
            return False
        went.append(now[0] // S)
        return True

    hub.control = control
    s = hub.sampler(7)
    steps = np.zeros(20, API_DTYPE)
    steps["role"] = [ApiRole.LAUNCH, ApiRole.SYNC] * 10
    for i in range(600):
        now[0] = i * S
        if 7 in hub._followed:
            hub.on_launches(7, steps)
        hub._after_step(s, "probe", now[0])
    # THEN the windows that never went out cost the workload nothing and do not count: the first two it got
    # are 30 s apart, then 60 s, as for a process that had none before
    assert went[:3] == [215, 245, 305], went


def test_a_restarted_daemon_backs_off_from_the_windows_the_probe_already_had() -> None:
    # GIVEN a probe that had 9 launch windows from the daemon before this one (a DaemonSet roll): its
    # heartbeat says so, through the probe's session, before the new daemon opens any
    from gpufootprint.configload import load_config
    from gpufootprint.ingest.session import Session
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.wire import framing
    from gpufootprint.wire.framing import FrameDecoder, FrameType

    def schedule(counters: dict[str, int]) -> list[int]:
        pipeline = Pipeline(load_config(env={}).footprint)
        sent: list[tuple[int, dict[str, Any]]] = []
        now = [0]
        pipeline.hub.control = lambda pid, body: sent.append((now[0], body)) is None
        session = Session(pipeline, source="probe", name="probe pid=7", peer_pid=7)
        dec = FrameDecoder()
        hb = framing.encode_json(FrameType.HEARTBEAT, {"ts": 1, "pid": 7, "counters": counters})
        for f in dec.feed(framing.PREAMBLE + framing.encode_json(FrameType.HELLO, {"pid": 7, "launch_windows": 1})
                          + hb):
            session.handle(f)
        s = pipeline.hub.sampler(7)
        steps = np.zeros(20, API_DTYPE)
        steps["role"] = [ApiRole.LAUNCH, ApiRole.SYNC] * 10
        for i in range(1800):  # 30 minutes of 1 s watermarks, no burst; each window records its steps
            now[0] = i
            if 7 in pipeline.hub._followed:
                pipeline.hub.on_launches(7, steps)
            pipeline.hub._after_step(s, "probe", i * S)
        return sorted({t for t, b in sent if b["op"] == "kernel_window" and b["ms"] > 1 and b.get("steps")})

    fresh = schedule({"launch_windows": 0})
    rolled = schedule({"launch_windows": 9, "kernel_windows": 0})
    # THEN a process new to every daemon gets the usual start: 5, 35, 95 s in...
    assert fresh[:4] == [5, 35, 95, 215], fresh
    # AND the rolled one gets one window soon (the new daemon holds no verdict for it), then gaps already
    # at the back-off's ceiling (30 s doubled nine times is past 600 s), not ten windows in its first hour
    assert rolled[:3] == [5, 605, 1205], rolled
    # AND a count a heartbeat cannot mean (negative, not a number) backs nothing off
    assert schedule({"launch_windows": -3})[:4] == fresh[:4]
