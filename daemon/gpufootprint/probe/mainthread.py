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
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any, Final

#: int (*)(void *), what Py_AddPendingCall takes.
_PENDING_FN: Final = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class MainThreadCall:
    """One call at a time on the main thread, or on the caller's after ``timeout`` (``run``)."""

    def __init__(self, avoid: Iterable[CodeType] = ()) -> None:
        self._pid = os.getpid()  # the process whose main thread makes the calls (not a forked child)
        self._avoid = frozenset(avoid)  # frames inside which the main thread must not make the call
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._fn: Callable[[], Any] | None = None
        # The main thread's outcome: (True, result) or (False, what fn raised there); None: it made none
        self._outcome: tuple[bool, Any] | None = None
        self._callback = _PENDING_FN(self._on_main)  # kept for the process's life: CPython may call it late
        self._add: Any = None  # None: the caller's thread makes every call
        try:
            if _in_main_interpreter():
                add = ctypes.pythonapi.Py_AddPendingCall
                add.argtypes = [_PENDING_FN, ctypes.c_void_p]
                add.restype = ctypes.c_int
                self._add = add
        except AttributeError:  # not CPython
            pass
        self.on_main = 0  # calls the main thread made
        self.fallbacks = 0  # calls the caller made itself: the main thread did not come in time, or refused

    def _on_main(self, _arg: Any) -> int:
        """The main thread, between two bytecodes, GIL held. Never raises into the program."""
        try:
            if os.getpid() != self._pid:
                # A child forked while the call was queued (CPython's queue of pending calls survives the
                # fork): the parent's CUPTI is unusable here and the lock may have been held by the parent's
                # sender, which is gone. Nothing to make, nothing to touch.
                return 0
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
                    self._outcome = (True, fn())
                except BaseException as exc:  # noqa: BLE001 - the caller tells whose it is (run)
                    # fn's own error, or the program's: its signal handlers run at the bytecode boundaries
                    # inside fn (Ctrl-C's KeyboardInterrupt, a timeout's exception), and fn stopped half-way
                    self._outcome = (False, exc)
                self._done.set()  # only wakes the caller early: the outcome, read under the lock, is what counts
        except BaseException:  # noqa: BLE001, S110 - nothing may reach the ctypes callback (it would be lost)
            pass
        return 0

    def run(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()`` on the main thread if it comes within ``timeout`` seconds, else on this one.

        Whatever the main thread's ``fn()`` raised, the call is made again here: a signal handler of the
        program may have raised there, at a bytecode boundary, leaving it half made. An exception it raises
        here too is ``fn``'s own and the caller's; one raised only there is the program's and is raised again
        in the program's main thread (``_give_back``): ``fn`` should report its own failures by its result,
        as the probe's switches do, not by raising."""
        if threading.current_thread() is threading.main_thread():
            self.on_main += 1
            return fn()
        if self._add is None:  # no pending calls here (not CPython, or a subinterpreter)
            self.fallbacks += 1
            return fn()
        with self._lock:
            self._fn, self._outcome = fn, None
            self._done.clear()
        if self._add(self._callback, None) != 0:  # CPython's queue of pending calls is full
            with self._lock:
                self._fn = None
            self.fallbacks += 1
            return fn()
        self._done.wait(timeout)
        with self._lock:  # taken while the main thread makes the call: its outcome is in once this returns
            self._fn = None  # cancelled, if the main thread has not taken it: its pending call will make nothing
            outcome, self._outcome = self._outcome, None
        if outcome is not None and outcome[0]:
            self.on_main += 1
            return outcome[1]
        self.fallbacks += 1  # the main thread did not come, refused, or was interrupted in fn
        try:
            result = fn()  # an exception here is fn's own: the caller's, and the main thread's was the same one
        except Exception:
            if outcome is not None and not isinstance(outcome[1], Exception):
                self._give_back(outcome[1])  # a KeyboardInterrupt there is the program's, whatever fn does
            raise
        if outcome is not None:
            self._give_back(outcome[1])
        return result

    def _give_back(self, exc: BaseException) -> None:
        """Raise the program's exception again in its main thread, once that has left ``_on_main`` (raised
        inside it, it would be lost in the ctypes callback): at its next bytecode boundary, as the signal's
        handler raised it."""
        main = threading.main_thread().ident
        if main is None:
            return
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code is not _ON_MAIN_CODE:
                frame = frame.f_back
            if frame is None:
                break
            time.sleep(0.001)
        _set_async_exc(main, _raising(exc))


def _raising(exc: BaseException) -> type[BaseException]:
    """A class that, raised, raises ``exc`` itself (PyThreadState_SetAsyncExc takes a class, not an object)."""
    def new(_cls: type, *_args: Any) -> BaseException:
        return exc

    try:
        return type(type(exc).__name__, (type(exc),), {"__new__": new, "__module__": type(exc).__module__})
    except TypeError:  # a class that cannot be subclassed: the class alone
        return type(exc)


def _set_async_exc(thread_id: int, cls: type[BaseException]) -> None:
    try:
        fn = ctypes.pythonapi.PyThreadState_SetAsyncExc
        fn.argtypes = [ctypes.c_ulong, ctypes.py_object]
        fn.restype = ctypes.c_int
        fn(thread_id, cls)
    except Exception:  # noqa: BLE001, S110 - not CPython: the exception stays the probe's, lost
        pass


def _in_main_interpreter() -> bool:
    """Whether this code runs in the main interpreter. Since 3.12 CPython runs every pending call on the
    main interpreter's main thread: a probe in a subinterpreter would have its objects used there."""
    get, main = ctypes.pythonapi.PyInterpreterState_Get, ctypes.pythonapi.PyInterpreterState_Main
    get.restype = main.restype = ctypes.c_void_p
    return bool(get() == main())


_ON_MAIN_CODE: Final = MainThreadCall._on_main.__code__
