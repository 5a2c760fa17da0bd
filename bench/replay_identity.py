"""Does every trace in tests/data still replay to the same daemon output as a base revision?

Each trace is replayed through the whole daemon (``App``, with a fixed clock) by the working tree's
code and by the base's (``git archive`` of ``--base``, default HEAD, into a temporary directory),
each in its own subprocess that imports only its own tree. Compared: the replay's result (records,
frames, marks, problems), the published snapshot (recursively; arrays by digest), the OOM capture
files, and what the daemon serves over HTTP: /metrics, /api/processes, /api/engines, /api/oom,
/api/anomalies, /api/migrations. Two /metrics values are the scrape's own wall clock
(``gpufootprint_daemon_snapshot_age_seconds``, ``gpufootprint_exporter_body_timestamp_seconds``)
and the ``process_*`` families measure the replaying process: those are left out. Exit status 1
when anything differs.

``--plain``: the ``.gfp.gz`` traces decompressed first (into a temporary directory), so that the reading
of plain native files, frame by frame, is compared too (the gzip'd ones are read in pieces).

Usage: python bench/replay_identity.py [--base REV] [--plain]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WALL = ("gpufootprint_daemon_snapshot_age_seconds ", "gpufootprint_exporter_body_timestamp_seconds ")
ROUTES = ("/metrics", "/api/processes", "/api/engines", "/api/oom", "/api/anomalies", "/api/migrations")
FIXED_NS = 1_800_000_000 * 10**9


def worker(tree: str, data: str, out: str) -> None:
    """In a subprocess: replay every trace of ``data`` with ``tree``'s code, write what came out."""
    sys.path.insert(0, os.path.join(tree, "daemon"))
    import dataclasses
    import enum
    import hashlib
    import urllib.request

    import gpufootprint
    import numpy as np
    from gpufootprint.app import App
    from gpufootprint.replay import replay_file

    assert Path(gpufootprint.__file__).resolve().is_relative_to(Path(tree).resolve()), gpufootprint.__file__
    try:  # the loader moved from config.py to configload.py
        from gpufootprint.configload import load_config
    except ImportError:
        from gpufootprint.config import load_config  # type: ignore[attr-defined,no-redef]

    def plain(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            digest = hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
            return {"ndarray": str(v.dtype), "shape": list(v.shape), "sha256": digest}
        if isinstance(v, np.generic):
            return repr(v.item())
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {type(v).__name__: {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}}
        if isinstance(v, enum.Enum):
            return f"{type(v).__name__}.{v.name}"
        if isinstance(v, dict):
            return [[plain(k), plain(x)] for k, x in v.items()]
        if isinstance(v, (set, frozenset)):
            return sorted((plain(x) for x in v), key=repr)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, float):
            return repr(v)
        if v is None or isinstance(v, (int, str, bool)):
            return v
        if hasattr(v, "__dict__"):
            return {type(v).__name__: {k: plain(x) for k, x in sorted(vars(v).items())}}
        return repr(v)

    results: dict[str, Any] = {}
    for path in sorted(p for p in Path(data).iterdir() if p.name.endswith((".gfp", ".gfp.gz", ".jsonl.gz"))):
        with tempfile.TemporaryDirectory() as oomdir:
            config = load_config(env={}, overrides={"oom.directory": oomdir})
            app = App(config, socket_path=None, listen="127.0.0.1:0", clock_ns=lambda: FIXED_NS)
            try:
                r = replay_file(path, app.pipeline, guard=app.ingest.lock,
                                max_frame_bytes=config.daemon.max_frame_bytes, on_mark=app.oom.on_mark)
                app.ingest.tick()
                app.ingest.tick()
                assert app.http is not None
                app.http.start()
                base = f"http://127.0.0.1:{app.http.port}"
                served = {}
                for route in ROUTES:
                    with urllib.request.urlopen(base + route, timeout=30) as resp:
                        served[route] = resp.read().decode().replace(oomdir, "<oomdir>")
                snapshot = json.loads(json.dumps(plain(app.ingest.snapshot), default=repr).replace(oomdir, "<oomdir>"))
                results[path.name] = {
                    "result": {"records": r.records, "frames": r.frames, "format": r.format,
                               "marks": plain(r.marks), "problems": r.problems},
                    "snapshot": snapshot, "served": served,
                    "oom_files": sorted(p.name for p in Path(oomdir).rglob("*")),
                }
            finally:
                app.stop()
    Path(out).write_text(json.dumps(results, sort_keys=True))


def _metrics_lines(text: str) -> list[str]:
    lines = (ln.split(" ")[0] + " <wall>" if ln.startswith(WALL) else ln for ln in text.splitlines())
    return [ln for ln in lines if not re.match(r"(# (HELP|TYPE) )?process_", ln)]


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two workers' outputs, one line each."""
    out = [f"only in one: {name}" for name in sorted(a.keys() ^ b.keys())]
    for name in sorted(a.keys() & b.keys()):
        x, y = a[name], b[name]
        out += [f"{name}: {part} differs" for part in ("result", "snapshot", "oom_files") if x[part] != y[part]]
        for route in ROUTES:
            sx, sy = x["served"][route], y["served"][route]
            if route == "/metrics":
                lx, ly = _metrics_lines(sx), _metrics_lines(sy)
                if lx != ly:
                    out.append(f"{name}: /metrics differs: -{[ln for ln in lx if ln not in ly][:3]} "
                               f"+{[ln for ln in ly if ln not in lx][:3]}")
            elif sx != sy:
                out.append(f"{name}: {route} differs")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree with (default HEAD)")
    ap.add_argument("--plain", action="store_true", help="replay the .gfp.gz traces decompressed, as plain .gfp files")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = ROOT / "tests" / "data"
        if args.plain:
            data = Path(tmp, "plain")
            data.mkdir()
            for src in sorted((ROOT / "tests" / "data").glob("*.gfp.gz")):
                with gzip.open(src, "rb") as fin, open(data / src.name.removesuffix(".gz"), "wb") as fout:
                    shutil.copyfileobj(fin, fout)
        base = Path(tmp, "base")
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.base], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        outs = {}
        for label, tree in (("base", base), ("new", ROOT)):
            out = Path(tmp, f"{label}.json")
            # Each tree from its own folder, nothing else of gpufootprint on the path; the traces are the working tree's.
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            code = ("import sys; sys.path.insert(0, sys.argv[4]); import replay_identity as r; "
                    "r.worker(sys.argv[1], sys.argv[2], sys.argv[3])")
            subprocess.run([sys.executable, "-I", "-c", code, str(tree), str(data), str(out),
                            str(ROOT / "bench")], env=env, cwd=tmp, check=True)
            outs[label] = json.loads(out.read_text())
    diffs = compare(outs["base"], outs["new"])
    n = len(outs["new"])
    size = sum(len(v["served"]["/metrics"]) for v in outs["new"].values())
    print(f"{n} traces against {args.base}: {size} bytes of /metrics, {len(diffs)} differences")
    for line in diffs:
        print(line)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
