"""The ``raw`` delivery's side in CUPTI's thread: the callbacks that hand CUPTI buffers and take them back untouched.

The sender thread reads each buffer afterwards (rawreader.py).

cupti-python's buffer-completed wrapper builds one Python object per record on
CUPTI's thread, holding the GIL, before our callback sees the list: on the H200
that work was most of the probe's CPU time in callbacks and flushes (docs/performance.md,
run 3: 0.49 s -> 0.09 s of packing, 0.88 s -> 0.12 s inside flushes, same records).
Here the two activity callbacks are ctypes functions registered on the libcupti
that cupti-python mapped (the only one in the process; see docs/probe.md):

* ``requested`` hands CUPTI a buffer from a bounded pool (malloc'ed, so a buffer
  that ever reached another owner, e.g. a profiler that registered its own
  callbacks, is still a plain heap block). Pool exhausted: no buffer, CUPTI drops
  and counts the records (``cupti_dropped_records``), the workload's memory stays bounded.
* ``completed`` only queues ``(address, valid bytes)`` for the sender and
  returns: no parsing, no locks, no I/O, never raises.

The sender reads the records with ``cupti_layout.walk`` and gives the buffer back.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

REQUESTED = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                              ctypes.POINTER(ctypes.c_size_t))
COMPLETED = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_size_t)

_libc = ctypes.CDLL(None)
_malloc = _libc.malloc
_malloc.restype = ctypes.c_void_p
_malloc.argtypes = [ctypes.c_size_t]

#: Every RawDelivery ever registered: CUPTI may call a registered pointer until the
#: process ends, so the ctypes thunks must never be garbage-collected.
_KEEP_ALIVE: list[Any] = []


class RawDelivery:
    native = False  # Python thunks (probe/nativecallbacks.py: the C ones)

    def __init__(self, buffer_bytes: int, max_buffers: int, on_completed: Callable[[int, int], None]) -> None:
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max(2, max_buffers)
        self._on_completed = on_completed
        self._free: list[int] = []
        self._ours: set[int] = set()  # every buffer address we ever allocated
        self.allocated = 0
        self.requested = 0
        self.completed = 0
        self.refused = 0  # requests answered with no buffer (pool exhausted)
        self.foreign = 0  # completed buffers that were not ours (left alone)
        self.errors = 0
        # (CUcontext, stream) of every completed buffer: CUPTI counts its drops per such queue.
        self.queues: set[tuple[int, int]] = set()
        self._req = REQUESTED(self._requested)
        self._cmp = COMPLETED(self._completed)
        _KEEP_ALIVE.append(self)

    def register(self, lib: Any) -> int:
        """cuptiActivityRegisterCallbacks on ``lib``; returns CUPTI's status (0: success)."""
        fn = lib.cuptiActivityRegisterCallbacks
        fn.restype = ctypes.c_int
        fn.argtypes = [REQUESTED, COMPLETED]
        return int(fn(self._req, self._cmp))

    @property
    def outstanding(self) -> int:
        """Buffers held by CUPTI or waiting for the sender."""
        return self.allocated - len(self._free)

    def give_back(self, address: int) -> None:
        """The sender is done with a buffer (sender thread)."""
        self._free.append(address)

    def take(self) -> list[tuple[int, int]]:
        """Nothing: ``completed`` hands each buffer to the sender itself."""
        return []

    def retire(self) -> None:
        """Nothing to let go of: the thunks wake the sender through Python."""

    # --- CUPTI's threads: list/set operations only (atomic under the GIL), never raise ---

    def _requested(self, buf: Any, size: Any, max_records: Any) -> None:
        try:
            self.requested += 1
            addr = 0
            if self._free:
                addr = self._free.pop()
            elif self.allocated < self.max_buffers:
                addr = _malloc(self.buffer_bytes + 8) or 0
                if addr:
                    addr = (addr + 7) & ~7  # CUPTI wants 8-byte alignment (malloc gives 16)
                    self._ours.add(addr)
                    self.allocated += 1
            if not addr:
                self.refused += 1
            buf[0] = addr or None
            size[0] = self.buffer_bytes if addr else 0
            max_records[0] = 0
        except BaseException:  # noqa: BLE001 - never into CUPTI
            self.errors += 1
            try:
                buf[0] = None
                size[0] = 0
            except BaseException:  # noqa: BLE001, S110 - never into CUPTI; the error is counted above
                pass

    def _completed(self, ctx: Any, stream: int, buf: int | None, size: int, valid: int) -> None:
        try:
            self.completed += 1
            self.queues.add((int(ctx or 0), int(stream)))
            if not buf or buf not in self._ours:
                self.foreign += 1
                return
            if valid <= 0:
                self._free.append(buf)
                return
            self._on_completed(buf, min(int(valid), self.buffer_bytes))
        except BaseException:  # noqa: BLE001
            self.errors += 1


#: ctypes array types by power-of-two size, each made once. ``ctypes.c_uint8 * n`` makes a new type for
#: every length it is not holding alive (about 10 us, and a type object for the cyclic collector), and
#: CUPTI hands its buffers back with as many lengths as their records take: a view per buffer cost that
#: in the sender's thread, GIL held, for each buffer.
_VIEW_TYPES: dict[int, Any] = {}


def view(address: int, valid: int) -> memoryview:
    """The first ``valid`` bytes of a buffer, without a copy (valid until given back)."""
    valid = max(0, valid)
    size = 1 << max(12, (valid - 1).bit_length())
    array = _VIEW_TYPES.get(size)
    if array is None:
        array = _VIEW_TYPES[size] = ctypes.c_uint8 * size
    # The slice is all that may be read: the object behind it (``.obj``) is the whole power-of-two size
    # and may run past the buffer's mapping, so nothing may touch it.
    return memoryview(array.from_address(address)).cast("B")[:valid]
