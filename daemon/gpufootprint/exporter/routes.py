"""The daemon's JSON routes beside /metrics: ``/api/processes``, ``/api/engines``, ``/api/oom``,
``/api/anomalies``, ``/api/migrations`` and ``/api/nvml``.

Each is a document built at request time from the latest snapshot and what the daemon's other
parts hand in as callables (the engines' outputs, the OOM manager's events, NVML's PCIe samples,
pod labels): this module holds no state and reads nothing of the ingest side but its snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpufootprint.engines.runner import EngineOutputs, engine_report
from gpufootprint.exporter.http import JsonRoute
from gpufootprint.exporter.processes import PodOf, processes_document
from gpufootprint.features.frames import align_pcie
from gpufootprint.snapshot import PipelineSnapshot

PcieSamples = Callable[[int], list[tuple[int, float, float]]]


def json_routes(snapshot: Callable[[], PipelineSnapshot], engine_outputs: Callable[[], EngineOutputs], *,
                oom_events: Callable[[], Any], oom_counts: Callable[[], dict[tuple[int, int, str], int]],
                pod_of: PodOf | None, pcie_samples: PcieSamples | None,
                nvml_snapshot: Callable[[], Any] | None = None) -> dict[str, JsonRoute]:
    """Every JSON route by its path. ``pod_of`` None: no pod labels (kubernetes.mode off);
    ``pcie_samples`` and ``nvml_snapshot`` None: no NVML, so migration windows carry no PCIe figures
    and /api/nvml says unavailable."""
    return {
        "/api/anomalies": lambda: anomalies_document(snapshot()),
        "/api/migrations": lambda: migrations_document(snapshot(), pcie_samples),
        "/api/processes": lambda: processes_document(snapshot(), engine_outputs(), oom_counts=oom_counts(),
                                                     pod_of=pod_of),
        "/api/oom": oom_events,
        "/api/engines": lambda: engine_report(engine_outputs()),
        "/api/nvml": lambda: nvml_document(nvml_snapshot() if nvml_snapshot is not None else None),
    }


def nvml_document(snap: Any) -> dict[str, object]:
    """GET /api/nvml: NVML's per-process utilisation samples the daemon holds, per GPU and pid (what the
    CUDA Graph advisor bounds launch windows with; ``abtest`` reads the same document saved beside a
    trace as ``TRACE.nvml.json``)."""
    if snap is None:
        return {"state": "unavailable", "process_busy": {}}
    return {"state": snap.state, "process_busy": {
        str(g.index): {str(pid): [list(s) for s in samples] for pid, samples in g.process_busy.items()}
        for g in snap.gpus}}


def anomalies_document(snap: PipelineSnapshot) -> list[dict[str, object]]:
    """GET /api/anomalies: recent anomaly windows, oldest first (Grafana annotations)."""
    return [w.to_json() for w in snap.anomaly_windows]


def migrations_document(snap: PipelineSnapshot, pcie_samples: PcieSamples | None) -> list[dict[str, object]]:
    """GET /api/migrations: each (pid, gpu)'s page-migration windows of the last second, with the
    NVML PCIe throughput sampled inside the same window (CUDA ordinal taken as the NVML index)."""
    out: list[dict[str, object]] = []
    for f in snap.features:
        if not f.migration_windows:
            continue
        samples = pcie_samples(f.dev) if pcie_samples is not None else []
        for w in align_pcie(list(f.migration_windows), samples):
            out.append({"pid": f.pid, "gpu": f.dev, "start": w.start_ns, "end": w.start_ns + w.width_ns,
                        "um_transfers": w.um_transfers, "um_bytes": w.um_bytes, "page_faults": w.page_faults,
                        "copies": w.copies, "copy_bytes": w.copy_bytes, "frequency_hz": w.frequency_hz,
                        "pcie_tx_bytes_per_second": w.pcie_tx_bytes_per_second,
                        "pcie_rx_bytes_per_second": w.pcie_rx_bytes_per_second})
    return out
