from __future__ import annotations

import gzip
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import synth_traces
from gpufootprint.cli import main
from gpufootprint.wire.framing import FrameDecoder

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data"
POLICIES = ROOT / "examples" / "policies"
ARGS = [str(DATA / "synth_kernels.gfp.gz"), str(DATA / "h200_caching.jsonl.gz"),
        "--policy", str(POLICIES / "control.yaml"), "--policy", str(POLICIES / "treatment.yaml")]


@pytest.fixture(autouse=True)
def _restore_logging():  # type: ignore[no-untyped-def]
    # main() points the package logger at the stderr of the moment (capsys's): undo it after
    logger = logging.getLogger("gpufootprint")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


def test_abtest_table_compares_control_and_treatment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["abtest", *ARGS]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["trace", "pid", "stream"] and "treatment" in out[0]
    row = next(line.split() for line in out if line.split()[:3] == ["synth_kernels.gfp.gz", "4242", "7"])
    assert row[8] == "keep" and row[10] == "capture"
    assert out[-2].startswith("policy control: 1 stream(s) to capture")
    assert out[-1].startswith("policy treatment: 2 stream(s) to capture")


def test_abtest_json_in_a_real_process() -> None:
    run = subprocess.run([sys.executable, "-m", "gpufootprint", "abtest", *ARGS, "--json"],
                         capture_output=True, text=True, check=True)
    report = json.loads(run.stdout)
    assert [p["name"] for p in report["policies"]] == ["control", "treatment"]
    rows = {(Path(r["trace"]).name, r["pid"], r["stream"]): r for r in report["rows"]}
    assert rows[("synth_kernels.gfp.gz", 4444, 7)]["policies"]["control"]["decision"] == "capture"
    assert rows[("synth_kernels.gfp.gz", 4242, 13)]["policies"]["treatment"]["decision"] == "already_captured"
    assert rows[("h200_caching.jsonl.gz", 855, None)]["policies"]["control"]["decision"] == "insufficient_data"
    saved = rows[("synth_kernels.gfp.gz", 4242, 7)]["policies"]["treatment"]["saved_us_per_step"]
    assert 150 < saved < 250
    assert report["problems"] == []


def test_abtest_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("min_reuse: 2\n")
    assert main(["abtest", str(DATA / "synth_kernels.gfp.gz"), "--policy", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gpufootprint abtest: error: {bad}: graph_advisor.min_reuse: 2.0 is above the maximum 1"
    assert main(["abtest", str(tmp_path / "missing.gfp"), "--policy", str(POLICIES / "control.yaml")]) == 1
    assert "no such file" in capsys.readouterr().err


def _frames(data: bytes) -> list[tuple[int, int, bytes]]:
    decoder = FrameDecoder()
    frames = [(f.type, f.tag, f.payload) for f in decoder.feed(data)]
    decoder.close()
    return frames


def test_committed_synthetic_traces_equal_the_generator() -> None:
    # compared frame by frame (type, tag, payload), so a newer wire version of the same frames still equals
    for name, make in synth_traces.GENERATORS.items():
        committed = _frames(gzip.decompress((DATA / name).read_bytes()))
        assert committed == _frames(make()), f"regenerate {name}: python tests/synth_traces.py"
