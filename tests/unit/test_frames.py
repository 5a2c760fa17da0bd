"""Frames equal a brute-force computation (plain Python, from scratch) on real and synthetic traces."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.config import FeaturesConfig, FootprintConfig
from gpufootprint.features.frames import MigrationWindow, align_pcie
from gpufootprint.hub import FeatureHub
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file

sys.path.insert(0, str(Path(__file__).parents[1]))
from tracegen import MS, T0, cpy, mem, mset, read_jsonl, um, write_jsonl

RESIDENT = {3, 4, 6, 16}
COPY_NAMES = {0: "unknown", 1: "htod", 2: "dtoh", 3: "htoa", 4: "atoh", 5: "atoa", 6: "atod", 7: "dtoa",
              8: "dtod", 9: "htoh", 10: "ptop"}
FRAME = 10 * MS


def brute_frames(lines: list[dict[str, Any]], pid: int, dev: int) -> list[dict[str, Any]]:
    """Per 10 ms frame: peak resident bytes, alloc/release counts and bytes, copy and set bytes."""
    mems = sorted((o for o in lines if o["k"] == "mem" and o["pid"] == pid and o["dev"] == dev),
                  key=lambda o: o["ts"])
    frames: dict[int, dict[str, Any]] = defaultdict(lambda: {"peak": None, "a": 0, "ab": 0, "r": 0, "rb": 0,
                                                              "cpy": defaultdict(int), "set": 0})
    live: dict[int, tuple[int, int]] = {}
    level = 0
    level_after_frame: dict[int, int] = {}
    for o in mems:
        f = o["ts"] // FRAME
        fr = frames[f]
        if fr["peak"] is None:
            fr["peak"] = level  # the level held on entering the frame
        if o["op"] == 1:
            fr["a"] += 1
            fr["ab"] += o["bytes"]
            old = live.get(o["addr"])
            if old is not None and old[1] in RESIDENT:
                level -= old[0]
            live[o["addr"]] = (o["bytes"], o["mk"])
            if o["mk"] in RESIDENT:
                level += o["bytes"]
        elif o["op"] == 2:
            fr["r"] += 1
            fr["rb"] += o["bytes"]
            entry = live.pop(o["addr"], None)
            if entry is not None and entry[1] in RESIDENT:
                level -= entry[0]
        fr["peak"] = max(fr["peak"], level)
        level_after_frame[f] = level
    for o in lines:
        if o.get("pid", pid) != pid or o.get("dev", dev) != dev:
            continue
        if o["k"] == "cpy":
            frames[o["start"] // FRAME]["cpy"][COPY_NAMES[o["ck"]]] += o["bytes"]
        elif o["k"] == "set":
            frames[o["start"] // FRAME]["set"] += o["bytes"]
    out = []
    for f in sorted(frames):
        fr = frames[f]
        peak = fr["peak"]
        if peak is None:  # no memory event in the frame: the level held since the last one
            earlier = [g for g in level_after_frame if g < f]
            peak = level_after_frame[max(earlier)] if earlier else 0
        out.append({"start_ns": f * FRAME, "peak_bytes": peak, "allocations": fr["a"], "allocated_bytes": fr["ab"],
                    "releases": fr["r"], "released_bytes": fr["rb"], "memcpy_bytes": dict(fr["cpy"]),
                    "memset_bytes": fr["set"]})
    return out


def brute_reuse(lines: list[dict[str, Any]], pid: int, dev: int) -> float | None:
    freed: set[tuple[int, int]] = set()
    seen = hit = 0
    # device allocations only (features.reuse): not module globals, not pinned host memory
    for o in sorted((o for o in lines if o["k"] == "mem" and o["pid"] == pid and o["dev"] == dev
                     and o.get("mk") in (3, "device")),
                    key=lambda o: o["ts"]):
        if o["op"] == 1:
            seen += 1
            hit += (o["addr"], o["bytes"]) in freed
        else:
            freed.add((o["addr"], o["bytes"]))
    return hit / seen if seen else None


def replay(path: Path) -> Pipeline:
    # Keep enough history for the whole trace so every frame can be compared.
    cfg = FootprintConfig(window_peak_seconds=3600.0)
    pipeline = Pipeline(cfg, hub=FeatureHub(FeaturesConfig(keep_seconds=3600.0)))
    result = replay_file(path, pipeline)
    assert result.problems == []
    return pipeline


def as_dicts(builder: Any) -> list[dict[str, Any]]:
    return [{"start_ns": r.start_ns, "peak_bytes": r.peak_bytes, "allocations": r.allocations,
             "allocated_bytes": r.allocated_bytes, "releases": r.releases, "released_bytes": r.released_bytes,
             "memcpy_bytes": r.memcpy_bytes, "memset_bytes": r.memset_bytes} for r in builder.frames()]


@pytest.mark.parametrize("name", ["h200_caching.jsonl.gz", "h200_expandable.jsonl.gz"])
def test_frames_equal_brute_force_on_real_h200_traces(data_dir: Path, name: str) -> None:
    lines = read_jsonl(data_dir / name)
    pid = lines[0]["pid"]
    pipeline = replay(data_dir / name)
    builder = pipeline.hub.builders[(pid, 0)]
    expected = brute_frames(lines, pid, 0)
    got = as_dicts(builder)
    assert len(got) == len(expected) > 20
    assert got == expected
    assert builder.reuse_ratio == pytest.approx(brute_reuse(lines, pid, 0))
    assert builder.reuse_ratio is not None and 0 < builder.reuse_ratio < 1


def test_frames_equal_brute_force_on_shuffled_synthetic_trace_with_copies_and_two_devices(tmp_path: Path) -> None:
    import random

    rng = random.Random(7)
    lines: list[dict[str, Any]] = []
    live: dict[int, list[int]] = {0: [], 1: []}
    t = T0
    for i in range(3000):
        t += rng.randrange(0, 4 * MS)
        dev = rng.randrange(2)
        if live[dev] and rng.random() < 0.5:
            addr = live[dev].pop(rng.randrange(len(live[dev])))
            lines.append(mem(t, 2, addr, (addr >> 4) & 0xFFFFF, dev=dev))
        else:
            addr = (0x10_0000_0000 * (dev + 1)) + rng.randrange(64) * 0x1000_0000 + (rng.randrange(1, 1 << 16) << 4)
            if addr in live[dev]:
                continue
            live[dev].append(addr)
            lines.append(mem(t, 1, addr, (addr >> 4) & 0xFFFFF, mk=rng.choice([3, 3, 3, 2, 6]), dev=dev))
        if i % 7 == 0:
            lines.append(cpy(t + rng.randrange(MS), rng.choice([1, 2, 8]), rng.randrange(1, 1 << 20), dev=dev))
        if i % 11 == 0:
            lines.append(mset(t + rng.randrange(MS), rng.randrange(1, 1 << 16), dev=dev))
    # Delivery order is not time order: shuffle within 100-record blocks (inside the reorder window).
    blocks = [lines[i:i + 100] for i in range(0, len(lines), 100)]
    for b in blocks:
        rng.shuffle(b)
    shuffled = [{"k": "meta", "format": "cupti-jsonl", "version": 1, "pid": 4242}] + [o for b in blocks for o in b]
    path = write_jsonl(tmp_path / "synthetic.jsonl.gz", shuffled)
    pipeline = replay(path)
    assert pipeline.late_records == 0
    for dev in (0, 1):
        assert as_dicts(pipeline.hub.builders[(4242, dev)]) == brute_frames(lines, 4242, dev)


def test_migration_windows_count_um_transfers_faults_and_host_device_copies(tmp_path: Path) -> None:
    lines = [{"k": "meta", "format": "cupti-jsonl", "version": 1, "pid": 4242},
             mem(T0, 1, 0x1000, 4096, mk=5)]
    expect: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for i in range(200):
        t = T0 + i * 3 * MS + 17
        w = (t // (50 * MS))
        ck = [1, 2, 3, 4, 8][i % 5]
        # bytes for transfers, fault groups for GPU faults, and for CPU faults the faulting
        # instruction's address (as CUPTI fills it on the H200): one fault per record
        value = {1: 4096 * (i % 3 + 1), 2: 4096 * (i % 3 + 1), 8: 4096, 3: 0x7F3A_1C00_0000 + i, 4: i % 4 + 1}[ck]
        lines.append(um(t, ck, value))
        key = {1: "htod", 2: "dtoh", 8: "dtod", 3: "cpu", 4: "gpu"}[ck]
        expect[w][key] += value if ck == 4 else 1
        if i % 4 == 0:
            lines.append(cpy(t + 5, 1 if i % 8 else 2, 1000))
            expect[w]["copies"] += 1
            expect[w]["copy_bytes"] += 1000
        if i % 9 == 0:
            lines.append(cpy(t + 5, 8, 1000))  # device to device: not a migration
    pipeline = replay(write_jsonl(tmp_path / "um.jsonl", lines))
    b = pipeline.hub.builders[(4242, 0)]
    got = {w.start_ns // (50 * MS): w for w in b.migration_windows()}
    assert set(got) == set(expect)
    for wid, e in expect.items():
        w = got[wid]
        assert w.um_transfers == {"htod": e["htod"], "dtoh": e["dtoh"], "dtod": e["dtod"]}
        assert w.page_faults == {"cpu": e["cpu"], "gpu": e["gpu"]}
        assert (w.copies, w.copy_bytes) == (e["copies"], e["copy_bytes"])
        assert w.frequency_hz == pytest.approx(sum(v for k, v in e.items() if k != "copy_bytes") / 0.05)
    assert b.page_migrations == {"htod": 40, "dtoh": 40, "dtod": 40}
    assert sum(b.page_faults.values()) == sum(e["cpu"] + e["gpu"] for e in expect.values())


def test_recent_migration_windows_are_the_last_ones_closed_of_the_whole_history(tmp_path: Path) -> None:
    # Each snapshot reads the windows closed in the last second; they must be exactly those of the whole
    # history (in time order), whichever moment the snapshot is as of, with windows missing in between.
    lines = [um(T0 + i * 7 * MS + 3, [1, 2, 3, 4, 8][i % 5], 4096) for i in range(1500) if (i // 40) % 3]
    pipeline = replay(write_jsonl(tmp_path / "um.jsonl", lines))
    b = pipeline.hub.builders[(4242, 0)]
    every = b.migration_windows()
    assert len(every) > 60
    width = 50 * MS
    for as_of in [T0 - width, T0, T0 + 3 * width + 1, *(T0 + k * 37 * MS for k in range(0, 330, 7)), T0 + 10**12]:
        last_closed = as_of // width - 1
        expect = [w for w in every if last_closed - 20 < w.start_ns // width <= last_closed]
        assert b.recent_migration_windows(as_of) == expect
        assert b.recent_migration_windows(as_of, n=3) == [w for w in expect if w.start_ns // width > last_closed - 3]


def test_align_pcie_attaches_the_sample_taken_inside_each_window() -> None:
    w = [MigrationWindow(i * 50 * MS, 50 * MS, {}, {}, {}, 0, 0) for i in range(3)]
    samples = [(10 * MS, 100.0, 1.0), (40 * MS, 300.0, 3.0), (120 * MS, 7.0, 8.0)]
    out = align_pcie(w, samples)
    assert (out[0].pcie_tx_bytes_per_second, out[0].pcie_rx_bytes_per_second) == (200.0, 2.0)
    assert out[1].pcie_tx_bytes_per_second is None
    assert (out[2].pcie_tx_bytes_per_second, out[2].pcie_rx_bytes_per_second) == (7.0, 8.0)


def test_allocator_slack_comes_from_the_probe_heartbeat_torch_field() -> None:
    from gpufootprint.ingest.session import Session
    from gpufootprint.records import MEMORY_DTYPE, RecordKind
    from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, FrameType, encode_batch, encode_json

    pipeline = Pipeline(FootprintConfig())
    session = Session(pipeline, source="probe", peer_pid=77)
    recs = __import__("numpy").zeros(1, MEMORY_DTYPE)
    recs["ts"], recs["pid"], recs["op"], recs["mk"], recs["addr"], recs["bytes"] = T0, 77, 1, 3, 0x10, 1 << 20
    decoder = FrameDecoder()
    stream = PREAMBLE + encode_json(FrameType.HELLO, {"pid": 77}) + encode_batch(RecordKind.MEMORY, recs) + \
        encode_json(FrameType.HEARTBEAT, {"ts": T0, "counters": {"records_sent": 1},
                                          "torch": {"allocated": {"0": 3 << 20}, "reserved": {"0": 8 << 20}}})
    for frame in decoder.feed(stream):
        session.handle(frame)
    session.close()
    snap = pipeline.snapshot()
    (feat,) = snap.features
    assert feat.allocator_slack_bytes == 5 << 20
    # A heartbeat with a malformed torch field changes nothing and raises nothing.
    for frame in decoder.feed(encode_json(FrameType.HEARTBEAT, {"torch": {"allocated": 3}})):
        session.handle(frame)
    assert pipeline.snapshot().features[0].allocator_slack_bytes == 5 << 20
