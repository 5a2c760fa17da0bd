"""``gpufootprint export``: the pickle PyTorch's memory viewer reads, and Chrome trace-event JSON.

torch is not installed here, so the memory-viz pickle is checked against what
torch/cuda/_memory_viz.py reads from a ``_snapshot()`` (its ``segsum`` and ``trace``: segment
and block keys, the invariant that a segment's blocks add up to its size, the trace actions and
their fields) and against MemoryViz.js's walk back from the final segments through the trace.
The Perfetto file is loaded with json and checked against the trace-event format's rules.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.config import Config
from gpufootprint.export import memory_viz, perfetto
from gpufootprint.pipeline import Pipeline
from gpufootprint.recording import load
from gpufootprint.replay import load_frames, replay_file
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode

from tests.conftest import DATA, cli_env

TRACES = ["h200_probe_caching.gfp.gz", "h200_probe_expandable.gfp.gz", "h200_kernels_train.gfp.gz",
          "h200_caching.jsonl.gz"]
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"}


def _final_device_bytes(path: Path, tmp: Path) -> dict[int, int]:
    """The footprint the daemon's own pipeline ends with, per GPU (GPU-resident kinds), before the
    processes' exits (a GOODBYE frees everything; the exports show what was held at the end)."""
    frames, problems = load_frames(path)
    assert problems == []
    kept = tmp / "kept.gfp"
    kept.write_bytes(PREAMBLE + b"".join(encode(f.type, f.payload, f.tag) for f in frames
                                         if f.type is not FrameType.GOODBYE))
    pipeline = Pipeline(Config().footprint)
    replay_file(kept, pipeline)
    out: dict[int, int] = {}
    for proc in pipeline.processes.values():
        if proc.exited_at is None:
            for dev, fp in proc.devices.items():
                out[dev] = out.get(dev, 0) + fp.device_bytes
    return out


def _check_like_memory_viz(snap: dict[str, Any]) -> None:
    assert set(snap) >= {"segments", "device_traces"}
    for seg in snap["segments"]:
        for key in ("device", "address", "total_size", "allocated_size", "stream", "blocks", "segment_type"):
            assert key in seg, key
        allocated = free_internal = free_external = 0
        for b in seg["blocks"]:
            assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
            if b["state"] == "active_allocated":
                assert "frames" in b and "requested_size" in b  # _block_extra's new-format branch
                allocated += b["requested_size"]
                free_internal += b["size"] - b["requested_size"]
            else:
                free_external += b["size"]
            for f in b.get("frames", []):
                assert set(f) >= {"filename", "line", "name"}  # _frame_fmt
        assert allocated + free_internal + free_external == seg["total_size"]  # segsum's assertion
    for dev, entries in enumerate(snap["device_traces"]):
        live = {b["address"] for s in snap["segments"] if s["device"] == dev for b in s["blocks"]
                if b["state"] == "active_allocated"}
        times = [e["time_us"] for e in entries]
        assert times == sorted(times)
        for e in reversed(entries):  # MemoryViz.js: from the final state back through the trace
            assert e["action"] in ACTIONS and isinstance(e["size"], int)
            if e["action"] == "oom":
                assert isinstance(e["device_free"], int)
            elif e["action"] == "alloc":
                assert e["addr"] in live
                live.remove(e["addr"])
            elif e["action"] == "free_completed":
                assert e["addr"] not in live
                live.add(e["addr"])


@pytest.mark.parametrize("name", TRACES)
def test_memory_viz_snapshot_reads_like_torchs_and_ends_at_the_daemons_footprint(name: str, tmp_path: Path) -> None:
    rec = load([DATA / name])
    snap = memory_viz(rec)
    _check_like_memory_viz(snap)
    pickle.loads(pickle.dumps(snap))  # plain builtins only: no class of ours inside
    got: dict[int, int] = {}
    for s in snap["segments"]:
        got[s["device"]] = got.get(s["device"], 0) + s["total_size"]
    assert got == {d: b for d, b in _final_device_bytes(DATA / name, tmp_path).items() if b}


@pytest.mark.parametrize("name", TRACES)
def test_perfetto_json_follows_the_trace_event_format(name: str, tmp_path: Path) -> None:
    doc = json.loads(json.dumps(perfetto(load([DATA / name]))))
    events = doc["traceEvents"]
    assert events
    counters: dict[tuple[int, str], dict[str, int]] = {}
    for e in events:
        assert e["ph"] in ("C", "i", "X", "M") and isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] > 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "C":
            assert all(isinstance(v, int) for v in e["args"].values())
            counters[(e["pid"], e["name"])] = e["args"]  # the last value of each track
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t")
    resident = ("device", "device_static", "array", "untracked")
    final: dict[int, int] = {}
    for (_pid, track), args in counters.items():
        dev = int(track.split()[1])
        final[dev] = final.get(dev, 0) + sum(v for k, v in args.items() if k in resident)
    assert {d: b for d, b in final.items() if b} == {d: b for d, b in _final_device_bytes(DATA / name, tmp_path).items() if b}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names and all(n.startswith("pid ") for n in names)
    assert all(type(e["tid"]) is int for e in events)  # the trace-event format's thread ids are numbers


def test_kernels_become_slices_with_their_names() -> None:
    doc = perfetto(load([DATA / "h200_kernels_train.gfp.gz"]))
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X" and "stream" in tracks[(e["pid"], e["tid"])]]
    assert slices and any(e["name"] != "kernel" for e in slices)


def test_export_cli_writes_both_formats_and_refuses_a_missing_file(tmp_path: Path) -> None:
    src = DATA / "h200_probe_caching.gfp.gz"
    for to, out in (("memory-viz", tmp_path / "s.pickle"), ("perfetto", tmp_path / "t.json")):
        r = subprocess.run([sys.executable, "-m", "gpufootprint", "export", str(src), "--to", to, "-o", str(out)],
                           env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        assert out.stat().st_size > 0
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "export", str(tmp_path / "nope.gfp"), "--to",
                        "perfetto", "-o", str(tmp_path / "x.json")], env=cli_env(), capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == \
        f"gpufootprint export: error: {tmp_path / 'nope.gfp'}: no such file"
