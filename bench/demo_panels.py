"""A long demo under a real Prometheus: which panels of the shipped dashboard lose their data, and when.

The integration test (tests/integration/test_demo_prometheus.py) holds every panel from the
demo's 60th to its 80th second; the demo's traces loop on longer periods (the slow leak every
20 minutes), so this runs the demo as a newcomer does for ``SECONDS`` and then range-queries
every panel query, second by second, from the 60th second to the end.

Usage: python bench/demo_panels.py SECONDS OUT_DIR   (needs Debian's `prometheus` on PATH)
Writes OUT_DIR/gaps.json: {panel: {"missing_s": n, "first": [...], "last": [...]}} ({} = no gap).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.test_prometheus import (
    Prom,
    _assert_ok,
    _free_port,
    _get,
    _panel_queries,
    _substitute,
    _tool,
    _wait,
    start_prometheus,
    stop_processes,
)


def main() -> int:
    seconds, out = float(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    dport, pport = _free_port(), _free_port()
    server = start_prometheus(_tool("prometheus"), out, pport, dport, cluster="demo")
    prom = Prom(f"http://127.0.0.1:{pport}")
    _wait("Prometheus", lambda: _get(f"{prom.base}/-/ready"), 60, {"prometheus": (server, out / "prometheus.log")})
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFOOTPRINT_")}
    t0 = time.time()
    demo = subprocess.Popen([sys.executable, "-m", "gpufootprint", "demo", "--listen", f"127.0.0.1:{dport}"],
                            env=env, cwd=out, stdout=subprocess.DEVNULL, stderr=open(out / "demo.log", "w"))  # noqa: SIM115
    try:
        while time.time() - t0 < seconds + 3:
            assert demo.poll() is None, (out / "demo.log").read_text()[-2000:]
            time.sleep(5)
        gaps: dict[str, dict[str, object]] = {}
        for title, raw, _ in _panel_queries():
            expr = _substitute(raw)
            missing: list[int] = []
            lo = t0 + 60
            while lo < t0 + seconds:  # at most an hour of 1 s steps a query (Prometheus's 11,000-point limit)
                hi = min(lo + 3600, t0 + seconds)
                r = _assert_ok(prom.api("query_range", query=expr, start=f"{lo:.3f}", end=f"{hi:.3f}", step="1"), expr)
                have = {round(float(t) - t0) for series in r for t, _ in series["values"]}
                missing += [i for i in range(round(lo - t0), round(hi - t0) + 1) if i not in have]
                lo = hi + 1
            if missing:
                gaps[f"{title}: {expr}"] = {"missing_s": len(missing), "first": missing[:5], "last": missing[-5:]}
        result = {"seconds": seconds, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "gaps": gaps}
        (out / "gaps.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    finally:
        stop_processes(demo, server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
