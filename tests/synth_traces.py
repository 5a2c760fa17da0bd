"""Deterministic synthetic traces in the native format, for the engines' tests.

Until kernel traces recorded on the H200 are in tests/data, these stand in for
them: realistic kernel streams (a training step of distinct kernels with launch
gaps and a host gap between steps, a launch-bound stream of tiny kernels, a
stream replayed from a captured CUDA graph, an irregular stream) with the
allocation pattern of a caching allocator, and a slow leak next to a steady
process. Same seed, same bytes: ``python tests/synth_traces.py`` rewrites the
files in tests/data, and a test checks the committed files equal the generator.
"""

from __future__ import annotations

import gzip
import io
import itertools
import sys
from pathlib import Path

import numpy as np
from gpufootprint.records import KERNEL_DTYPE, MEMORY_DTYPE, MemoryKind, MemoryOp, RecordKind
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json, encode_watermark

BASE_NS = 1_764_633_600_000_000_000  # 2025-12-02 00:00:00 UTC
MS = 1_000_000
US = 1_000
DATA = Path(__file__).parent / "data"
KERNEL_FILE = "synth_kernels.gfp.gz"
LEAK_FILE = "synth_leak.gfp.gz"


class TraceBuilder:
    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.out.write(PREAMBLE)
        self.names: dict[str, int] = {}

    def meta(self, pid: int, scenario: str) -> None:
        self.out.write(encode_json(FrameType.META, {"pid": pid, "format": "synthetic", "scenario": scenario,
                                                    "device": "NVIDIA H200 (synthetic)"}))

    def name_ids(self, names: list[str]) -> list[int]:
        new = {}
        for n in names:
            if n not in self.names:
                self.names[n] = len(self.names) + 1
                new[str(self.names[n])] = n
        if new:
            self.out.write(encode_json(FrameType.STRINGS, new))
        return [self.names[n] for n in names]

    def batch(self, kind: RecordKind, recs: np.ndarray, size: int = 2048) -> None:
        for i in range(0, len(recs), size):
            self.out.write(encode_batch(kind, recs[i:i + size]))

    def watermark(self, ts: int) -> None:
        self.out.write(encode_watermark(ts))

    def goodbye(self, ts: int) -> None:
        self.out.write(encode_json(FrameType.GOODBYE, {"ts": ts, "counters": {}}))

    def data(self) -> bytes:
        return self.out.getvalue()


def kernel_stream(rng: np.random.Generator, *, pid: int, stream: int, t0: int, steps: int, ids: list[int],
                  dur_us: list[float], gap_us: float, step_gap_us: float, graph: int = 0,
                  dev: int = 0) -> tuple[np.ndarray, list[int]]:
    """``steps`` repetitions of the kernel sequence ``ids``; returns records and each step's start."""
    n = steps * len(ids)
    recs = np.zeros(n, KERNEL_DTYPE)
    t = t0
    starts = []
    i = 0
    for _ in range(steps):
        starts.append(t)
        for j, kid in enumerate(ids):
            d = int(dur_us[j] * US * rng.lognormal(0.0, 0.08))
            recs[i] = (t, t + d, j + 1 if graph else 0, pid, dev, stream, 1000 + i, graph, kid)
            t += d + int(gap_us * US * rng.uniform(0.7, 1.3))
            i += 1
        t += int(step_gap_us * US * rng.uniform(0.9, 1.1))
    return recs, starts


def memory_records(rows: list[tuple[int, int, int, int, int]], pid: int, dev: int = 0) -> np.ndarray:
    """rows: (ts, op, addr, bytes, kind) -> MEMORY records."""
    recs = np.zeros(len(rows), MEMORY_DTYPE)
    for i, (ts, op, addr, size, kind) in enumerate(rows):
        recs[i]["ts"], recs[i]["op"], recs[i]["addr"], recs[i]["bytes"], recs[i]["mk"] = ts, op, addr, size, kind
        recs[i]["pid"], recs[i]["dev"], recs[i]["corr"] = pid, dev, i + 1
    return recs[np.argsort(recs["ts"], kind="stable")]


def step_memory(starts: list[int], *, t0: int, base: int, reused: int, fresh: int, block: int,
                weights: int) -> list[tuple[int, int, int, int, int]]:
    """Caching-allocator-like traffic: weights once, then per step ``reused`` blocks at the same
    addresses and ``fresh`` at new ones, all freed before the next step."""
    alloc, rel, dev = MemoryOp.ALLOCATION, MemoryOp.RELEASE, MemoryKind.DEVICE
    rows = [(t0 - 5 * MS, alloc, base, weights, dev), (t0 - 5 * MS, alloc, base + (1 << 40), 4096,
                                                       MemoryKind.DEVICE_STATIC)]
    nxt = base + (1 << 32)
    for k, s in enumerate(starts):
        for r in range(reused):
            addr = base + (1 << 30) + r * block
            rows += [(s + 10 * US + r, alloc, addr, block, dev), (s + 500 * US + r, rel, addr, block, dev)]
        for _ in range(fresh):
            rows += [(s + 20 * US, alloc, nxt, block, dev), (s + 600 * US, rel, nxt, block, dev)]
            nxt += block
    return rows


