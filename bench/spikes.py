"""What catches a short memory spike? The daemon's exact peaks vs a 1 s poll of live bytes.

The trace: the real H200 caching-allocator trace (tests/data), then a stretch in
which that process makes short transient allocations, with sizes taken from the
trace's own device allocations, lasting 1 to 500 ms, at random times, a few
seconds apart. It is replayed through the daemon's pipeline (feature hub and
sampler included), and at the same time

* a Prometheus-style scrape every ``--scrape`` seconds reads
  ``gpufootprint_window_peak_bytes`` (window = the scrape interval): a spike is
  caught when a scrape whose window holds it reports at least its peak;
* the sampler's anomaly windows: caught when one covers the spike and its
  ``peak_bytes`` equals the spike's exact peak;
* a poll of live bytes every second (what NVML-based exporters see): caught when
  a poll happens to land inside the spike.

Usage: python bench/spikes.py [--spikes 400] [--seed 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "daemon"))

from gpufootprint.config import FootprintConfig, SamplerConfig
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import MEMORY_DTYPE, RecordKind
from gpufootprint.replay import replay_file
from gpufootprint.hub import FeatureHub
from gpufootprint.wire.framing import FrameDecoder, FrameType
from gpufootprint.wire.sources import TraceFile

MS = 1_000_000
DURATIONS_MS = (1, 2, 5, 10, 20, 30, 50, 100, 200, 500)


def real_sizes(path: Path) -> tuple[int, list[int], int]:
    """pid, sizes of the trace's device allocations, and its last timestamp."""
    dec = FrameDecoder()
    sizes: list[int] = []
    last = 0
    pid = 0
    for chunk in TraceFile(path).chunks():
        for f in dec.feed(chunk):
            if f.type is FrameType.BATCH and f.tag == RecordKind.MEMORY:
                r = f.records()
                pid = int(r["pid"][0])
                sizes += r["bytes"][(r["op"] == 1) & (r["mk"] == 3)].tolist()
                last = max(last, int(r["ts"].max()))
    return pid, sizes, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT / "tests/data/h200_caching.jsonl.gz"))
    ap.add_argument("--spikes", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scrape", type=float, default=15.0, help="scrape interval and peak window, seconds")
    ap.add_argument("--poll", type=float, default=1.0, help="live-bytes poll interval, seconds")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rng = random.Random(args.seed)

    cfg = FootprintConfig(window_peak_seconds=args.scrape)
    pipeline = Pipeline(cfg, hub=FeatureHub(sampler=SamplerConfig()))
    replay_file(args.trace, pipeline)
    pid, sizes, last = real_sizes(Path(args.trace))
    fp = pipeline.processes[pid].devices[0]
    base_level = fp.device_bytes
    # Spike sizes: the trace's own allocations; those below the sampler's relative threshold are
    # still counted (the window-peak metric must catch them; an anomaly window need not).
    big = sorted({s for s in sizes if s >= 1 << 20})

    # The spikes, a few seconds apart, each a real-sized allocation held for d ms.
    spikes: list[dict[str, Any]] = []
    t = last + 10_000 * MS
    addr = 0x7F00_0000_0000
    for i in range(args.spikes):
        t += rng.randrange(2_000, 6_000) * MS + rng.randrange(MS)
        d = DURATIONS_MS[i % len(DURATIONS_MS)]
        size = rng.choice(big)
        spikes.append({"start": t, "end": t + d * MS, "ms": d, "bytes": size, "peak": base_level + size,
                       "addr": addr + i * 0x1000_0000})
    end = spikes[-1]["end"] + 30_000 * MS

    recs = np.zeros(2 * len(spikes) + 1, MEMORY_DTYPE)
    for i, s in enumerate(spikes):
        for j, (ts, op) in enumerate(((s["start"], 1), (s["end"], 2))):
            r = recs[2 * i + j]
            r["ts"], r["op"], r["mk"], r["addr"], r["bytes"], r["pid"] = ts, op, 3, s["addr"], s["bytes"], pid
    recs[-1]["ts"], recs[-1]["op"], recs[-1]["mk"], recs[-1]["addr"], recs[-1]["pid"] = end, 1, 2, 1, pid
    recs[-1]["bytes"] = 4096  # a pinned allocation at the end, so the stream reaches `end`

    # Interleave: submit records up to each observation time, advance the watermark, look.
    phase = rng.randrange(int(args.poll * 1e9))
    first = spikes[0]["start"] - 5_000 * MS
    polls = list(range(first + phase, end, int(args.poll * 1e9)))
    scrapes = list(range(first + rng.randrange(int(args.scrape * 1e9)), end, int(args.scrape * 1e9)))
    times = sorted([(p, "poll") for p in polls] + [(s, "scrape") for s in scrapes])
    fed = 0
    poll_seen: list[tuple[int, int]] = []
    scrape_seen: list[tuple[int, int]] = []
    for ts, what in times:
        upto = int(np.searchsorted(recs["ts"], ts, "right"))
        if upto > fed:
            pipeline.submit(RecordKind.MEMORY, recs[fed:upto])
            fed = upto
        pipeline.advance(pid, ts)
        if what == "poll":
            poll_seen.append((ts, fp.device_bytes))
        else:
            snap = pipeline.device_state(pid, 0)
            assert snap is not None
            scrape_seen.append((ts, snap.window_peak_bytes))
    pipeline.submit(RecordKind.MEMORY, recs[fed:])
    pipeline.finish(pid)
    windows = list(pipeline.hub.windows)

    by_d: dict[int, dict[str, int]] = defaultdict(
        lambda: {"n": 0, "window_peak": 0, "eligible": 0, "anomaly_exact": 0, "anomaly_covers": 0, "poll": 0})
    win_ns = int(args.scrape * 1e9)
    sc = SamplerConfig()
    threshold = max(sc.volatile_min_bytes, sc.volatile_rel_change * base_level)
    for s in spikes:
        row = by_d[s["ms"]]
        row["n"] += 1
        # a scrape whose trailing window overlaps the spike reports at least its peak
        if any(v >= s["peak"] for ts, v in scrape_seen if ts >= s["start"] and ts - win_ns <= s["end"]):
            row["window_peak"] += 1
        if s["bytes"] >= threshold:  # big enough to be volatile by the sampler's relative threshold
            row["eligible"] += 1
            overlapping = [w for w in windows if w.start_ns <= s["end"] and w.end_ns >= s["start"]]
            if any(w.peak_bytes == s["peak"] for w in overlapping):
                row["anomaly_exact"] += 1
            if any(w.start_ns <= s["start"] and w.end_ns >= s["end"] for w in overlapping):
                row["anomaly_covers"] += 1
        if any(v >= s["peak"] for ts, v in poll_seen if s["start"] <= ts < s["end"]):
            row["poll"] += 1

    print(f"{len(spikes)} spikes on top of {base_level} bytes (real trace {Path(args.trace).name}), "
          f"sizes {min(big)}..{max(big)} bytes from its own allocations")
    print(f"scrape every {args.scrape:g} s (peak window {args.scrape:g} s), live-bytes poll every {args.poll:g} s\n")
    print(f"(spikes >= {threshold:.0f} bytes, the sampler's volatile threshold at this level, are 'eligible' "
          "for an anomaly window)\n")
    print("| spike | n | window-peak metric | 1 s poll of live bytes | eligible | anomaly window with exact peak "
          "| one window covers it |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    table = []

    def pct(a: int, b: int) -> str:
        return f"{a} ({100 * a / b:.0f}%)" if b else "0"

    for d in sorted(by_d):
        r = by_d[d]
        table.append({"ms": d, **r})
        print(f"| {d} ms | {r['n']} | {pct(r['window_peak'], r['n'])} | {pct(r['poll'], r['n'])} | {r['eligible']} | "
              f"{pct(r['anomaly_exact'], r['eligible'])} | {pct(r['anomaly_covers'], r['eligible'])} |")
    ge5 = [r for r in table if r["ms"] >= 5]
    caught = sum(r["window_peak"] for r in ge5)
    total = sum(r["n"] for r in ge5)
    elig = sum(r["eligible"] for r in ge5)
    print(f"\nspikes >= 5 ms: window-peak metric {caught}/{total}, 1 s poll {sum(r['poll'] for r in ge5)}/{total}; "
          f"eligible ones with an exact-peak anomaly window {sum(r['anomaly_exact'] for r in ge5)}/{elig}")
    if args.json:
        Path(args.json).write_text(json.dumps({"spikes": len(spikes), "table": table,
                                               "anomaly_windows": len(windows)}, indent=1))
    return 0 if caught == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
