"""A signal that comes while the main thread holds the stop event's lock still stops the process.

The daemon's main thread waits on ``stop`` (``Event.wait``, ten times a second); a Python signal handler
runs in that thread between two bytecodes, possibly while it holds the event's lock. A handler that
called ``stop.set()`` then waited for that lock forever: a daemon told to stop by SIGTERM hung (found in a
CI rehearsal, 2026-12-06). Each case runs in a child process, where the signal can be sent and a hang
ends in the timeout rather than in this test run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DAEMON = str(Path(__file__).resolve().parents[2] / "daemon")

_PRELUDE = f"""
import os, signal, sys, threading
sys.path.insert(0, {DAEMON!r})
"""

_CASES = {
    "daemon": """
from gpufootprint.cli.serve import install_signal_handlers
stop, hup = threading.Event(), threading.Event()
install_signal_handlers(stop, hup)
""",
    "interrupt": """
from gpufootprint.cli.common import Interrupt
interrupt = Interrupt()
interrupt.__enter__()
stop = interrupt.stop
""",
}

_SEND = """
with stop._cond:  # the main thread holds the event's lock, as it does inside stop.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    held = True  # the handler runs here, at a bytecode boundary, the lock still held
assert stop.wait(5), "SIGTERM did not set stop"
print("stopped")
"""


@pytest.mark.parametrize("case", sorted(_CASES))
def test_sigterm_while_the_main_thread_holds_the_stop_events_lock_stops_it(case: str) -> None:
    try:
        r = subprocess.run([sys.executable, "-c", _PRELUDE + _CASES[case] + _SEND], capture_output=True, text=True,
                           timeout=20, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung: the signal handler waited for a lock its own thread held")
    assert r.returncode == 0 and r.stdout.strip() == "stopped", r.stderr[-2000:]


def test_a_signal_action_that_fails_does_not_stop_later_signals_from_acting() -> None:
    script = _PRELUDE + """
from gpufootprint.signals import on_signal
done = threading.Event()
calls = []
def action(signum):
    calls.append(signum)
    if len(calls) == 1:
        raise RuntimeError("first one fails")
    done.set()
on_signal(signal.SIGUSR1, action)
os.kill(os.getpid(), signal.SIGUSR1)
import time; time.sleep(0.5)
os.kill(os.getpid(), signal.SIGUSR1)
assert done.wait(5), calls
print(len(calls))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-2000:]
    assert "first one fails" in r.stderr  # logged, not swallowed


def test_a_signal_that_lands_as_an_interrupt_block_ends_is_not_lost() -> None:
    # The handler only queues the signal: the block's end must let the signals thread act on it before the
    # action is forgotten (a review saw 65 of 200 lost before).
    script = _PRELUDE + """
from gpufootprint.cli.common import Interrupt
lost = 0
for _ in range(200):
    it = Interrupt()
    with it:
        os.kill(os.getpid(), signal.SIGTERM)
    lost += it.signal is None
print(lost)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "0", (r.stdout, r.stderr[-2000:])


def test_nested_interrupts_give_the_signal_back_to_the_outer_one() -> None:
    script = _PRELUDE + """
import time
from gpufootprint.cli.common import Interrupt
outer, inner = Interrupt(), Interrupt()
with outer:
    with inner:
        pass
    os.kill(os.getpid(), signal.SIGINT)
    assert outer.stop.wait(5)
print(outer.signal, inner.signal)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "SIGINT None", (r.stdout, r.stderr[-2000:])
