"""Several GPUs: per-device footprints in one process and across processes, and peer copies
attributed to both ends (synthetic records; the 2-GPU run itself is a GPU test)."""

from __future__ import annotations

import random

import numpy as np
from gpufootprint.config import FootprintConfig
from gpufootprint.exporter.collector import FootprintCollector
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import MEMCPY_DTYPE, CopyKind, RecordKind
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from tests.conftest import ALLOC, FREE, mem, mem_batch

MS = 1_000_000


def _history(rng: random.Random, pid: int, devs: tuple[int, ...], n: int) -> list[tuple]:
    live: dict[int, tuple[int, int]] = {}
    rows, ts = [], 10**12
    for _ in range(n):
        ts += rng.randint(1, MS)
        if live and rng.random() < 0.4:
            addr = rng.choice(sorted(live))
            size, dev = live.pop(addr)
            rows.append(mem(ts, FREE, addr, size, pid=pid, dev=dev))
        else:
            dev = rng.choice(devs)
            addr = (dev + 1) << 40 | rng.randrange(1 << 20) << 12  # UVA: each device its own range
            if addr in live:
                continue
            size = rng.choice([2 << 20, 20 << 20, 512])
            live[addr] = (size, dev)
            rows.append(mem(ts, ALLOC, addr, size, pid=pid, dev=dev))
    return rows


def _expected(rows: list[tuple]) -> dict[tuple[int, int], int]:
    live: dict[int, tuple[int, int, int]] = {}
    for ts, op, addr, size, _kind, pid, dev, _ in sorted(rows, key=lambda r: r[0]):
        if op == ALLOC:
            live[addr] = (size, pid, dev)
        else:
            live.pop(addr)
    out: dict[tuple[int, int], int] = {}
    for size, pid, dev in live.values():
        out[(pid, dev)] = out.get((pid, dev), 0) + size
    return out


def _peer(pid: int, copies: list[tuple[int, int, int]], t0: int) -> np.ndarray:
    out = np.zeros(len(copies), dtype=MEMCPY_DTYPE)
    for i, (src, dst, size) in enumerate(copies):
        out[i]["start"], out[i]["end"] = t0 + i * MS, t0 + i * MS + 1000
        out[i]["ck"], out[i]["bytes"], out[i]["pid"] = CopyKind.PTOP, size, pid
        out[i]["dev"], out[i]["src_dev"], out[i]["dst_dev"] = src, src, dst
    return out


def test_one_process_on_two_gpus_and_two_ranks_one_gpu_each_are_exact_per_device() -> None:
    rng = random.Random(2)
    rows = _history(rng, 500, (0, 1), 1500) + _history(rng, 600, (0,), 600) + _history(rng, 601, (1,), 600)
    delivered = rows[:]
    rng.shuffle(delivered)  # three processes' records interleaved and out of order
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=10**6))
    for lo in range(0, len(delivered), 100):
        pipeline.submit(RecordKind.MEMORY, mem_batch(delivered[lo : lo + 100]))
    for pid in (500, 600, 601):
        pipeline.finish(pid)
    got = {(p.pid, d.dev): d.device_bytes for p in pipeline.snapshot().processes for d in p.devices}
    want = _expected(rows)
    assert {k: v for k, v in got.items() if v} == want
    assert pipeline.errors.counts == {}


def test_peer_copies_are_attributed_to_both_ends() -> None:
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=0))
    copies = [(0, 1, 64 << 20), (0, 1, 64 << 20), (1, 0, 8 << 20), (1, 0, 8 << 20), (1, 0, 8 << 20)]
    pipeline.submit(RecordKind.MEMCPY, _peer(500, copies, 10**12))
    pipeline.finish(500)
    reg = CollectorRegistry(auto_describe=False)
    snap = pipeline.snapshot()
    reg.register(FootprintCollector(lambda: snap))
    samples = {(s.labels["src_gpu"], s.labels["dst_gpu"]): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode())
               for s in fam.samples if s.name == "gpufootprint_peer_copy_bytes_total"}
    assert samples == {("0", "1"): 128 << 20, ("1", "0"): 24 << 20}
    by_dev = {d.dev: d.memcpy_bytes.get(CopyKind.PTOP, 0) for d in snap.processes[0].devices}
    assert by_dev == {0: 128 << 20, 1: 24 << 20}  # the device that ran each copy
