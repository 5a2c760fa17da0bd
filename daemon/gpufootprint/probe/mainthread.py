"""Run a short call on the program's main thread, from the probe's sender thread.

CUPTI's per-API switches of a launch window (probe/launches.py), turned on and off from a thread of the
probe's own, left a loop of launches on the program's thread slower for good, more with every window:
12-37 % after 100-150 windows on three lent H100 hosts, against 0-6 % when the loop's own thread
switched them, whether between steps or among a step's launches (bench/launch_toggle.py,
docs/performance.md, 2026-12-06). A side thread that had made the context current or launched a kernel
of its own did no better. So the sender asks the main thread to switch: ``Py_AddPendingCall`` runs a
call on the main thread at its next bytecode boundary, as CPython runs signal handlers, without
installing one: nothing the program can see or has to allow.

A bytecode boundary can fall inside the probe's own Python that CUPTI calls on the program's thread
(its buffer callbacks), where CUPTI may hold its lock: a switch made there could wait on that lock for
good. Such frames (``avoid``) are looked for on the main thread's stack; inside one, the call is left
for the caller's fallback.

The main thread may not reach a bytecode boundary soon (it waits in C: a ``loss.backward()``, a
``join``, a long kernel's synchronize). The sender waits at most ``timeout`` seconds and then makes the
call itself (the old way), the pending call cancelled so that it runs nothing when it comes. Exactly
one of the two makes the call: a lock decides.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any, Final

#: int (*)(void *), what Py_AddPendingCall takes.
_PENDING_FN: Final = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class MainThreadCall:
    """One call at a time on the main thread, or on the caller's after ``timeout`` (``run``)."""

    def __init__(self, avoid: Iterable[CodeType] = ()) -> None:
        self._avoid = frozenset(avoid)  # frames inside which the main thread must not make the call
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._fn: Callable[[], Any] | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._callback = _PENDING_FN(self._on_main)  # kept for the process's life: CPython may call it late
        try:
            add = ctypes.pythonapi.Py_AddPendingCall
            add.argtypes = [_PENDING_FN, ctypes.c_void_p]
            add.restype = ctypes.c_int
            self._add: Any = add
        except AttributeError:  # not CPython: the caller's thread makes every call
            self._add = None
        self.on_main = 0  # calls the main thread made
        self.fallbacks = 0  # calls the caller made itself: the main thread did not come in time, or refused

    def _on_main(self, _arg: Any) -> int:
        """The main thread, between two bytecodes, GIL held. Never raises into the program."""
        try:
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code in self._avoid:
                    return 0  # inside CUPTI's call of the probe: left for the caller's fallback
                frame = frame.f_back  # type: ignore[assignment]
            with self._lock:
                fn, self._fn = self._fn, None
                if fn is None:
                    return 0  # cancelled: the caller made the call itself
                try:
                    self._result = fn()
                except Exception as exc:  # noqa: BLE001 - handed to the caller, never to the program
                    self._error = exc
                self.on_main += 1
                self._done.set()
        except BaseException:  # noqa: BLE001, S110 - a KeyboardInterrupt here belongs to nobody
            pass
        return 0

    def run(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()`` on the main thread if it comes within ``timeout`` seconds, else on this one."""
        if self._add is None or threading.current_thread() is threading.main_thread():
            return fn()
        with self._lock:
            self._fn, self._result, self._error = fn, None, None
            self._done.clear()
        if self._add(self._callback, None) != 0:  # CPython's queue of pending calls is full
            with self._lock:
                self._fn = None
            self.fallbacks += 1
            return fn()
        if not self._done.wait(timeout):
            with self._lock:
                late = self._fn is None  # the main thread took it just now
                self._fn = None
            if not late:
                self.fallbacks += 1
                return fn()
            self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result
