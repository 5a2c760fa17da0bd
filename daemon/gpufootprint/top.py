"""``gpufootprint top``: a live terminal table of a running daemon (or the demo).

It reads the daemon's HTTP API (``/api/processes``), never the probe socket, so it
works from anywhere the metrics port is reachable. The live view uses the standard
library's curses (no escape codes written by hand, nothing to install); ``--once``
prints one frame as plain text for scripts. Every line fits 80 columns.
"""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from gpufootprint.errors import GpuFootprintError

WIDTH = 80
SORT_KEYS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "device": lambda r: -(r.get("device_bytes") or 0),
    "peak": lambda r: -(r.get("window_peak_bytes") or 0),
    "slack": lambda r: -(r.get("allocator_slack_bytes") or 0),
    "oom": lambda r: -(r.get("oom_events") or 0),
    "pid": lambda r: r.get("pid") or 0,
}
#: curses keys -> sort key
KEYS = {"d": "device", "p": "peak", "s": "slack", "o": "oom", "i": "pid"}
_KIND_SHORT = {"device": "dev", "pinned": "pin", "managed": "mgd", "device_static": "sta", "array": "arr",
               "untracked": "unt", "pageable": "pgb", "managed_static": "mst", "unknown": "unk"}
_MODE = {"steady": "stdy", "quiet": "quiet", "burst": "BURST"}
_GRAPH = {"capture": "CAPT", "keep": "keep", "already_captured": "done", "insufficient_data": "-"}
HEADER = f"{'PID':>7} {'POD/COMMAND':<13} {'GP':>2} {'DEVICE':>8} {'PEAK':>8} {'KINDS %':<12} {'SLACK':>8} " \
         f"{'MODE':<5} {'GRPH':<4} {'L'} {'OO'}"


def size(n: int | None) -> str:
    """Bytes in binary units, as the demo's table, the report, nvidia-smi and nvitop print them, in at
    most 8 characters: 512B, 4.0KiB, 772.2MiB, 2.36GiB, 140.4GiB. A unit gives way to the next at
    1000 (not 1024), so four digits never appear: 1000.0MiB would not fit its column."""
    if n is None:
        return "-"
    v = float(n)
    if abs(v) < 1000:
        return f"{int(v)}B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024
        if abs(v) < 1000 or unit == "TiB":
            return f"{v:.2f}{unit}" if abs(v) < 10 else f"{v:.1f}{unit}"
    return f"{v:.1f}TiB"


