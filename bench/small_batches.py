"""Per-batch cost of the ingest path with many small batches, as 64 live probes produce them.

64 processes over 8 GPUs, 100 flushes each: a 50-record MEMORY batch (25 allocation/release pairs)
and a WATERMARK per flush, handed to the daemon's own Session and Pipeline (feature frames and
sampler included) in one thread. Prints the wall time per batch+watermark, median of --rounds.

Usage: python bench/small_batches.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from gpufootprint.config import Config  # noqa: E402
from gpufootprint.pipeline import Pipeline  # noqa: E402
from gpufootprint.ingest.session import Session  # noqa: E402
from gpufootprint.records import MEMORY_DTYPE, RecordKind  # noqa: E402
from gpufootprint.hub import FeatureHub  # noqa: E402
from gpufootprint.wire.framing import HEADER_SIZE, Frame, FrameType, encode_batch, encode_watermark  # noqa: E402

T0 = 1_796_000_000_000_000_000


def frames(processes: int = 64, steps: int = 100) -> list[tuple[int, Frame]]:
    out = []
    for step in range(steps):
        for p in range(processes):
            pid = 1000 + p
            recs = np.zeros(50, MEMORY_DTYPE)
            base = T0 + step * 100_000_000 + np.arange(25) * 1_000_000
            recs["ts"][0::2], recs["ts"][1::2] = base, base + 500_000
            recs["op"][0::2], recs["op"][1::2] = 1, 2
            addr = 0x7F00_0000_0000 + (p << 32) + np.arange(25) * 4096
            recs["addr"][0::2], recs["addr"][1::2] = addr, addr
            recs["bytes"], recs["mk"], recs["pid"], recs["dev"] = 1 << 20, 3, pid, p % 8
            batch = encode_batch(RecordKind.MEMORY, recs)[HEADER_SIZE:]
            mark = encode_watermark(T0 + (step + 1) * 100_000_000)[HEADER_SIZE:]
            out.append((pid, Frame(FrameType.BATCH, RecordKind.MEMORY, batch, 0)))
            out.append((pid, Frame(FrameType.WATERMARK, 0, mark, 0)))
    return out


def one_round(work: list[tuple[int, Frame]]) -> float:
    cfg = Config()
    pipeline = Pipeline(cfg.footprint, hub=FeatureHub(cfg.features, cfg.sampler))
    sessions = {}
    for pid in {pid for pid, _ in work}:
        s = Session(pipeline, source="probe", name=f"probe {pid}", peer_pid=pid)
        s.pids.add(pid)
        pipeline.process(pid, "probe")
        sessions[pid] = s
    started = time.perf_counter()
    for pid, frame in work:
        sessions[pid].handle(frame)
    return (time.perf_counter() - started) / (len(work) / 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = frames()
    per_batch = [one_round(work) for _ in range(args.rounds)]
    print(f"{statistics.median(per_batch) * 1e3:.3f} ms per batch+watermark (median of {args.rounds}; "
          f"{', '.join(f'{x * 1e3:.3f}' for x in per_batch)})")
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
          f"Python {platform.python_version()}, numpy {np.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
