"""Replay the traces the probe recorded on the H200 (tests/data/h200_probe_*, h200_kernels_*).

Each was recorded by ``tests/gpu`` (the probe's ``tee`` of every frame it sent)
or ``gpufootprint record``. At every mark the workload had synchronised and
attached PyTorch's numbers; the GPU test checked the live daemon against them.
Here the daemon's pipeline must reproduce the same footprint from the file.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.configload import load_config
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import RecordKind
from gpufootprint.replay import replay_file
from gpufootprint.wire.framing import FrameType, iter_frames
from gpufootprint.wire.sources import TraceFile

DATA = Path(__file__).resolve().parents[1] / "data"
MiB = 1 << 20


def replay(name: str) -> tuple[dict[str, dict[str, Any]], Pipeline]:
    pipeline = Pipeline(load_config(env={}).footprint)
    result = replay_file(DATA / name, pipeline)
    assert result.problems == []
    assert pipeline.errors.counts == Counter()
    assert all(m["matches"] for m in result.marks), [m for m in result.marks if not m["matches"]]
    return {m["label"]: m for m in result.marks}, pipeline


def library_bytes(m: dict[str, Any]) -> int:
    return int(m["expect_library_device_bytes"])


@pytest.mark.parametrize("name", ["h200_probe_caching.gfp.gz", "h200_probe_expandable.gfp.gz"])
def test_caching_and_expandable_device_bytes_are_torch_reserved_plus_library_memory(name: str) -> None:
    marks, _ = replay(name)
    assert list(marks) == ["start", "allocated", "freed_some", "empty_cache", "after_mlp_steps", "end"]
    for label, m in marks.items():
        device = m["live_bytes"].get("device", 0)
        assert device == m["torch_memory_reserved"] + library_bytes(m), label
    # cuBLAS and friends hold memory PyTorch's statistics never show (128.25 MiB here)
    assert library_bytes(marks["allocated"]) == 0
    assert library_bytes(marks["after_mlp_steps"]) == 134_481_920


def test_cuda_malloc_async_live_bytes_follow_torch_allocated() -> None:
    marks, pipeline = replay("h200_probe_async.gfp.gz")
    proc = next(iter(pipeline.processes.values()))
    assert marks["allocated"]["live_bytes"]["device"] == marks["allocated"]["torch_memory_allocated"]
    assert marks["freed_some"]["live_bytes"]["device"] == marks["freed_some"]["torch_memory_allocated"]
    # after the MLP the non-async library memory (128.25 MiB) sits beside the pool
    m = marks["after_mlp_steps"]
    assert m["live_bytes"]["device"] - m["torch_memory_allocated"] == 134_481_920
    assert proc.exited_at is not None  # the GOODBYE closed it


def test_pinned_and_managed_memory_marks() -> None:
    marks, pipeline = replay("h200_probe_pinned_managed.gfp.gz")
    pm = marks["pinned_and_managed"]
    assert pm["live_bytes"] == {"pinned": 21 * MiB, "device": 16 * MiB, "managed": 64 * MiB}
    assert "managed" not in marks["managed_freed"]["live_bytes"]
    # Unified memory (counters configured at the first managed allocation, 2026-12-02 17:27 UTC):
    # the workload wrote its 64 MiB from the CPU, then the GPU, twice, after the mark above.
    (proc,) = pipeline.processes.values()
    um_bytes = Counter({k: v for d in proc.devices.values() for k, v in d.um_value.items()})
    um_records = Counter({k: v for d in proc.devices.values() for k, v in d.um_count.items()})
    assert um_bytes[1] == um_bytes[2] == 2 * 64 * MiB  # HtoD and DtoH migrations: what the program moved
    # CPU page faults: one per record (CUPTI's value is the faulting instruction's address)
    assert um_bytes[3] == um_records[3] == 384
    assert um_bytes[4] == 477 and um_records[4] == 126  # GPU page fault groups


def test_profiler_gap_is_resynced_and_the_allocation_after_it_is_seen() -> None:
    marks, _ = replay("h200_probe_profiler.gfp.gz")
    after = marks["after_profiler"]
    assert after["live_bytes"]["device"] == after["torch_memory_reserved"]
    grown = marks["allocated_after_profiler"]["live_bytes"]["device"] - after["live_bytes"]["device"]
    assert grown == 300 * MiB
    frames = Counter(f.type for f in iter_frames(TraceFile(DATA / "h200_probe_profiler.gfp.gz").chunks()))
    assert frames[FrameType.RESYNC_BEGIN] == 1 and frames[FrameType.RESYNC_END] == 1


def test_restart_trace_holds_every_record_the_daemon_missed() -> None:
    # The tee never drops: the allocations made while the daemon was down are in the file.
    marks, _ = replay("h200_probe_restart.gfp.gz")
    assert marks["while_down"]["live_bytes"]["device"] == marks["while_down"]["torch_memory_reserved"]
    assert marks["after_restart"]["live_bytes"]["device"] == marks["after_restart"]["torch_memory_reserved"]


@pytest.mark.parametrize("name,graph_kernels", [("h200_kernels_train.gfp.gz", 0), ("h200_kernels_graph.gfp.gz", 80)])
def test_kernel_traces_carry_named_kernels_and_graph_ids(name: str, graph_kernels: int) -> None:
    marks, pipeline = replay(name)
    kernels = graph = 0
    names: dict[str, str] = {}
    for f in iter_frames(TraceFile(DATA / name).chunks()):
        if f.type is FrameType.BATCH and f.tag == RecordKind.KERNEL:
            recs = f.records()
            kernels += len(recs)
            graph += int((recs["graph"] != 0).sum())
        elif f.type is FrameType.STRINGS:
            names.update(f.json())
    assert kernels > 100 and graph == graph_kernels
    assert len(names) > 5 and all(isinstance(v, str) and v for v in names.values())
    dev = next(iter(pipeline.processes.values())).devices[0]
    assert dev.kernel_count == kernels
    if graph_kernels:
        assert marks["replayed_20"]["graph_replays"] == 20


@pytest.mark.parametrize("name", ["h200_probe_threads_caching.gfp.gz", "h200_probe_threads_expandable.gfp.gz"])
def test_allocations_made_on_new_threads_are_all_in_the_footprint(name: str) -> None:
    # Recorded with the driver-API hooks (docs/probe.md, "Lost records"; CUPTI's per-API activity
    # switch, 20:30 UTC): four new threads each allocated, then ran a cuBLAS product; then
    # training steps (the autograd thread).
    marks, pipeline = replay(name)
    (proc,) = [p for p in pipeline.processes.values() if p.probe_counters]
    assert proc.probe_counters["driver_hooks"] == 1 and proc.probe_counters["driver_hooks_unavailable"] == 0
    if "expandable" in name:  # one DRIVER record per cuMemMap/cuMemUnmap: counted, never sent as a record
        assert proc.probe_counters["driver_api_records"] > 0
    assert list(marks) == ["start", "thread_0", "thread_1", "thread_2", "thread_3", "after_mlp_steps", "end"]
    for label, m in marks.items():
        assert m["live_bytes"].get("device", 0) == m["torch_memory_reserved"] + library_bytes(m), label
    assert marks["thread_3"]["torch_memory_reserved"] > marks["thread_0"]["torch_memory_reserved"] > 0


def test_driver_api_mappings_on_every_thread_are_seen() -> None:
    # 2, 4 and 6 MiB mapped by cuMemCreate/cuMemMap on the main thread, a thread with no current
    # context and one that set it; all unmapped at the end.
    marks, _ = replay("h200_probe_vmm_threads.gfp.gz")
    device = [marks[k]["live_bytes"].get("device", 0) for k in
              ("start", "main_thread", "thread_no_context", "thread_with_context", "unmapped")]
    deltas = [b - a for a, b in itertools.pairwise(device)]
    assert deltas == [2 * MiB, 4 * MiB, 6 * MiB, -12 * MiB]
    assert [marks[k]["mapped_bytes"] for k in ("main_thread", "thread_no_context", "thread_with_context")] == \
        [2 * MiB, 4 * MiB, 6 * MiB]


def test_a_recording_that_lost_records_shows_it() -> None:
    # Recorded before the subscription (18:17 UTC): CUPTI never delivered the autograd thread's first
    # records, a 2 MiB mapping among them. The daemon cannot invent it, but it does not hide it either:
    # the release of the unseen mapping is an ingest error, and PyTorch's figure disagrees at the mark.
    pipeline = Pipeline(load_config(env={}).footprint)
    result = replay_file(DATA / "h200_probe_expandable_lost_records.gfp.gz", pipeline)
    assert result.problems == []
    assert pipeline.errors.counts == Counter({"release_without_allocation": 1})
    m = {x["label"]: x for x in result.marks}["after_mlp_steps"]
    assert m["live_bytes"]["device"] == m["torch_memory_reserved"] + library_bytes(m) - 2 * MiB


@pytest.mark.parametrize("alloc", ["async", "nocache"])
def test_allocation_churn_recordings_replay_exact_with_every_check_matching(alloc: str) -> None:
    """Recorded on the H200 (2026-12-03 04:42 UTC, tests/gpu churn test): 150 transformer steps under
    cudaMallocAsync or with PyTorch's caching off, about 87,000 memory records from two threads. The
    recording carries the probe's table totals at every watermark; replayed, the daemon's footprint
    equals them at every one, and PyTorch's figures at every mark."""
    marks, pipeline = replay(f"h200_probe_churn_{alloc}.gfp.gz")
    assert list(marks) == ["start", *[f"step_{n}" for n in range(25, 151, 25)], "end"]
    assert sum(pipeline.records_ingested.values()) > 80_000
    assert pipeline.late_records == 0
    assert pipeline.verify_results["match"] >= 10 and pipeline.verify_results["mismatch"] == 0
    for label, m in marks.items():
        if alloc == "async":
            (_proc,) = pipeline.processes.values()
            assert m["live_bytes"].get("device", 0) >= m["torch_memory_allocated"], label
        else:
            assert m["live_bytes"].get("device", 0) == m["torch_memory_reserved"] + library_bytes(m), label


#: Recorded by tests/gpu/test_probe_gpu.py on an H100 on 2026-12-06 (16:29 UTC, 04a7552) with the probe's
#: buffer callbacks and its walk of mixed buffers in C (bench/device_native.sh): every scenario of that file.
NATIVE = sorted(p.name for p in DATA.glob("h100_native_probe_*.gfp.gz"))


def test_the_c_callbacks_recordings_are_all_here() -> None:
    assert len(NATIVE) == 12, NATIVE


@pytest.mark.parametrize("name", NATIVE)
def test_traces_recorded_on_the_c_callbacks_replay_exact_at_every_mark(name: str) -> None:
    marks, pipeline = replay(name)
    assert marks, name
    assert all(p.drift_bytes == 0 for p in pipeline.processes.values()), name
