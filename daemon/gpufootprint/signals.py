"""Signals acted on by a thread of their own, never inside the Python signal handler.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread is: inside
``threading.Event.wait`` it may hold the event's lock, and a handler that calls ``Event.set`` then waits
for that lock forever (a daemon told to stop by SIGTERM hung so in a loaded CI rehearsal, 2026-12-06;
tests/unit/test_signals.py). So the handler only writes the signal's number to a pipe; a daemon thread reads it and
runs the action, taking whatever locks it needs like any other thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_start_lock = threading.Lock()
_actions: dict[int, Callable[[int], None]] = {}  # the action of each signal now
_handlers: dict[Any, Callable[[int], None]] = {}  # each handler made here, and its action: put back by restore
_flushes: list[threading.Event] = []  # set, in order, as the thread reads each FLUSH byte
_write_fd: int | None = None

#: Written by ``restore`` after the handler is put back: every signal written before it is acted on first.
FLUSH = 0


def _deliver(read_fd: int) -> None:
    while True:
        data = os.read(read_fd, 64)
        if not data:
            return
        for signum in data:
            if signum == FLUSH:
                if _flushes:
                    _flushes.pop(0).set()
                continue
            action = _actions.get(signum)
            if action is None:
                continue
            try:
                action(signum)
            except Exception:
                log.exception("the action for signal %d failed", signum)


def _pipe() -> int:
    global _write_fd
    with _start_lock:
        if _write_fd is None:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            threading.Thread(target=_deliver, args=(read_fd,), name="gpufootprint-signals", daemon=True).start()
            _write_fd = write_fd
        return _write_fd


def on_signal(signum: int, action: Callable[[int], None]) -> Any:
    """From now on ``action(signum)`` runs on the signals thread soon after ``signum`` arrives. Call it
    from the main thread (as ``signal.signal``); returns the handler it replaces."""
    write_fd = _pipe()
    _actions[signum] = action

    def _handler(num: int, _frame: object) -> None:
        try:
            os.write(write_fd, bytes((num,)))
        except OSError:  # the pipe is full: signals enough are on their way already
            pass

    _handlers[_handler] = action
    return signal.signal(signum, _handler)


def restore(signum: int, handler: Any, wait_s: float = 1.0) -> None:
    """Put back ``handler`` (what ``on_signal`` returned). A signal that came before is acted on first
    (up to ``wait_s``): one that lands as a block ends is not lost. If ``handler`` was made here, its
    action is the signal's action again (nested uses)."""
    current = signal.signal(signum, handler)
    if _write_fd is not None:
        done = threading.Event()
        _flushes.append(done)
        try:
            os.write(_write_fd, bytes((FLUSH,)))
        except OSError:
            _flushes.remove(done)
        else:
            done.wait(wait_s)
    _handlers.pop(current, None)
    if handler in _handlers:
        _actions[signum] = _handlers[handler]
    else:
        _actions.pop(signum, None)
