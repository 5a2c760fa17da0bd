"""Replay throughput: records per second through the daemon's own decoder, session and pipeline.

Two inputs, both replayed by ``gpufootprint.replay.replay_file`` exactly as ``gpufootprint replay`` does:
  * native: a synthetic caching-allocator churn (alloc/free at reused addresses, a copy every
    tenth record) written in the native framing, and the real H200 caching trace looped;
  * cupti-jsonl: the same churn written as CUPTI-JSONL (gzip).

"native churn, footprint only" runs the same file with the feature frames and the sampler
switched off, to show side by side what they cost (the daemon always runs them).

Usage: python bench/replay_throughput.py [--records N] [--rounds R] [--json OUT]
Prints one line per input with the median records/s of R rounds, and the machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from gpufootprint.config import FootprintConfig  # noqa: E402
from gpufootprint.footprint.peaks import FramePeaks  # noqa: E402
from gpufootprint.pipeline import Pipeline  # noqa: E402
from gpufootprint.sampler.hub import FeatureHub  # noqa: E402
from gpufootprint.records import MEMCPY_DTYPE, MEMORY_DTYPE, CopyKind, MemoryKind, RecordKind  # noqa: E402
from gpufootprint.replay import load_frames, shift_frame  # noqa: E402
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode, encode_batch, encode_json  # noqa: E402
from gpufootprint.wire.jsonl import write_jsonl  # noqa: E402

BATCH = 4096
ROOT = Path(__file__).resolve().parents[1]


def churn_batches(n_records: int, seed: int = 1):  # type: ignore[no-untyped-def]
    """(kind, records) batches: alloc/free pairs over 2,048 reused addresses, 1 copy per 10 records."""
    rng = np.random.default_rng(seed)
    t0 = 1_796_000_000_000_000_000
    slots = 2048
    produced = 0
    step = 0
    while produced < n_records:
        n = min(BATCH, n_records - produced)
        n_cpy = n // 10
        n_mem = n - n_cpy
        n_mem -= n_mem % 2
        if n_mem == 0:
            break  # one odd record left: a release needs its allocation
        half = n_mem // 2
        # Each pair: allocate at a slot, release it a little later.
        slot = (np.arange(half) + step * half) % slots
        addr = 0x7F00_0000_0000 + slot.astype(np.uint64) * (64 << 20) + np.uint64(step % 2) * 4096
        size = rng.choice([512, 4096, 1 << 20, 2 << 20, 20 << 20], size=half).astype(np.uint64)
        base = t0 + step * 10_000_000 + np.arange(half, dtype=np.int64) * 2_000
        mem = np.zeros(n_mem, dtype=MEMORY_DTYPE)
        mem["ts"][0::2], mem["ts"][1::2] = base, base + 1_000
        mem["op"][0::2], mem["op"][1::2] = 1, 2
        mem["addr"][0::2], mem["addr"][1::2] = addr, addr
        mem["bytes"][0::2], mem["bytes"][1::2] = size, size
        mem["mk"] = MemoryKind.DEVICE
        mem["pid"] = 4242
        yield RecordKind.MEMORY, mem
        if n_cpy:
            cpy = np.zeros(n_cpy, dtype=MEMCPY_DTYPE)
            cpy["start"] = t0 + step * 10_000_000 + np.arange(n_cpy, dtype=np.int64) * 9_000
            cpy["end"] = cpy["start"] + 5_000
            cpy["bytes"] = 1 << 20
            cpy["ck"] = rng.choice([CopyKind.HTOD, CopyKind.DTOH, CopyKind.DTOD], size=n_cpy)
            cpy["pid"] = 4242
            yield RecordKind.MEMCPY, cpy
        produced += n_mem + n_cpy
        step += 1


def write_native(path: Path, n_records: int) -> int:
    total = 0
    with open(path, "wb") as fh:
        fh.write(PREAMBLE + encode_json(FrameType.META, {"pid": 4242, "scenario": "churn"}))
        for kind, recs in churn_batches(n_records):
            fh.write(encode_batch(kind, recs))
            total += len(recs)
    return total


def write_looped_h200(path: Path, loops: int) -> int:
    """The real caching trace repeated, each loop a new process that exits at the end."""
    frames, _ = load_frames(ROOT / "tests" / "data" / "h200_caching.jsonl.gz")
    total = 0
    with open(path, "wb") as fh:
        fh.write(PREAMBLE)
        for i in range(loops):
            pid = 10_000 + i
            fh.write(encode_json(FrameType.HELLO, {"pid": pid, "start_time": i}))
            for frame in frames:
                if frame.type is FrameType.BATCH:
                    total += len(frame.records())
                f = shift_frame(frame, i * 5_000_000_000, pid=pid)
                fh.write(encode(f.type, f.payload, f.tag))
            fh.write(encode_json(FrameType.GOODBYE, {"ts": 0}))
    return total


def write_jsonl_gz(native: Path, path: Path) -> None:
    from gpufootprint.wire.framing import iter_frames
    from gpufootprint.wire.sources import TraceFile

    with gzip.open(path, "wt", compresslevel=1) as fh:
        write_jsonl(iter_frames(TraceFile(native).chunks()), fh)


class FootprintOnlyHub(FeatureHub):
    """Frames and sampler switched off: only to show, side by side, what they cost."""

    def open_device(self, pid: int, dev: int, peaks: FramePeaks) -> None:
        pass  # no frame builder and no sampler: the hub passes everything by


def time_replay(path: Path, rounds: int, footprint_only: bool = False) -> tuple[float, int, list[float]]:
    from gpufootprint.replay import replay_file

    rates = []
    records = 0
    for _ in range(rounds):
        hub = FootprintOnlyHub() if footprint_only else FeatureHub()
        pipeline = Pipeline(FootprintConfig(), hub=hub)
        started = time.perf_counter()
        result = replay_file(path, pipeline)
        elapsed = time.perf_counter() - started
        assert not result.problems, result.problems[:3]
        assert not pipeline.errors.counts, dict(pipeline.errors.counts)
        records = result.records
        rates.append(records / elapsed)
    return statistics.median(rates), records, rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=2_000_000, help="records in the native churn trace")
    ap.add_argument("--jsonl-records", type=int, default=300_000, help="records in the JSONL trace")
    ap.add_argument("--loops", type=int, default=500, help="loops of the real H200 trace")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        native, looped, small, jsonl = t / "churn.gfp", t / "h200_loop.gfp", t / "churn_small.gfp", t / "churn.jsonl.gz"
        write_native(native, args.records)
        write_looped_h200(looped, args.loops)
        write_native(small, args.jsonl_records)
        write_jsonl_gz(small, jsonl)
        cases = (("native churn", native, False), ("native churn, footprint only", native, True),
                 ("native h200 looped", looped, False), ("cupti-jsonl churn", jsonl, False))
        for name, path, footprint_only in cases:
            median, n, rates = time_replay(path, args.rounds, footprint_only)
            results[name] = {"records": n, "median_records_per_s": median, "rates": rates,
                             "file_bytes": os.path.getsize(path)}
            print(f"{name:30s} {n:>10,} records  median {median:>12,.0f} records/s  "
                  f"(min {min(rates):,.0f}, max {max(rates):,.0f}, {args.rounds} rounds)")
    machine = f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}, numpy {np.__version__}"
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