def kernel_trace() -> bytes:
    rng = np.random.default_rng(20261202)
    b = TraceBuilder()
    t0 = BASE_NS + 1000 * MS
    end = t0

    # pid 4242: a training step of 10 kernels (~0.7 ms) on stream 7, reuse ~0.75 (3 of 4 blocks reused);
    # and a captured CUDA graph replayed on stream 13.
    b.meta(4242, "train step + captured graph")
    names = ["gemm_fwd", "gelu_fwd", "gemm_fwd", "layernorm_fwd", "softmax_fwd", "gemm_bwd", "gemm_bwd",
             "gelu_bwd", "adamw_step", "reduce_grad"]
    ids = b.name_ids(names)
    k1, starts = kernel_stream(rng, pid=4242, stream=7, t0=t0, steps=60, ids=ids,
                               dur_us=[900, 300, 900, 250, 400, 1100, 1100, 350, 800, 600],
                               gap_us=25, step_gap_us=2000)
    gids = b.name_ids([f"graph_node_kernel_{i}" for i in range(16)])
    k2, _ = kernel_stream(rng, pid=4242, stream=13, t0=t0 + 3 * MS, steps=40, ids=gids, dur_us=[300] * 16,
                          gap_us=1.5, step_gap_us=1000, graph=11)
    mem = memory_records(step_memory(starts, t0=t0, base=0x7F0000000000, reused=3, fresh=1, block=8 << 20,
                                     weights=256 << 20), 4242)
    end = max(end, int(k1["end"].max()), int(k2["end"].max()))

    # pid 4343: launch-bound: 100 tiny add_ kernels and one SGD kernel per step.
    b.meta(4343, "launch bound tiny kernels")
    tiny = b.name_ids(["add_"] * 100 + ["sgd_step"])
    k3, starts3 = kernel_stream(rng, pid=4343, stream=7, t0=t0, steps=30, ids=tiny, dur_us=[6] * 100 + [40],
                                gap_us=9, step_gap_us=300)
    mem3 = memory_records(step_memory(starts3, t0=t0, base=0x7E0000000000, reused=2, fresh=0, block=1 << 20,
                                      weights=16 << 20), 4343)

    # pid 4444: a big model: 16 long kernels per step, reuse ~0.97.
    b.meta(4444, "big kernels")
    big = b.name_ids([f"big_gemm_{i % 4}" if i % 2 == 0 else f"big_attn_{i % 3}" for i in range(16)])
    k4, starts4 = kernel_stream(rng, pid=4444, stream=7, t0=t0, steps=40, ids=big, dur_us=[2000] * 16,
                                gap_us=40, step_gap_us=3000)
    mem4 = memory_records(step_memory(starts4, t0=t0, base=0x7D0000000000, reused=4, fresh=0, block=32 << 20,
                                      weights=1 << 30), 4444)

    # pid 4545: irregular: no repeating step.
    b.meta(4545, "irregular")
    pool = b.name_ids([f"misc_kernel_{i}" for i in range(40)])
    seq = [pool[i] for i in rng.integers(0, 40, 300)]
    k5, _ = kernel_stream(rng, pid=4545, stream=21, t0=t0, steps=1, ids=seq, dur_us=list(rng.uniform(50, 900, 300)),
                          gap_us=30, step_gap_us=0)

    for recs in (mem, mem3, mem4):
        b.batch(RecordKind.MEMORY, recs)
    kern = np.concatenate([k1, k2, k3, k4, k5])
    kern = kern[np.argsort(kern["end"], kind="stable")]  # CUPTI delivers kernels as they complete
    b.batch(RecordKind.KERNEL, kern)
    b.watermark(max(end, int(kern["end"].max())) + 1)
    return b.data()


def leak_trace(seconds: int = 1200) -> bytes:
    """pid 5151 leaks 2 MiB every 2 s beside its churn; pid 5252 holds old weights but does not grow."""
    b = TraceBuilder()
    b.meta(5151, "slow leak")
    b.meta(5252, "steady")
    t0 = BASE_NS + 5000 * MS
    alloc, rel, dev = MemoryOp.ALLOCATION, MemoryOp.RELEASE, MemoryKind.DEVICE
    rows1: list[tuple[int, int, int, int, int]] = [(t0, alloc, 0x7A0000000000, 64 << 20, dev)]
    rows2: list[tuple[int, int, int, int, int]] = [(t0, alloc, 0x790000000000, 512 << 20, dev)]
    leak_addr = 0x7B0000000000
    for s in range(seconds):
        t = t0 + s * 1000 * MS
        for r in range(3):
            a = 0x7C0000000000 + r * (4 << 20)
            rows1 += [(t + 100 * MS + r, alloc, a, 4 << 20, dev), (t + 400 * MS + r, rel, a, 4 << 20, dev)]
            a2 = 0x780000000000 + r * (4 << 20)
            rows2 += [(t + 100 * MS + r, alloc, a2, 4 << 20, dev), (t + 400 * MS + r, rel, a2, 4 << 20, dev)]
        if s % 2 == 0:
            rows1.append((t + 700 * MS, alloc, leak_addr, 2 << 20, dev))
            leak_addr += 2 << 20
    m1, m2 = memory_records(rows1, 5151), memory_records(rows2, 5252)
    # Deliver one second at a time with a watermark, as a probe flushing every second would.
    edges = [t0 + s * 1000 * MS for s in range(seconds + 1)]
    for lo, hi in itertools.pairwise(edges):
        for m in (m1, m2):
            part = m[(m["ts"] >= lo) & (m["ts"] < hi)]
            if len(part):
                b.batch(RecordKind.MEMORY, part)
        b.watermark(hi)
    return b.data()


def gz(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", filename="", mtime=0) as fh:
        fh.write(data)
    return buf.getvalue()


GENERATORS = {KERNEL_FILE: kernel_trace, LEAK_FILE: leak_trace}


def main() -> int:
    for name, make in GENERATORS.items():
        (DATA / name).write_bytes(gz(make()))
        print(f"wrote {DATA / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
