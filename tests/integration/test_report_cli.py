"""``gpufootprint report`` as a user runs it (a child process): it says in the terminal when the
page has no plots, and the page shows no "None" GPU and no negative time (issue 30, item 6)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DATA, cli_env

pytestmark = pytest.mark.integration


def _report(tmp: Path, trace: Path, env_extra: dict[str, str] | None = None) -> tuple[str, str]:
    env = {**cli_env(), **(env_extra or {})}
    env.pop("GPUFOOTPRINT_PROBE", None)
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "report", str(trace), "-o", "r.html"], env=env,
                       cwd=tmp, capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr
    return r.stderr, (tmp / "r.html").read_text()


def test_without_matplotlib_the_terminal_says_the_page_has_no_plots(tmp_path: Path) -> None:
    # A matplotlib that cannot be imported, first on the path: as in the daemon image (no report extra).
    fake = tmp_path / "no_mpl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib (test)')\n")
    stderr, page = _report(tmp_path, DATA / "h200_probe_caching.gfp.gz",
                           {"PYTHONPATH": f"{fake.parent}:{cli_env()['PYTHONPATH']}"})
    assert "no plots: matplotlib is not installed here (pip install 'gpufootprint[report]')" in stderr, stderr
    assert "<img" not in page and "matplotlib is not installed" in page
    stderr, page = _report(tmp_path, DATA / "h200_probe_caching.gfp.gz")
    assert "no plots" not in stderr and "<img" in page  # with it: plots, and no hint


@pytest.mark.parametrize("trace", ["synth_leak.gfp.gz", "h200_probe_pinned_managed.gfp.gz",
                                   "h200_probe_caching.gfp.gz"])
def test_the_page_shows_no_None_gpu_and_no_negative_time(trace: str, tmp_path: Path) -> None:
    _, page = _report(tmp_path, DATA / trace)
    cells = re.findall(r"<td>(.*?)</td>", page)
    assert cells, page[:500]
    assert "None" not in cells
    times = [float(c[:-2]) for c in cells if re.fullmatch(r"-?\d+\.\d{3} s", c)]
    assert times and min(times) >= 0.0, sorted(times)[:3]
    verdicts = page.split("<h2>Engine verdicts</h2>", 1)[1]
    assert "<td>graph</td>" in verdicts  # there are verdict rows to show, some with no single GPU
