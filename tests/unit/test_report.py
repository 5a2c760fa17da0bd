"""``gpufootprint report``: a self-contained page with real matplotlib plots, and ``--plot``."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpufootprint.errors import GpuFootprintError
from gpufootprint.recording import load, series
from gpufootprint.report import render_html, write_report

from tests.conftest import DATA, cli_env

PNG = b"\x89PNG\r\n\x1a\n"


def test_page_is_self_contained_with_the_footprint_plot_and_tables(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    write_report([DATA / "h200_probe_caching.gfp.gz"], out)
    page = out.read_text()
    # every image is inline, nothing is fetched from elsewhere
    images = re.findall(r'<img alt="plot" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    assert images and all(base64.b64decode(i).startswith(PNG) for i in images)
    assert "http://" not in page and "https://" not in page and "<script" not in page
    for section in ("Footprint over time", "Largest live allocations at the peak", "Copy and migration traffic",
                    "Sampler intervals and anomaly windows", "Marks", "Engine verdicts"):
        assert section in page
    # the peak in the table is the series' own
    (s,) = series(load([DATA / "h200_probe_caching.gfp.gz"]))
    peak, _ = s.peak()
    assert f"{peak / 2**20:,.1f} MiB" in page


@pytest.mark.parametrize("suffix,magic", [(".png", PNG), (".svg", b"<?xml")])
def test_plot_option_writes_png_or_svg(tmp_path: Path, suffix: str, magic: bytes) -> None:
    plot = tmp_path / f"p{suffix}"
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "report", str(DATA / "h200_probe_expandable.gfp.gz"),
                        "-o", str(tmp_path / "r.html"), "--plot", str(plot)], env=cli_env(), capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert plot.read_bytes().startswith(magic)


def test_plot_with_another_suffix_is_a_one_line_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "report", str(DATA / "h200_probe_caching.gfp.gz"),
                        "-o", str(tmp_path / "r.html"), "--plot", str(tmp_path / "p.jpg")], env=cli_env(),
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == f"gpufootprint report: error: command line --plot {tmp_path / 'p.jpg'}: the file " \
                               "name must end in .png or .svg"


def test_without_matplotlib_the_page_still_has_its_tables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    page, fig = render_html(load([DATA / "h200_probe_caching.gfp.gz"]))
    assert fig is None and "<img" not in page
    assert "pip install 'gpufootprint[report]'" in page and "Largest live allocations" in page
    with pytest.raises(GpuFootprintError, match="matplotlib missing"):
        write_report([DATA / "h200_probe_caching.gfp.gz"], tmp_path / "r.html", plot=tmp_path / "p.png")


def test_several_files_and_a_jsonl_trace(tmp_path: Path) -> None:
    rec = write_report([DATA / "h200_caching.jsonl.gz", DATA / "h200_probe_pinned_managed.gfp.gz"],
                       tmp_path / "r.html")
    assert rec.formats == ["cupti-jsonl", "native"] and len(series(rec)) >= 2
