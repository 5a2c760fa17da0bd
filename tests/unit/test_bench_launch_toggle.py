"""bench/launch_toggle.py's reading: each process's turns against the unswitched processes' same turns.

docs/performance.md publishes this table ("Launch windows from the main thread"); the analysis must
find a lasting slowdown that grows with the windows, ignore the machine's drift that hits every
process alike, and leave each window's own steps out.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tests.script_module import load_script

ROOT = Path(__file__).resolve().parents[2]


def _toggle() -> Any:
    return load_script(ROOT / "bench" / "launch_toggle.py", "bench_launch_toggle")


def _process(mode: str, turns: int, slowdown_per_window: float, drift: list[float], seed: int,
             window_cost: float = 0.10) -> dict[str, Any]:
    """Turns of 100 ms, one a second; a 20 ms window 10 ms into each turn for a switched mode."""
    rng = random.Random(seed)
    steps, windows = [], []
    for k in range(turns):
        t0 = k * 1.0
        lasting = 1.0 + slowdown_per_window * k
        win = (t0 + 0.010, t0 + 0.030) if mode != "none" else None
        t = t0
        while t < t0 + 0.1:
            d = 0.001 * drift[k] * lasting * rng.gauss(1.0, 0.01)
            if win and win[0] <= t + d and t <= win[1]:
                d *= 1 + window_cost  # a window's own records
            steps.append((t, d))
            t += d + 0.0001
        if win:
            windows.append(win)
    return {"mode": mode, "steps": steps, "windows": windows}


def test_a_slowdown_that_grows_with_the_windows_reads_against_the_unswitched_processes_despite_drift() -> None:
    lt = _toggle()
    turns = 60
    drift = [1.0 + 0.3 * (k % 7 == 0) for k in range(turns)]  # the machine slows every process alike
    results = [_process("none", turns, 0.0, drift, 1), _process("none", turns, 0.0, drift, 2),
               _process("side", turns, 0.004, drift, 3), _process("main_idle", turns, 0.0, drift, 4)]
    rows = {r["mode"] + str(i): r for i, r in enumerate(lt.against_none(results))}
    side = rows["side2"]["vs_none_by_part"]
    # the side process: 1 + 0.004 k, medians of k in each third about 10, 30, 50
    assert [round(x, 2) for x in side] == [1.04, 1.12, 1.2], side
    assert all(abs(x - 1) < 0.01 for x in rows["main_idle3"]["vs_none_by_part"])
    assert all(abs(x - 1) < 0.01 for x in rows["none0"]["vs_none_by_part"])  # drift cancelled
    assert rows["side2"]["windows"] == turns and rows["side2"]["turns"] == turns


def test_a_windows_own_steps_are_left_out() -> None:
    lt = _toggle()
    turns = 30
    drift = [1.0] * turns
    costly = _process("main_idle", turns, 0.0, drift, 5, window_cost=1.0)  # steps in a window twice as long
    rows = lt.against_none([_process("none", turns, 0.0, drift, 6), costly])
    assert all(abs(x - 1) < 0.01 for x in rows[1]["vs_none_by_part"]), rows
    assert len(lt.outside(costly["steps"], costly["windows"])) < len(costly["steps"])


def test_processes_not_taken_in_turns_give_no_table() -> None:
    lt = _toggle()
    one_turn = {"mode": "none", "steps": [(i * 0.001, 0.001) for i in range(1000)], "windows": []}
    assert lt.against_none([one_turn, dict(one_turn, mode="side")]) == []


def test_the_published_table_is_read_back_from_a_committed_run_without_an_out_file() -> None:
    # the command docs/performance.md gives for its table: --analyse alone (no --out, no GPU, no torch)
    import subprocess
    import sys

    run = ROOT / "bench" / "results" / "h100_2026-12-06T1117Z_launch_toggle_threads.json.gz"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "launch_toggle.py"), "--analyse", str(run)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    assert set(rows) >= {"none", "side", "thread_side", "thread_pending"}, out.stdout
    assert rows["none"][-3:] == ["1.000", "1.000", "1.000"], out.stdout
    # and a run still needs its --out
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "launch_toggle.py"), "--modes", "none"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--out is required" in bad.stderr, bad.stderr
