"""After a torch.profiler session, the probe skips the C-level teardown at exit, keeping the exit status.

On the H200 a probed process that had run a torch.profiler session aborted in 3 to 6 runs
of 10 during the C-level teardown, after Python had finished (docs/probe.md, exit abort).
Here a real child process stands in for that teardown with a C exit handler that aborts
(libc's ``abort`` registered with ``__cxa_atexit``, as a C++ static destructor is, before the probe starts), runs the real probe
over the fake CUPTI, goes through the profiler hand-over, and leaves by every way a Python
program can. Without a hand-over the same child aborts: the stand-in is real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env

CHILD = r"""
import ctypes, os, sys
sys.path.insert(0, sys.argv[1])
libc = ctypes.CDLL(None)
# a C teardown that aborts, registered the way a C++ library's static destructor is
libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
assert libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None) == 0
from gpufootprint import probe
from tests import probe_fakes
fake = probe_fakes.FakeRawCupti()
assert probe.start(backend=fake, discover_devices=False, socket="")
fake.alloc(0x1000, 4096)
if sys.argv[2] == "profiler":
    p = probe.current()
    p.takeover_begin()
    p.takeover_end([], list)
print("work done", flush=False)  # left in Python's buffer: finalisation must still write it
how = sys.argv[3]
if how == "exit3":
    sys.exit(3)
if how == "raise4":
    raise SystemExit(4)
if how == "error":
    raise RuntimeError("the workload failed")
"""


def run_child(tmp_path: Path, session: str, how: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    e = cli_env()
    e.pop("GPUFOOTPRINT_PROBE", None)
    e.update(env)
    return subprocess.run([sys.executable, str(script), str(ROOT), session, how], env=e, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("how,status", [("normal", 0), ("exit3", 3), ("raise4", 4), ("error", 1)])
def test_after_a_profiler_session_the_c_teardown_is_skipped_and_the_exit_status_kept(
        tmp_path: Path, how: str, status: int) -> None:
    r = run_child(tmp_path, "profiler", how)
    assert r.returncode == status, r.stderr[-2000:]
    assert r.stdout == "work done\n"
    if how == "error":
        assert "RuntimeError: the workload failed" in r.stderr


def test_without_a_profiler_session_the_c_teardown_runs_as_before(tmp_path: Path) -> None:
    r = run_child(tmp_path, "none", "normal")
    assert r.returncode == -signal.SIGABRT  # the stand-in teardown ran: the test above can fail
    assert r.stdout == "work done\n"


def test_the_skip_can_be_switched_off(tmp_path: Path) -> None:
    r = run_child(tmp_path, "profiler", "exit3", GPUFOOTPRINT_PROBE_SKIP_C_TEARDOWN_AFTER_PROFILER="0")
    assert r.returncode == -signal.SIGABRT


@pytest.fixture(autouse=True)
def _glibc_only() -> None:
    if not hasattr(os, "confstr") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""):
        pytest.skip("on_exit is glibc's")
