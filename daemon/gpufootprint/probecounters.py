"""A process's probe counters: the latest value of each, as its HEARTBEAT and GOODBYE frames said.

A heartbeat carries some 40 counters; checking and converting them one by one cost about 10 us a
heartbeat, while nothing reads them until a snapshot (the exporter's metrics, a report). So a
heartbeat's counters are kept as they came and taken in when read: the newest value of each key
wins, as when every heartbeat was taken in at once, and keys keep the order in which they first
came with a value kept. A replay that never reads them (or a looped trace whose process restarts)
does not pay for them; a daemon that snapshots every tick takes in each process's heartbeats of
that tick together, so it pays no more than before.
"""

from __future__ import annotations

import sys
from typing import Any, Final

_FLOAT_MAX: Final = sys.float_info.max  # compared with a JSON integer exactly, whatever its size
#: Counters waiting to be taken in, at most (some 25 heartbeats of this build's probe): a process whose
#: counters are never read holds no more, and a damaged trace's huge heartbeat is taken in at once.
MAX_PENDING: Final = 1024


def counter_value(value: object) -> float | None:
    """A counter's value as kept: a finite number a float holds (JSON's integers have no bound, and
    NaN or Infinity would poison the sums read from them); None for anything else, which is dropped."""
    if isinstance(value, (int, float)) and -_FLOAT_MAX < value < _FLOAT_MAX:
        return float(value)
    return None


def clean_counters(counters: dict[str, Any]) -> dict[str, float]:
    """The counters of one heartbeat that are kept, in its order."""
    return {k: float(v) for k, v in counters.items()
            if isinstance(v, (int, float)) and -_FLOAT_MAX < v < _FLOAT_MAX}


class ProbeCounters:
    __slots__ = ("_pending", "_pending_keys", "_values")

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._pending: list[dict[str, Any]] = []
        self._pending_keys = 0

    def add(self, counters: dict[str, Any]) -> None:
        """One heartbeat's counters, unchecked (JSON object keys are str): taken in when read.
        The caller hands over the dict: it must not change it afterwards."""
        self._pending.append(counters)
        self._pending_keys += len(counters)
        if self._pending_keys >= MAX_PENDING:
            self._take_in()

    def add_clean(self, clean: dict[str, float]) -> None:
        """Counters already checked (a live peer's, also cut to a bound), taken in now."""
        if self._pending:
            self._take_in()
        self._values.update(clean)

    def values(self) -> dict[str, float]:
        """The latest value of each counter (the dict itself: read it, do not keep it)."""
        if self._pending:
            self._take_in()
        return self._values

    def _take_in(self) -> None:
        pending, values = self._pending, self._values
        # Newest first: a key's value is the newest one kept; an older heartbeat with no key left to
        # give (the common case: the same keys in every heartbeat) is passed with one set difference.
        latest: dict[str, float] = {}
        for raw in reversed(pending):
            for key in raw.keys() - latest.keys():
                value = counter_value(raw[key])
                if value is not None:
                    latest[key] = value
        new = latest.keys() - values.keys()
        if new:
            # New keys go in where taking each heartbeat in at once would have put them: in the order
            # they first came with a value kept (their values are set just below).
            for raw in pending:
                for key, value in raw.items():
                    if key in new and counter_value(value) is not None:
                        values[key] = 0.0
                        new.discard(key)
                if not new:
                    break
        values.update(latest)
        pending.clear()
        self._pending_keys = 0
