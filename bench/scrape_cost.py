"""CPU time of one /metrics exposition with N probed processes, measured with nothing else running.

  python bench/scrape_cost.py [--probes 64] [--gpus 8] [--repeat 30]

Runs the daemon's App in this process, lets N simulated probes (bench/load.py's) report for
4 s at 500 records/s each, stops ingest, then times with thread CPU time, side by side:

* ``generate_latest`` on the daemon's registry: what a scrape cost before the render cache
  (collect the families and format them with prometheus_client on the request thread);
* collecting the families alone, and formatting the same families with prometheus_client and
  with the lean writer (exporter/text.py; the two bodies are checked to be equal);
* one rendering of the cache (collect, lean text, gzip), which the render thread does every
  ``exporter.render_interval_ms``;
* what a scrape costs now: ``ExpositionCache.body`` returning the cached bytes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, percentile  # noqa: E402
from load import probe  # noqa: E402

from gpufootprint.app import App  # noqa: E402
from gpufootprint.configload import load_config  # noqa: E402
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    cfg = load_config(env={}, overrides={"nvml.enabled": False, "footprint.process_grace_seconds": 600})
    sock = os.path.join(tempfile.mkdtemp(prefix="gfp-scrape-"), "p.sock")
    app = App(cfg, socket_path=sock, listen=None)
    app.ingest.open()
    t = threading.Thread(target=app.ingest.run, daemon=True)
    t.start()
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    go = time.time() + 0.5
    ps = [ctx.Process(target=probe, args=(sock, i, args.gpus, 500.0, go + 4, go, q), daemon=True)
          for i in range(args.probes)]
    for p in ps:
        p.start()
    for _ in ps:
        q.get(timeout=60)
    for p in ps:
        p.join()
    time.sleep(1.0)
    app.ingest.stop()
    t.join(5)
    from prometheus_client.exposition import generate_latest

    from gpufootprint.exporter.exposition import ExpositionCache, _Families
    from gpufootprint.exporter.text import render_text

    families = list(app.registry.collect())
    cache = ExpositionCache(app.registry, 1.0)
    cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, True)  # the first scrape: asks for gzip too
    bodies: dict[str, bytes] = {}
    steps = {
        "generate_latest (before: per scrape)": lambda: bodies.__setitem__("old", generate_latest(app.registry)),
        "collect families": lambda: list(app.registry.collect()),
        "format: prometheus_client": lambda: bodies.__setitem__("lib", generate_latest(_Families(families))),
        "format: lean writer": lambda: bodies.__setitem__("lean", render_text(families)),
        "render (collect, lean text, gzip)": cache.render,
        "cached body (now: per scrape)": lambda: cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, True),
    }
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeat):  # interleaved, so drift in the machine's speed hits every step alike
        for name, step in steps.items():
            c0 = time.thread_time()
            step()
            cpu[name].append(time.thread_time() - c0)
    assert bodies["lib"] == bodies["lean"], "the lean writer must write what prometheus_client writes"
    body = bodies["old"]
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; machine {machine()}")
    print(f"processes {len(app.ingest.snapshot.processes)}, series {series}, body {len(body)} bytes; "
          f"thread CPU per step over {args.repeat} rounds:")
    for name, values in cpu.items():
        print(f"  {name:40s} p50 {percentile(values, 50) * 1000:7.2f} ms   p90 {percentile(values, 90) * 1000:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
