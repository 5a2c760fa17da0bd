"""``gpufootprint report``: one self-contained HTML page for a recording.

Plots come from matplotlib (the ``report`` extra), imported only here and only when a
page or ``--plot`` is made: the daemon never needs it. matplotlib rather than hand-made
SVG because stacked step areas, shaded spans, log-free byte axes and PNG/SVG output are
all there and well kept. Without matplotlib the page is still written, with its
tables and a line saying how to get the plots.

The page: per (process, GPU) the footprint over time stacked by memory kind, with the
peak marked, anomaly windows shaded and marks labelled (OOM marks in red); the largest
live allocations at the peak; copy and unified-memory traffic; the sampler's intervals;
the engines' verdicts; and the replay's problems, if any.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpufootprint.errors import GpuFootprintError
from gpufootprint.outfile import atomic_output
from gpufootprint.recording import Recording, Series, kind_name, load, series, tables_at
from gpufootprint.records import COPY_KIND_NAMES, DEVICE_RESIDENT_KINDS, MemoryKind, RecordKind

_STACK_RANK = {**{k: 0 for k in DEVICE_RESIDENT_KINDS}, MemoryKind.PINNED: 2, MemoryKind.PAGEABLE: 2}
_MAX_PANELS = 8  # (pid, GPU) panels in the main plot; the rest are listed in the table
_TOP_ALLOCATIONS = 15


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _since(ts: int, t0: int) -> float:
    """Seconds from ``t0``, clamped at 0: an anomaly window (its pre-roll) or the probe's start mark
    comes a few ms before the first memory event the page counts from, and "-0.004 s" reads as a
    bug; those few ms say nothing a reader needs."""
    return max(0.0, (ts - t0) / 1e9)


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def _t0(rec: Recording, all_series: list[Series]) -> int:
    starts = [int(s.times[0]) for s in all_series if len(s.times)]
    return min(starts) if starts else 0


def main_figure(rec: Recording, all_series: list[Series]) -> Any:
    """The footprint plot (None without matplotlib or without memory records)."""
    plt = _pyplot()
    shown = [s for s in all_series if len(s.times)][:_MAX_PANELS]
    if plt is None or not shown:
        return None
    t0 = _t0(rec, all_series)
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 3.2 * len(shown)), squeeze=False, sharex=False)
    for ax, s in zip(axes[:, 0], shown):
        x = (s.times.astype(np.float64) - t0) / 1e9
        # Steps: each level holds until the next change; the stack is drawn from cumulative sums,
        # GPU-resident kinds at the bottom (the peak line is theirs), then managed, then host kinds.
        order = sorted(range(len(s.kinds)), key=lambda j: (_STACK_RANK.get(s.kinds[j], 1), s.kinds[j]))
        stack = np.cumsum(s.levels[:, order] / 2**20, axis=1)
        prev = np.zeros(len(x))
        for col, j in enumerate(order):
            k = s.kinds[j]
            label = kind_name(k) + (" (host)" if _STACK_RANK.get(k, 1) == 2 else "")
            ax.fill_between(x, prev, stack[:, col], step="post", alpha=0.75, label=label, linewidth=0)
            prev = stack[:, col]
        peak, i = s.peak()
        if i >= 0:
            ax.axhline(peak / 2**20, color="black", linewidth=0.8, linestyle="--")
            ax.annotate(f"GPU-resident peak {_mib(peak)}", (x[i], peak / 2**20), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        for w in rec.anomaly_windows:
            if int(w["pid"]) == s.pid and int(w["gpu"]) == s.dev:
                ax.axvspan(_since(int(w["start"]), t0), _since(int(w["end"]), t0), color="orange", alpha=0.15)
        for m in rec.marks:
            if m.get("pid") == s.pid and m.get("dev", 0) == s.dev and isinstance(m.get("ts"), int):
                oom = m.get("label") == "oom"
                mx = _since(m["ts"], t0)
                ax.axvline(mx, color="red" if oom else "grey", linewidth=1.2 if oom else 0.6)
                ax.annotate(str(m.get("label")), (mx, ax.get_ylim()[1]), rotation=90, fontsize=7, va="top",
                            color="red" if oom else "dimgrey")
        ax.set_title(f"pid {s.pid}, GPU {s.dev}", fontsize=10)
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("seconds since the recording's first memory event (shaded: anomaly windows)")
    fig.tight_layout()
    return fig


def _traffic_figure(rec: Recording, t0: int) -> Any:
    plt = _pyplot()
    copies = rec.records_of(RecordKind.MEMCPY)
    um = rec.records_of(RecordKind.UNIFIED_MEMORY)
    if plt is None or (len(copies) == 0 and len(um) == 0):
        return None
    fig, ax = plt.subplots(figsize=(10, 2.8))
    for ck in sorted(set(copies["ck"].tolist())):
        sel = copies[copies["ck"] == ck]
        x = (sel["start"].astype(np.float64) - t0) / 1e9
        ax.step(x, np.cumsum(sel["bytes"].astype(np.float64)) / 2**20, where="post",
                label=f"memcpy {COPY_KIND_NAMES.get(int(ck), ck)}")
    if len(um):
        x = (um["start"].astype(np.float64) - t0) / 1e9
        ax.step(x, np.cumsum(um["value"].astype(np.float64)) / 2**20, where="post", label="unified memory")
    ax.set_ylabel("MiB, cumulative")
    ax.set_xlabel("seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _sampler_figure(rec: Recording, t0: int) -> Any:
    plt = _pyplot()
    if plt is None or not rec.sampler_intervals:
        return None
    fig, ax = plt.subplots(figsize=(10, 2.4))
    drawn = False
    for pid, intervals in rec.sampler_intervals.items():
        pts = [(int(iv["start"]), float(iv["interval_ms"])) for iv in intervals
               if isinstance(iv, dict) and "start" in iv and "interval_ms" in iv]
        if pts:
            ax.step([(a - t0) / 1e9 for a, _ in pts], [b for _, b in pts], where="post", label=f"pid {pid}")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_ylabel("interval (ms)")
    ax.set_xlabel("seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _img(fig: Any, close: bool = True) -> str:
    if fig is None:
        return ""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    if close:
        _pyplot().close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def render_html(rec: Recording, *, title: str | None = None) -> tuple[str, Any]:
    """The page, and the main figure (for ``--plot``; None without matplotlib)."""
    all_series = series(rec)
    t0 = _t0(rec, all_series)
    fig = main_figure(rec, all_series)
    plots_ok = _pyplot() is not None
    parts: list[str] = []
    name = title or "gpufootprint report: " + ", ".join(Path(p).name for p in rec.paths)
    parts.append(f"<h1>{html.escape(name)}</h1>")
    parts.append(f"<p>{html.escape(', '.join(rec.paths))} ({html.escape(', '.join(rec.formats))}); "
                 f"{rec.records:,} records.</p>")
    if not plots_ok:
        parts.append("<p><strong>No plots:</strong> matplotlib is not installed "
                     "(<code>pip install 'gpufootprint[report]'</code>).</p>")
    ooms = [m for m in rec.marks if m.get("label") == "oom"]
    for m in ooms:
        oom_value = m.get("oom")
        oom: dict[str, Any] = oom_value if isinstance(oom_value, dict) else {}
        parts.append(f"<p class=oom><strong>Out of memory</strong> in pid {m.get('pid')} on GPU {m.get('dev')}: "
                     f"footprint {_mib(sum(m.get('live_bytes', {}).get(k, 0) for k in ('device', 'device_static', 'array', 'untracked')))}"
                     f", requested {html.escape(str(oom.get('requested_bytes', 'unknown')))} bytes"
                     f" (seen by {html.escape(', '.join(map(str, oom.get('seen_by', [oom.get('source', '?')]))))})."
                     "</p>")
    parts.append("<h2>Footprint over time, stacked by kind</h2>")
    parts.append(_img(fig, close=False) if fig is not None else "<p><em>no plot</em></p>")
    rows = []
    for s in all_series:
        peak, i = s.peak()
        last = int(s.device[-1]) if len(s.times) else 0
        rows.append([s.pid, s.dev, _mib(peak), f"{(int(s.times[i]) - t0) / 1e9:.3f} s" if i >= 0 else "-",
                     _mib(last), len(s.times)])
    parts.append(_table(["pid", "GPU", "peak (GPU-resident)", "at", "at the end", "changes"], rows))
    parts.append("<h2>Largest live allocations at the peak</h2>")
    for s in all_series[:_MAX_PANELS]:
        peak, i = s.peak()
        if i < 0:
            continue
        table = tables_at(rec, s.pid, s.dev, int(s.times[i]))
        top = sorted(table.items(), key=lambda kv: -kv[1][0])[:_TOP_ALLOCATIONS]
        parts.append(f"<h3>pid {s.pid}, GPU {s.dev}: {_mib(peak)} in {len(table)} allocations</h3>")
        parts.append(_table(["address", "bytes", "size", "kind", "allocated at"],
                            [[f"{a:#x}", f"{b:,}", _mib(b), kind_name(k), f"{(ts - t0) / 1e9:.3f} s"]
                             for a, (b, k, ts) in top]))
    parts.append("<h2>Copy and migration traffic</h2>")
    traffic = _traffic_figure(rec, t0)
    parts.append(_img(traffic) if traffic is not None else "<p><em>no copy or unified-memory records "
                 "(copies are recorded with <code>probe.copies: always</code>)</em></p>")
    parts.append("<h2>Sampler intervals and anomaly windows</h2>")
    sampler = _sampler_figure(rec, t0)
    parts.append(_img(sampler) if sampler is not None else "")
    parts.append(_table(["pid", "GPU", "start", "end", "reason", "peak"],
                        [[w["pid"], w["gpu"], f"{_since(int(w['start']), t0):.3f} s",
                          f"{_since(int(w['end']), t0):.3f} s", w["reason"], _mib(int(w["peak_bytes"]))]
                         for w in rec.anomaly_windows]))
    parts.append("<h2>Marks</h2>")
    parts.append(_table(["label", "pid", "GPU", "at", "live bytes", "matches the probe"],
                        [[m.get("label"), m.get("pid"), m.get("dev"),
                          f"{_since(int(m['ts']), t0):.3f} s" if isinstance(m.get("ts"), int) else "-",
                          ", ".join(f"{k} {_mib(v)}" for k, v in (m.get("live_bytes") or {}).items()),
                          m.get("matches", "-")] for m in rec.marks]))
    parts.append("<h2>Engine verdicts</h2>")
    eng = rec.engines
    # A graph verdict from launch windows is the whole process's (dev None): "-", never "None".
    parts.append(_table(["engine", "pid", "GPU", "verdict", "reasons"],
                        [["graph", g.get("pid"), _or_dash(g.get("dev")), g.get("decision"),
                          "; ".join(g.get("reasons", []))]
                         for g in eng.get("graph", [])]
                        + [["leaks", lk.get("pid"), _or_dash(lk.get("dev")), "suspect" if lk.get("suspect") else "no",
                            f"suspect bytes {lk.get('suspect_bytes')}"] for lk in eng.get("leaks", [])]))
    if rec.problems:
        parts.append("<h2>Problems met reading the recording</h2>")
        parts.append("<ul>" + "".join(f"<li>{html.escape(p)}</li>" for p in rec.problems[:50]) + "</ul>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:1em auto;color:#222}"
             "table{border-collapse:collapse;font-size:13px;margin:.5em 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
             "th{background:#f0f0f0}img{max-width:100%}.oom{color:#a00}")
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(name)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
    return page, fig


def write_report(files: Sequence[str | Path], out: str | Path, *, title: str | None = None,
                 plot: str | Path | None = None) -> Recording:
    """Read ``files``, write the page to ``out`` and, with ``plot``, the main plot (PNG or SVG by suffix)."""
    rec = load(files)
    page, fig = render_html(rec, title=title)
    if plot is not None:
        suffix = Path(plot).suffix.lower()
        if suffix not in (".png", ".svg"):
            raise GpuFootprintError(f"--plot {plot}: the file name must end in .png or .svg")
        if fig is None:
            fig = main_figure(rec, series(rec))
        if fig is None:
            raise GpuFootprintError(f"--plot {plot}: no plot (matplotlib missing, or no memory records)")
    try:
        # Both files appear together or not at all (each beside its target, renamed when whole).
        with atomic_output("-o", out, "w") as page_fh:
            page_fh.write(page)
            if plot is not None and fig is not None:
                with atomic_output("--plot", plot, "wb") as plot_fh:
                    fig.savefig(plot_fh, format=Path(plot).suffix.lower()[1:], dpi=110)
    finally:
        if fig is not None:
            _pyplot().close(fig)
    return rec


def plots_available() -> bool:
    """Whether matplotlib imports here (the ``report`` extra): without it pages have tables only."""
    return _pyplot() is not None
