"""The sampler's own cost: daemon CPU per second of traffic, quiet vs burst, sampler on vs off.

A live daemon sees records arrive in batches (the probe's flush interval) and
advances each process's watermark on its tick. This script drives the daemon's
own pipeline exactly so (batches every ``--flush-ms`` of trace time, a watermark
every ``--tick-ms``) for ``--seconds`` of trace time, and measures the CPU time
(``time.process_time``) it took, per second of traffic:

* quiet: a process holding 1 GiB allocates and frees 1 KiB 5 times a second;
* burst: a process allocating and freeing 64-512 MiB blocks 1000 times a second,
  so the sampler stays in (or keeps re-entering) 5 ms burst frames;

each with the full feature hub and sampler, and with the sampler disabled
(``sampler.enabled=false``: frames still built, fixed 20 ms interval), interleaved
A/B for ``--rounds`` rounds; medians reported.

Usage: python bench/sampler_cost.py [--seconds 60] [--rounds 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "daemon"))

from gpufootprint.config import FootprintConfig, SamplerConfig
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import MEMORY_DTYPE, RecordKind
from gpufootprint.hub import FeatureHub
from gpufootprint.sampler.state import ProcessSampler

# CPU spent inside the sampler's own walk (ProcessSampler._run), measured around each call.
_SPENT = [0.0]
_orig_run = ProcessSampler._run


def _timed_run(self: ProcessSampler, limit: int, final: bool) -> None:
    t = time.process_time()
    try:
        _orig_run(self, limit, final)
    finally:
        _SPENT[0] += time.process_time() - t


ProcessSampler._run = _timed_run  # type: ignore[method-assign]

MS = 1_000_000
T0 = 1_796_000_000_000_000_000
PID = 77


def traffic(kind: str, seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "quiet":
        n = int(seconds * 5)
        ts = T0 + 1000 * MS + np.arange(n, dtype=np.int64) * 200 * MS
        recs = np.zeros(2 * n + 1, MEMORY_DTYPE)
        recs["ts"][1::2], recs["ts"][2::2] = ts, ts + 2 * MS
        recs["op"][1::2], recs["op"][2::2] = 1, 2
        recs["bytes"][1:] = 1024
        recs["addr"][1:] = 0x2000
    else:
        n = int(seconds * 1000)
        ts = T0 + 1000 * MS + np.sort(rng.integers(0, int(seconds * 1e9), n)).astype(np.int64)
        recs = np.zeros(2 * n + 1, MEMORY_DTYPE)
        recs["ts"][1::2], recs["ts"][2::2] = ts, ts + rng.integers(MS // 10, 3 * MS, n)
        recs["op"][1::2], recs["op"][2::2] = 1, 2
        sizes = rng.choice([64 << 20, 128 << 20, 256 << 20, 512 << 20], n)
        recs["bytes"][1::2], recs["bytes"][2::2] = sizes, sizes
        addrs = 0x10_0000_0000 + np.arange(n, dtype=np.uint64) * 0x4000_0000
        recs["addr"][1::2], recs["addr"][2::2] = addrs, addrs
        recs = recs[np.argsort(recs["ts"], kind="stable")]
    recs["ts"][0], recs["op"][0], recs["bytes"][0], recs["addr"][0] = T0, 1, 1 << 30, 0x1000
    recs["mk"], recs["pid"] = 3, PID
    return recs


def run(recs: np.ndarray, seconds: float, sampler: bool, flush_ms: int,
        tick_ms: int) -> tuple[float, float, int, int]:
    hub = FeatureHub(sampler=SamplerConfig(enabled=sampler))
    pipeline = Pipeline(FootprintConfig(), hub=hub)
    pipeline.process(PID, "probe")
    end = T0 + int((seconds + 1) * 1e9)
    flush_points = np.arange(T0, end + 1, flush_ms * MS, dtype=np.int64)
    cut = np.searchsorted(recs["ts"], flush_points, "right")
    next_tick = T0
    fed = 0
    _SPENT[0] = 0.0
    started = time.process_time()
    for t, upto in zip(flush_points.tolist(), cut.tolist()):
        if upto > fed:
            pipeline.submit(RecordKind.MEMORY, recs[fed:upto])
            fed = upto
        if t >= next_tick:
            pipeline.advance(PID, t - 500 * MS)  # the tick's watermark: now minus the reorder window
            pipeline.snapshot()
            next_tick = t + tick_ms * MS
    cpu = time.process_time() - started
    s = hub.samplers[PID]
    bursts = sum((e - st) for st, e, _iv, m, _n in s.history if m == "burst")
    return cpu, _SPENT[0], len(hub.windows), bursts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flush-ms", type=int, default=20)
    ap.add_argument("--tick-ms", type=int, default=100)
    args = ap.parse_args()
    data = {k: traffic(k, args.seconds) for k in ("quiet", "burst")}
    results: dict[tuple[str, bool], list[float]] = {}
    walk: dict[str, list[float]] = {}
    info: dict[str, tuple[int, int]] = {}
    for _ in range(args.rounds):
        for kind in ("quiet", "burst"):
            for sampler in (True, False):  # interleaved A/B
                cpu, spent, nwin, burst_ns = run(data[kind], args.seconds, sampler, args.flush_ms, args.tick_ms)
                results.setdefault((kind, sampler), []).append(cpu / args.seconds)
                if sampler:
                    info[kind] = (nwin, burst_ns)
                    walk.setdefault(kind, []).append(spent / args.seconds)
    print(f"{platform.node()} {platform.processor() or platform.machine()} python {platform.python_version()}; "
          f"{args.seconds:g} s of traffic, flush {args.flush_ms} ms, tick {args.tick_ms} ms, "
          f"median of {args.rounds} interleaved rounds\n")
    print("| traffic | records/s | daemon CPU per s, sampler on | of which the sampler's walk | "
          "sampler off (fixed 20 ms) | on/off | windows | time in burst |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("quiet", "burst"):
        on = statistics.median(results[(kind, True)])
        off = statistics.median(results[(kind, False)])
        nwin, burst_ns = info[kind]
        w = statistics.median(walk[kind])
        print(f"| {kind} | {len(data[kind]) / args.seconds:.0f} | {on * 1000:.2f} ms ({on * 100:.2f}%) | "
              f"{w * 1000:.2f} ms | {off * 1000:.2f} ms | {on / off:.2f} | {nwin} | "
              f"{100 * burst_ns / (args.seconds * 1e9):.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
