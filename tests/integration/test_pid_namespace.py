"""The probe's ``untracked`` figure in a container with its own pid namespace (issue 30, item 9).

NVML reports host pids; a probe in its own pid namespace knows only its container pid, so matching
the two would find nothing, or a host process that happens to have the same number. The probe
must then give no figure (the daemon, which sees host pids, exports NVML's per-process figure).
The namespace is a real one (``unshare --pid --fork --mount-proc``); NVML is a stand-in that lists
the child's own pid number, as a host process with that pid would appear.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import cli_env

pytestmark = pytest.mark.integration

CHILD = r"""
import json, os, sys, types
fake = types.ModuleType("pynvml")
class NVMLError(Exception): pass
class Proc:  # a process NVML lists with this child's pid number (in the host's numbering)
    pid = os.getpid(); usedGpuMemory = 123 << 20
fake.NVMLError = NVMLError
fake.nvmlInit = lambda: None
fake.nvmlDeviceGetHandleByIndex = lambda i: i
fake.nvmlDeviceGetComputeRunningProcesses = lambda h: [Proc()]
sys.modules["pynvml"] = fake
from gpufootprint.probe import untracked
print(json.dumps({"pid": os.getpid(), "own_ns": untracked.in_own_pid_namespace(),
                  "used": untracked.nvml_used_bytes(os.getpid(), [{"index": 0}])}))
"""


def _run(prefix: list[str]) -> dict[str, object]:
    r = subprocess.run([*prefix, sys.executable, "-c", CHILD], env=cli_env(), capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_no_untracked_figure_in_a_pid_namespace_of_its_own() -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) here: the pid-namespace part cannot run")
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30,
                           check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here (unprivileged?): {probe.stderr.decode().strip()[:200]}")
    host = _run([])
    if host["own_ns"]:
        pytest.skip("the tests themselves run in a pid namespace of their own: no host-namespace baseline")
    # In the host's namespace the pid NVML lists is this process: the figure is given.
    assert host["used"] == {"0": 123 << 20}, host
    inside = _run([unshare, "--pid", "--fork", "--mount-proc"])
    assert inside["own_ns"] is True and inside["pid"] == 1, inside
    assert inside["used"] is None, inside  # the same listing, but that pid is not this process: no figure
