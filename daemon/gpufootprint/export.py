"""A recording in the formats other viewers read.

* ``memory-viz``: a pickle shaped like ``torch.cuda.memory._snapshot()``, which
  pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` open. Our records
  are driver-level (every cuMemAlloc/cudaMalloc of every library, not PyTorch's
  blocks inside its segments), so each GPU-resident allocation is one segment holding
  one block; the trace has ``segment_alloc``/``alloc`` and ``free_requested``/
  ``free_completed``/``segment_free`` per record, and an ``oom`` entry at each OOM
  mark. The memory kind stands in the place of the Python frames, so the viewer's
  stacks group bytes by kind. Only GPU-resident kinds are segments: pinned and pageable
  memory is host memory, and managed memory's pages move between host and GPU with no
  record of where each page is at a given time (only the unified-memory counters), so the
  viewer's picture of one GPU's memory has no place for them; the Perfetto export and the
  report show them, each as its own kind. Synchronous allocations carry CUPTI's "no stream"
  id; they are put on stream 0, PyTorch's default stream.
* ``perfetto``: Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing): one
  counter track per process, GPU and kind, marks as instants, copies and kernels as
  slices, anomaly windows as slices of their own; thread ids are integers, named by
  ``thread_name`` metadata events.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from gpufootprint.outfile import atomic_output
from gpufootprint.recording import Recording, _events, kind_name, series
from gpufootprint.records import COPY_KIND_NAMES, DEVICE_RESIDENT_KINDS, MemoryOp, RecordKind

FORMATS = ("memory-viz", "perfetto")


#: CUPTI's "no stream" id (CUPTI_INVALID_STREAM_ID as a 32-bit field): synchronous allocations carry it.
_NO_STREAM = 0xFFFFFFFF


def stream_id(stream: int) -> int:
    """The stream as PyTorch's snapshots give it: 0 for the default stream, which is also where a
    synchronous allocation (CUPTI's "no stream", 0xFFFFFFFF) belongs; otherwise CUPTI's id. The
    viewer names streams ``stream_<id>``: ``stream_4294967295`` said nothing to a reader."""
    return 0 if stream >= _NO_STREAM else stream


def _frames(kind: int) -> list[dict[str, Any]]:
    return [{"filename": f"gpufootprint:{kind_name(kind)}", "line": 0, "name": f"CUDA allocation ({kind_name(kind)})"}]


def memory_viz(rec: Recording) -> dict[str, Any]:
    """The ``_snapshot()``-shaped dictionary (state at the recording's end, trace of every change)."""
    devices: set[int] = set()
    traces: dict[int, list[dict[str, Any]]] = {}
    live: dict[tuple[int, int], dict[int, tuple[int, int, int]]] = {}  # (pid, dev) -> addr -> (bytes, kind, stream)

    def entry(dev: int, action: str, addr: int, size: int, stream: int, ts: int, kind: int) -> None:
        traces.setdefault(dev, []).append({"action": action, "addr": addr, "size": size, "stream": stream_id(stream),
                                           "time_us": ts // 1000, "frames": _frames(kind)})

    for pid in rec.pids():
        for ts, order, payload in _events(rec, pid):
            if order == 0:  # a resync replaces the state; the trace shows it as frees then allocations
                table = payload
                for (p, dev), t in list(live.items()):
                    if p != pid:
                        continue
                    for addr, (size, kind, stream) in t.items():
                        for action in ("free_requested", "free_completed", "segment_free"):
                            entry(dev, action, addr, size, stream, ts, kind)
                    t.clear()
                for r in table:
                    kind = int(r["mk"])
                    if kind not in DEVICE_RESIDENT_KINDS:
                        continue
                    dev, addr, size = int(r["dev"]), int(r["addr"]), int(r["bytes"])
                    devices.add(dev)
                    live.setdefault((pid, dev), {})[addr] = (size, kind, int(r["stream"]))
                    entry(dev, "segment_alloc", addr, size, int(r["stream"]), ts, kind)
                    entry(dev, "alloc", addr, size, int(r["stream"]), ts, kind)
                continue
            r = payload
            kind = int(r["mk"])
            if kind not in DEVICE_RESIDENT_KINDS:
                continue
            dev, addr = int(r["dev"]), int(r["addr"])
            devices.add(dev)
            t = live.setdefault((pid, dev), {})
            if int(r["op"]) == MemoryOp.ALLOCATION and addr not in t:
                size, stream = int(r["bytes"]), int(r["stream"])
                t[addr] = (size, kind, stream)
                entry(dev, "segment_alloc", addr, size, stream, ts, kind)
                entry(dev, "alloc", addr, size, stream, ts, kind)
            elif int(r["op"]) == MemoryOp.RELEASE and addr in t:
                size, kind, stream = t.pop(addr)
                for action in ("free_requested", "free_completed", "segment_free"):
                    entry(dev, action, addr, size, stream, ts, kind)
    for m in rec.marks:
        oom = m.get("oom")
        if m.get("label") == "oom" and isinstance(oom, dict) and isinstance(m.get("ts"), int):
            dev = int(m.get("dev", 0))
            devices.add(dev)
            torch_value = oom.get("torch")
            torch: dict[str, Any] = torch_value if isinstance(torch_value, dict) else {}
            traces.setdefault(dev, []).append({
                "action": "oom", "addr": 0, "size": int(oom.get("requested_bytes") or 0), "stream": 0,
                "device_free": int(torch.get("device_free_bytes") or 0), "time_us": int(m["ts"]) // 1000,
                "frames": []})
    segments: list[dict[str, Any]] = []
    for (_pid, dev), t in sorted(live.items()):
        for addr, (size, kind, stream) in sorted(t.items()):
            block = {"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                     "frames": _frames(kind)}
            segments.append({"device": dev, "address": addr, "total_size": size, "allocated_size": size,
                             "active_size": size, "requested_size": size, "stream": stream_id(stream),
                             "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                             "frames": _frames(kind), "blocks": [block]})
    n_dev = max(devices) + 1 if devices else 1
    for dev_trace in traces.values():
        dev_trace.sort(key=lambda e: e["time_us"])  # stable: the order of one time's entries stays
    return {"segments": segments, "device_traces": [traces.get(d, []) for d in range(n_dev)],
            "allocator_settings": {"source": "gpufootprint (CUPTI driver-level allocations)"}}


def perfetto(rec: Recording) -> dict[str, Any]:
    """Chrome trace-event JSON: counters per process, GPU and kind; marks; copies; kernels; anomaly windows."""
    events: list[dict[str, Any]] = []
    pids: set[int] = set()
    for s in series(rec):
        pids.add(s.pid)
        name = f"GPU {s.dev} memory (bytes)"
        for i in range(len(s.times)):
            events.append({"name": name, "ph": "C", "ts": int(s.times[i]) / 1000, "pid": s.pid, "tid": 0,
                           "args": {kind_name(k): int(s.levels[i, j]) for j, k in enumerate(s.kinds)}})
    for m in rec.marks:
        if isinstance(m.get("ts"), int) and isinstance(m.get("pid"), int):
            pids.add(m["pid"])
            args = {k: v for k, v in m.items() if k in ("label", "dev", "matches", "live_bytes", "oom")}
            events.append({"name": f"mark: {m.get('label')}", "ph": "i", "s": "p", "ts": m["ts"] / 1000,
                           "pid": m["pid"], "tid": 0, "args": _jsonable(args)})
    # The trace-event format wants integer thread ids (Perfetto's importer drops or renumbers string
    # ones): each track gets a small integer per process, and its name in a thread_name event.
    tracks: dict[tuple[int, str], int] = {}

    def tid(pid: int, name: str) -> int:
        if (pid, name) not in tracks:
            tracks[(pid, name)] = 1 + sum(1 for p, _ in tracks if p == pid)  # 0: the counters and marks
        return tracks[(pid, name)]

    copies = rec.records_of(RecordKind.MEMCPY)
    for r in copies:
        pid = int(r["pid"])
        pids.add(pid)
        direction = COPY_KIND_NAMES.get(int(r["ck"]), str(int(r["ck"])))
        events.append({"name": f"memcpy {direction}", "ph": "X", "ts": int(r["start"]) / 1000,
                       "dur": max(0, int(r["end"]) - int(r["start"])) / 1000, "pid": pid,
                       "tid": tid(pid, f"GPU {int(r['dev'])} copies"), "args": {"bytes": int(r["bytes"])}})
    kernels = rec.records_of(RecordKind.KERNEL)
    for r in kernels:
        pid = int(r["pid"])
        pids.add(pid)
        events.append({"name": rec.kernel_names.get(int(r["name_id"]), "kernel"), "ph": "X",
                       "ts": int(r["start"]) / 1000, "dur": max(0, int(r["end"]) - int(r["start"])) / 1000,
                       "pid": pid, "tid": tid(pid, f"GPU {int(r['dev'])} stream {stream_id(int(r['stream']))}"),
                       "args": {"graph": int(r["graph"])}})
    for w in rec.anomaly_windows:
        pids.add(int(w["pid"]))
        events.append({"name": f"anomaly window: {w['reason']}", "ph": "X", "ts": int(w["start"]) / 1000,
                       "dur": max(0, int(w["end"]) - int(w["start"])) / 1000, "pid": int(w["pid"]),
                       "tid": tid(int(w["pid"]), "sampler"),
                       "args": {"peak_bytes": int(w["peak_bytes"]), "gpu": int(w["gpu"])}})
    for (pid, name), number in sorted(tracks.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": number, "args": {"name": name}})
    for pid in sorted(pids):
        info = rec.info.get(pid, {})
        argv = info.get("argv")
        label = " ".join(map(str, argv)) if isinstance(argv, list) else str(info.get("scenario") or "")
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"pid {pid} {label}".strip()}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"source": "gpufootprint", "files": rec.paths}}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda o: int(o) if isinstance(o, np.integer) else str(o)))


def write_export(rec: Recording, to: str, out: str | Path) -> str:
    """Write ``rec`` as ``to`` (one of FORMATS) to ``out``; returns a one-line summary."""
    out = Path(out)
    # Beside ``out`` first, renamed when whole: an unwritable path is one line (exit 2), and a
    # failure part way leaves no half pickle behind.
    if to == "memory-viz":
        snap = memory_viz(rec)
        with atomic_output("-o", out, "wb") as fh:
            pickle.dump(snap, fh, protocol=4)
        n = sum(len(t) for t in snap["device_traces"])
        return f"wrote {out}: {len(snap['segments'])} live segments, {n} trace entries (open at pytorch.org/memory_viz)"
    doc = perfetto(rec)
    with atomic_output("-o", out, "w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    return f"wrote {out}: {len(doc['traceEvents'])} trace events (open at ui.perfetto.dev)"