def fetch(url: str, timeout: float = 5.0, user: str | None = None) -> dict[str, Any]:
    """GET ``url``/api/processes; a one-line error that names the URL otherwise."""
    target = url.rstrip("/")
    target = target.removesuffix("/metrics")
    target += "/api/processes"
    req = urllib.request.Request(target)
    if user:
        req.add_header("Authorization", "Basic " + base64.b64encode(user.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # the user's own daemon URL
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise GpuFootprintError(f"{target}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GpuFootprintError(f"{target}: cannot connect ({reason}); is the daemon running?") from None
    except ValueError as exc:
        raise GpuFootprintError(f"{target}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("processes"), list):
        raise GpuFootprintError(f"{target}: not a gpufootprint /api/processes document")
    return doc


def _name(row: dict[str, Any]) -> str:
    if row.get("pod"):
        return str(row["pod"])
    cmd = str(row.get("command") or "")
    return cmd.rsplit("/", 1)[-1] if cmd else "-"


def _kinds(live: dict[str, int]) -> str:
    total = sum(v for v in live.values() if v > 0)
    if total <= 0:
        return "-"
    top = sorted(live.items(), key=lambda kv: -kv[1])[:2]
    return " ".join(f"{_KIND_SHORT.get(k, k[:3])}{min(99, round(100 * v / total))}" for k, v in top)


def process_line(r: dict[str, Any]) -> str:
    line = (f"{r.get('pid', 0):>7} {_name(r)[:13]:<13} {r.get('gpu', 0):>2} {size(r.get('device_bytes')):>8} "
            f"{size(r.get('window_peak_bytes')):>8} {_kinds(r.get('live_bytes') or {}):<12} "
            f"{size(r.get('allocator_slack_bytes')):>8} {_MODE.get(r.get('sampler_mode') or '', '-'):<5} "
            f"{_GRAPH.get(r.get('graph_verdict') or '', '-'):<4} {'L' if r.get('leak_suspect') else ' '} "
            f"{min(99, r.get('oom_events') or 0) or '':>2}")
    return line[:WIDTH]


def gpu_line(g: dict[str, Any]) -> str:
    """``GPU 0  NVIDIA H200 (simulated)  used 2.36GiB / 140.4GiB  probed 384.7MiB``, in 80 columns:
    only the model name gives way, and it is never cut inside its parentheses."""
    used, total = g.get("used_bytes"), g.get("total_bytes")
    view = f"used {size(used)} / {size(total)}" if used is not None else \
        f"total {size(total)}" if total is not None else "no NVML view"
    head, tail = f"GPU {g.get('gpu')}  ", f"  {view}  probed {size(g.get('probed_bytes'))}"
    model = _fit(str(g.get("model") or "-"), WIDTH - len(head) - len(tail))
    return (head + model + tail)[:WIDTH]


def _fit(text: str, room: int) -> str:
    """``text`` in ``room`` columns: first without its parenthesised parts, then cut with "..."."""
    if len(text) <= room:
        return text
    bare = re.sub(r"\s*\([^)]*\)", "", text).strip()
    if len(bare) <= room:
        return bare
    return bare[:max(0, room - 3)] + "..." if room > 3 else bare[:max(0, room)]


def render(doc: dict[str, Any], sort: str = "device", *, source: str = "", limit: int | None = None) -> list[str]:
    """One frame: a title, a line per GPU, the header, a line per (process, GPU)."""
    rows = [r for r in doc.get("processes", []) if isinstance(r, dict)]
    rows.sort(key=SORT_KEYS.get(sort, SORT_KEYS["device"]))
    taken = doc.get("taken_at")
    when = time.strftime("%H:%M:%S", time.localtime(taken)) if isinstance(taken, (int, float)) and taken else "-"
    window = doc.get("window_peak_seconds")
    peak = f"{window:g}s" if isinstance(window, (int, float)) else "-"
    title = f"gpufootprint top {when}  sort {sort}  peak over {peak}  {source}"
    lines = [title[:WIDTH]]
    lines += [gpu_line(g) for g in doc.get("gpus", []) if isinstance(g, dict)]
    lines.append(HEADER)
    shown = rows if limit is None else rows[:max(0, limit)]
    lines += [process_line(r) for r in shown]
    if not rows:
        lines.append("(no probed processes)")
    elif len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more")
    return lines


def run_once(url: str, sort: str, user: str | None = None) -> str:
    return "\n".join(render(fetch(url, user=user), sort, source=url))


def run_live(url: str, sort: str, interval: float = 1.0, user: str | None = None) -> None:
    """The live view: refreshes every ``interval`` s; keys d/p/s/o/i sort, q quits."""
    import curses

    def loop(screen: Any) -> None:
        nonlocal sort
        curses.curs_set(0)
        screen.timeout(int(interval * 1000))
        error = ""
        doc: dict[str, Any] = {"processes": [], "gpus": []}
        while True:
            try:
                doc = fetch(url, user=user)
                error = ""
            except GpuFootprintError as exc:
                error = str(exc)
            height, width = screen.getmaxyx()
            lines = render(doc, sort, source=url, limit=max(0, height - 6))
            lines.append("keys: d device  p peak  s slack  o oom  i pid  q quit")
            if error:
                lines.append(("! " + error)[:WIDTH])
            screen.erase()
            for y, line in enumerate(lines[: height - 1]):
                attr = curses.A_BOLD if y == 0 or line == HEADER else curses.A_NORMAL
                screen.addnstr(y, 0, line, max(1, width), attr)  # never the last row: no scroll
            screen.refresh()
            key = screen.getch()
            if key in (ord("q"), 27):
                return
            if 0 <= key < 256 and chr(key) in KEYS:
                sort = KEYS[chr(key)]

    curses.wrapper(loop)
