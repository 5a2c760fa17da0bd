"""CUDA Graph advisor: which streams would gain from graph capture, and why.

Per process and stream, from the retained kernel window: kernels per repeated
step (the period of the kernel-name sequence), mean kernel duration, the
allocation reuse ratio (a graph replays fixed addresses) and the share of the
step the stream sat idle between kernels. The policy (op count, duration and
reuse, each with a lower and an optional upper bound) decides; every decision
lists each check with its value.

A process with no kernel records is judged from its launch windows instead (host-side
launch and wait calls, engines/launches.py: the default, since windows of kernel records
leave a lasting slowdown): one decision for the process (``stream`` None,
``evidence="launches"``), its op count the launches per step and its mean kernel
duration known only to be at most a bound (kernels one at a time) and, where NVML
sampled the process's GPU busy time over the window's steps (engines/busy.py), at
least that busy time over the launches, less ``busy_error``: with that lower bound a
policy's minimum can pass; without it, it can only fail.

Decisions: ``capture`` (every check passes), ``keep`` (a check fails),
``already_captured`` (the stream's kernels are replayed from a graph: graph id
!= 0), ``insufficient_data`` (no kernels, no repeating step, or an unknown
input the policy needs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpufootprint.config import GraphAdvisorConfig
from gpufootprint.engines import inputs
from gpufootprint.engines.busy import BusyEstimate, busy_over, kernel_seconds_min
from gpufootprint.engines.kernels import StreamKernelStats, stream_stats
from gpufootprint.engines.launches import LaunchStats, launch_stats
from gpufootprint.snapshot import PipelineSnapshot

CAPTURE, KEEP, ALREADY, INSUFFICIENT = "capture", "keep", "already_captured", "insufficient_data"
DECISIONS = (CAPTURE, KEEP, ALREADY, INSUFFICIENT)
NO_RECORDS_YET = "no kernel or launch records seen yet (both are sampled in windows: sampler.kernel_window_ms)"


@dataclass(frozen=True, slots=True)
class GraphPolicy:
    min_op_count: int = 8
    min_mean_kernel_ms: float = 0.5
    min_reuse: float = 0.7
    max_op_count: int | None = None
    max_mean_kernel_ms: float | None = None
    max_reuse: float | None = None
    allow_unknown_reuse: bool = False
    captured_share: float = 0.5
    min_steps: int = 3
    min_match: float = 0.9
    max_period: int = 4096
    analysis_kernels: int = 16384
    host_gap_ms: float = 1.0
    graph_gap_us: float = 2.0
    gpu_busy: bool = True
    busy_error: float = 0.2

    @classmethod
    def from_config(cls, cfg: GraphAdvisorConfig) -> GraphPolicy:
        return cls(**{f: getattr(cfg, f) for f in cls.__dataclass_fields__})

    def stats_key(self) -> tuple[float, ...]:
        """The fields that change the kernel statistics (not the verdict)."""
        return (self.min_steps, self.min_match, self.max_period, self.analysis_kernels, self.host_gap_ms,
                self.graph_gap_us)


@dataclass(frozen=True, slots=True)
class GraphDecision:
    pid: int
    source: str
    dev: int | None
    stream: int | None  # None: the process had no kernel records at all
    decision: str
    reasons: tuple[str, ...]
    kernels: int = 0
    graph_kernels: int = 0
    op_count: int | None = None
    steps: int = 0
    mean_kernel_seconds: float | None = None
    reuse_ratio: float | None = None
    step_seconds: float | None = None
    gap_share: float | None = None
    launch_overhead_seconds: float | None = None  # per step, what capture would save
    exited: bool = False
    # "kernels": from kernel records (a kernel window, or kernels always on); "launches": from a launch
    # window's host-side calls (engines/launches.py), which bound the mean kernel duration instead
    evidence: str = "kernels"
    thread: int | None = None  # launches: the thread whose steps were read
    mean_kernel_seconds_max: float | None = None  # launches: the mean kernel duration is at most this
    # launches with NVML's busy samples near the window's steps: the mean kernel duration is at least this
    mean_kernel_seconds_min: float | None = None
    gpu_busy_ratio: float | None = None  # the sampled share of the steps' time the process's kernels ran
    busy_samples: int = 0


def compute_stats(kernels: object, policy: GraphPolicy) -> dict[tuple[int, int], StreamKernelStats]:
    assert isinstance(kernels, np.ndarray)
    return stream_stats(kernels, min_match=policy.min_match, min_steps=policy.min_steps,
                        max_period=policy.max_period, analysis_kernels=policy.analysis_kernels,
                        host_gap_ns=int(policy.host_gap_ms * 1e6), graph_gap_ns=int(policy.graph_gap_us * 1e3))


def decide_stream(stats: StreamKernelStats, reuse: float | None, policy: GraphPolicy, *, pid: int,
                  source: str, exited: bool = False) -> GraphDecision:
    """The policy's verdict on one stream's statistics."""
    base = GraphDecision(pid=pid, source=source, dev=stats.dev, stream=stats.stream, decision=INSUFFICIENT,
                         reasons=(), kernels=stats.kernels, graph_kernels=stats.graph_kernels, op_count=stats.period,
                         steps=stats.steps, mean_kernel_seconds=stats.mean_kernel_seconds if stats.kernels else None,
                         reuse_ratio=reuse, step_seconds=stats.step_seconds, gap_share=stats.gap_share,
                         launch_overhead_seconds=stats.saveable_seconds, exited=exited)

    def verdict(decision: str, *reasons: str) -> GraphDecision:
        return dataclasses.replace(base, decision=decision, reasons=reasons)

    untimed = (f"{stats.untimed} kernel record(s) without start or end time left out (CUPTI wrote zero)"
               if stats.untimed else None)
    if stats.kernels == 0:
        return verdict(INSUFFICIENT, untimed or "no kernel records on this stream")
    if stats.graph_kernels and stats.graph_share >= policy.captured_share:
        return verdict(ALREADY, f"{stats.graph_kernels} of {stats.kernels} kernels were replayed from a captured "
                                f"CUDA graph (share {stats.graph_share:.2f} >= {policy.captured_share})")
    if stats.period is None:
        return verdict(INSUFFICIENT, f"no kernel sequence repeats at least {policy.min_steps} times with "
                                     f"{policy.min_match:.0%} of kernels matching (in {stats.kernels} kernels)",
                       *([untimed] if untimed else []))
    reasons: list[str] = []
    failed = unknown = False
    mean_ms = stats.mean_kernel_seconds * 1e3
    checks = [_bounded("op_count", stats.period, "kernels/step", "", "d", policy.min_op_count, policy.max_op_count),
              _bounded("mean kernel duration", mean_ms, "ms", " ms", ".3f", policy.min_mean_kernel_ms,
                       policy.max_mean_kernel_ms)]
    for ok, text in checks:
        reasons.append(("pass: " if ok else "fail: ") + text)
        failed |= not ok
    ok3 = _reuse_check(reuse, policy, reasons)
    failed |= ok3 is False
    unknown |= ok3 is None
    if stats.gap_share is not None and stats.saveable_seconds is not None and stats.step_seconds is not None:
        reasons.append(f"info: launch gaps {stats.gap_share:.1%} of a {stats.step_seconds * 1e3:.3f} ms step; "
                       f"capture would save about {stats.saveable_seconds * 1e6:.1f} us per step")
    if stats.steps_from_gaps:
        reasons.append(f"info: steps read from the idle gaps above {policy.host_gap_ms:g} ms between them "
                       f"({stats.steps} steps of {stats.period} kernels; the kernel names repeat more often)")
    if untimed:
        reasons.append("info: " + untimed)
    return verdict(KEEP if failed else (INSUFFICIENT if unknown else CAPTURE), *reasons)


def decide_launches(st: LaunchStats, reuse: float | None, policy: GraphPolicy, *, pid: int, source: str,
                    exited: bool = False, busy: BusyEstimate | None = None) -> GraphDecision:
    """The policy's verdict from a launch window's calls (engines/launches.py): the op count is the
    launches per step, the mean kernel duration is known to lie in an interval: at most the span of
    the steps' launches and waits over their count, at least NVML's busy time over it (``busy``:
    engines/busy.py) less ``policy.busy_error``."""
    k_min = None
    if busy is not None and st.period and st.step_seconds:
        k_min = kernel_seconds_min(busy, st.step_seconds, st.period, policy.busy_error)
        if st.kernel_seconds_max is not None:
            k_min = min(k_min, st.kernel_seconds_max)  # the host's bound is exact; the estimate is not
    base = GraphDecision(pid=pid, source=source, dev=st.dev, stream=None, decision=INSUFFICIENT, reasons=(),
                         op_count=st.period, steps=st.steps, reuse_ratio=reuse, step_seconds=st.step_seconds,
                         exited=exited, evidence="launches", thread=st.tid, mean_kernel_seconds_max=st.kernel_seconds_max,
                         mean_kernel_seconds_min=k_min, gpu_busy_ratio=busy.ratio if busy is not None else None,
                         busy_samples=busy.samples if busy is not None else 0)

    def verdict(decision: str, *reasons: str) -> GraphDecision:
        return dataclasses.replace(base, decision=decision, reasons=reasons)

    source_text = f"from launch calls on thread {st.tid} ({st.windows} launch window(s))"
    if st.graph_launches and st.graph_share >= policy.captured_share:
        return verdict(ALREADY, f"{st.graph_launches} of {st.launches + st.graph_launches} launch calls replayed a "
                                f"captured CUDA graph (share {st.graph_share:.2f} >= {policy.captured_share}), "
                                f"{source_text}")
    if st.period is None:
        return verdict(INSUFFICIENT, f"no step repeats at least {policy.min_steps} times between waits for the GPU "
                                     f"with {policy.min_match:.0%} of steps alike ({st.launches} launches, "
                                     f"{st.waits} waits) {source_text}; a kernel window "
                                     f"(sampler.kernel_window_records: kernels) reads steps from kernel names")
    reasons = [f"info: {source_text}"]
    failed = unknown = False
    ok, text = _bounded("op_count", st.period, "launches/step", "", "d", policy.min_op_count, policy.max_op_count)
    reasons.append(("pass: " if ok else "fail: ") + text)
    failed |= not ok
    if st.kernel_seconds_max is None:
        ok2: bool | None = None
        text = ("mean kernel duration: every step replayed a graph besides its launches (kernels no launch call "
                "counts); a kernel window (sampler.kernel_window_records: kernels) would time the kernels")
    else:
        ok2, text = _between("mean kernel duration", None if k_min is None else k_min * 1e3,
                             st.kernel_seconds_max * 1e3, policy.min_mean_kernel_ms, policy.max_mean_kernel_ms)
    reasons.append({True: "pass: ", False: "fail: ", None: "unknown: "}[ok2] + text)
    failed |= ok2 is False
    unknown |= ok2 is None
    ok3 = _reuse_check(reuse, policy, reasons)
    failed |= ok3 is False
    unknown |= ok3 is None
    if busy is not None:
        reasons.append(f"info: NVML sampled the process's kernels running {busy.ratio:.0%} of the steps' time "
                       f"({busy.samples} sample(s); taken as at least {max(0.0, busy.ratio - policy.busy_error):.0%}, "
                       f"graph_advisor.busy_error {policy.busy_error})")
    if st.step_seconds and st.launch_seconds is not None and st.wait_seconds is not None:
        reasons.append(f"info: the host launched for {st.launch_seconds / st.step_seconds:.1%} and waited for the GPU "
                       f"{st.wait_seconds / st.step_seconds:.1%} of a {st.step_seconds * 1e3:.3f} ms step "
                       f"({st.steps} steps)")
    return verdict(KEEP if failed else (INSUFFICIENT if unknown else CAPTURE), *reasons)


def _reuse_check(reuse: float | None, policy: GraphPolicy, reasons: list[str]) -> bool | None:
    """The reuse check, its reason appended: True, False, or None (unknown and not allowed)."""
    if reuse is None:
        if policy.allow_unknown_reuse:
            reasons.append("pass: allocation reuse ratio unknown (allowed by policy)")
            return True
        reasons.append("unknown: allocation reuse ratio not available")
        return None
    ok, text = _bounded("allocation reuse", reuse, "", "", ".2f", policy.min_reuse, policy.max_reuse)
    reasons.append(("pass: " if ok else "fail: ") + text)
    return ok


def _between(name: str, lo_v: float | None, hi_v: float, lo: float, hi: float | None) -> tuple[bool | None, str]:
    """A check of a value known only to lie in [``lo_v``, ``hi_v``] (ms; ``lo_v`` None: 0): False when
    the whole interval is outside the policy's bounds, True when it is inside them, None (unknown)
    otherwise."""
    top = "inf" if hi is None else hi
    shown = f"{name} at most {hi_v:.3f} ms (kernels one at a time)"
    if lo_v is not None:
        shown = f"{name} at least {lo_v:.3f} ms (NVML busy time) and at most {hi_v:.3f} ms"
    floor = lo_v if lo_v is not None else 0.0
    if hi_v < lo:
        return False, f"{shown} < {lo} ms"
    if hi is not None and floor > hi:
        return False, f"{shown} > {hi} ms"
    if floor >= lo and (hi is None or hi_v <= hi):
        return True, f"{shown}: within [{lo}, {top}] ms"
    return None, (f"{shown}, not known to be within [{lo}, {top}] ms: a kernel window "
                  f"(sampler.kernel_window_records: kernels) would time the kernels"
                  + ("" if lo_v is not None else ", NVML's per-process utilisation would bound it below"))


def _bounded(name: str, value: float, unit: str, bound_unit: str, spec: str, lo: float,
             hi: float | None) -> tuple[bool, str]:
    """One check against a lower and an optional upper bound, with the text the decision lists."""
    shown = f"{name} {format(value, spec)}" + (f" {unit}" if unit else "")
    if value < lo:
        return False, f"{shown} < {lo}{bound_unit}"
    if hi is not None and value > hi:
        return False, f"{shown} > {hi}{bound_unit}"
    if hi is None:
        return True, f"{shown} >= {lo}{bound_unit}"
    return True, f"{lo}{bound_unit} <= {shown} <= {hi}{bound_unit}"


def reuse_since(kernels: np.ndarray | None) -> int | None:
    """Where the steady part starts for the reuse ratio: the median start of the retained kernels (or
    launch calls)."""
    if kernels is None or len(kernels) == 0:
        return None
    return int(np.median(kernels["start"]))


def busy_samples(snap: PipelineSnapshot) -> dict[tuple[int, int], tuple[tuple[int, float], ...]]:
    """NVML's per-process utilisation samples in the snapshot by (pid, GPU index); the CUDA ordinal
    is taken as the NVML index, as elsewhere in the daemon."""
    if snap.nvml is None:
        return {}
    return {(pid, g.index): samples for g in snap.nvml.gpus for pid, samples in g.process_busy.items()}


def compute_launch_stats(api: object, policy: GraphPolicy) -> LaunchStats | None:
    if api is None:
        return None
    assert isinstance(api, np.ndarray)
    return launch_stats(api, min_match=policy.min_match, min_steps=policy.min_steps)


def advise(snap: PipelineSnapshot, policy: GraphPolicy,
           reuse: Mapping[tuple[int, int], float] | None = None,
           stats: Mapping[int, dict[tuple[int, int], StreamKernelStats]] | None = None,
           since: Mapping[int, int | None] | None = None,
           launches: Mapping[int, LaunchStats | None] | None = None,
           busy: Mapping[tuple[int, int], Sequence[tuple[int, float]]] | None = None,
           launch_since: Mapping[int, int | None] | None = None,
           estimates: Mapping[tuple[int, int], BusyEstimate | None] | None = None) -> tuple[GraphDecision, ...]:
    """Decisions for every process whose kernels (or launch calls) the pipeline retains.

    Kernel records decide where there are any; a process with none is judged from its launch
    windows' calls (``decide_launches``). ``reuse`` overrides the reuse ratio per (pid, dev) (a
    test's what-if); otherwise the sampler's feature is read over the steady part (``reuse_since``),
    the same way live and in ``abtest``. ``stats`` lets a caller pass per-pid statistics it cached
    (they depend only on the kernels), ``since`` the per-pid ``reuse_since`` likewise, ``launches``
    the per-pid launch statistics. ``busy``: NVML's per-process utilisation samples by (pid, GPU)
    (``busy_samples``), which give launch evidence its lower bound; the snapshot's NVML ones by default.
    ``launch_since`` and ``estimates``: per-pid ``reuse_since`` of the launch calls and per (pid, GPU)
    ``busy_over`` estimates a caller cached (they depend only on the launch calls, and on the samples
    and the spans); computed here where absent.
    """
    if busy is None:
        busy = busy_samples(snap)
    out: list[GraphDecision] = []
    feats = inputs.features_of(snap)
    for proc in snap.processes:
        if proc.recent_kernels is None:
            continue  # kernel retention is off: no opinion
        per_stream = stats[proc.pid] if stats is not None and proc.pid in stats else compute_stats(
            proc.recent_kernels, policy)
        if not per_stream:
            ls = launches[proc.pid] if launches is not None and proc.pid in launches else compute_launch_stats(
                proc.recent_launches, policy)
            if ls is not None:
                r = reuse.get((proc.pid, ls.dev)) if reuse is not None else None
                if r is None:
                    start = (launch_since[proc.pid] if launch_since is not None and proc.pid in launch_since
                             else reuse_since(proc.recent_launches))
                    r = inputs.reuse_ratio(feats.get((proc.pid, ls.dev)), start)
                b = None
                if policy.gpu_busy and ls.spans:
                    key = (proc.pid, ls.dev)
                    b = estimates[key] if estimates is not None and key in estimates else busy_over(
                        busy.get(key, ()), ls.spans)
                out.append(decide_launches(ls, r, policy, pid=proc.pid, source=proc.source, exited=proc.exited,
                                           busy=b))
                continue
            out.append(GraphDecision(pid=proc.pid, source=proc.source, dev=None, stream=None,
                                     decision=INSUFFICIENT, exited=proc.exited,
                                     reasons=(NO_RECORDS_YET,)))
            continue
        start = since[proc.pid] if since is not None and proc.pid in since else reuse_since(proc.recent_kernels)
        for (dev, stream), st in sorted(per_stream.items()):
            r = reuse.get((proc.pid, dev)) if reuse is not None else None
            if r is None:
                r = inputs.reuse_ratio(feats.get((proc.pid, dev)), start)
            out.append(decide_stream(st, r, policy, pid=proc.pid, source=proc.source, exited=proc.exited))
    return tuple(out)
