"""The CUDA Graph advisor from launch windows: steps between waits, bounds on the mean kernel duration."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from engine_support import dev, proc, snap, with_busy
from gpufootprint.engines.graph import GraphPolicy, advise
from gpufootprint.engines.launches import WINDOW_GAP_NS, launch_stats
from gpufootprint.records import API_DTYPE, KERNEL_DTYPE, ApiRole

DEFAULT = GraphPolicy()
US = 1_000
L, S, G = ApiRole.LAUNCH, ApiRole.SYNC, ApiRole.GRAPH_LAUNCH


def calls(spec: list[tuple[int, int, int]], *, tid: int = 1, t0: int = 10**12) -> np.ndarray:
    """API records from (role, start offset ns, duration ns)."""
    out = np.zeros(len(spec), API_DTYPE)
    for i, (role, off, dur) in enumerate(spec):
        out[i]["start"], out[i]["end"], out[i]["role"], out[i]["tid"] = t0 + off, t0 + off + dur, role, tid
        out[i]["domain"], out[i]["pid"] = 5, 1
    return out


def loop(steps: int, launches: int, *, launch_ns: int = 5 * US, wait_ns: int = 20 * US, host_ns: int = 100 * US,
         t0: int = 10**12, extra_sync: bool = False) -> np.ndarray:
    """A training loop: host work, ``launches`` launches back to back, a wait (optionally two in a row)."""
    spec: list[tuple[int, int, int]] = [(S, 0, 1 * US)]
    t = 1 * US
    for _ in range(steps):
        t += host_ns
        for _ in range(launches):
            spec.append((L, t, launch_ns))
            t += launch_ns
        if extra_sync:  # loss.item(): a synchronous copy, then a synchronize with nothing left to wait for
            spec.append((S, t, wait_ns))
            t += wait_ns
            spec.append((S, t, 1 * US))
            t += 1 * US
        else:
            spec.append((S, t, wait_ns))
            t += wait_ns
    return calls(spec, t0=t0)


def one(decisions):  # type: ignore[no-untyped-def]
    assert len(decisions) == 1, decisions
    return decisions[0]


def test_a_launch_bound_loop_is_judged_from_its_steps_between_waits() -> None:
    st = launch_stats(loop(20, 100))
    assert st is not None and st.period == 100 and st.steps == 20 and st.match_ratio == 1.0
    # every kernel ran between the step's first launch and the end of its wait: 500 + 20 us over 100
    assert abs(st.kernel_seconds_max - 5.2e-6) < 1e-9
    assert abs(st.step_seconds - 620e-6) < 1e-9 and abs(st.wait_seconds - 20e-6) < 1e-9
    assert abs(st.launch_seconds - 500e-6) < 1e-9
    # THEN under the default policy (mean kernel at least 0.5 ms) the interval decides: keep
    d = one(advise(snap(1.0, proc(1, dev(0, 1), recent_kernels=np.zeros(0, KERNEL_DTYPE),
                                  recent_launches=loop(20, 100))), DEFAULT, reuse={(1, 0): 1.0}))
    assert (d.decision, d.evidence, d.op_count, d.stream) == ("keep", "launches", 100, None)
    assert "fail: mean kernel duration at most 0.005 ms (kernels one at a time) < 0.5 ms" in d.reasons
    # AND a launch-bound policy (at most 0.05 ms) captures it
    lb = GraphPolicy(min_mean_kernel_ms=0.0, max_mean_kernel_ms=0.05)
    d = one(advise(snap(1.0, proc(1, dev(0, 1), recent_kernels=np.zeros(0, KERNEL_DTYPE),
                                  recent_launches=loop(20, 100))), lb, reuse={(1, 0): 1.0}))
    assert d.decision == "capture", d.reasons


def test_a_gpu_bound_loop_is_unknown_not_guessed() -> None:
    # 10 launches, then the host waits 50 ms: the kernels took at most 5 ms each; nothing says at least
    api = loop(5, 10, wait_ns=50_000 * US)
    st = launch_stats(api)
    assert st is not None and st.period == 10 and 5e-3 <= st.kernel_seconds_max <= 5.01e-3
    # so "at least 0.5 ms" (the seed's policies) is unknown, not passed ...
    d = one(advise(snap(1.0, proc(1, recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=api)),
                   GraphPolicy(min_op_count=8), reuse={(1, 0): 1.0}))
    assert d.decision == "insufficient_data"
    assert any(r.startswith("unknown: mean kernel duration at most 5.00") for r in d.reasons), d.reasons
    # ... and "at most 0.05 ms" (launch_bound) fails outright? No: at most 5 ms says nothing about 0.05
    d = one(advise(snap(1.0, proc(1, recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=api)),
                   GraphPolicy(min_op_count=8, min_mean_kernel_ms=0.0, max_mean_kernel_ms=0.05), reuse={(1, 0): 1.0}))
    assert d.decision == "insufficient_data", d.reasons


def test_host_work_between_two_waits_and_a_copys_transfer_are_never_read_as_kernel_time() -> None:
    # each step: 100 launches of tiny kernels, a synchronize, 20 ms of host work (data loading), then a
    # 10 ms synchronous copy: under a launch-bound policy (at most 0.05 ms) this loop is launch bound
    spec: list[tuple[int, int, int]] = [(S, 0, US)]
    t = US
    for _ in range(10):
        for _ in range(100):
            spec.append((L, t, 5 * US))
            t += 5 * US
        spec.append((S, t, 20 * US))
        t += 20 * US + 20_000 * US
        spec.append((S, t, 10_000 * US))  # cudaMemcpy: its transfer is no kernel's time
        t += 10_000 * US
    api = calls(spec)
    st = launch_stats(api)
    assert st is not None and st.period == 100
    lb = GraphPolicy(min_mean_kernel_ms=0.0, max_mean_kernel_ms=0.05)
    d = one(advise(snap(1.0, proc(1, recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=api)), lb,
                   reuse={(1, 0): 1.0}))
    assert d.decision == "capture", d.reasons  # before: "keep" (the waits' 30 ms read as kernel time)


def test_a_step_that_also_replays_a_graph_gives_no_bound() -> None:
    # 20 launches and a graph replay per step (the graph's kernels are uncounted): no upper bound
    spec: list[tuple[int, int, int]] = [(S, 0, US)]
    t = US
    for _ in range(10):
        for _ in range(20):
            spec.append((L, t, 5 * US))
            t += 5 * US
        spec.append((G, t, 10 * US))
        t += 10 * US
        spec.append((S, t, 5_000 * US))
        t += 5_000 * US
    st = launch_stats(calls(spec))
    assert st is not None and st.period == 20 and st.kernel_seconds_max is None
    d = one(advise(snap(1.0, proc(1, recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=calls(spec))),
                   DEFAULT, reuse={(1, 0): 1.0}))
    assert d.decision == "insufficient_data" and any("replayed a graph" in r for r in d.reasons), d.reasons


def test_a_wait_longer_than_the_window_gap_does_not_split_a_window() -> None:
    # 5 steps of 10 launches and a 600 ms wait (a kernel window of seconds on a slow model)
    api = loop(5, 10, wait_ns=600_000 * US)
    st = launch_stats(api)
    assert st is not None and st.windows == 1 and st.period == 10 and st.steps == 5


def test_the_work_of_a_tick_is_bounded_whatever_a_probe_sends() -> None:
    import time

    # every record its own window, and launch/wait alternating: the patterns that cost most by call
    n = 65_536
    spread = calls([(L if i % 2 else S, i * 10**9, 10) for i in range(n)])
    alternating = calls([(L if i % 2 else S, i * 100, 10) for i in range(n)])
    for api in (spread, alternating):
        t0 = time.perf_counter()
        launch_stats(api)
        assert time.perf_counter() - t0 < 0.5  # was 0.78 s and 0.23 s with a Python loop per wait


def test_waits_in_a_row_are_one_wait_and_windows_pool_their_steps() -> None:
    # loss.item() then a synchronize: one wait; two windows 30 s apart, 2 steps each (fewer than the 3
    # needed in one window), pooled
    a = loop(2, 50, extra_sync=True)
    b = loop(2, 50, extra_sync=True, t0=10**12 + 30 * 10**9)
    api = np.concatenate([a, b])
    st = launch_stats(api)
    assert st is not None and (st.period, st.steps, st.windows) == (50, 4, 2)
    assert st.waits == 6  # 3 per window: the first one and one per step
    assert launch_stats(a) is not None and launch_stats(a).period is None  # 2 steps alone: not enough
    assert 30 * 10**9 > WINDOW_GAP_NS


def test_no_wait_no_step_graph_launches_are_already_captured_and_the_busiest_thread_speaks() -> None:
    # launches only, never a wait: no step to read
    nowait = calls([(L, i * 10 * US, 5 * US) for i in range(500)])
    d = one(advise(snap(1.0, proc(1, recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=nowait)), DEFAULT))
    assert d.decision == "insufficient_data" and "no step repeats" in d.reasons[0]
    # a step that replays a graph and launches one kernel: already captured
    spec: list[tuple[int, int, int]] = [(S, 0, US)]
    for i in range(10):
        spec += [(G, 100 * US * (i + 1), 10 * US), (L, 100 * US * (i + 1) + 20 * US, 5 * US),
                 (S, 100 * US * (i + 1) + 40 * US, 30 * US)]
    d = one(advise(snap(1.0, proc(1, recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=calls(spec))),
                   DEFAULT))
    assert d.decision == "already_captured", d.reasons
    # a data-loader thread's few launches do not speak for the training loop's thread
    both = np.concatenate([loop(20, 100), calls([(L, i * US, US) for i in range(30)], tid=2)])
    st = launch_stats(both)
    assert st is not None and st.tid == 1 and st.period == 100


def test_kernel_records_decide_where_there_are_any() -> None:
    kern = np.zeros(40, KERNEL_DTYPE)
    kern["start"] = 10**12 + np.arange(40) * 10 * US
    kern["end"] = kern["start"] + 2 * US
    kern["name_id"] = np.arange(40) % 10
    kern["stream"] = 7
    d = advise(snap(1.0, proc(1, recent_kernels=kern, recent_launches=loop(20, 100))), DEFAULT, reuse={(1, 0): 1.0})
    assert [x.evidence for x in d] == ["kernels"] and d[0].op_count == 10


def test_a_wait_that_spans_a_watermark_is_kept_and_not_counted_late() -> None:
    from gpufootprint.config import FootprintConfig
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.records import RecordKind

    pipeline = Pipeline(FootprintConfig(), kernel_retention=1000)
    pipeline.process(1, "probe")
    pipeline.advance(1, 10**12 + 10**9)  # the watermark is past the calls below
    api = loop(5, 10)
    pipeline.submit(RecordKind.API, api)
    (proc,) = pipeline.snapshot().processes
    assert pipeline.late_records == 0 and proc.late_records == 0
    assert proc.recent_launches is not None and len(proc.recent_launches) == len(api)


def test_a_loop_whose_backward_launches_on_another_thread_is_read_from_all_threads() -> None:
    # GIVEN PyTorch's shape of a training step: the main thread launches the forward (40) and the
    # optimizer (20) and waits; autograd's device thread launches the backward (80) in between, and
    # never waits. The busiest launching thread alone has no wait, hence no step.
    spec_main: list[tuple[int, int, int]] = [(S, 0, 1 * US)]
    spec_bwd: list[tuple[int, int, int]] = []
    t = 1 * US
    for _ in range(6):
        t += 100 * US
        for _ in range(40):
            spec_main.append((L, t, 5 * US))
            t += 5 * US
        for _ in range(80):
            spec_bwd.append((L, t, 5 * US))
            t += 5 * US
        for _ in range(20):
            spec_main.append((L, t, 5 * US))
            t += 5 * US
        spec_main.append((S, t, 50 * US))
        t += 50 * US
    api = np.concatenate([calls(spec_main, tid=1), calls(spec_bwd, tid=2)])
    st = launch_stats(api)
    # THEN the step is every thread's launches between the main thread's waits
    assert st is not None and st.period == 140 and st.steps == 6, st
    assert st.tid == 2  # the busiest thread is still named
    # AND a loop whose busiest thread waits itself is read from that thread alone, as before
    both = np.concatenate([loop(20, 100), calls([(L, i * US, US) for i in range(30)], tid=2)])
    st2 = launch_stats(both)
    assert st2 is not None and st2.tid == 1 and st2.period == 100


def test_warm_up_steps_at_a_windows_start_are_dropped_and_the_steady_steps_decide() -> None:
    # GIVEN one window whose first two steps launch other counts (lazy init, autotuning), then 4 alike
    spec: list[tuple[int, int, int]] = [(S, 0, 1 * US)]
    t = 1 * US
    for n in (37, 55, 10, 10, 10, 10):
        t += 100 * US
        for _ in range(n):
            spec.append((L, t, 5 * US))
            t += 5 * US
        spec.append((S, t, 200 * US))
        t += 200 * US
    st = launch_stats(calls(spec))
    # THEN the four steady steps are read (without dropping, 4 of 6 agree: below min_match)
    assert st is not None and st.period == 10 and st.steps == 4 and st.match_ratio == 1.0, st
    assert len(st.spans) == 1 and st.spans[0][1] - st.spans[0][0] == pytest.approx(4 * 350 * US, abs=2 * US)


def test_nvml_busy_time_over_the_steps_lets_a_long_kernel_loop_pass_the_minimum() -> None:
    from gpufootprint.engines.busy import busy_over

    # GIVEN 10 launches per 266 ms step (the host waits for the GPU)
    api = loop(5, 10, wait_ns=265_000 * US)
    st = launch_stats(api)
    assert st is not None and st.period == 10
    s0, e0 = st.spans[0]
    samples = ((s0 + 100_000 * US, 0.99), (s0 + 300_000 * US, 1.0), (e0 + 400_000 * US, 0.98),
               (e0 + 900_000 * US, 0.0))  # the last is after the window and its slack: not counted
    b = busy_over(samples, st.spans)
    assert b is not None and b.samples == 3 and b.ratio == pytest.approx(0.99)
    p = proc(1, dev(0, 1), recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=api)
    d = one(advise(snap(1.0, p), DEFAULT, reuse={(1, 0): 1.0}, busy={(1, 0): samples}))
    # THEN the mean kernel lies in [(0.99 - 0.2) * step / 10, step / 10]: about 21 to 26.6 ms, and capture
    assert d.decision == "capture", d.reasons
    assert d.mean_kernel_seconds_min == pytest.approx(0.79 * d.step_seconds / 10, rel=1e-6)
    assert d.mean_kernel_seconds_min <= d.mean_kernel_seconds_max
    assert d.gpu_busy_ratio == pytest.approx(0.99) and d.busy_samples == 3
    # AND with no sample near the steps, or the bound turned off, the minimum stays unknown
    far = ((e0 + 10**10, 1.0),)
    assert one(advise(snap(1.0, p), DEFAULT, reuse={(1, 0): 1.0}, busy={(1, 0): far})).decision == "insufficient_data"
    off = GraphPolicy(gpu_busy=False)
    assert one(advise(snap(1.0, p), off, reuse={(1, 0): 1.0}, busy={(1, 0): samples})).decision == "insufficient_data"
    # AND a busy share so low the bound falls under the minimum decides nothing either (an interval across it)
    low = tuple((ts, 0.2) for ts, _ in samples)
    d_low = one(advise(snap(1.0, p), DEFAULT, reuse={(1, 0): 1.0}, busy={(1, 0): low}))
    assert d_low.decision == "insufficient_data" and d_low.mean_kernel_seconds_min == pytest.approx(0.0, abs=1e-12)


def test_a_lower_bound_above_the_policys_maximum_fails_it() -> None:
    api = loop(5, 10, wait_ns=265_000 * US)
    st = launch_stats(api)
    assert st is not None
    samples = ((st.spans[0][0] + 100_000 * US, 1.0),)
    p = proc(1, dev(0, 1), recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=api)
    launch_bound_only = GraphPolicy(min_mean_kernel_ms=0.0, max_mean_kernel_ms=0.05)
    d = one(advise(snap(1.0, p), launch_bound_only, reuse={(1, 0): 1.0}, busy={(1, 0): samples}))
    assert d.decision == "keep" and any(r.startswith("fail: mean kernel duration at least") for r in d.reasons)


def test_a_launch_windows_busy_bound_holds_after_nvmls_samples_of_it_are_dropped() -> None:
    from gpufootprint.config import Config, GraphAdvisorConfig
    from gpufootprint.engines.runner import Engines
    from gpufootprint.nvml.poller import BUSY_SAMPLES

    # GIVEN a process judged from one launch window of 266 ms steps, NVML's samples over them 99 % busy
    eng = Engines(Config(graph_advisor=GraphAdvisorConfig(allow_unknown_reuse=True)))
    api = loop(5, 10, wait_ns=265_000 * US)
    st = launch_stats(api)
    assert st is not None
    s0, e0 = st.spans[0]
    near = [(s0 + 100_000 * US, 0.99), (s0 + 300_000 * US, 1.0)]
    p = proc(1, dev(0, 1), recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=api)
    (first,) = eng.step(with_busy(snap(1.0, p), {1: near})).graph
    assert first.decision == "capture", first.reasons
    # WHEN its next window is minutes away (the sampler backs windows off up to 600 s apart) and the poller,
    # which keeps BUSY_SAMPLES samples a process (about three minutes), has dropped those of the window
    later = [(e0 + 10**9 + i * 166_667 * US, 0.99) for i in range(BUSY_SAMPLES)]
    (second,) = eng.step(with_busy(snap(300.0, p), {1: later})).graph
    # THEN the window's bound, and the verdict, stand until the next window says otherwise
    assert second.decision == "capture", second.reasons
    assert second.mean_kernel_seconds_min == pytest.approx(first.mean_kernel_seconds_min)


def test_the_busy_samples_kept_near_windows_are_those_a_scan_of_every_sample_keeps() -> None:
    # The engines keep NVML's samples near a launch window's steps by bisecting the time-ordered samples (they
    # run at every snapshot for every process); held here to the plain rule, a scan of every sample against
    # every span, tick after tick, on random windows and a poller that keeps only its newest samples
    import random
    from types import SimpleNamespace

    from gpufootprint.config import Config
    from gpufootprint.engines.busy import SLACK_NS, busy_over
    from gpufootprint.engines.runner import Engines

    def scan(kept_before: set[tuple[int, float]], current: tuple[tuple[int, float], ...],
             spans: tuple[tuple[int, int], ...]) -> tuple[set[tuple[int, float]], tuple[tuple[int, float], ...]]:
        kept = {r for r in kept_before | set(current) if any(s <= r[0] <= e + SLACK_NS for s, e in spans)}
        return kept, tuple(sorted(set(current) | kept)) if kept else current

    rng = random.Random(7)
    for trial in range(40):
        eng = Engines(Config())
        spans = tuple(sorted((s, s + rng.randrange(1, 3 * 10**9))
                             for s in rng.sample(range(0, 600 * 10**9, 10**8), rng.randrange(1, 6))))
        stats = SimpleNamespace(dev=0, spans=spans)  # what the engines read of a LaunchStats
        times = sorted(rng.sample(range(0, 700 * 10**9, 10**7), 400))
        samples = tuple((t, rng.random()) for t in times)
        kept: set[tuple[int, float]] = set()
        for tick in range(0, 400, rng.randrange(20, 90)):
            current = samples[max(0, tick - 120):tick]  # the poller's newest 120 samples
            kept, want = scan(kept, current, spans)
            node = with_busy(snap(1.0), {1: current})
            # twice on the same snapshot: the second step finds the same samples and spans and reuses the first's
            for _ in range(2):
                got, estimates = eng._busy_for(node, {1: stats})  # type: ignore[dict-item]
                assert got.get((1, 0), ()) == want, (trial, tick)
                assert estimates.get((1, 0)) == busy_over(want, spans), (trial, tick)


def test_busy_over_counts_what_a_scan_of_every_sample_against_every_span_counts() -> None:
    # busy_over bisects the time-ordered samples per span (the advisor asks it at every snapshot for every
    # process judged from launch windows); held to the plain rule on random samples and overlapping spans
    import random

    from gpufootprint.engines.busy import SLACK_NS, busy_over

    rng = random.Random(11)
    for _ in range(300):
        times = sorted(rng.sample(range(0, 100 * 10**9, 10**6), rng.randrange(0, 200)))
        samples = tuple((t, rng.random()) for t in times)
        # up to 12 spans of up to 20 s in 100 s: overlapping, nested, and apart
        spans = [(s, s + rng.randrange(0, 20 * 10**9)) for s in rng.sample(range(0, 100 * 10**9, 10**8),
                                                                         rng.randrange(1, 13))]
        chosen = [r for ts, r in samples if any(s <= ts <= e + SLACK_NS for s, e in spans)]
        got = busy_over(samples, spans)
        if not chosen:
            assert got is None
        else:
            assert got is not None and got.samples == len(chosen)
            assert got.ratio == sum(chosen) / len(chosen)


def test_abtest_reads_saved_busy_samples_in_time_order(tmp_path: Any) -> None:
    # an /api/nvml document edited or merged by hand may list samples in any order; the advisor's bisections
    # need them in time order
    import json

    from gpufootprint.abtest import load_busy

    trace = tmp_path / "t.gfp"
    (tmp_path / "t.gfp.nvml.json").write_text(json.dumps(
        {"state": "ok", "process_busy": {"0": {"7": [[300, 0.3], [100, 0.1], [200, 0.2]]}}}))
    assert load_busy(str(trace)) == {(7, 0): ((100, 0.1), (200, 0.2), (300, 0.3))}


def test_a_step_reuses_what_it_worked_out_only_while_the_samples_and_spans_are_the_same_objects() -> None:
    # NVML's poller replaces a process's samples when it polls; between polls the engines' step finds the same
    # tuple and reuses its work. Held to a fresh computation, step after step: the same samples object again, a
    # new object with one more sample (the poll), new spans (a new window), and a poller that forgot old ones.
    from types import SimpleNamespace

    from gpufootprint.config import Config
    from gpufootprint.engines.busy import busy_over
    from gpufootprint.engines.runner import Engines

    spans = ((10 * 10**9, 11 * 10**9),)
    stats = SimpleNamespace(dev=0, spans=spans)
    base = tuple((t * 10**8, 0.25 + t / 1000) for t in range(95, 125))  # samples around the window
    eng = Engines(Config())
    fresh_near: tuple[tuple[int, float], ...] = ()
    wider = spans + ((12 * 10**9, 12 * 10**9 + 5 * 10**8),)
    polled = base + ((13 * 10**9, 0.9),)
    # (samples, spans): the same two objects again; the same samples with a new window's spans; a poll;
    # a poller that forgot the oldest 20
    sequence = [(base, spans), (base, spans), (base, wider), (polled, wider), (polled[20:], wider)]
    for i, (current, these) in enumerate(sequence):
        if stats.spans is not these:
            stats = SimpleNamespace(dev=0, spans=these)
        got, estimates = eng._busy_for(with_busy(snap(1.0), {1: current}), {1: stats})  # type: ignore[dict-item]
        other = Engines(Config())
        other._busy_near = {(1, 0): fresh_near} if fresh_near else {}
        want, want_est = other._busy_for(with_busy(snap(1.0), {1: current}), {1: stats})  # type: ignore[dict-item]
        assert got == want and estimates == want_est, i
        assert estimates[(1, 0)] == busy_over(got[(1, 0)], stats.spans)
        fresh_near = other._busy_near.get((1, 0), ())
    # the window's samples the poller forgot are still read (kept near the window)
    assert got[(1, 0)][0] == base[5]  # 10.0 s, the window's first, no longer in what the poller holds
