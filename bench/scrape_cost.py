"""CPU time of one /metrics exposition with N probed processes, measured with nothing else running.

  python bench/scrape_cost.py [--probes 64] [--gpus 8] [--repeat 30]

Runs the daemon's App in this process, lets N simulated probes (bench/load.py's) report for
4 s at 500 records/s each, stops ingest, then times ``generate_latest`` on the daemon's registry
(the exact body /metrics serves) with thread CPU time: the floor under /metrics latency, before
any contention with the ingest thread.
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
from gpufootprint.config import load_config  # noqa: E402


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

    cpu: list[float] = []
    body = b""
    for _ in range(args.repeat):
        c0 = time.thread_time()
        body = generate_latest(app.registry)
        cpu.append(time.thread_time() - c0)
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; machine {machine()}")
    print(f"processes {len(app.ingest.snapshot.processes)}, series {series}, body {len(body)} bytes; "
          f"exposition CPU p50 {percentile(cpu, 50) * 1000:.1f} ms, p90 {percentile(cpu, 90) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
