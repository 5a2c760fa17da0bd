"""Every subcommand's first errors, run as a user runs them (a child process): one line on stderr
that names the key or the path, no traceback, exit 2 for usage and configuration (busy port,
output that cannot be written or is the input, missing socket directory), 1 for damaged or empty
input. A new subcommand adds its cases to CASES (test_every_subcommand_has_error_cases says so)."""

from __future__ import annotations

import gzip
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gpufootprint.cli import build_parser

from tests.conftest import DATA, cli_env

pytestmark = pytest.mark.integration
TRACE = DATA / "synth_leak.gfp.gz"


@dataclass(frozen=True)
class Case:
    command: str
    name: str
    argv: Callable[[Path, int], list[str]]  # (tmp dir, a busy port) -> arguments
    exit_code: int
    says: str  # in the error line


def _damaged(tmp: Path) -> str:
    raw = gzip.decompress(TRACE.read_bytes())
    out = tmp / "damaged.gfp"
    out.write_bytes(raw[: len(raw) // 2 + 7])  # cut inside a frame
    return str(out)


def _empty(tmp: Path) -> str:
    (tmp / "empty.gfp").write_bytes(b"")
    return str(tmp / "empty.gfp")


def _copy(tmp: Path) -> str:
    shutil.copy(TRACE, tmp / "in.gfp.gz")
    return str(tmp / "in.gfp.gz")


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bad_config(tmp: Path) -> str:
    (tmp / "bad.yaml").write_text("exporter:\n  listen: nowhere\n")
    return str(tmp / "bad.yaml")


CASES = [
    Case("start", "busy port", lambda t, p: ["--listen", f"127.0.0.1:{p}", "--duration", "5"], 2,
         "address already in use"),
    Case("start", "bad config file", lambda t, p: ["--config", _bad_config(t)], 2, "exporter.listen"),
    Case("daemon", "busy port", lambda t, p: ["--listen", f"127.0.0.1:{p}", "--socket", str(t / "p.sock")], 2,
         "address already in use"),
    Case("daemon", "busy port by the exporters' flag",
         lambda t, p: ["--web.listen-address", f"127.0.0.1:{p}", "--socket", str(t / "p.sock")], 2,
         "exporter.listen 127.0.0.1:"),
    Case("daemon", "missing socket directory", lambda t, p: ["--listen", "127.0.0.1:0", "--socket",
                                                             str(t / "no" / "dir" / "p.sock")], 2,
         "/no/dir does not exist"),
    Case("daemon", "unwritable oom.directory", lambda t, p: ["--listen", "127.0.0.1:0", "--socket", str(t / "p.sock"),
                                                             "--set", "oom.directory=/proc/oom"], 2,
         "oom.directory /proc/oom: cannot write there"),
    Case("daemon", "missing config file", lambda t, p: ["--config", str(t / "none.yaml")], 2, "none.yaml"),
    Case("demo", "busy port", lambda t, p: ["--listen", f"127.0.0.1:{p}", "--duration", "5"], 2,
         "address already in use"),
    Case("demo", "damaged trace",
         lambda t, p: ["--listen", "127.0.0.1:0", "--trace", _damaged(t), "--duration", "20"], 1,
         "damaged.gfp"),
    Case("demo", "empty trace", lambda t, p: ["--listen", "127.0.0.1:0", "--trace", _empty(t), "--duration", "20"], 1,
         "empty.gfp"),
    Case("demo", "missing trace", lambda t, p: ["--trace", str(t / "none.gfp")], 2, "none.gfp is not a file"),
    Case("replay", "busy port", lambda t, p: [str(TRACE), "--listen", f"127.0.0.1:{p}"], 2,
         "address already in use"),
    Case("replay", "report in a missing directory", lambda t, p: [str(TRACE), "--report-json",
                                                                  str(t / "no" / "r.json")], 2,
         "--report-json"),
    Case("replay", "report over its input", lambda t, p: [(c := _copy(t)), "--report-json", c], 2,
         "is the input file"),
    Case("replay", "missing input", lambda t, p: [str(t / "none.gfp")], 1, "none.gfp: no such file"),
    Case("convert", "output is the input", lambda t, p: [(c := _copy(t)), "-o", c], 2, "is the input file"),
    Case("convert", "output is the input by another name",
         lambda t, p: [_copy(t), "-o", str(t / "." / ".." / t.name / "in.gfp.gz")], 2, "is the input file"),
    Case("convert", "output in a missing directory", lambda t, p: [_copy(t), "-o", str(t / "no" / "o.jsonl")], 2,
         "does not exist"),
    Case("convert", "output is a directory", lambda t, p: [_copy(t), "-o", str(t)], 2, "is a directory"),
    Case("convert", "missing input", lambda t, p: [str(t / "none.gfp"), "-o", str(t / "o.gfp")], 1,
         "none.gfp: no such file"),
    Case("check-config", "bad value", lambda t, p: ["--config", _bad_config(t)], 2, "exporter.listen"),
    Case("check-config", "bad --set", lambda t, p: ["--set", "exporter.nope=1"], 2, "exporter.nope"),
    Case("run", "no command", lambda t, p: ["--"], 2, "give the command"),
    Case("record", "no command", lambda t, p: ["-o", str(t / "r.gfp"), "--"], 2, "give the command"),
    Case("record", "output in a missing directory",
         lambda t, p: ["-o", str(t / "no" / "r.gfp"), "--", sys.executable, "-c", "pass"], 2, "does not exist"),
    Case("record", "empty recording", lambda t, p: ["-o", str(t / "r.gfp"), "--", sys.executable, "-c", "pass"],
         1, "empty recording"),
    Case("abtest", "missing policy", lambda t, p: [str(TRACE), "--policy", str(t / "none.yaml")], 2,
         "none.yaml"),
    Case("top", "no daemon there", lambda t, p: ["--once", "--url", f"http://127.0.0.1:{_closed_port()}"], 1,
         "cannot connect"),
    Case("top", "bad interval", lambda t, p: ["--interval", "0"], 2, "--interval"),
    Case("report", "missing input", lambda t, p: [str(t / "none.gfp")], 1, "none.gfp: no such file"),
    Case("report", "output is the input", lambda t, p: [(c := _copy(t)), "-o", c], 2, "is the input file"),
    Case("report", "output in a missing directory", lambda t, p: [str(TRACE), "-o", str(t / "no" / "r.html")], 2,
         "does not exist"),
    Case("report", "plot of another kind", lambda t, p: [str(TRACE), "--plot", str(t / "p.jpg")], 2,
         "must end in .png or .svg"),
    Case("export", "missing input", lambda t, p: [str(t / "none.gfp"), "--to", "perfetto", "-o", str(t / "o.json")],
         1, "none.gfp: no such file"),
    Case("export", "output is the input", lambda t, p: [(c := _copy(t)), "--to", "memory-viz", "-o", c], 2,
         "is the input file"),
    Case("export", "output in a missing directory",
         lambda t, p: [str(TRACE), "--to", "perfetto", "-o", str(t / "no" / "o.json")], 2, "does not exist"),
    # Where no file can be created, though root passes every access check there (issue 30)
    Case("export", "output under /proc", lambda t, p: [str(TRACE), "--to", "memory-viz", "-o", "/proc/nope.pickle"],
         2, "-o /proc/nope.pickle: cannot write"),
    Case("report", "output under /proc", lambda t, p: [str(TRACE), "-o", "/proc/r.html"], 2,
         "-o /proc/r.html: cannot write"),
    Case("convert", "output under /proc", lambda t, p: [str(TRACE), "-o", "/proc/x.gfp"], 2,
         "-o /proc/x.gfp: cannot write"),
    # Empty input is damage to report, not a success (README: exit 1)
    Case("replay", "empty input", lambda t, p: [_empty(t)], 1, "empty.gfp: no frames"),
    Case("report", "empty input", lambda t, p: [_empty(t), "-o", str(t / "r.html")], 1, "empty.gfp: no frames"),
    Case("export", "empty input", lambda t, p: [_empty(t), "--to", "perfetto", "-o", str(t / "o.json")], 1,
         "empty.gfp: no frames"),
    Case("convert", "empty input", lambda t, p: [_empty(t), "-o", str(t / "o.gfp")], 1, "empty.gfp: no frames"),
]


@pytest.fixture
def busy_port() -> Iterator[int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def _run(argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = cli_env()
    env.pop("GPUFOOTPRINT_PROBE", None)
    return subprocess.run([sys.executable, "-m", "gpufootprint", *argv], env=env, cwd=tmp, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.command}: {c.name}" for c in CASES])
def test_each_error_is_one_line_with_its_exit_code(case: Case, tmp_path: Path, busy_port: int) -> None:
    r = _run([case.command, *case.argv(tmp_path, busy_port)], tmp_path)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(f"gpufootprint {case.command}: error: ")]
    assert "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1, r.stderr
    assert case.says in errors[0], errors[0]
    assert r.returncode == case.exit_code, r.stderr
    # Nothing else but the notice `start` gives where there is no GPU, and what a probe says of itself.
    others = [ln for ln in lines if ln not in errors and not ln.startswith(("gpufootprint: no GPU here",
                                                                            "gpufootprint probe"))]
    assert not others, r.stderr


def test_every_subcommand_has_error_cases() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    commands = set(sub.choices)  # type: ignore[arg-type]
    missing = commands - {c.command for c in CASES}
    assert not missing, f"add error cases to CASES for: {sorted(missing)}"


def test_convert_refuses_to_overwrite_its_input_and_leaves_it_whole(tmp_path: Path) -> None:
    src = _copy(tmp_path)
    before = Path(src).read_bytes()
    for out in (src, src.replace(".gfp.gz", ".jsonl.gz")):
        Path(out).write_bytes(before) if out != src else None
        r = _run(["convert", out, "-o", out], tmp_path)
        assert r.returncode == 2, r.stderr
        assert Path(out).read_bytes() == before


def test_create_socket_dir_makes_the_directory_the_daemon_otherwise_refuses(tmp_path: Path, busy_port: int) -> None:
    # The directory is made before the (busy) port stops the daemon: the flag did it.
    sock = tmp_path / "made" / "here" / "p.sock"
    r = _run(["daemon", "--create-socket-dir", "--socket", str(sock), "--listen", f"127.0.0.1:{busy_port}"],
             tmp_path)
    assert r.returncode == 2 and "address already in use" in r.stderr, r.stderr
    assert sock.parent.is_dir()


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_is_accepted_before_or_after_the_command_and_adds_the_traceback(tmp_path: Path, where: str) -> None:
    argv = ["check-config", "--set", "exporter.nope=1"]
    argv = ["-v", *argv] if where == "before" else [*argv, "-v"]
    r = _run(argv, tmp_path)
    assert r.returncode == 2
    assert "Traceback" in r.stderr and "gpufootprint check-config: error: " in r.stderr


def test_a_damaged_demo_trace_fails_before_serving(tmp_path: Path) -> None:
    r = _run(["demo", "--listen", "127.0.0.1:0", "--trace", _damaged(tmp_path), "--duration", "30"], tmp_path)
    assert r.returncode == 1
    assert "serving" not in r.stdout


def test_start_keeps_its_no_gpu_notice_on_the_repainted_screen(tmp_path: Path) -> None:
    import os
    import pty

    master, slave = pty.openpty()
    env = cli_env()
    p = subprocess.Popen([sys.executable, "-m", "gpufootprint", "start", "--listen", "127.0.0.1:0", "--duration",
                          "2.5"], env=env, cwd=tmp_path, stdout=slave, stderr=subprocess.PIPE, text=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    p.communicate(timeout=60)
    assert p.returncode == 0
    screens = out.decode(errors="replace").split("\x1b[2J")
    assert len(screens) >= 2  # repainted at least once
    assert "no GPU here" in screens[-1]
