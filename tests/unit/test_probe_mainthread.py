"""A launch window's switches are made on the program's main thread (probe/mainthread.py).

Switched from a thread of the probe's own, CUPTI's per-API launch switches left the program's launches
slower for good, more with every window (bench/launch_toggle.py on three H100 hosts, 2026-12-06); the
loop's own thread switching them left none. The sender therefore hands the switch to the main thread
and waits for it, and makes the switch itself only when the main thread does not come in time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gpufootprint
import pytest
from gpufootprint.probe import windows as windows_module
from gpufootprint.probe.core import Probe
from gpufootprint.probe.mainthread import MainThreadCall
from gpufootprint.probe.settings import ProbeSettings

from tests import probe_fakes as fk

MAIN = threading.main_thread().ident


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """``fn`` on a thread of its own: its result or exception, and when it returned, in ``out``. A daemon
    thread: a caller that never returns must fail the test, not hang the session."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
        out["at"] = time.monotonic()

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th, out


def _spin_until(th: threading.Thread, timeout: float = 5.0) -> None:
    """The main thread runs bytecode (as a training loop's Python does) until ``th`` ends."""
    deadline = time.monotonic() + timeout
    while th.is_alive() and time.monotonic() < deadline:
        sum(range(50))


def test_a_call_from_another_thread_runs_on_the_main_thread() -> None:
    call = MainThreadCall()
    ran_on: list[int | None] = []
    th, out = _in_thread(lambda: call.run(lambda: ran_on.append(threading.get_ident()) or 7, timeout=5.0))
    _spin_until(th)
    assert out == {"result": 7, "at": out["at"]} and ran_on == [MAIN]
    assert call.on_main == 1 and call.fallbacks == 0


def test_without_pending_calls_the_caller_makes_the_call_and_it_counts_as_a_fallback() -> None:
    call = MainThreadCall()
    call._add = None  # as in a subinterpreter, or a Python without Py_AddPendingCall
    th, out = _in_thread(lambda: call.run(lambda: threading.get_ident(), timeout=5.0))
    th.join(5)
    assert out["result"] == th.ident and call.fallbacks == 1 and call.on_main == 0


def test_the_main_thread_calls_directly() -> None:
    call = MainThreadCall()
    assert call.run(lambda: threading.get_ident(), timeout=5.0) == MAIN
    assert call.on_main == 1 and call.fallbacks == 0


def test_a_main_thread_held_in_c_gets_the_call_made_by_the_caller_after_the_timeout_and_never_twice() -> None:
    # GIVEN the main thread waiting in C (an Event's lock: no bytecode boundary), as in a backward pass
    call = MainThreadCall()
    ran_on: list[int | None] = []
    asked: list[float] = []

    def ask() -> None:
        time.sleep(0.1)  # the main thread is in its wait by now
        asked.append(time.monotonic())
        call.run(lambda: ran_on.append(threading.get_ident()), timeout=0.2)

    th, out = _in_thread(ask)
    threading.Event().wait(0.7)  # held in C past the timeout
    # THEN the caller made the call itself, after about the timeout, once
    th.join(5)
    assert 0.15 < out["at"] - asked[0] < 0.5, out["at"] - asked[0]
    assert ran_on == [th.ident] and call.fallbacks == 1 and call.on_main == 0
    # AND the pending call that now reaches the main thread makes nothing
    for _ in range(1000):
        sum(range(10))
    assert ran_on == [th.ident] and call.on_main == 0


def test_the_main_thread_makes_no_call_from_inside_cuptis_call_of_the_probe() -> None:
    # GIVEN the main thread running the probe's buffer callback (CUPTI may hold its lock there), at
    # bytecode boundaries all along
    def buffer_callback(until: float) -> None:
        while time.monotonic() < until:
            sum(range(50))

    call = MainThreadCall(avoid=[buffer_callback.__code__])
    ran_on: list[int | None] = []

    def ask() -> None:
        time.sleep(0.1)  # the main thread is in the callback by now
        call.run(lambda: ran_on.append(threading.get_ident()), timeout=0.2)

    th, _ = _in_thread(ask)
    buffer_callback(time.monotonic() + 0.7)
    th.join(5)
    # THEN the main thread left it to the caller, who made it after the wait
    assert ran_on == [th.ident] and call.fallbacks == 1 and call.on_main == 0
    # AND the probe's windows avoid exactly CUPTI's callbacks into the probe
    names = {c.co_qualname for c in windows_module.cupti_callback_codes()}
    assert names == {"RawDelivery._requested", "RawDelivery._completed", "Intake.requested",
                     "Intake.completed", "Intake.raw_completed"}


def test_an_error_in_the_call_reaches_the_caller_not_the_program() -> None:
    call = MainThreadCall()

    def boom() -> None:
        raise RuntimeError("cupti said no")

    th, out = _in_thread(lambda: call.run(boom, timeout=5.0))
    _spin_until(th)  # the main thread runs it: nothing may be raised here
    for _ in range(1000):
        sum(range(10))  # nor later
    # the main thread's failed call is made again by the caller (it may have been a signal handler's
    # exception, not fn's): raised there too, it is fn's own and the caller's
    assert isinstance(out.get("error"), RuntimeError) and call.on_main == 0 and call.fallbacks == 1


