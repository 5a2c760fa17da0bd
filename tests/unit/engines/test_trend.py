"""The engines' trend: its window, slope and the leak engine's segment floors, against the plain loops they replaced."""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest
from gpufootprint.engines.leaks import _rising_floors
from gpufootprint.engines.trend import Trend


class ListTrend:
    """The trend as it was: (t, v) pairs in a deque, the window kept by popping from the left."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.points: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        if self.points and t <= self.points[-1][0]:
            if t == self.points[-1][0]:
                self.points[-1] = (t, value)
            return
        self.points.append((t, value))
        while self.points and self.points[0][0] < t - self.window:
            self.points.popleft()


def least_squares_slope(points: list[tuple[float, float]]) -> float | None:
    """The slope as ``Trend.slope`` computed it before: four sums over the pairs."""
    n = len(points)
    if n < 2:
        return None
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / var


def reference_floors(points: list[tuple[float, float]], window: float, segments: int) -> tuple[int, int, int | None]:
    if len(points) < 2:
        return 0, 0, None
    start = points[-1][0] - window
    width = window / segments
    floors: list[tuple[float, float] | None] = [None] * segments
    for t, v in points:
        j = min(segments - 1, max(0, int((t - start) / width)))
        f = floors[j]
        if f is None or v < f[1]:
            floors[j] = (start + j * width, v)
    seen = [f for f in floors if f is not None]
    ups = [b[1] > a[1] for a, b in itertools.pairwise(seen)]
    onset = next((int(seen[i][0] * 1e9) for i, up in enumerate(ups) if up), None)
    return sum(ups), len(ups), onset


@pytest.mark.parametrize("seed", range(12))
def test_the_trend_keeps_the_same_window_slope_and_floors_as_the_plain_loops(seed: int) -> None:
    # GIVEN random series: snapshot cadences from 10 ms to minutes, repeated and backward times, flat stretches,
    # steps, slow growth, wall-clock-sized times and byte-sized values, windows of 1 s to an hour
    rng = np.random.default_rng(seed)
    grid = seed % 3 == 0  # whole-second times and windows: samples fall exactly on the window's edge
    window = float(rng.choice([1.0, 4.0, 240.0, 3600.0]))
    segments = int(rng.choice([2, 4, 8, 13]))
    new, old = Trend(window), ListTrend(window)
    t = 1.8e9 + (0.0 if grid else float(rng.random()))
    v = float(rng.integers(0, 1 << 40))
    for step in range(3000):
        r = rng.random()
        if r < 0.03:
            t -= float(rng.random())  # backwards: ignored
        elif r > 0.06:
            t += 1.0 if grid else float(rng.choice([0.01, 0.1, 1.0, 60.0])) * float(rng.random() + 0.5)
        kind = rng.random()
        if kind < 0.4:
            v += float(rng.integers(0, 1 << 20))
        elif kind < 0.5:
            v = float(rng.integers(0, 1 << 40))
        new.add(t, v)
        old.add(t, v)
        # THEN the same samples, the same segment floors and onset, and the same slope to rounding
        assert new.points == list(old.points), step
        assert new.covered_seconds == (old.points[-1][0] - old.points[0][0] if len(old.points) > 1 else 0.0)
        assert _rising_floors(new, window, segments) == reference_floors(list(old.points), window, segments), step
        want = least_squares_slope(list(old.points)) if len(old.points) >= 5 else None
        got = new.slope(5)
        if want is None or got is None:
            assert (want is None) == (got is None) or abs(want or got or 0) < 1e-6, (step, want, got)
        else:
            assert got == pytest.approx(want, rel=1e-6, abs=1e-6), step


def test_the_slope_stays_exact_through_a_day_of_samples_leaving_the_window() -> None:
    # GIVEN a footprint of a terabyte growing exactly 3 B/s, sampled every second for a day from a wall-clock
    # time, through a 240 s window: 86,160 samples leave it, each taken from the running sums
    trend = Trend(240.0)
    t0 = 1.8e9
    for i in range(86_400):
        trend.add(t0 + i, float((1 << 40) + 3 * i))
        if i % 9_973 == 0 and i >= 4:
            # THEN at every point the slope is 3 exactly: the sums neither drift nor lose the small
            # growth under the large level (sums kept as floats fail here)
            assert trend.slope(5) == 3.0, i
    assert len(trend) == 241
    assert trend.slope(5) == 3.0
    # AND a value replaced at the latest time, and a flat stretch after it, move the slope as the plain loops do
    trend.add(t0 + 86_399, float(1 << 40))
    want = least_squares_slope(trend.points)
    assert trend.slope(5) == pytest.approx(want, rel=1e-9)
    for i in range(86_400, 86_400 + 240):
        trend.add(t0 + i, float(1 << 40))
    assert trend.slope(5) == 0.0


def test_a_trend_of_fewer_than_two_samples_has_no_slope_and_a_repeated_time_replaces_its_value() -> None:
    trend = Trend(60.0)
    assert trend.slope(2) is None
    trend.add(5.0, 10.0)
    assert trend.slope(2) is None  # one sample
    trend.add(5.0, 20.0)  # the same time: replaced, still one sample
    assert len(trend) == 1 and trend.points == [(5.0, 20.0)]
    trend.add(6.0, 30.0)
    assert trend.slope(3) is None and trend.slope(2) == 10.0


def test_samples_that_are_not_finite_are_ignored_and_large_integers_kept_as_the_array_keeps_them() -> None:
    trend = Trend(60.0)
    for i in range(10):
        trend.add(1.8e9 + i, float(1000 * i))
    before = trend.points
    # GIVEN a value or time that is not finite (nothing to fit): THEN ignored, the trend as it was
    for t, v in ((1.8e9 + 10, float("nan")), (1.8e9 + 10, float("inf")), (float("nan"), 5.0), (float("inf"), 5.0),
                 (1e300, 5.0)):
        trend.add(t, v)
        assert trend.points == before and trend.slope(2) == 1000.0
    # GIVEN Python integers past 2**53 (the float the array keeps is not the integer): THEN the sums are of
    # the kept floats, so a flat stretch after a step reads flat once the step has left the window
    big = Trend(10.0)
    big.add(0.0, (1 << 60) + 1)
    for i in range(1, 30):
        big.add(float(i), 1 << 60)
    assert big.slope(2) == 0.0


def test_a_gap_longer_than_the_window_leaves_the_newest_sample_and_exact_sums() -> None:
    trend = Trend(100.0)
    for i in range(500):
        trend.add(1.8e9 + i, float(7 * i))
    trend.add(1.8e9 + 10_000, 5.0)  # a stall of 10,000 s: every earlier sample leaves at once
    assert len(trend) == 1 and trend.slope(2) is None
    for i in range(1, 50):
        trend.add(1.8e9 + 10_000 + i, 5.0 + 3 * i)
    assert trend.slope(2) == 3.0


@pytest.mark.parametrize("window", [-1.0, float("nan")])
def test_a_window_that_is_not_a_length_of_time_is_refused(window: float) -> None:
    with pytest.raises(ValueError, match="window must be a number of seconds"):
        Trend(window)
