"""Build CUPTI-JSONL traces for tests and benchmarks: synthetic ones and real ones with spikes added."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

MS = 1_000_000
T0 = 1_796_210_000_000_000_000


def mem(ts: int, op: int, addr: int, size: int, mk: int = 3, pid: int = 4242, dev: int = 0) -> dict[str, Any]:
    return {"k": "mem", "ts": ts, "op": op, "mk": mk, "addr": addr, "bytes": size, "dev": dev, "ctx": 1,
            "stream": 7, "pid": pid, "corr": 0, "is_async": 0, "pool_type": 0, "pool_addr": 0, "pool_thresh": 0}


def cpy(start: int, ck: int, size: int, pid: int = 4242, dev: int = 0, dur: int = 100_000) -> dict[str, Any]:
    return {"k": "cpy", "start": start, "end": start + dur, "ck": ck, "bytes": size, "src": 3, "dst": 3,
            "dev": dev, "ctx": 1, "stream": 7, "corr": 0, "graph": 0, "pid": pid}


def mset(start: int, size: int, pid: int = 4242, dev: int = 0) -> dict[str, Any]:
    return {"k": "set", "start": start, "end": start + 50_000, "bytes": size, "dev": dev, "stream": 7,
            "corr": 0, "pid": pid}


def um(start: int, ck: int, value: int, pid: int = 4242, dev: int = 0) -> dict[str, Any]:
    return {"k": "um", "ck": ck, "value": value, "start": start, "end": start + 10_000, "addr": 0x7000_0000,
            "src": 0, "dst": 0, "pid": pid, "dev": dev}


def quiet_minute_with_spike(*, pid: int = 4242, base: int = 1 << 30, spike: int = 256 << 20,
                            spike_at_ms: int = 30_000, spike_ms: int = 30, minute_ms: int = 60_000,
                            tick_ms: int = 500) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """A process holds ``base`` bytes, allocates and frees 1 KiB every ``tick_ms`` for a minute,
    and once holds ``spike`` more bytes for ``spike_ms``. Returns (lines, facts)."""
    lines: list[dict[str, Any]] = [{"k": "meta", "format": "cupti-jsonl", "version": 1, "pid": pid,
                                    "scenario": "quiet_minute_with_spike"}]
    lines.append(mem(T0, 1, 0x1000_0000, base, pid=pid))
    for i in range(1, minute_ms // tick_ms):
        t = T0 + i * tick_ms * MS
        lines.append(mem(t, 1, 0x2000_0000, 1024, pid=pid))
        lines.append(mem(t + 2 * MS, 2, 0x2000_0000, 1024, pid=pid))
    s0 = T0 + spike_at_ms * MS + 3 * MS + 123_457  # off the frame grid on purpose
    s1 = s0 + spike_ms * MS
    lines.append(mem(s0, 1, 0x3000_0000, spike, pid=pid))
    lines.append(mem(s1, 2, 0x3000_0000, spike, pid=pid))
    lines.append(mem(T0 + minute_ms * MS, 2, 0x1000_0000, base, pid=pid))
    lines.sort(key=lambda o: o.get("ts", o.get("start", 0)))
    return lines, {"spike_start": s0, "spike_end": s1, "peak": base + spike, "t0": T0,
                   "end": T0 + minute_ms * MS}


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:  # type: ignore[operator]
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path: str | Path, lines: list[dict[str, Any]]) -> Path:
    path = Path(path)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as fh:  # type: ignore[operator]
        for obj in lines:
            fh.write(json.dumps(obj) + "\n")
    return path
