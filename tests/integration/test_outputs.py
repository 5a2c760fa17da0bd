"""What a command leaves on disk when it cannot finish, run as a user runs it (a child process):
an output appears whole or not at all (issue 30, items 1, 2 and 4).

* an output path nothing can be created in (/proc as root or not) is one line, exit 2, before any work;
* an empty input (0 bytes, or a preamble only) is one line, exit 1, and no output;
* a damaged input (a cut .gz) is one line and no output (convert, export), or a page that lists
  the problems (report);
* ``record`` with no probe leaves no file; ``replay --report-json`` stopped by SIGINT or SIGTERM
  says so in one line and writes a report that says it is partial.
"""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DATA, cli_env

pytestmark = pytest.mark.integration
TRACE = DATA / "h200_probe_pinned_managed.gfp.gz"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = cli_env()
    env.pop("GPUFOOTPRINT_PROBE", None)
    return subprocess.run([sys.executable, "-m", "gpufootprint", *argv], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


def _lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("gpufootprint probe")]


def _cut_gz(tmp: Path) -> Path:
    """The bundled trace's .gz cut in the middle: gzip's stream ends early."""
    raw = TRACE.read_bytes()
    out = tmp / "cut.gfp.gz"
    out.write_bytes(raw[: len(raw) // 2])
    return out


def _leftovers(tmp: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name not in keep)


@pytest.mark.parametrize("argv", [
    ["export", str(TRACE), "--to", "memory-viz", "-o", "/proc/nope.pickle"],
    ["export", str(TRACE), "--to", "perfetto", "-o", "/proc/nope.json"],
    ["report", str(TRACE), "-o", "/proc/r.html"],
    ["report", str(TRACE), "-o", "r.html", "--plot", "/proc/p.png"],
    ["convert", str(TRACE), "-o", "/proc/x.gfp"],
    ["replay", str(TRACE), "--report-json", "/proc/r.json"],
], ids=lambda a: f"{a[0]} {a[-2]} {a[-1]}")
def test_an_output_where_nothing_can_be_created_is_one_line_exit_2(argv: list[str], tmp_path: Path) -> None:
    r = _run(argv, tmp_path)
    lines = _lines(r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"gpufootprint {argv[0]}: error: command line "), r.stderr
    assert argv[-1] in lines[0] and "cannot write" in lines[0], lines
    assert _leftovers(tmp_path, set()) == []  # nothing half-made here either (r.html with a bad --plot)


@pytest.mark.parametrize("preamble", [False, True], ids=["0 bytes", "preamble only"])
@pytest.mark.parametrize("command", ["replay", "report", "export", "convert"])
def test_an_empty_input_is_one_line_exit_1_and_no_output(command: str, preamble: bool, tmp_path: Path) -> None:
    from gpufootprint.wire.framing import PREAMBLE

    src = tmp_path / "empty.gfp"
    src.write_bytes(PREAMBLE if preamble else b"")  # the preamble: the 8 bytes `record` used to leave behind
    out = {"replay": ["--report-json", "r.json"], "report": ["-o", "r.html"],
           "export": ["--to", "perfetto", "-o", "o.json"], "convert": ["-o", "o.gfp"]}[command]
    r = _run([command, str(src), *out], tmp_path)
    lines = _lines(r.stderr)
    assert r.returncode == 1, r.stderr
    assert lines == [f"gpufootprint {command}: error: {src}: no frames (an empty trace)"], r.stderr
    assert _leftovers(tmp_path, {"empty.gfp"}) == []


@pytest.mark.parametrize("out", ["o.gfp", "o.jsonl", "o.jsonl.gz"])
def test_convert_of_a_cut_gz_says_one_line_and_leaves_the_previous_output(out: str, tmp_path: Path) -> None:
    cut = _cut_gz(tmp_path)
    (tmp_path / out).write_bytes(b"previous")
    r = _run(["convert", str(cut), "-o", out], tmp_path)
    lines = _lines(r.stderr)
    assert r.returncode == 1, r.stderr
    assert len(lines) == 1 and "compressed data ends before the end of the gzip stream" in lines[0], r.stderr
    assert f"nothing written to {out}" in lines[0] and not any(ln.startswith("wrote") for ln in lines)
    assert (tmp_path / out).read_bytes() == b"previous"
    assert _leftovers(tmp_path, {cut.name, out}) == []  # no temporary file left either


def test_export_of_a_cut_gz_writes_nothing_and_report_says_its_page_lists_the_problems(tmp_path: Path) -> None:
    cut = _cut_gz(tmp_path)
    r = _run(["export", str(cut), "--to", "memory-viz", "-o", "o.pickle"], tmp_path)
    assert r.returncode == 1 and len(_lines(r.stderr)) == 1, r.stderr
    assert not (tmp_path / "o.pickle").exists()
    r = _run(["report", str(cut), "-o", "r.html"], tmp_path)
    lines = _lines(r.stderr)
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "r.html shows what could be read and lists the problems" in lines[0]
    page = (tmp_path / "r.html").read_text()
    assert "Problems met reading the recording" in page and "gzip stream" in page


def test_a_whole_conversion_still_round_trips(tmp_path: Path) -> None:
    r = _run(["convert", str(TRACE), "-o", "o.jsonl.gz"], tmp_path)
    assert r.returncode == 0 and r.stderr.startswith("wrote o.jsonl.gz"), r.stderr
    assert gzip.decompress((tmp_path / "o.jsonl.gz").read_bytes()).count(b"\n") > 100
    assert _leftovers(tmp_path, {"o.jsonl.gz"}) == []


def test_record_with_no_probe_keeps_no_file(tmp_path: Path) -> None:
    r = _run(["record", "-o", "rec.gfp", "--", sys.executable, "-c", "pass"], tmp_path)
    assert r.returncode == 1
    assert "empty recording" in r.stderr and "no file kept" in r.stderr
    assert not (tmp_path / "rec.gfp").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_replay_says_so_and_writes_a_report_marked_partial(signum: int, tmp_path: Path) -> None:
    env = cli_env()
    env.pop("GPUFOOTPRINT_PROBE", None)
    # At real speed the slow leak's minutes take minutes: the signal comes while it runs.
    leak = DATA / "synth_leak.gfp.gz"
    p = subprocess.Popen([sys.executable, "-m", "gpufootprint", "replay", str(leak), "--speed", "1",
                          "--listen", "127.0.0.1:0", "--report-json", "r.json"], env=env, cwd=tmp_path,
                         stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    first = p.stderr.readline()  # "serving URL": the signal handlers are in place from before it
    assert first.startswith("serving "), first
    time.sleep(1.5)
    p.send_signal(signum)
    rest = p.stderr.read()
    rc = p.wait(timeout=60)
    name = signal.Signals(signum).name
    assert rc == 128 + signum, rest
    lines = [ln for ln in _lines(rest) if not ln.startswith("ts=")]  # the served daemon's own log lines
    assert len(lines) == 1 and lines[0].startswith(f"gpufootprint replay: interrupted by {name} after "), rest
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["complete"] is False and report["interrupted"] == name
    full = json.loads(_run(["replay", str(leak), "--report-json", "-"], tmp_path).stdout)
    assert full["complete"] is True and full["interrupted"] is None
    assert 0 < report["records"] < full["records"]  # some, not all: it did stop part way
