"""Where the engines read each input from the snapshot, in one place.

Some inputs come from other stages (the sampler's reuse ratio and allocator
slack, the NVML source's GPU model, memory and utilisation, Kubernetes pod and
namespace). Each is read here, tolerantly: a field that is absent or None means
"unknown", and an engine that needs it gives no advice rather than a guess.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpufootprint.features.reuse import steady_ratio
from gpufootprint.snapshot import DeviceFeatures, DeviceSnapshot, GpuState, PipelineSnapshot, ProcessSnapshot


def gpu_states(snap: PipelineSnapshot) -> dict[int, GpuState]:
    """Every GPU the snapshot knows of: NVML's, plus devices only the probes reported.

    A GPU NVML does not describe takes its model and memory from what the process
    said of it: the probe's HELLO ``devices`` (CUDA's name and total memory) or a
    recorded trace's header ``device``, so a replay is priced as the GPU it ran on.
    """
    out = {g.index: g for g in snap.gpus}
    for proc in snap.processes:
        for dev in proc.devices:
            known = out.get(dev.dev)
            if known is None or (known.model is None and known.total_bytes is None):
                model, total = _described(proc, dev.dev)
                if known is None or model is not None or total is not None:
                    out[dev.dev] = GpuState(index=dev.dev, model=model, total_bytes=total,
                                            utilization_ratio=known.utilization_ratio if known else None)
    return out


def _described(proc: ProcessSnapshot, dev: int) -> tuple[str | None, int | None]:
    devices = proc.info.get("devices")
    if isinstance(devices, list):
        for d in devices:
            if isinstance(d, dict) and d.get("index") == dev:
                name, total = d.get("name"), d.get("total_bytes")
                return (name if isinstance(name, str) and name else None,
                        total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None)
    name = proc.info.get("device")
    return (name if isinstance(name, str) and name else None), None


def model_key(model: str | None, table: Mapping[str, object]) -> str | None:
    """The table key for a GPU model name: exact, else the longest key contained in it (case-insensitive)."""
    if not model:
        return None
    if model in table:
        return model
    low = model.lower()
    hits = [k for k in table if k.lower() in low]
    return max(hits, key=len) if hits else None


def gpu_model(gpu: GpuState, default_model: str | None) -> str | None:
    return gpu.model or default_model


def gpu_total_bytes(gpu: GpuState, memory_table: Mapping[str, int], default_model: str | None) -> int | None:
    if gpu.total_bytes:
        return gpu.total_bytes
    key = model_key(gpu_model(gpu, default_model), memory_table)
    return memory_table[key] if key is not None else None


def features_of(snap: PipelineSnapshot) -> dict[tuple[int, int], DeviceFeatures]:
    """The sampler's features by (pid, device)."""
    return {(f.pid, f.dev): f for f in snap.features}


def reuse_ratio(feat: DeviceFeatures | None, since: int | None) -> float | None:
    """Device-allocation reuse from ``since`` on (features.reuse: the one definition ``abtest`` shares)."""
    if feat is None:
        return None
    if feat.reuse_events is None:
        return feat.allocation_reuse_ratio
    if since is None:
        return feat.allocation_reuse_ratio
    return steady_ratio(feat.reuse_events, feat.device_allocations, since)


def allocator_slack_bytes(proc: ProcessSnapshot, dev: DeviceSnapshot, feat: DeviceFeatures | None = None) -> int:
    """PyTorch reserved minus allocated on this device (0 when unknown): the sampler's feature (from
    the probe's heartbeat), else the process's own "torch" info."""
    if feat is not None and feat.allocator_slack_bytes is not None:
        return max(0, int(feat.allocator_slack_bytes))
    torch = proc.info.get("torch")
    if isinstance(torch, dict):
        res, alloc = torch.get("reserved", {}), torch.get("allocated", {})
        if isinstance(res, dict) and isinstance(alloc, dict):
            r, a = res.get(str(dev.dev), res.get(dev.dev)), alloc.get(str(dev.dev), alloc.get(dev.dev))
            if isinstance(r, (int, float)) and isinstance(a, (int, float)):
                return max(0, int(r - a))
    return 0


def pool_headroom_bytes(dev: DeviceSnapshot) -> int:
    """Bytes a stream-ordered pool reserved but no live allocation uses."""
    return max(0, dev.pool_reserved_bytes - dev.pool_used_bytes)


def pod_of(proc: ProcessSnapshot) -> str | None:
    value = proc.info.get("pod")
    return value if isinstance(value, str) and value else None


def namespace_of(proc: ProcessSnapshot) -> str | None:
    value = proc.info.get("namespace")
    return value if isinstance(value, str) and value else None


def live(proc: ProcessSnapshot) -> bool:
    return not proc.exited
