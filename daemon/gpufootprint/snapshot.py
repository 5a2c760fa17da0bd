"""Immutable snapshots: what the exporter, the engines and reports read.

The pipeline thread builds a new snapshot every tick and swaps a reference; a
scrape reads whichever snapshot is current and never sees a half-applied batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    dev: int
    live_bytes: dict[str, int]  # by memory-kind name, non-zero kinds only
    device_bytes: int  # GPU-resident kinds summed
    async_device_bytes: int  # live stream-ordered (cudaMallocAsync) allocations
    pool_reserved_bytes: int
    pool_used_bytes: int
    window_peak_bytes: int
    live_allocations: int
    allocations: dict[str, int]
    releases: dict[str, int]
    allocated_bytes: dict[str, int]
    released_bytes: dict[str, int]
    memcpy_count: dict[int, int]  # by CopyKind value
    memcpy_bytes: dict[int, int]
    memcpy_seconds: dict[int, float]
    memset_count: int
    memset_bytes: int
    kernel_count: int
    kernel_seconds: float
    um_count: dict[int, int]
    um_value: dict[int, int]
    # Live allocations as a read-only structured array (ts, bytes, mk); filled only
    # when the pipeline is asked to (``Pipeline.snapshot_live_tables``): the leak engine.
    live_table: np.ndarray | None = None
    peer_copy_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # (src gpu, dst gpu) -> bytes


@dataclass(frozen=True, slots=True)
class ProcessSnapshot:
    pid: int
    source: str
    exited: bool
    info: dict[str, Any]
    devices: tuple[DeviceSnapshot, ...]
    pending_records: int
    as_of_ns: int
    probe_counters: dict[str, float] = field(default_factory=dict)
    # The newest KERNEL records of this process (read-only, in the order applied), bounded by
    # graph_advisor.kernel_retention; None when the pipeline keeps none.
    recent_kernels: np.ndarray | None = None
    # The newest host-side API records (kernel launches and synchronisations, RecordKind.API), kept
    # the same way: the advisor's evidence when no kernel records were taken.
    recent_launches: np.ndarray | None = None
    # Self-verification against the probe's own table at its watermarks (0 and 0 without a probe).
    drift_bytes: int = 0  # sum over GPUs and kinds of |daemon - probe| at the latest check
    drift_checks: int = 0
    drift_mismatches: int = 0
    late_records: int = 0


@dataclass(frozen=True, slots=True)
class GpuState:
    """What the engines need to know about one GPU; None means unknown (the NVML source fills it)."""

    index: int
    model: str | None = None
    uuid: str | None = None
    total_bytes: int | None = None
    utilization_ratio: float | None = None  # 0..1, the latest NVML sample


# --- features, sampler, NVML (all optional: absent means "not computed") -------------------


@dataclass(frozen=True, slots=True)
class DeviceFeatures:
    pid: int
    dev: int
    frame_peak_bytes: int | None  # peak of the last closed sampler interval (its width: the interval)
    allocation_reuse_ratio: float | None  # allocations at a freed (address, size) / allocations
    pool_utilization_ratio: float | None  # stream-ordered pools: used / reserved
    allocator_slack_bytes: int | None  # torch reserved - allocated, from the probe's heartbeat
    page_migrations: dict[str, int]  # unified-memory transfer records, by direction
    page_faults: dict[str, int]  # unified-memory page faults, by side (cpu, gpu)
    migration_rate_hz: float | None  # migrations + faults + host<->device copies per second, last window
    migration_windows: tuple[Any, ...] = ()  # features.frames.MigrationWindow: the last second's, with activity
    # The newest device allocations' (ts, reused) (features.reuse.REUSE_EVENT_DTYPE, read-only) and how many
    # device allocations there were in all: the advisor's reuse over the steady part (features.reuse.steady_ratio).
    reuse_events: np.ndarray | None = None
    device_allocations: int = 0


@dataclass(frozen=True, slots=True)
class SamplerState:
    pid: int
    mode: str  # quiet | steady | burst
    interval_s: float
    as_of_ns: int


@dataclass(frozen=True, slots=True)
class AnomalyWindow:
    pid: int
    gpu: int
    start_ns: int
    end_ns: int
    reason: str
    peak_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start_ns, "end": self.end_ns, "reason": self.reason,
                "peak_bytes": self.peak_bytes, "pid": self.pid, "gpu": self.gpu}


@dataclass(frozen=True, slots=True)
class NvmlGpu:
    index: int
    uuid: str
    model: str
    up: bool
    state: str  # ok | lost | error
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_reserved_bytes: int | None
    utilization_ratio: float | None
    pcie_tx_bytes_per_second: float | None
    pcie_rx_bytes_per_second: float | None
    power_watts: float | None
    energy_joules: float | None
    field_supported: dict[str, bool]
    xid_errors: dict[int, int]
    processes: dict[int, int | None]  # host pid -> used bytes (None: the driver does not say)
    # host pid -> NVML's per-process utilisation samples, oldest first: (end of the driver's sample period
    # in wall-clock ns, share of it in which one or more of the process's kernels ran)
    process_busy: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NvmlSnapshot:
    state: str  # ok | unavailable | error
    detail: str
    driver_version: str | None
    gpus: tuple[NvmlGpu, ...]
    errors: dict[str, int]  # by reason
    poll_interval_s: float


@dataclass(frozen=True, slots=True)
class PipelineSnapshot:
    taken_at: float
    processes: tuple[ProcessSnapshot, ...]
    records_ingested: dict[str, int]
    ingest_errors: dict[str, int]
    late_records: int
    window_peak_seconds: float
    verify_results: dict[str, int] = field(default_factory=dict)  # match, mismatch, skipped
    late_by_kind: dict[str, int] = field(default_factory=dict)  # late records by record kind
    ingest_repairs: dict[str, int] = field(default_factory=dict)  # records set right by a stated rule, by reason
    daemon: dict[str, Any] = field(default_factory=dict)  # connections, gpu presence, ...
    features: tuple[DeviceFeatures, ...] = ()
    sampler: tuple[SamplerState, ...] = ()
    anomaly_windows: tuple[AnomalyWindow, ...] = ()  # recent ones, oldest first
    anomaly_counts: dict[str, int] = field(default_factory=dict)  # all since start, by reason
    sampler_controls: dict[tuple[str, str], int] = field(default_factory=dict)  # CONTROL messages, (op, sent|failed)
    nvml: NvmlSnapshot | None = None
    gpus: tuple[GpuState, ...] = ()  # engines' view of the GPUs (empty: unknown)


EMPTY_SNAPSHOT = PipelineSnapshot(
    taken_at=0.0, processes=(), records_ingested={}, ingest_errors={}, late_records=0,
    window_peak_seconds=0.0,
)
