"""Shared helpers for the engines' tests: snapshot builders and stepwise replays."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gpufootprint.config import FootprintConfig
from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.snapshot import DeviceSnapshot, GpuState, NvmlGpu, NvmlSnapshot, PipelineSnapshot, ProcessSnapshot
from gpufootprint.wire.framing import FrameDecoder, FrameType
from gpufootprint.wire.sources import TraceFile

DATA = Path(__file__).parent / "data"
GIB = 1 << 30
MIB = 1 << 20


def dev(d: int = 0, device_bytes: int = 0, *, peak: int | None = None, kernel_seconds: float = 0.0,
        pool_reserved: int = 0, pool_used: int = 0, live_table: np.ndarray | None = None) -> DeviceSnapshot:
    return DeviceSnapshot(
        dev=d, live_bytes={"device": device_bytes} if device_bytes else {}, device_bytes=device_bytes,
        async_device_bytes=pool_used, pool_reserved_bytes=pool_reserved, pool_used_bytes=pool_used,
        window_peak_bytes=device_bytes if peak is None else peak, live_allocations=0, allocations={},
        releases={}, allocated_bytes={}, released_bytes={}, memcpy_count={}, memcpy_bytes={},
        memcpy_seconds={}, memset_count=0, memset_bytes=0, kernel_count=0, kernel_seconds=kernel_seconds,
        um_count={}, um_value={}, live_table=live_table)


def proc(pid: int, *devices: DeviceSnapshot, source: str = "probe", exited: bool = False,
         info: dict[str, Any] | None = None, as_of_ns: int = 0,
         recent_kernels: np.ndarray | None = None, recent_launches: np.ndarray | None = None) -> ProcessSnapshot:
    return ProcessSnapshot(pid=pid, source=source, exited=exited, info=info or {}, devices=tuple(devices),
                           pending_records=0, as_of_ns=as_of_ns, recent_kernels=recent_kernels,
                           recent_launches=recent_launches)


def snap(t: float, *procs: ProcessSnapshot, gpus: tuple[GpuState, ...] = ()) -> PipelineSnapshot:
    return PipelineSnapshot(taken_at=t, processes=tuple(procs), records_ingested={}, ingest_errors={},
                            late_records=0, window_peak_seconds=60.0, gpus=gpus)


def with_busy(s: PipelineSnapshot, busy: Mapping[int, Sequence[tuple[int, float]]]) -> PipelineSnapshot:
    """``s`` with NVML's per-process busy samples on GPU 0 (pid -> time-ordered (ns, share) samples)."""
    gpu = NvmlGpu(index=0, uuid="GPU-0", model="H100", up=True, state="ok", memory_total_bytes=None,
                  memory_used_bytes=None, memory_reserved_bytes=None, utilization_ratio=None,
                  pcie_tx_bytes_per_second=None, pcie_rx_bytes_per_second=None, power_watts=None,
                  energy_joules=None, field_supported={}, xid_errors={}, processes={},
                  process_busy={pid: tuple(samples) for pid, samples in busy.items()})
    return dataclasses.replace(s, nvml=NvmlSnapshot(state="ok", detail="", driver_version=None, gpus=(gpu,),
                                                    errors={}, poll_interval_s=1.0))


def replay_snapshots(path: Path | str, *, kernel_retention: int = 0, live_tables: bool = False,
                     footprint: FootprintConfig | None = None) -> Iterator[PipelineSnapshot]:
    """Replay a trace through the real session and pipeline; yield a snapshot at every WATERMARK,
    taken at the watermark's time, and one at the end."""
    pipeline = Pipeline(footprint or FootprintConfig(), kernel_retention=kernel_retention)
    pipeline.snapshot_live_tables = live_tables
    session = Session(pipeline, source="trace", name=str(path))
    decoder = FrameDecoder()
    last = 0
    for chunk in TraceFile(path).chunks():
        for frame in decoder.feed(chunk):
            session.handle(frame)
            if frame.type is FrameType.WATERMARK:
                last = frame.watermark()
                yield pipeline.snapshot(wall_time=last / 1e9)
    assert decoder.error is None, decoder.error
    session.close()
    yield pipeline.snapshot(wall_time=last / 1e9 + 0.001)
