"""A bounded time series and its least-squares slope (budgets, leaks)."""

from __future__ import annotations

from collections import deque


def least_squares_slope(points: list[tuple[float, float]]) -> float | None:
    """Slope of the least-squares line through ``(t, v)`` points; None when undefined."""
    n = len(points)
    if n < 2:
        return None
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / var


class Trend:
    """Samples of one quantity over a trailing window of seconds."""

    def __init__(self, window_seconds: float) -> None:
        self.window = window_seconds
        self.points: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        if self.points and t <= self.points[-1][0]:
            if t == self.points[-1][0]:
                self.points[-1] = (t, value)
            return  # time went backwards (a replay restarted): keep the newer history
        self.points.append((t, value))
        horizon = t - self.window
        while self.points and self.points[0][0] < horizon:
            self.points.popleft()

    def slope(self, min_points: int) -> float | None:
        if len(self.points) < min_points:
            return None
        return least_squares_slope(list(self.points))

    @property
    def covered_seconds(self) -> float:
        return self.points[-1][0] - self.points[0][0] if len(self.points) > 1 else 0.0
