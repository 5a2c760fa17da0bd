"""A recording read whole for offline views (``report``, ``export``).

The file goes through exactly the daemon's pipeline (``replay_file``), which gives
the marks, anomaly windows, sampler intervals and engine verdicts; on the way its
frames are kept, so the footprint can be rebuilt as a time series: every MEMORY
record in time order, and each RESYNC (a live table replacing the process's state,
as at a probe's connect or at the start of an OOM capture) at its time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpufootprint.config import Config
from gpufootprint.errors import GpuFootprintError, TraceError
from gpufootprint.hub import FeatureHub
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import DEVICE_RESIDENT_KINDS, DTYPES, MEMORY_KIND_NAMES, TIME_FIELD, MemoryOp, RecordKind
from gpufootprint.replay import replay_file
from gpufootprint.wire.framing import Frame, FrameType


@dataclass
class Series:
    """One (pid, GPU): the level of each memory kind after each change, in time order."""

    pid: int
    dev: int
    times: np.ndarray  # u8 ns
    kinds: list[int]  # column order of ``levels``
    levels: np.ndarray  # (len(times), len(kinds)) i8 bytes

    @property
    def device(self) -> np.ndarray:
        cols = [i for i, k in enumerate(self.kinds) if k in DEVICE_RESIDENT_KINDS]
        out: np.ndarray = self.levels[:, cols].sum(axis=1) if cols else np.zeros(len(self.times), np.int64)
        return out

    def peak(self) -> tuple[int, int]:
        """(bytes, index) of the highest GPU-resident level (the first time it is reached)."""
        dev = self.device
        if len(dev) == 0:
            return 0, -1
        i = int(np.argmax(dev))
        return int(dev[i]), i


@dataclass
class Recording:
    paths: list[str]
    formats: list[str]
    records: int
    memory: dict[int, list[np.ndarray]] = field(default_factory=dict)  # pid -> MEMORY chunks (outside resyncs)
    resyncs: dict[int, list[tuple[int, np.ndarray]]] = field(default_factory=dict)  # pid -> (ts, table)
    other: dict[RecordKind, list[np.ndarray]] = field(default_factory=dict)  # copies, memsets, UM, kernels
    marks: list[dict[str, Any]] = field(default_factory=list)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    kernel_names: dict[int, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    anomaly_windows: list[dict[str, Any]] = field(default_factory=list)
    sampler_intervals: dict[str, Any] = field(default_factory=dict)
    engines: dict[str, Any] = field(default_factory=dict)

    def records_of(self, kind: RecordKind) -> np.ndarray:
        parts = self.other.get(kind, [])
        if not parts:
            return np.zeros(0, DTYPES[kind])
        arr = np.concatenate(parts)
        return arr[np.argsort(arr[TIME_FIELD[kind]], kind="stable")]

    def pids(self) -> list[int]:
        return sorted(set(self.memory) | set(self.resyncs))


def load(paths: Sequence[str | Path], config: Config | None = None) -> Recording:
    """Replay ``paths`` (native or CUPTI-JSONL, gzip or plain) and keep what the views need."""
    from gpufootprint.engines.runner import Engines, engine_report

    config = config or Config()
    pipeline = Pipeline(config.footprint, hub=FeatureHub(config.features, config.sampler))
    pipeline.kernel_retention = config.graph_advisor.kernel_retention if config.graph_advisor.enabled else 0
    pipeline.snapshot_live_tables = config.leaks.enabled
    rec = Recording(paths=[str(p) for p in paths], formats=[], records=0)
    in_resync: dict[str, Any] = {"on": False, "ts": 0, "chunks": []}

    def on_frame(frame: Frame) -> None:
        t = frame.type
        try:
            if t is FrameType.BATCH:
                kind = RecordKind(frame.tag)
                recs = frame.records()
                if kind is RecordKind.MEMORY:
                    if in_resync["on"]:
                        in_resync["chunks"].append(recs)
                    else:
                        for pid in np.unique(recs["pid"]).tolist():
                            rec.memory.setdefault(pid, []).append(recs[recs["pid"] == pid])
                else:
                    rec.other.setdefault(kind, []).append(recs)
            elif t is FrameType.RESYNC_BEGIN:
                body = frame.json()
                in_resync.update(on=True, ts=int(body.get("ts", 0)), chunks=[])
            elif t is FrameType.RESYNC_END:
                chunks = in_resync["chunks"]
                table = np.concatenate(chunks) if chunks else np.zeros(0, DTYPES[RecordKind.MEMORY])
                for pid in (np.unique(table["pid"]).tolist() or list(rec.info)[-1:]):
                    rec.resyncs.setdefault(pid, []).append((in_resync["ts"], table[table["pid"] == pid]))
                in_resync.update(on=False, chunks=[])
            elif t is FrameType.HELLO:
                body = frame.json()
                if isinstance(body.get("pid"), int):
                    rec.info.setdefault(body["pid"], {}).update(body)
            elif t is FrameType.STRINGS:
                for k, v in frame.json().items():
                    if k.isdigit() and isinstance(v, str):
                        rec.kernel_names[int(k)] = v
        except (ValueError, GpuFootprintError):
            pass  # the session counts the damage; the views show what could be read

    engines = Engines(config)
    for path in paths:
        if not Path(path).exists():
            raise GpuFootprintError(f"{path}: no such file")
        result = replay_file(path, pipeline, on_frame=on_frame, max_frame_bytes=config.daemon.max_frame_bytes)
        if result.frames == 0 and not result.problems:
            raise TraceError(f"{path}: no frames (an empty trace)")  # a view of nothing is no success
        rec.formats.append(result.format)
        rec.records += result.records
        rec.marks.extend(result.marks)
        rec.problems.extend(result.problems)
    report = pipeline.hub.report()
    rec.anomaly_windows = list(report.get("anomaly_windows", []))
    rec.sampler_intervals = dict(report.get("sampler_intervals", {}))
    try:
        rec.engines = engine_report(engines.step(pipeline.snapshot()))
    except Exception as exc:  # noqa: BLE001 - a view without verdicts still helps
        rec.problems.append(f"engines: {exc}")
    return rec


def _events(rec: Recording, pid: int) -> Iterator[tuple[int, int, Any]]:
    """(ts, order, payload) in time order: a resync (payload: table) before records at its time."""
    chunks = rec.memory.get(pid, [])
    mem = np.concatenate(chunks) if chunks else np.zeros(0, DTYPES[RecordKind.MEMORY])
    mem = mem[np.argsort(mem["ts"], kind="stable")]
    resyncs = sorted(rec.resyncs.get(pid, []), key=lambda r: r[0])
    ri = 0
    for row in mem:
        ts = int(row["ts"])
        while ri < len(resyncs) and resyncs[ri][0] <= ts:
            yield resyncs[ri][0], 0, resyncs[ri][1]
            ri += 1
        yield ts, 1, row
    while ri < len(resyncs):
        yield resyncs[ri][0], 0, resyncs[ri][1]
        ri += 1


def replay_tables(rec: Recording, pid: int, stop_after: int | None = None) -> tuple[
        dict[int, list[tuple[int, np.ndarray]]], dict[int, dict[int, tuple[int, int, int]]]]:
    """Per device: (ts, levels by kind) after each change; and the live tables (addr -> bytes, kind, ts)
    after event number ``stop_after`` (all events when None)."""
    tables: dict[int, dict[int, tuple[int, int, int]]] = {}
    levels: dict[int, np.ndarray] = {}
    out: dict[int, list[tuple[int, np.ndarray]]] = {}

    def level(dev: int) -> np.ndarray:
        if dev not in levels:
            levels[dev] = np.zeros(32, np.int64)
            tables[dev] = {}
        return levels[dev]

    for n, (ts, order, payload) in enumerate(_events(rec, pid)):
        if order == 0:
            table = payload
            for dev in set(tables) | set(np.unique(table["dev"]).tolist()):
                lv = level(dev)
                lv[:] = 0
                tables[dev] = {}
                for r in table[table["dev"] == dev]:
                    k = int(r["mk"]) % 32
                    tables[dev][int(r["addr"])] = (int(r["bytes"]), k, int(r["ts"]))
                    lv[k] += int(r["bytes"])
                out.setdefault(dev, []).append((ts, lv.copy()))
        else:
            r = payload
            dev, addr, k = int(r["dev"]), int(r["addr"]), int(r["mk"]) % 32
            lv = level(dev)
            t = tables[dev]
            if int(r["op"]) == MemoryOp.ALLOCATION:
                if addr in t:
                    continue  # a double allocation: the pipeline counts it as an error and keeps the first
                t[addr] = (int(r["bytes"]), k, ts)
                lv[k] += int(r["bytes"])
            elif int(r["op"]) == MemoryOp.RELEASE:
                old = t.pop(addr, None)
                if old is None:
                    continue  # release of an allocation never seen
                lv[old[1]] -= old[0]
            else:
                continue
            out.setdefault(dev, []).append((ts, lv.copy()))
        if stop_after is not None and n >= stop_after:
            break
    return out, tables


def series(rec: Recording) -> list[Series]:
    result: list[Series] = []
    for pid in rec.pids():
        per_dev, _ = replay_tables(rec, pid)
        for dev, points in sorted(per_dev.items()):
            times = np.array([p[0] for p in points], np.uint64)
            lv = np.stack([p[1] for p in points]) if points else np.zeros((0, 32), np.int64)
            used = [k for k in range(32) if lv.size and lv[:, k].any()]
            result.append(Series(pid, dev, times, used, lv[:, used]))
    return result


def tables_at(rec: Recording, pid: int, dev: int, ts: int) -> dict[int, tuple[int, int, int]]:
    """The live table of (pid, dev) just after the last change at or before ``ts``."""
    last = -1
    for n, (t, _order, _payload) in enumerate(_events(rec, pid)):
        if t > ts:
            break
        last = n
    if last < 0:
        return {}
    _, tables = replay_tables(rec, pid, stop_after=last)
    return tables.get(dev, {})


def kind_name(k: int) -> str:
    return MEMORY_KIND_NAMES.get(k, str(k))
