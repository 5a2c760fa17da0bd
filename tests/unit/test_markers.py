"""Every test under tests/integration/ carries the ``integration`` marker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_integration_test_carries_the_integration_marker() -> None:
    # Collect tests/integration/ without the marked ones: nothing may be left (pytest exits 5), and
    # the summary must show tests deselected, so an empty or broken collection does not pass.
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "not integration", "tests/integration"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 5, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "deselected" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
