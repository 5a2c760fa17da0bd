"""A bounded time series and its least-squares slope (budgets, leaks)."""

from __future__ import annotations

import numpy as np


class Trend:
    """Samples of one quantity over a trailing window of seconds.

    Kept in two arrays (times, values) with a moving start, not a list of pairs: the engines read the slope
    of every process's trend at every snapshot, ten a second, over windows of minutes (2,400 samples at the
    leak engine's 240 s), and a walk of those in Python cost about a millisecond each."""

    _MIN = 64

    def __init__(self, window_seconds: float) -> None:
        self.window = window_seconds
        self._t = np.empty(self._MIN)
        self._v = np.empty(self._MIN)
        self._lo = 0
        self._hi = 0

    def __len__(self) -> int:
        return self._hi - self._lo

    @property
    def times(self) -> np.ndarray:
        """The samples' times, oldest first (a view: valid until the next ``add``)."""
        return self._t[self._lo:self._hi]

    @property
    def values(self) -> np.ndarray:
        return self._v[self._lo:self._hi]

    @property
    def points(self) -> list[tuple[float, float]]:
        """The samples as (time, value) pairs, oldest first."""
        return list(zip(self.times.tolist(), self.values.tolist(), strict=True))

    def add(self, t: float, value: float) -> None:
        lo, hi = self._lo, self._hi
        if hi > lo and t <= self._t[hi - 1]:
            if t == self._t[hi - 1]:
                self._v[hi - 1] = value
            return  # time went backwards (a replay restarted): keep the newer history
        if hi == len(self._t):
            n = hi - lo
            if n * 2 > len(self._t):  # more than half full: a larger array
                size = max(self._MIN, 2 * n)
                t_new, v_new = np.empty(size), np.empty(size)
            else:  # the space before the samples is the larger: taken back
                t_new, v_new = self._t, self._v
            t_new[:n] = self._t[lo:hi]
            v_new[:n] = self._v[lo:hi]
            self._t, self._v, lo, hi = t_new, v_new, 0, n
        self._t[hi] = t
        self._v[hi] = value
        hi += 1
        # the samples at or after the horizon stay
        self._lo = lo + int(np.searchsorted(self._t[lo:hi], t - self.window, "left"))
        self._hi = hi

    def slope(self, min_points: int) -> float | None:
        if len(self) < min_points or len(self) < 2:
            return None
        t, v = self.times, self.values
        dt = t - t.mean()
        var = float(dt @ dt)
        if var <= 0:
            return None
        return float(dt @ (v - v.mean())) / var

    @property
    def covered_seconds(self) -> float:
        return float(self._t[self._hi - 1] - self._t[self._lo]) if len(self) > 1 else 0.0
