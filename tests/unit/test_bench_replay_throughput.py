"""bench/replay_throughput.py against a baseline given as an unpacked tree (``--base-tree``), as on the lent GPU
host, which has the working tree's files but not the repository's history: the run names the baseline's commit
from its COMMIT file, replays with both trees and finds their marks identical."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(base: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "replay_throughput.py"), "--base-tree", str(base),
                           "--rounds", "1", "--cases", "churn-4096,h200-async", "--records", "20000",
                           "--loop-records", "3000", "--json", str(out)],
                          check=False, capture_output=True, text=True, timeout=240, cwd=out.parent)


def test_a_baseline_tree_without_history_is_replayed_beside_the_working_tree(tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(ROOT / "daemon", base / "daemon", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (base / "COMMIT").write_text("abc1234\n")
    out = tmp_path / "replay.json"
    run = _bench(base, out)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["base"] == "abc1234"
    assert "cpus (" in result["machine"]  # the CPU's model is named: per-CPU-second rates differ by model
    for case in ("churn-4096", "h200-async"):
        row = result["results"][case]
        assert row["marks_identical"], row
        assert row["base"]["records"] == row["new"]["records"] > 0
        assert all(r > 0 for r in row["base"]["rates"] + row["new"]["rates"])
    assert result["results"]["h200-async"]["new"]["marks_digest"] != result["results"]["churn-4096"]["new"]["marks_digest"]
    assert f"base abc1234 ({base})" in run.stdout


def test_the_baseline_replays_with_its_own_trees_code(tmp_path: Path) -> None:
    """A baseline tree whose pipeline cannot be imported stops the run: its workers import that tree, not this one."""
    base = tmp_path / "base"
    shutil.copytree(ROOT / "daemon", base / "daemon", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (base / "daemon" / "gpufootprint" / "pipeline.py").write_text("raise ImportError('the baseline tree was read')\n")
    run = _bench(base, tmp_path / "replay.json")
    assert run.returncode != 0
    assert f"with {base} failed" in run.stderr and "the baseline tree was read" in run.stderr, run.stderr[-2000:]