def _probe(tmp_path: Path, fake: fk.FakeCupti, **kw: Any) -> Probe:
    p = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10, **kw), fake, discover_devices=False)
    assert p.start()
    fake.alloc(0x1000, 4096)  # CUDA is up: the priming ends
    deadline = time.monotonic() + 5
    while fake.launch_switch != [True, False] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.launch_switch == [True, False]
    return p


def test_a_window_the_sender_opens_and_closes_is_switched_on_the_main_thread(tmp_path: Path) -> None:
    # GIVEN a probe whose sender thread opens a launch window (as on the daemon's CONTROL)
    fake = fk.FakeCupti()
    p = _probe(tmp_path, fake)
    try:
        th, _ = _in_thread(lambda: p.sender.open_kernel_window(100, 3, "launches"))
        _spin_until(th)
        assert fake.launch_switch[-1] is True and p.sender.windows.kernel_window is not None
        # WHEN its lease ends and the sender closes it, while the program's Python runs
        deadline = time.monotonic() + 5
        while p.status()["launch_switches_main"] < 2 and time.monotonic() < deadline:
            sum(range(50))
        # THEN both switches were made on the main thread
        assert fake.launch_switch == [True, False, True, False]
        assert fake.launch_switch_threads[2:] == [MAIN, MAIN]
        st = p.status()
        assert st["launch_switches_main"] == 2 and st["launch_switches_fallback"] == 0
    finally:
        p.stop()


