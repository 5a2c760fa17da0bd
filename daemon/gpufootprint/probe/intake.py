"""Where CUPTI's threads hand their work to the sender: one queue, written without locks.

CUPTI calls ``requested`` and ``completed`` (cupti-python's objects) or
``raw_completed`` (the raw delivery's ctypes thunk) on whichever thread it
flushes on, inside the workload's process: they pack or queue and return. No
locks held across CUPTI, no I/O, no flush, never raises. The workload's own
threads queue marks and the profiler hand-over here too (probe/core.py); the
sender thread (probe/sender.py) takes everything off.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from gpufootprint.probe.packing import Packer
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.records import MEMORY_DTYPE, RecordKind


def _nothing() -> None:
    return None


class Intake:
    def __init__(self, settings: ProbeSettings, pid: int, counters: Counter[str],
                 dropped_by_reason: Counter[str]) -> None:
        self.settings = settings
        self.counters = counters
        self.dropped_by_reason = dropped_by_reason
        # (RecordKind, records), ("raw", address, valid), ("mark", body, done), ("gap_begin", None, done),
        # ("gap_end", (before, after), done): appended by any thread, taken off by the sender only.
        self.q: deque[Any] = deque()
        # Written by one thread each (no lost updates without a lock): queued = in - out.
        self.records_in = 0  # CUPTI's thread
        self.records_out = 0  # the sender
        self._max_queued = max(1024, settings.buffer_bytes // MEMORY_DTYPE.itemsize)
        self.packer = Packer(pid, self._sink, capacity=settings.capacity, bulk=settings.bulk_pack)
        self.callback_seconds = 0.0
        # Set by the sender: wakes it (threading.Event.set: a lock held for a moment, never across CUPTI).
        self.wake: Callable[[], None] = _nothing
        self.buffers_requested = 0
        self.buffers_completed = 0

    def requested(self) -> tuple[int, int]:
        self.buffers_requested += 1
        return self.settings.cupti_buffer_bytes, 0

    def completed(self, records: list[Any]) -> None:
        # CPU time of this thread: the callback's own cost, not time spent waiting for the GIL.
        t0 = time.thread_time()
        try:
            self.buffers_completed += 1
            self.packer.pack(records)
        except Exception:  # noqa: BLE001
            self.counters["callback_errors"] += 1
        self.callback_seconds += time.thread_time() - t0

    def raw_completed(self, address: int, valid: int) -> None:
        # CUPTI's thread: queue the buffer for the sender and wake it, nothing else.
        self.q.append(("raw", address, valid))
        self.wake()

    def _sink(self, chunk: tuple[RecordKind, np.ndarray]) -> None:
        kind, arr = chunk
        if kind is not RecordKind.MEMORY and self.records_in - self.records_out > self._max_queued:
            self.counters["records_dropped"] += len(arr)  # the sender is far behind: shed volume, keep memory
            self.dropped_by_reason["queue_full"] += len(arr)
            return
        self.records_in += len(arr)
        self.q.append(chunk)
