"""deploy/grafana/render_panel.py draws query results as a well-formed SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

from tests.script_module import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "render_panel.py"
NS = "{http://www.w3.org/2000/svg}"


def _mod() -> ModuleType:
    return load_script(SCRIPT, "gpufootprint_render_panel")


def test_stacked_panel_has_one_band_per_series_and_legend_values() -> None:
    r = _mod()
    series = [("pid 1 device", [(0.0, 2**20), (1.0, 2 * 2**20), (2.0, 3 * 2**20)]),
              ("pid 2 device", [(0.0, 2**30), (2.0, 2**30)])]  # a missing point counts as 0 when stacking
    svg = r.render_svg("GPU memory", series, "bytes", True, "note")
    root = ET.fromstring(svg)
    assert len(root.findall(f"{NS}polygon")) == 2 and len(root.findall(f"{NS}polyline")) == 2
    text = " ".join("".join(t.itertext()) for t in root.iter(f"{NS}text"))
    assert "pid 1 device 3 MiB" in text and "pid 2 device 1 GiB" in text
    # The top band's last point is the sum of both series, and it is the highest point drawn.
    top = root.findall(f"{NS}polyline")[1].attrib["points"].split()
    assert float(top[-1].split(",")[1]) < float(root.findall(f"{NS}polyline")[0].attrib["points"].split()[-1]
                                                .split(",")[1])


def test_no_data_is_an_error_not_an_empty_picture() -> None:
    with pytest.raises(SystemExit, match="no data"):
        _mod().render_svg("t", [], "bytes", False, "")


def test_queries_are_taken_from_the_dashboard_with_all_selected() -> None:
    r = _mod()
    panel = r.panel_by_title("Copy bandwidth by direction")
    expr = r.substitute(panel["targets"][0]["expr"])
    assert "$" not in expr and 'namespace=~".*"' in expr
    assert r.legend("{{pod}} pid {{pid}}", {"pod": "p", "pid": "7"}) == "p pid 7"
