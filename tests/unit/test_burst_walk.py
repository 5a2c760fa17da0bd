"""``sampler.burst.walk_frames`` passes runs of empty frames in one step; here it is held to the plain
walk, frame after frame, that it replaced (kept below as the reference)."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
import pytest
from gpufootprint.config import SamplerConfig
from gpufootprint.sampler import burst as burst_mod

from tests.random_batches import as_lists, burst_stretch

_MS = 1_000_000


def _walk_one_by_one(cfg: SamplerConfig, cursor: int, iv: int, frames: int, mem_ts: list[int], ev_ts: list[int],
                     total: list[int], i_mem: int, i_ev: int, win: burst_mod.Window) -> burst_mod.Judged | None:
    """``walk_frames`` as it was: every frame judged on its own, empty or not."""
    tolerance = max(cfg.volatile_min_bytes, cfg.volatile_rel_change * max(win.baseline, cfg.volatile_min_bytes))
    settle_ns, max_ns = cfg.burst_settle_ms * _MS, cfg.burst_max_ms * _MS
    secs = iv / 1e9
    rate_floor = cfg.rate_jump_factor * max(win.rate_ewma, cfg.quiet_max_rate)
    range_floor = cfg.range_jump_factor * win.range_ewma
    calm, lve, level = win.calm, win.last_volatile_end, win.level
    n_mem, n_ev = len(mem_ts), len(ev_ts)
    pm = pe = 0
    judged: tuple[int, int, int, int, int, int] | None = None
    for f in range(frames):
        end = cursor + iv * (f + 1)
        qm = bisect_left(mem_ts, end, pm) if pm < n_mem and mem_ts[pm] < end else pm
        qe = bisect_left(ev_ts, end, pe) if pe < n_ev and ev_ts[pe] < end else pe
        entering = after = level
        rng = 0
        if qm > pm:
            seg = total[pm:qm]
            after = seg[-1]
            rng = max(entering, max(seg)) - min(entering, min(seg))
        events = qe - pe
        volatile = cfg.enabled and (
            (rng >= cfg.volatile_min_bytes and rng > 0
             and rng >= cfg.volatile_rel_change * max(entering, cfg.volatile_min_bytes) and rng > range_floor)
            or (events >= cfg.rate_min_events and events / secs >= rate_floor))
        if volatile:
            calm, lve = 0, end
        else:
            calm += 1
        back = abs(after - win.baseline) < tolerance
        if (calm >= cfg.burst_min_frames and (back or end - lve >= settle_ns)) or end - win.start >= max_ns:
            break
        judged = (f + 1, pm, qm, qe, calm, lve)
        level, pm, pe = after, qm, qe
    if judged is None:
        return None
    c, start, mem_end, ev_end, calm, lve = judged
    return burst_mod.Judged(c, i_mem + start, i_mem + mem_end, i_ev + ev_end, calm, lve)


@pytest.mark.parametrize("seed", range(12))
def test_walk_frames_passing_empty_frames_together_judges_as_the_frame_by_frame_walk(seed: int) -> None:
    # GIVEN random stretches of up to 250 burst frames holding few events (long runs of empty frames between
    # them, or none at all), windows young and old, calm counts low and high, levels near and far from the
    # baseline, settle times of none to longer than the stretch, and configurations where an empty frame
    # is a rate jump (rate_min_events 0 with a zero rate floor) or the sampler is off
    rng = np.random.default_rng(seed)
    for _ in range(300):
        cfg = SamplerConfig(burst_settle_ms=int(rng.choice([0, 10, 100, 3000])),
                            burst_min_frames=int(rng.integers(1, 30)),
                            burst_max_ms=int(rng.choice([5, 20, 300, 2000])),
                            rate_min_events=int(rng.choice([0, 1, 3, 50])),
                            quiet_max_rate=float(rng.choice([0.0, 100.0])),
                            volatile_min_bytes=int(rng.choice([1, 1 << 20, 64 << 20])),
                            enabled=bool(rng.random() < 0.9))
        stretch = burst_stretch(rng, max_frames=251, n_ahead=lambda: int(rng.choice([0, 1, 3, 8, 40])), other_max=6,
                                late_frames=(0, 3), calm_max=30)
        args = as_lists(stretch)
        # THEN the stretch walked with its empty frames passed together is judged as frame after frame
        assert burst_mod.walk_frames(cfg, *args) == _walk_one_by_one(cfg, *args)


@pytest.mark.parametrize("seed", range(16))
def test_a_judgement_ahead_that_says_the_next_frame_closes_the_window_is_right(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a sampler fed quiet seconds, then clusters of up to hundreds of level changes and other events,
    # watermarks anywhere, windows that close within a few frames or stay open for hundreds (a long settle
    # time: judgements ahead that run out of frames before one closes); every judgement of burst frames
    # ahead that says the frame it stopped at closes the window (so the walk takes that frame as usual,
    # without judging ahead from it)
    import copy

    from gpufootprint.sampler.state import ProcessSampler

    rng = np.random.default_rng(seed)
    long_windows = seed % 2 == 1
    cfg = SamplerConfig(burst_settle_ms=1500 if long_windows else int(rng.choice([0, 30, 100])),
                        burst_min_frames=int(rng.integers(1, 6)),
                        burst_max_ms=2000 if long_windows else int(rng.choice([40, 300, 2000])))
    sampler = ProcessSampler(1, cfg)
    judge_ahead = ProcessSampler._burst_run
    said = checked = unsaid = 0

    def checking(self: ProcessSampler, cursor: int, iv: int, frames: int, *rest: object) -> object:
        nonlocal said, checked, unsaid
        got = judge_ahead(self, cursor, iv, frames, *rest)
        unsaid += got is not None and not got[3] and frames - (got[0] - cursor) // iv >= 2
        if got is not None and got[3]:
            said += 1
            # THEN judging ahead again from that frame, with the state the judgement left, stops at once
            again = copy.deepcopy(self)
            c = (got[0] - cursor) // iv
            mem_ts, ev_ts, total, devs, per_dev = rest[:5]
            if frames - c >= 1:
                checked += 1
                assert judge_ahead(again, got[0], iv, frames - c, mem_ts, ev_ts, total, devs, per_dev,
                                   got[1], got[2]) is None
        return got

    monkeypatch.setattr(ProcessSampler, "_burst_run", checking)
    t = 10**12
    last_mark = 0
    for _ in range(30):
        t = last_mark + int(rng.integers(1, 4000)) * _MS  # quiet
        parts = []
        for _ in range(int(rng.integers(1, 10))):
            t += int(rng.choice([0, 1, 5, 10, 15, 20, 150])) * _MS + int(rng.integers(0, 5 * _MS))
            parts.append(t + np.sort(rng.integers(0, int(rng.choice([1, 5, 15])) * _MS, int(rng.integers(1, 300)))))
        ts = np.sort(np.concatenate(parts))
        sampler.add_levels(ts, rng.choice([1 << 20, -(1 << 20), 64 << 20, -(64 << 20), 4 << 10], len(ts)), 0)
        other = np.sort(rng.choice(ts, int(rng.integers(0, len(ts) + 1))))
        if len(other):
            sampler.add_events(other)
        t = int(ts[-1])
        for mark in sorted(t - rng.integers(0, 400, int(rng.integers(1, 4))) * _MS) + [t + int(rng.integers(1, 300)) * _MS]:
            last_mark = max(last_mark, int(mark))
            sampler.advance(last_mark)
    sampler.finish(t + 5000 * _MS)
    assert said > 0 and checked > 0 and (unsaid > 0 or not long_windows)


def test_waiting_level_changes_are_joined_in_time_order_as_a_full_check_finds() -> None:
    # GIVEN random lists of chunks of level-change times, each chunk in time order (as add_levels takes
    # them and a walk keeps the rest of one), some empty, joined in or out of order, with ties
    from gpufootprint.sampler import state as state_mod

    rng = np.random.default_rng(5)
    for _ in range(3000):
        chunks = [np.sort(rng.integers(0, int(rng.choice([3, 50, 10**6])), int(rng.choice([0, 1, 2, 40]))))
                  for _ in range(int(rng.integers(1, 6)))]
        joined = np.concatenate(chunks)
        # THEN the boundaries alone tell what comparing every neighbour tells
        assert state_mod._joined_in_order(chunks) == bool(len(joined) < 2 or (joined[1:] >= joined[:-1]).all())
