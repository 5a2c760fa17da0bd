"""The image without a container builder (none can be installed from the package registries
here): the Dockerfile's build-stage install steps run as written in a venv, its layer order,
its HEALTHCHECK command against a real daemon, and `demo` and `daemon` as PID 1 of their own pid
namespace (as in a container) stopping on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import gpufootprint
import pytest

from tests.conftest import cli_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _build_stage() -> list[tuple[str, str]]:
    """(instruction, argument) of the first stage, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    steps: list[tuple[str, str]] = []
    froms = 0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word == "FROM":
            froms += 1
            if froms == 2:
                break
            continue
        if froms == 1:
            steps.append((word, rest.strip()))
    return steps


def test_the_dependency_layer_comes_before_the_code_layer() -> None:
    steps = _build_stage()
    install = [i for i, (w, a) in enumerate(steps) if w == "RUN" and "pip install" in a]
    assert len(install) == 2, steps
    deps, code = install
    copied_before = " ".join(a for w, a in steps[:deps] if w == "COPY")
    assert "daemon/" not in copied_before and "README.md" not in copied_before  # code changes keep the layer
    assert "-c constraints.txt" in steps[deps][1]
    assert any(w == "COPY" and a.startswith("daemon/") for w, a in steps[deps:code])
    assert "--no-deps" in steps[code][1]


def test_the_build_stage_install_steps_make_a_working_daemon_venv(tmp_path: Path) -> None:
    src, venv = tmp_path / "src", tmp_path / "opt"
    src.mkdir()
    subst = {"/opt/gpufootprint": str(venv), "/tmp/requirements.txt": str(tmp_path / "requirements.txt"),
             "/src": str(src)}
    ran = 0
    for word, arg in _build_stage():
        if word == "COPY":
            *sources, dest = shlex.split(arg)
            target = src / dest if not dest.startswith("/") else Path(subst.get(dest, dest))
            for s in sources:
                if (ROOT / s).is_dir():  # as docker does: the directory's contents
                    shutil.copytree(ROOT / s, target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
                else:
                    shutil.copy(ROOT / s, target / Path(s).name)
        elif word == "RUN" and not arg.startswith("apt-get"):
            command = arg
            for old, new in subst.items():
                command = re.sub(re.escape(old) + r"(?=[/\s]|$)", new, command)
            r = subprocess.run(["bash", "-c", command], cwd=src, capture_output=True, text=True, timeout=900,
                               check=False, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
            assert r.returncode == 0, f"RUN {command}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            ran += 1
    assert ran == 2
    # the daemon's C core was built (the stage's last step loads it), the probe's library was not
    assert [p.name for p in venv.rglob("libgfp-*.so")] == ["libgfp-core.so"]
    py, env = str(venv / "bin" / "python"), {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    r = subprocess.run([str(venv / "bin" / "gpufootprint"), "--version"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path, check=False)
    assert r.stdout.strip() == f"gpufootprint {gpufootprint.__version__}", r.stderr
    # the daemon's bindings are there, the probe's are not (nodes do not need CUPTI)
    r = subprocess.run([py, "-c", "import pynvml, bcrypt, prometheus_client, yaml, numpy"], capture_output=True,
                       text=True, timeout=120, env=env, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([py, "-c", "import cupti"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path, check=False)
    assert r.returncode != 0
    # at the versions of the constraints file
    pins = dict(ln.split("==", 1) for ln in (ROOT / "constraints.txt").read_text().splitlines()
                if ln and not ln.startswith("#"))
    pins = {k.lower().replace("_", "-"): v for k, v in pins.items()}
    r = subprocess.run([py, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                       timeout=120, env=env, check=True)
    for line in r.stdout.splitlines():
        name, _, version = line.partition("==")
        name = name.lower().replace("_", "-")
        if name in pins:
            assert version == pins[name], line
    # the HEALTHCHECK's command, with nothing listening: one line, exit 1
    port = _free_port()
    r = subprocess.run([py, "-m", "gpufootprint.healthcheck", "--listen", f"127.0.0.1:{port}"], capture_output=True,
                       text=True, timeout=60, env=env, cwd=tmp_path, check=False)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_only_the_build_stage_installs_a_compiler() -> None:
    """The daemon's C core is compiled in the build stage; the image that runs keeps no compiler."""
    build, final = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").split("\nFROM ", 2)[1:]
    apt = [ln for ln in build.splitlines() if "apt-get install" in ln]
    assert len(apt) == 1 and {"gcc", "libc6-dev"} <= set(apt[0].split()), apt
    final_apt = " ".join(ln for ln in final.splitlines() if "apt-get install" in ln)
    assert final_apt and not {"gcc", "cc", "clang", "libc6-dev", "build-essential"} & set(final_apt.split())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_healthcheck_command_in_the_dockerfile_passes_against_a_running_daemon(tmp_path: Path) -> None:
    text = (ROOT / "Dockerfile").read_text()
    m = re.search(r"^HEALTHCHECK .*CMD (\[.*\])$", text, re.MULTILINE)
    assert m, "no HEALTHCHECK"
    import json

    cmd = json.loads(m.group(1))
    assert cmd[:3] == ["python3", "-m", "gpufootprint.healthcheck"]
    port = _free_port()
    env = {**cli_env(), "GPUFOOTPRINT_EXPORTER__LISTEN": f"0.0.0.0:{port}"}  # as the image's ENV sets it
    d = subprocess.Popen([sys.executable, "-m", "gpufootprint", "daemon", "--socket", str(tmp_path / "p.sock")],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, rc = time.monotonic() + 60, -1
        while time.monotonic() < deadline:
            rc = subprocess.run([sys.executable, *cmd[1:]], env=env, capture_output=True, timeout=60, check=False).returncode
            if rc == 0:
                break
            time.sleep(0.3)
        assert rc == 0
    finally:
        d.send_signal(signal.SIGTERM)
        d.communicate(timeout=60)


def _as_pid_1(argv: list[str]) -> subprocess.Popen[str]:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no new pid namespace here: {probe.stderr.decode().strip()}")
    return subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-m", "gpufootprint", *argv],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _child_of(pid: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise AssertionError("unshare started no child")


@pytest.mark.parametrize("command", ["demo", "daemon"])
def test_demo_and_daemon_stop_on_sigterm_as_pid_1(command: str, tmp_path: Path) -> None:
    port = _free_port()
    argv = [command, "--listen", f"127.0.0.1:{port}"]
    if command == "daemon":
        argv += ["--socket", str(tmp_path / "p.sock")]
    p = _as_pid_1(argv)
    init = 0
    try:
        init = _child_of(p.pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # serving: the handlers are in place
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(init, signal.SIGTERM)  # from the parent namespace, as the container runtime sends it
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            # The namespace's init holds the pipes too: killing unshare alone left communicate() waiting
            # forever when the daemon hung (a CI rehearsal, 2026-12-06).
            if init:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGKILL)
            p.kill()
            p.communicate()
    assert p.returncode == 0, err[-2000:]


def test_nothing_the_dockerfile_copies_is_left_out_of_the_build_context() -> None:
    ignored = {ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()}
    for word, arg in _build_stage():
        if word == "COPY":
            for s in shlex.split(arg)[:-1]:
                assert s.rstrip("/") not in ignored and (ROOT / s).exists(), s