def test_with_the_main_thread_held_the_window_still_closes_within_the_wait(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a window open, and the main thread held in C when its lease ends
    monkeypatch.setattr(windows_module, "MAIN_SWITCH_WAIT_S", 0.2)
    fake = fk.FakeCupti()
    p = _probe(tmp_path, fake)
    try:
        th, _ = _in_thread(lambda: p.sender.open_kernel_window(50, 4, "launches"))
        _spin_until(th)
        opened = time.monotonic()
        threading.Event().wait(1.0)  # the lease ends 50 ms in: the sender asks, and the main thread is away
        deadline = time.monotonic() + 5
        while p.status()["launch_switches_fallback"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        # THEN the sender switched off itself, about the wait after the lease, not when the main thread came
        assert fake.launch_switch == [True, False, True, False]
        assert fake.launch_switch_threads[2] == MAIN and fake.launch_switch_threads[3] != MAIN
        assert fake.host_call(211) is False  # off: no launch recorded any more
        st = p.status()
        assert st["launch_switches_main"] == 1 and st["launch_switches_fallback"] == 1
        assert p.sender.windows.kernel_window is None and time.monotonic() - opened < 1.5
        assert fake.launch_switch_at[3] - opened < 0.5  # the lease (50 ms) and the wait (0.2 s), not the 1 s
    finally:
        p.stop()


def test_switching_from_the_sender_as_before_is_one_setting(tmp_path: Path) -> None:
    fake = fk.FakeCupti()
    p = _probe(tmp_path, fake, launch_switch_on_main=False)
    try:
        th, _ = _in_thread(lambda: p.sender.open_kernel_window(50, 5, "launches"))
        th.join(5)  # no bytecode from the main thread needed
        assert fake.launch_switch[-1] is True and fake.launch_switch_threads[-1] == th.ident
        assert p.status()["launch_switches_main"] == 0
    finally:
        p.stop()


def test_a_ctrl_c_while_the_main_thread_switches_reaches_the_program_and_the_caller_still_returns() -> None:
    # GIVEN Python's own SIGINT handler (KeyboardInterrupt), and a Ctrl-C that arrives while the main thread
    # makes the call: its handler runs at the call's next bytecode boundary, inside the call
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        call = MainThreadCall()
        made_on: list[int | None] = []

        def switch() -> bool:
            if threading.current_thread() is threading.main_thread():
                signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, delivered here
            made_on.append(threading.get_ident())
            return True

        th, out = _in_thread(lambda: call.run(switch, timeout=0.2))
        interrupted = False
        try:
            _spin_until(th, timeout=3.0)
            th.join(0.5)  # the main thread's bytecode keeps running while it waits (Event.wait's Python)
            for _ in range(1000):
                sum(range(10))
        except KeyboardInterrupt:
            interrupted = True
        th.join(3.0)
        # THEN the program got its KeyboardInterrupt (not swallowed by the probe)
        assert interrupted
        # AND the caller did not wait forever: it made the switch itself, whole, and returned
        assert not th.is_alive(), "the caller waits forever for a call the main thread abandoned"
        assert out.get("result") is True and made_on == [th.ident] and call.fallbacks == 1
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_exception_of_the_programs_signal_handler_during_the_call_is_the_programs_not_the_callers() -> None:
    # GIVEN the program's handler that raises its own exception (a timeout by SIGALRM, say), run by the main
    # thread at a bytecode boundary inside the call
    class ProgramTimeout(Exception):
        pass

    def on_alarm(_sig: int, _frame: Any) -> None:
        raise ProgramTimeout("the program's own timeout")

    previous = signal.signal(signal.SIGUSR1, on_alarm)
    try:
        call = MainThreadCall()
        made_on: list[int | None] = []

        def switch() -> bool:
            if threading.current_thread() is threading.main_thread():
                signal.raise_signal(signal.SIGUSR1)
            made_on.append(threading.get_ident())
            return True

        th, out = _in_thread(lambda: call.run(switch, timeout=0.2))
        got: BaseException | None = None
        try:
            _spin_until(th, timeout=3.0)
            th.join(0.5)
            for _ in range(1000):
                sum(range(10))
        except ProgramTimeout as exc:
            got = exc
        th.join(3.0)
        # THEN the program's exception reached the program, as it is
        assert isinstance(got, ProgramTimeout) and got.args == ("the program's own timeout",)
        # AND the caller got no error: the switch was made, whole, by the caller
        assert not th.is_alive() and "error" not in out, out
        assert out.get("result") is True and made_on == [th.ident] and call.fallbacks == 1
    finally:
        signal.signal(signal.SIGUSR1, previous)


_FORK_SCRIPT = r"""
import ctypes, os, sys, threading, time
from gpufootprint.probe.mainthread import MainThreadCall

call = MainThreadCall()
r, w = os.pipe()
parent = os.getpid()

def switch():
    os.write(w, b"%d\n" % os.getpid())  # who made the switch
    return True

@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
def forker(_arg):
    # the program forks (a DataLoader worker, say) while the sender's pending call is still queued
    if call._fn is None:
        print("NOT_QUEUED", flush=True)  # the test's own set-up went wrong: fail, not pass
        return 0
    os.fork()  # the child goes on: CPython's next pending call in its queue is the sender's
    return 0

add = ctypes.pythonapi.Py_AddPendingCall
add.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
go = threading.Event()

def sender():
    time.sleep(0.2)  # the main thread is held in C by now (go.wait): the two calls stay queued
    add(ctypes.cast(forker, ctypes.c_void_p), None)
    threading.Timer(0.3, go.set).start()
    call.run(switch, timeout=5.0)

threading.Thread(target=sender, daemon=True).start()
go.wait(10)  # held in C while both calls are queued; the pending calls run once it returns
for _ in range(1000):
    sum(range(10))
if os.getpid() != parent:
    os._exit(0)
time.sleep(0.5)
os.close(w)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
pids = os.read(r, 4096).decode().split()
print("PARENT", parent, "SWITCHED_IN", " ".join(pids))
"""


def test_a_call_still_queued_when_the_program_forks_makes_nothing_in_the_child(tmp_path: Path) -> None:
    # GIVEN the sender's pending call queued in CPython when the program forks: the child inherits the
    # queue and runs it (the CUDA parent's CUPTI is unusable there; its locks may be held by threads
    # that did not survive the fork)
    script = tmp_path / "fork_queued.py"
    script.write_text(_FORK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(gpufootprint.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True,
                          timeout=60, env=env, check=False)
    assert done.returncode == 0 and "NOT_QUEUED" not in done.stdout, (done.stdout, done.stderr)
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("PARENT"))
    parent, switched = line.split()[1], line.split()[3:]
    # THEN the switch was made once, in the parent, never in the child
    assert switched == [parent], line


def test_a_ctrl_c_during_the_call_reaches_the_program_even_when_the_call_fails_for_the_caller_too() -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        call = MainThreadCall()

        def switch() -> bool:
            if threading.current_thread() is threading.main_thread():
                signal.raise_signal(signal.SIGINT)
            raise RuntimeError("cupti said no")

        th, out = _in_thread(lambda: call.run(switch, timeout=0.2))
        interrupted = False
        try:
            _spin_until(th, timeout=3.0)
            th.join(0.5)
            for _ in range(1000):
                sum(range(10))
        except KeyboardInterrupt:
            interrupted = True
        th.join(3.0)
        # THEN the caller got fn's error, and the program its Ctrl-C all the same
        assert not th.is_alive() and isinstance(out.get("error"), RuntimeError), out
        assert interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_probe_in_a_subinterpreter_makes_every_call_on_the_callers_thread() -> None:
    # Since 3.12 CPython runs every pending call on the main interpreter's main thread: a probe in a
    # subinterpreter would have its objects used by another interpreter. There, no pending calls at all.
    interpreters = pytest.importorskip("_xxsubinterpreters", reason="this Python has no _xxsubinterpreters")
    daemon_dir = str(Path(windows_module.__file__).resolve().parents[2])
    interp = interpreters.create()
    try:
        interpreters.run_string(interp, f"""
import importlib.util
spec = importlib.util.spec_from_file_location("mt", {daemon_dir!r} + "/gpufootprint/probe/mainthread.py")
mt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mt)
call = mt.MainThreadCall()
assert call._add is None, "pending calls used in a subinterpreter"
assert call.run(lambda: 5, timeout=0.1) == 5  # (no threads in an isolated subinterpreter to call from)
""")
    finally:
        interpreters.destroy(interp)
    assert MainThreadCall()._add is not None  # and in the main interpreter, they are used
