"""Families of the feature frames, the adaptive sampler and the NVML source (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import Metric

from gpufootprint.exporter.table import Row, Samples, build, counter, each, gauge, one, states
from gpufootprint.snapshot import DeviceFeatures, NvmlGpu, NvmlSnapshot, PipelineSnapshot, SamplerState

_PROC = ("pid", "gpu", "source")
_GPU = ("gpu", "uuid", "model")

SAMPLER_FAMILIES: tuple[Row[SamplerState], ...] = (
    gauge("gpufootprint_sampler_mode", "1 for the sampler's current mode of a process.", ("pid", "source", "mode"),
          states(lambda st: st.mode, ("quiet", "steady", "burst"))),
    gauge("gpufootprint_sampler_interval_seconds",
          "The sampler's current interval for a process (5 ms burst .. 200 ms quiet).", ("pid", "source"),
          one(lambda st: st.interval_s)),
)

ANOMALY_FAMILIES: tuple[Row[PipelineSnapshot], ...] = (
    counter("gpufootprint_anomaly_windows", "Anomaly windows closed, by reason.", ("reason",),
            each(lambda s: s.anomaly_counts, sort=True)),
    counter("gpufootprint_sampler_controls", "CONTROL messages the sampler sent to probes, by op and result.",
            ("op", "result"), lambda s: [(key, n) for key, n in sorted(s.sampler_controls.items())]),
)

FEATURE_FAMILIES: tuple[Row[DeviceFeatures], ...] = (
    gauge("gpufootprint_frame_peak_bytes", "Peak GPU-resident bytes of the last closed sampler interval (exact).",
          _PROC, one(lambda f: f.frame_peak_bytes)),
    counter("gpufootprint_page_migrations", "Unified-memory page migrations (transfer records), by direction.",
            (*_PROC, "direction"), each(lambda f: f.page_migrations, sort=True)),
    counter("gpufootprint_page_faults", "Unified-memory page faults, by side.", (*_PROC, "side"),
            each(lambda f: f.page_faults, sort=True)),
    gauge("gpufootprint_allocation_reuse_ratio", "Share of allocations made at an (address, size) released before.",
          _PROC, one(lambda f: f.allocation_reuse_ratio)),
    gauge("gpufootprint_pool_utilization_ratio", "Stream-ordered pools: bytes of live allocations / bytes reserved.",
          _PROC, one(lambda f: f.pool_utilization_ratio)),
    gauge("gpufootprint_allocator_slack_bytes",
          "PyTorch caching allocator: reserved minus allocated bytes (from the probe).", _PROC,
          one(lambda f: f.allocator_slack_bytes)),
    gauge("gpufootprint_page_migration_rate_hertz",
          "UM migrations + faults + host<->device copies per second, last closed window.", _PROC,
          one(lambda f: f.migration_rate_hz)),
)

GPU_FAMILIES: tuple[Row[NvmlGpu], ...] = (
    gauge("gpufootprint_nvml_memory_used_bytes", "NVML: device memory used.", _GPU, one(lambda g: g.memory_used_bytes)),
    gauge("gpufootprint_nvml_memory_total_bytes", "NVML: device memory.", _GPU, one(lambda g: g.memory_total_bytes)),
    gauge("gpufootprint_nvml_memory_reserved_bytes", "NVML (v2 call): memory reserved by the driver and firmware.",
          _GPU, one(lambda g: g.memory_reserved_bytes)),
    gauge("gpufootprint_nvml_utilization_ratio", "NVML: share of the last sample period a kernel ran.", _GPU,
          one(lambda g: g.utilization_ratio)),
    gauge("gpufootprint_nvml_pcie_tx_bytes_per_second", "NVML: PCIe transmit throughput.", _GPU,
          one(lambda g: g.pcie_tx_bytes_per_second)),
    gauge("gpufootprint_nvml_pcie_rx_bytes_per_second", "NVML: PCIe receive throughput.", _GPU,
          one(lambda g: g.pcie_rx_bytes_per_second)),
    gauge("gpufootprint_nvml_power_watts", "NVML: power draw.", _GPU, one(lambda g: g.power_watts)),
    counter("gpufootprint_nvml_energy_joules", "NVML: energy since the driver was loaded.", _GPU,
            one(lambda g: g.energy_joules)),
    gauge("gpufootprint_nvml_up", "1 when NVML answers for the GPU, 0 when it is lost.", _GPU,
          one(lambda g: 1.0 if g.up else 0.0)),
)

_GpuSeen = tuple[NvmlGpu, Mapping[int, str]]  # a GPU, and the source of each pid the pipeline knows


def _gpu_processes(seen: _GpuSeen) -> Samples:
    g, sources = seen
    return [((str(pid), str(g.index), "probe" if sources.get(pid) == "probe" else "nvml"), used)
            for pid, used in sorted(g.processes.items()) if used is not None]


GPU_DETAIL_FAMILIES: tuple[Row[_GpuSeen], ...] = (
    counter("gpufootprint_nvml_xid_errors", "NVML: Xid critical-error events, by Xid.", ("gpu", "xid"),
            lambda s: [((str(s[0].index), str(x)), n) for x, n in sorted(s[0].xid_errors.items())]),
    gauge("gpufootprint_nvml_field_supported", "1 when the driver answers the field, 0 when it does not support it.",
          ("gpu", "field"),
          lambda s: [((str(s[0].index), f), 1.0 if ok else 0.0) for f, ok in sorted(s[0].field_supported.items())]),
    gauge("gpufootprint_nvml_process_used_bytes",
          "NVML: memory a process uses on the GPU (CUDA context and libraries included); source=probe when a probe "
          "reports the same (host) pid.", ("pid", "gpu", "source"), _gpu_processes),
)

NVML_FAMILIES: tuple[Row[NvmlSnapshot], ...] = (
    gauge("gpufootprint_nvml_state", "1 for the NVML source's current state.", ("state",),
          states(lambda nv: nv.state, ("ok", "unavailable", "error"))),
    counter("gpufootprint_nvml_errors", "NVML calls that failed, by reason.", ("reason",),
            each(lambda nv: nv.errors, sort=True)),
    gauge("gpufootprint_nvml_poll_interval_seconds",
          "Current NVML poll interval (follows the fastest sampler interval).", (), one(lambda nv: nv.poll_interval_s)),
)


def sampler_nvml_families(snap: PipelineSnapshot) -> list[Metric]:
    """Families of the feature frames, the sampler and the NVML source (docs/metrics.md)."""
    sources = {p.pid: p.source for p in snap.processes}
    fams = build(SAMPLER_FAMILIES, (((str(st.pid), sources.get(st.pid, "trace")), st) for st in snap.sampler))
    fams += build(ANOMALY_FAMILIES, (((), snap),))
    fams += build(FEATURE_FAMILIES, (((str(f.pid), str(f.dev), sources.get(f.pid, "trace")), f)
                                     for f in snap.features))
    nv = snap.nvml
    if nv is None:
        return fams
    fams += build(GPU_FAMILIES, (((str(g.index), g.uuid, g.model), g) for g in nv.gpus))
    fams += build(GPU_DETAIL_FAMILIES, (((), (g, sources)) for g in nv.gpus))
    fams += build(NVML_FAMILIES, (((), nv),))
    return fams
