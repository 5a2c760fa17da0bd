#!/usr/bin/env python3
"""Render one dashboard panel to SVG from a live Prometheus, without Grafana.

    python deploy/grafana/render_panel.py --prometheus http://127.0.0.1:9090 \\
        --panel "GPU memory per process, stacked by kind" --minutes 2 -o docs/img/panel-footprint.svg

It runs the panel's own queries from deploy/grafana/gpufootprint.json (template
variables set to "All") through /api/v1/query_range and draws them the way the
panel is configured (stacked or not, its unit). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

DASHBOARD = Path(__file__).with_name("gpufootprint.json")
VARS = {"$__rate_interval": "15s", "$__interval": "5s", "$__range": "5m", "$cluster": ".*", "$node": ".*",
        "$namespace": ".*", "$pod": ".*", "$gpu": ".*"}
PALETTE = ["#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0",
           "#508642", "#CCA300", "#447EBC", "#C15C17"]
Series = tuple[str, list[tuple[float, float]]]


def substitute(expr: str) -> str:
    for var, value in sorted(VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    return expr


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=30) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise SystemExit(f"query failed: {expr}: {body.get('error')}")
    return list(body["data"]["result"])


def fmt_value(v: float, unit: str) -> str:
    if unit in ("bytes", "Bps"):
        for div, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= div:
                return f"{v / div:.4g} {name}{'/s' if unit == 'Bps' else ''}"
        return f"{v:.3g} B{'/s' if unit == 'Bps' else ''}"
    return f"{v:.3g}"


def nice_ticks(hi: float, unit: str, n: int = 5) -> list[float]:
    if hi <= 0:
        return [0.0]
    base = 1024.0 if unit in ("bytes", "Bps") else 10.0
    raw = hi / n
    mag = base ** math.floor(math.log(raw, base)) if raw > 0 else 1.0
    step = next(m * mag for m in (1, 2, 2.5, 5, 10, 20, 25, 50, 100, 200, 256, 512, 1024) if m * mag >= raw)
    return [i * step for i in range(int(hi / step) + 2)]


def render_svg(title: str, series: list[Series], unit: str, stacked: bool, note: str,
               width: int = 960, height: int = 380) -> str:
    left, right, top, bottom = 80, 340, 48, 44
    pw, ph = width - left - right, height - top - bottom
    times = sorted({t for _, pts in series for t, _ in pts})
    if not times:
        raise SystemExit("no data to draw")
    t0, t1 = times[0], max(times[-1], times[0] + 1)
    values = [dict(pts) for _, pts in series]
    base = [0.0] * len(times)
    bands: list[tuple[list[float], list[float]]] = []
    for vals in values:
        ys = [vals.get(t, 0.0) for t in times]
        lo = list(base) if stacked else [0.0] * len(times)
        hi = [a + b for a, b in zip(lo, ys)] if stacked else ys
        bands.append((lo, hi))
        if stacked:
            base = hi
    vmax = max((max(hi) for _, hi in bands), default=0.0) or 1.0
    ticks = nice_ticks(vmax, unit)
    ymax = max(ticks[-1], vmax)

    def x(t: float) -> float:
        return left + (t - t0) / (t1 - t0) * pw

    def y(v: float) -> float:
        return top + ph - v / ymax * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="#181b1f"/>',
           f'<text x="{left}" y="22" fill="#d8d9da" font-size="14" font-weight="bold">{escape(title)}</text>',
           f'<text x="{left}" y="38" fill="#8e8e8e" font-size="10">{escape(note)}</text>']
    for tv in ticks:
        if tv > ymax:
            continue
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(tv):.1f}" y2="{y(tv):.1f}" stroke="#2c3235"/>')
        out.append(f'<text x="{left - 6}" y="{y(tv) + 4:.1f}" fill="#8e8e8e" text-anchor="end">'
                   f'{escape(fmt_value(tv, unit))}</text>')
    for i in range(6):
        tt = t0 + (t1 - t0) * i / 5
        label = datetime.fromtimestamp(tt, timezone.utc).strftime("%H:%M:%S")
        out.append(f'<text x="{x(tt):.1f}" y="{top + ph + 16}" fill="#8e8e8e" text-anchor="middle">{label}</text>')
    for i, ((name, _), (lo, hi)) in enumerate(zip(series, bands)):
        color = PALETTE[i % len(PALETTE)]
        line = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in zip(times, hi))
        if stacked:
            back = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in reversed(list(zip(times, lo))))
            out.append(f'<polygon points="{line} {back}" fill="{color}" fill-opacity="0.35" stroke="none"/>')
        out.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.2"/>')
        ly = top + 4 + i * 16
        if ly < top + ph:
            last = hi[-1] - lo[-1] if stacked else hi[-1]
            out.append(f'<rect x="{left + pw + 14}" y="{ly}" width="10" height="10" fill="{color}"/>')
            out.append(f'<text x="{left + pw + 30}" y="{ly + 9}" fill="#d8d9da">{escape(name[:46])} '
                       f'<tspan fill="#8e8e8e">{escape(fmt_value(last, unit))}</tspan></text>')
    out.append(f'<text x="{width - 10}" y="22" fill="#8e8e8e" font-size="10" text-anchor="end">'
               f'{len(series)} series{", stacked" if stacked else ""}, times in UTC</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def panel_by_title(title: str) -> dict[str, Any]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["title"] == title:
            return dict(panel)
    raise SystemExit(f"no panel titled {title!r} in {DASHBOARD}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--panel", required=True, help="panel title in gpufootprint.json")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    panel = panel_by_title(args.panel)
    end = time.time()
    start = end - args.minutes * 60
    step = max(1.0, args.minutes * 60 / 300)
    series: list[Series] = []
    for t in panel["targets"]:
        for r in query_range(args.prometheus, substitute(t["expr"]), start, end, step):
            pts = [(float(ts), float(v)) for ts, v in r["values"]]
            series.append((legend(t.get("legendFormat", ""), r["metric"]), pts))
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
    note = (f"gpufootprint dashboard panel rendered from Prometheus query_range by deploy/grafana/render_panel.py, "
            f"{datetime.fromtimestamp(end, timezone.utc):%Y-%m-%d %H:%M} UTC")
    args.output.write_text(render_svg(panel["title"], series, defaults.get("unit", ""), stacked, note))
    print(f"wrote {args.output} ({len(series)} series)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
