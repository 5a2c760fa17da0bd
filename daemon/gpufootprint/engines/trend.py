"""A bounded time series and its least-squares slope (budgets, leaks)."""

from __future__ import annotations

import math

import numpy as np

#: Times enter the sums as whole units of 2**-32 s: exact for any time since 1970 in float seconds (whose
#: resolution there is 2**-22 s), and within 2**-32 s for smaller ones.
_TIME_UNITS = 1 << 32


class Trend:
    """Samples of one quantity over a trailing window of seconds.

    Kept in two arrays (times, values) with a moving start, not a list of pairs: the leak engine reads the
    segment floors of every process's trend over windows of minutes (2,400 samples at its 240 s).

    The slope comes from running sums (count, sum of times, of values, of squared times, of their products)
    kept as Python integers, added to as a sample comes and taken from as it leaves the window: exact, so
    nothing drifts however long a trend runs, and a slope costs a few integer operations instead of a pass
    over the window. The engines read it for every device at every snapshot, ten a second: a pass cost
    about 20 us a device even with few samples (numpy's fixed costs), 0.04 s a snapshot on a node of 2,048
    devices. Values enter the sums rounded to whole units (the engines' are bytes)."""

    _MIN = 64

    def __init__(self, window_seconds: float) -> None:
        if not window_seconds >= 0:  # (NaN too: the window's cut compares with it)
            raise ValueError(f"a trend's window must be a number of seconds at least 0, got {window_seconds!r}")
        self.window = window_seconds
        self._t = np.empty(self._MIN)
        self._v = np.empty(self._MIN)
        self._lo = 0
        self._hi = 0
        self._origin = 0  # the first sample's time in units: the sums' times are relative to it (smaller ints)
        self._sx = self._sy = self._sxx = self._sxy = 0

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
        """A sample; one at the latest time replaces its value, an earlier one is ignored (a replay restarted:
        the newer history stays), and so is one whose time or value is not finite (nothing to fit)."""
        value = float(value)  # the sums take back what the array keeps: the same float
        units = t * _TIME_UNITS
        if not (math.isfinite(units) and math.isfinite(value)):
            return
        y = round(value)
        lo, hi = self._lo, self._hi
        if hi > lo:
            last = self._t.item(hi - 1)
            if t <= last:
                if t == last:  # the same time again: its value replaced
                    dy = y - round(self._v.item(hi - 1))
                    self._sy += dy
                    self._sxy += (int(units) - self._origin) * dy
                    self._v[hi - 1] = value
                return
        else:
            self._origin = int(units)
        x = int(units) - self._origin
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
        self._sx += x
        self._sy += y
        self._sxx += x * x
        self._sxy += x * y
        # the samples at or after the horizon stay: usually none leaves, or one (a look, not a search)
        horizon = t - self.window
        if self._t.item(lo) < horizon:
            if self._t.item(lo + 1) >= horizon:  # (the newest sample stays: lo + 1 < hi here)
                keep = lo + 1  # one leaves: a full window at an even cadence
            else:
                keep = lo + int(np.searchsorted(self._t[lo:hi], horizon, "left"))
            if keep - lo <= hi - keep:
                self._take(lo, keep, -1)  # the leaving samples out of the sums
            else:  # most leave (a gap longer than the window): the sums of those that stay
                self._sx = self._sy = self._sxx = self._sxy = 0
                self._take(keep, hi, 1)
            lo = keep
        self._lo, self._hi = lo, hi

    def _take(self, start: int, stop: int, sign: int) -> None:
        """Samples ``start:stop`` added to the sums (``sign`` 1) or taken from them (-1)."""
        origin = self._origin
        for t, v in zip(self._t[start:stop].tolist(), self._v[start:stop].tolist(), strict=True):
            x, y = int(t * _TIME_UNITS) - origin, round(v)
            self._sx += sign * x
            self._sy += sign * y
            self._sxx += sign * x * x
            self._sxy += sign * x * y

    def slope(self, min_points: int) -> float | None:
        """The least-squares slope in value units a second; None below ``min_points`` samples (or 2)."""
        n = self._hi - self._lo
        if n < min_points or n < 2:
            return None
        var = n * self._sxx - self._sx * self._sx
        if var <= 0:
            return None
        return (n * self._sxy - self._sx * self._sy) * _TIME_UNITS / var

    @property
    def covered_seconds(self) -> float:
        return float(self._t[self._hi - 1] - self._t[self._lo]) if len(self) > 1 else 0.0
