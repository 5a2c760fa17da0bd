"""``gpufootprint abtest``: compare CUDA Graph advisor policies offline on recorded traces.

Each trace is replayed through the daemon's own decoder, session, pipeline and
feature hub (with kernel retention on), so the allocation reuse ratio is the
live daemon's (``features.reuse``); then every policy judges every stream of
every process with the advisor the daemon runs.
A policy file is YAML: either the keys of ``graph_advisor`` at the top level, or
a whole configuration with a ``graph_advisor:`` section.

NVML's per-process utilisation samples, which bound a launch window's mean kernel
duration from below (engines/busy.py), are no part of a probe's trace: the daemon
polls them. A file ``TRACE.nvml.json`` beside a trace (the daemon's ``GET /api/nvml``
document, saved while the workload ran) gives them to the replay; without one the
advisor judges as a daemon without NVML would.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpufootprint.config import Config
from gpufootprint.configload import build_config
from gpufootprint.engines.graph import CAPTURE, GraphDecision, GraphPolicy, advise, compute_stats
from gpufootprint.errors import ConfigError, GpuFootprintError
from gpufootprint.hub import FeatureHub
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file

OFFLINE_RETENTION = 1 << 22  # kernels kept per process when replaying a file


@dataclass(frozen=True)
class NamedPolicy:
    name: str
    path: str
    policy: GraphPolicy


def load_policy(path: str) -> NamedPolicy:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read policy ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a policy must be a mapping, got {type(data).__name__}")
    tree = data if "graph_advisor" in data else {"graph_advisor": data}
    cfg = build_config(tree, str(path))
    return NamedPolicy(p.stem, str(path), GraphPolicy.from_config(cfg.graph_advisor))


def load_busy(trace: str) -> dict[tuple[int, int], tuple[tuple[int, float], ...]]:
    """NVML's per-process utilisation samples saved beside ``trace`` (``TRACE.nvml.json``), by (pid, GPU)."""
    path = Path(trace + ".nvml.json")
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
        # in time order, as the poller keeps them and the advisor's bisections need them
        return {(int(pid), int(gpu)): tuple(sorted((int(ts), float(r)) for ts, r in samples))
                for gpu, per_pid in doc["process_busy"].items() for pid, samples in per_pid.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise GpuFootprintError(f"{path}: not an /api/nvml document ({exc})") from None


def run_abtest(traces: list[str], policies: list[NamedPolicy], config: Config) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for trace in traces:
        if not Path(trace).is_file():
            raise GpuFootprintError(f"{trace}: no such file")
        # The daemon's own hub: the reuse ratio is the live one (features.reuse), read by the advisor
        # over the same steady part as live.
        pipeline = Pipeline(config.footprint, hub=FeatureHub(config.features, config.sampler),
                            kernel_retention=OFFLINE_RETENTION)
        result = replay_file(trace, pipeline, max_frame_bytes=config.daemon.max_frame_bytes)
        problems.extend(result.problems)
        snap = pipeline.snapshot(wall_time=0.0)
        busy = load_busy(trace)
        per_policy: list[tuple[NamedPolicy, tuple[GraphDecision, ...]]] = []
        cache: dict[tuple[float, ...], dict[int, Any]] = {}
        for np_ in policies:
            key = np_.policy.stats_key()
            if key not in cache:
                cache[key] = {p.pid: compute_stats(p.recent_kernels, np_.policy) for p in snap.processes
                              if p.recent_kernels is not None}
            # launch stats: computed inside
            per_policy.append((np_, advise(snap, np_.policy, stats=cache[key], busy=busy)))
        index: dict[tuple[int, int | None, int | None], dict[str, Any]] = {}
        for np_, decisions in per_policy:
            for d in decisions:
                row = index.get((d.pid, d.dev, d.stream))
                if row is None:
                    row = {"trace": trace, "pid": d.pid, "dev": d.dev, "stream": d.stream, "evidence": d.evidence,
                           "kernels": d.kernels,
                           "graph_kernels": d.graph_kernels, "op_count": d.op_count, "steps": d.steps,
                           "mean_kernel_ms": None if d.mean_kernel_seconds is None else d.mean_kernel_seconds * 1e3,
                           "mean_kernel_ms_max": (None if d.mean_kernel_seconds_max is None
                                                  else d.mean_kernel_seconds_max * 1e3),
                           "mean_kernel_ms_min": (None if d.mean_kernel_seconds_min is None
                                                  else d.mean_kernel_seconds_min * 1e3),
                           "gpu_busy_ratio": d.gpu_busy_ratio,
                           "reuse_ratio": d.reuse_ratio, "gap_share": d.gap_share,
                           "step_ms": None if d.step_seconds is None else d.step_seconds * 1e3, "policies": {}}
                    index[(d.pid, d.dev, d.stream)] = row
                    rows.append(row)
                save = d.launch_overhead_seconds if d.decision == CAPTURE and d.launch_overhead_seconds else 0.0
                row["policies"][np_.name] = {
                    "decision": d.decision, "saved_us_per_step": save * 1e6,
                    "saved_share_of_step": (save / d.step_seconds) if d.step_seconds else 0.0,
                    "reasons": list(d.reasons)}
    summary = {}
    for np_ in policies:
        chosen = [r["policies"][np_.name] for r in rows if np_.name in r["policies"]]
        summary[np_.name] = {"capture": sum(c["decision"] == CAPTURE for c in chosen),
                             "saved_us_per_step": sum(c["saved_us_per_step"] for c in chosen)}
    return {"policies": [{"name": p.name, "file": p.path, **dataclasses.asdict(p.policy)} for p in policies],
            "rows": rows, "summary": summary, "problems": problems}


def render_table(report: dict[str, Any]) -> str:
    names = [p["name"] for p in report["policies"]]
    head = ["trace", "pid", "stream", "kernels", "ops/step", "mean ms", "reuse", "gaps"]
    for n in names:
        head += [f"{n}", f"{n} saved us/step"]
    lines = [head]

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for r in report["rows"]:
        line = [Path(r["trace"]).name, str(r["pid"]), "-" if r["stream"] is None else str(r["stream"]),
                str(r["kernels"]), fmt(r["op_count"], "d"),
                fmt(r["mean_kernel_ms"], ".3f") if r["mean_kernel_ms_max"] is None else f"<={r['mean_kernel_ms_max']:.3f}",
                fmt(r["reuse_ratio"], ".2f"), fmt(r["gap_share"], ".1%")]
        for n in names:
            c = r["policies"].get(n, {})
            line += [c.get("decision", "-"), f"{c.get('saved_us_per_step', 0.0):.1f}"]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
    for n in names:
        s = report["summary"][n]
        out.append(f"policy {n}: {s['capture']} stream(s) to capture, {s['saved_us_per_step']:.1f} us "
                   f"of launch gaps saved per step in total")
    return "\n".join(out)
