"""GET /api/processes: one JSON document with what ``gpufootprint top`` shows.

Built from the current snapshot and the engines' latest outputs at request time
(pure: no state here). Per GPU: NVML's used/total where NVML runs, and the probed
bytes on it. Per (process, GPU): pid, pod, command, device bytes, window peak,
bytes by kind, allocator slack, sampler mode, CUDA Graph verdict, leak flag, OOM
events.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpufootprint.engines.runner import EngineOutputs
from gpufootprint.snapshot import PipelineSnapshot

PodOf = Callable[[int], dict[str, str]]


def _command(info: Mapping[str, Any]) -> str | None:
    argv = info.get("argv")
    if isinstance(argv, list) and argv:
        return " ".join(str(a) for a in argv)[:200]
    for key in ("cmd", "scenario", "exe"):
        if isinstance(info.get(key), str):
            return str(info[key])[:200]
    return None


def processes_document(snap: PipelineSnapshot, engines: EngineOutputs, *,
                       oom_counts: Mapping[tuple[int, int, str], int] | None = None,
                       pod_of: PodOf | None = None) -> dict[str, Any]:
    features = {(f.pid, f.dev): f for f in snap.features}
    sampler = {s.pid: s for s in snap.sampler}
    leaks = {(lk.pid, lk.dev): lk for lk in engines.leaks}
    graph: dict[int, list[str]] = {}
    for d in engines.graph:
        graph.setdefault(d.pid, []).append(d.decision)
    ooms: dict[tuple[int, int], int] = {}
    for (pid, gpu, _source), n in (oom_counts or {}).items():
        ooms[(pid, gpu)] = ooms.get((pid, gpu), 0) + n
    rows: list[dict[str, Any]] = []
    probed: dict[int, int] = {}
    for proc in snap.processes:
        pod: dict[str, str] = {}
        if pod_of is not None:
            try:
                pod = {k: v for k, v in pod_of(proc.pid).items() if v}
            except Exception:  # noqa: BLE001 - attribution is best effort here
                pod = {}
        s = sampler.get(proc.pid)
        verdicts = graph.get(proc.pid, [])
        for dev in proc.devices:
            f = features.get((proc.pid, dev.dev))
            leak = leaks.get((proc.pid, dev.dev))
            if not proc.exited:
                probed[dev.dev] = probed.get(dev.dev, 0) + dev.device_bytes
            rows.append({
                "pid": proc.pid, "gpu": dev.dev, "source": proc.source, "exited": proc.exited,
                "command": _command(proc.info), "pod": pod.get("pod"), "namespace": pod.get("namespace"),
                "device_bytes": dev.device_bytes, "window_peak_bytes": dev.window_peak_bytes,
                "live_bytes": dict(dev.live_bytes), "live_allocations": dev.live_allocations,
                "pool_reserved_bytes": dev.pool_reserved_bytes,
                "allocator_slack_bytes": f.allocator_slack_bytes if f is not None else None,
                "sampler_mode": s.mode if s is not None else None,
                "sampler_interval_s": s.interval_s if s is not None else None,
                "graph_verdict": _verdict(verdicts),
                "leak_suspect": bool(leak.suspect) if leak is not None else None,
                "oom_events": ooms.get((proc.pid, dev.dev), 0),
            })
    gpus: list[dict[str, Any]] = []
    if snap.nvml is not None and snap.nvml.gpus:
        for g in snap.nvml.gpus:
            gpus.append({"gpu": g.index, "model": g.model, "state": g.state, "used_bytes": g.memory_used_bytes,
                         "total_bytes": g.memory_total_bytes, "probed_bytes": probed.get(g.index, 0)})
    else:
        known = {g.index: g for g in snap.gpus}
        for index in sorted(set(probed) | set(known)):
            gs = known.get(index)
            gpus.append({"gpu": index, "model": gs.model if gs else None, "state": None, "used_bytes": None,
                         "total_bytes": gs.total_bytes if gs else None, "probed_bytes": probed.get(index, 0)})
    return {"taken_at": snap.taken_at, "window_peak_seconds": snap.window_peak_seconds,
            "gpus": gpus, "processes": rows}


def _verdict(decisions: list[str]) -> str | None:
    """One word per process: the most telling decision over its streams."""
    for word in ("capture", "already_captured", "keep", "insufficient_data"):
        if word in decisions:
            return word
    return decisions[0] if decisions else None
