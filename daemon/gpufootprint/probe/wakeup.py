"""The sender's wake-up: ``threading.Event``'s set, wait and clear over an eventfd.

C code can set an eventfd without the GIL: the C buffer callbacks (probe/nativecallbacks.py) wake
the sender that way when CUPTI completes a buffer, and Python threads (a mark, ``stop``) the same
way through ``set``. Where the platform has no eventfd, a ``threading.Event`` serves (the C
callbacks are then not used: they need the fd).
"""

from __future__ import annotations

import math
import os
import select
import threading
from typing import Any

from gpufootprint.probe.nativecallbacks import eventfd


class Wakeup:
    def __init__(self, native: Any = None) -> None:
        # The probe's C library through ctypes.PyDLL: ``clear`` keeps the GIL (the sender's thread clears after
        # each wake; behind busy Python threads a call that lets the GIL go waits to win it back).
        self._native = native
        self.fd = eventfd()
        self._lock = threading.Lock()  # set against close: never a write to a closed (or reused) fd
        self._closed = False
        self.pinned = False  # C code writes to the fd: only ``close`` after the C side let go ends it
        self._event: threading.Event | None = None
        if self.fd is None:
            self._event = threading.Event()
        else:
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)

    def set(self) -> None:
        if self._event is not None:
            self._event.set()
            return
        with self._lock:
            if not self._closed:
                try:
                    os.eventfd_write(self.fd, 1)  # type: ignore[arg-type]
                except OSError:  # BlockingIOError: the counter is at its maximum, the sender is awake
                    pass

    def wait(self, timeout: float) -> None:
        if self._event is not None:
            self._event.wait(timeout)
            return
        if not self._closed:
            self._poll.poll(max(0, math.ceil(timeout * 1000)))  # poll's unit is the millisecond

    def clear(self) -> None:
        if self._event is not None:
            self._event.clear()
            return
        with self._lock:
            if not self._closed:
                if self._native is not None:
                    self._native.gfp_eventfd_clear(self.fd)
                    return
                try:
                    os.eventfd_read(self.fd)  # type: ignore[arg-type]
                except OSError:  # BlockingIOError: nothing was set
                    pass

    def close(self) -> None:
        """No more wakes (the C side, if it writes to the fd, must have let go of it first)."""
        with self._lock:
            if self._closed or self.fd is None:
                return
            self._closed = True
            os.close(self.fd)

    def __del__(self) -> None:
        if not self.pinned:
            try:
                self.close()
            except Exception:  # noqa: BLE001, S110 - interpreter shutdown
                pass
