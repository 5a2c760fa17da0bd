from __future__ import annotations

import numpy as np
from engine_support import DATA, dev, proc, replay_snapshots, snap
from gpufootprint.engines.graph import GraphPolicy, advise
from gpufootprint.records import KERNEL_DTYPE

DEFAULT = GraphPolicy()


def steps(n_steps: int, ids: list[int], dur_ns: int, gap_ns: int, *, pid: int = 1, stream: int = 7,
          graph: int = 0) -> np.ndarray:
    recs = np.zeros(n_steps * len(ids), KERNEL_DTYPE)
    t = 1_000_000_000
    for i in range(len(recs)):
        recs[i] = (t, t + dur_ns, 0, pid, 0, stream, i, graph, ids[i % len(ids)])
        t += dur_ns + gap_ns
    recs.flags.writeable = False
    return recs


def one(decisions):  # type: ignore[no-untyped-def]
    assert len(decisions) == 1, decisions
    return decisions[0]


def test_replayed_synthetic_trace_decisions_under_the_default_policy() -> None:
    final = list(replay_snapshots(DATA / "synth_kernels.gfp.gz", kernel_retention=100_000))[-1]
    reuse = {(4242, 0): 0.73, (4343, 0): 0.95, (4444, 0): 0.97}
    got = {(d.pid, d.stream): d for d in advise(final, DEFAULT, reuse=reuse)}
    assert {k: d.decision for k, d in got.items()} == {
        (4242, 7): "capture", (4242, 13): "already_captured", (4343, 7): "keep", (4444, 7): "capture",
        (4545, 21): "insufficient_data"}
    assert got[(4242, 7)].op_count == 10 and got[(4343, 7)].op_count == 101 and got[(4444, 7)].op_count == 16
    # the tiny-kernel stream fails on duration only, and says so
    assert [r.split(":")[0] for r in got[(4343, 7)].reasons[:3]] == ["pass", "fail", "pass"]
    assert "mean kernel duration 0.006 ms < 0.5 ms" in got[(4343, 7)].reasons[1]
    # about 9 launch gaps of ~25 us, less the ~2 us a graph keeps: ~200 us per step
    assert 150e-6 < got[(4242, 7)].launch_overhead_seconds < 250e-6  # type: ignore[operator]
    assert got[(4242, 13)].graph_kernels == got[(4242, 13)].kernels == 640


def test_control_policy_keeps_what_the_treatment_captures() -> None:
    final = list(replay_snapshots(DATA / "synth_kernels.gfp.gz", kernel_retention=100_000))[-1]
    control = GraphPolicy(min_op_count=12, min_mean_kernel_ms=1.0, min_reuse=0.8)
    d = {x.stream: x for x in advise(final, control, reuse={(4242, 0): 0.73}) if x.pid == 4242}
    assert d[7].decision == "keep"
    assert sum(r.startswith("fail") for r in d[7].reasons) == 3  # 10 < 12, 0.67 ms < 1.0, 0.73 < 0.8


def test_thresholds_are_inclusive() -> None:
    s = snap(1.0, proc(1, dev(), recent_kernels=steps(5, list(range(8)), 500_000, 10_000)))
    assert one(advise(s, DEFAULT, reuse={(1, 0): 0.7})).decision == "capture"
    s = snap(1.0, proc(1, dev(), recent_kernels=steps(5, list(range(7)), 500_000, 10_000)))
    assert one(advise(s, DEFAULT, reuse={(1, 0): 0.7})).decision == "keep"


def test_upper_bounds_keep_long_kernels_and_long_steps_out_of_a_launch_bound_policy() -> None:
    launch_bound = GraphPolicy(min_mean_kernel_ms=0.0, max_mean_kernel_ms=0.05, max_op_count=200)
    tiny = snap(1.0, proc(1, dev(), recent_kernels=steps(5, list(range(101)), 5_000, 10_000)))
    d = one(advise(tiny, launch_bound, reuse={(1, 0): 1.0}))
    assert d.decision == "capture"
    assert d.reasons[:2] == ("pass: 8 <= op_count 101 kernels/step <= 200",
                             "pass: 0.0 ms <= mean kernel duration 0.005 ms <= 0.05 ms")
    long = snap(1.0, proc(1, dev(), recent_kernels=steps(5, list(range(10)), 800_000, 10_000)))
    d = one(advise(long, launch_bound, reuse={(1, 0): 1.0}))
    assert d.decision == "keep" and d.reasons[1] == "fail: mean kernel duration 0.800 ms > 0.05 ms"
    wide = snap(1.0, proc(1, dev(), recent_kernels=steps(4, list(range(300)), 5_000, 10_000)))
    d = one(advise(wide, launch_bound, reuse={(1, 0): 1.0}))
    assert d.decision == "keep" and d.reasons[0] == "fail: op_count 300 kernels/step > 200"
    # the upper bounds come from the configuration like the lower ones
    from gpufootprint.config import GraphAdvisorConfig
    p = GraphPolicy.from_config(GraphAdvisorConfig(max_mean_kernel_ms=0.05, max_op_count=200))
    assert (p.max_mean_kernel_ms, p.max_op_count, p.max_reuse) == (0.05, 200, None)


def test_unknown_reuse_gives_no_capture_unless_the_policy_allows_it() -> None:
    s = snap(1.0, proc(1, dev(), recent_kernels=steps(5, list(range(10)), 800_000, 10_000)))
    d = one(advise(s, DEFAULT))
    assert d.decision == "insufficient_data" and any("reuse ratio not available" in r for r in d.reasons)
    assert one(advise(s, GraphPolicy(allow_unknown_reuse=True))).decision == "capture"
    # a failing known check still decides "keep" even with reuse unknown
    s = snap(1.0, proc(1, dev(), recent_kernels=steps(5, list(range(10)), 100_000, 10_000)))
    assert one(advise(s, DEFAULT)).decision == "keep"


def test_no_kernels_seen_is_insufficient_data_and_retention_off_is_silent() -> None:
    empty = np.zeros(0, KERNEL_DTYPE)
    d = one(advise(snap(1.0, proc(1, dev(0, 5), recent_kernels=empty)), DEFAULT))
    assert (d.decision, d.stream) == ("insufficient_data", None)
    assert advise(snap(1.0, proc(1, dev(0, 5), recent_kernels=None)), DEFAULT) == ()
    # a replayed trace without kernel records (the real H200 memory trace)
    final = list(replay_snapshots(DATA / "h200_caching.jsonl.gz", kernel_retention=1000))[-1]
    assert [x.decision for x in advise(final, DEFAULT)] == ["insufficient_data"]


def test_process_that_exits_mid_window_is_judged_on_what_it_ran() -> None:
    # GIVEN a process that ran 2.5 steps and exited: too few repetitions to trust a period
    k = steps(5, list(range(10)), 800_000, 10_000)[:25]
    d = one(advise(snap(1.0, proc(1, dev(), exited=True, recent_kernels=k)), DEFAULT, reuse={(1, 0): 0.9}))
    assert d.decision == "insufficient_data" and d.exited
    # AND one that exited after 4 whole steps still gets its verdict
    k = steps(4, list(range(10)), 800_000, 10_000)
    d = one(advise(snap(1.0, proc(1, dev(), exited=True, recent_kernels=k)), DEFAULT, reuse={(1, 0): 0.9}))
    assert d.decision == "capture" and d.exited


def test_mixed_stream_is_already_captured_only_above_the_share() -> None:
    captured = steps(4, list(range(10)), 800_000, 2_000, graph=3)
    loose = steps(4, list(range(10)), 800_000, 20_000)
    mixed = np.concatenate([captured[:20], loose[:30]])
    mixed["start"][20:] += 100_000_000
    mixed["end"][20:] += 100_000_000
    d = one(advise(snap(1.0, proc(1, dev(), recent_kernels=mixed)), DEFAULT, reuse={(1, 0): 0.9}))
    assert d.decision != "already_captured"  # 20 of 50 < 0.5
    d = one(advise(snap(1.0, proc(1, dev(), recent_kernels=mixed)), GraphPolicy(captured_share=0.4)))
    assert d.decision == "already_captured"


def _one_kernel_loop(n_steps: int, per_step: int, dur_ns: int, launch_gap_ns: int, sync_gap_ns: int) -> np.ndarray:
    """``per_step`` launches of one kernel back to back, then the host waits and works (``sync_gap_ns``
    of idle GPU) before the next step: the H200 matmul loop of issue 28 (ten 8192x8192 matmuls and a
    synchronize per step)."""
    recs = np.zeros(n_steps * per_step, KERNEL_DTYPE)
    t = 1_000_000_000
    for i in range(len(recs)):
        recs[i] = (t, t + dur_ns, 0, 1, 0, 7, i, 0, 42)
        t += dur_ns + (sync_gap_ns if i % per_step == per_step - 1 else launch_gap_ns)
    return recs


def test_a_loop_of_one_repeated_kernel_takes_its_steps_from_the_idle_gaps_between_them() -> None:
    # GIVEN ten 21 ms matmuls a step, 3 us apart, and 40 ms of host work after each step's synchronize
    k = _one_kernel_loop(8, 10, 21_000_000, 3_000, 40_000_000)
    d = one(advise(snap(1.0, proc(1, dev(), recent_kernels=k)), DEFAULT, reuse={(1, 0): 1.0}))
    # THEN a step is ten kernels (not one), of about 250 ms, and the default policy captures it; the
    # steps counted are the whole ones after the first idle gap (the window may open mid-step)
    assert d.op_count == 10 and d.steps == 7, d
    assert d.decision == "capture", d.reasons
    assert 0.245 < d.step_seconds < 0.255, d  # type: ignore[operator]
    # what capture saves is the launch gaps (9 x 3 us less the graph's 2 us each), not the host's 40 ms
    assert 5e-6 < d.launch_overhead_seconds < 15e-6, d  # type: ignore[operator]


def test_steps_of_a_short_period_follow_the_idle_gaps_only_where_every_step_has_one() -> None:
    # GIVEN kernels A, B repeated with no step-level gap pattern (idle gaps at irregular places)
    k = steps(20, [1, 2], 100_000, 5_000)
    k = k.copy()
    for after, ms in ((7, 5), (15, 9), (30, 14)):  # host work after kernels 7, 15 and 30
        k["start"][after + 1:] += np.uint64(ms * 10**6)
        k["end"][after + 1:] += np.uint64(ms * 10**6)
    d = one(advise(snap(1.0, proc(1, dev(), recent_kernels=k)), DEFAULT, reuse={(1, 0): 1.0}))
    # THEN the period stays the name sequence's (2): gaps must recur at one spacing to define a step
    assert d.op_count == 2, d


def test_kernel_records_without_timestamps_are_left_out_and_said() -> None:
    # GIVEN the one-kernel loop with two records whose start (or end) CUPTI left at zero
    k = _one_kernel_loop(30, 10, 21_000_000, 3_000, 40_000_000)
    k["start"][5] = 0
    k["end"][33] = 0
    d = one(advise(snap(1.0, proc(1, dev(), recent_kernels=k)), DEFAULT, reuse={(1, 0): 1.0}))
    # THEN the step is still 10 kernels of ~250 ms (a zero start made it 4,091,886 s on the H200)
    assert d.op_count == 10 and 0.2 < d.step_seconds < 0.3, d  # type: ignore[operator]
    # (a left-out record moves the later steps' ends one kernel back: the steps are read at the phase
    # most of them share, here those after the second one)
    assert d.kernels == 298 and d.steps >= 25 and abs(d.mean_kernel_seconds - 0.021) < 1e-6, d  # type: ignore[operator]
    assert any("2 kernel record(s) without start or end time left out" in r for r in d.reasons), d.reasons
    # AND a stream whose records all lack times gets no verdict, with the reason
    k["start"] = 0
    d = one(advise(snap(1.0, proc(1, dev(), recent_kernels=k)), DEFAULT, reuse={(1, 0): 1.0}))
    assert d.decision == "insufficient_data" and "without start or end time" in d.reasons[0], d


def test_host_work_every_few_steps_does_not_turn_several_steps_into_one() -> None:
    # GIVEN 40 steps of 101 distinct kernels, and 3 ms of host work (logging) after every 4th step
    k = steps(40, list(range(101)), 5_000, 10_000)
    k = k.copy()
    for after in range(4 * 101 - 1, len(k) - 1, 4 * 101):
        k["start"][after + 1:] += np.uint64(3_000_000)
        k["end"][after + 1:] += np.uint64(3_000_000)
    d = one(advise(snap(1.0, proc(1, dev(), recent_kernels=k)), DEFAULT, reuse={(1, 0): 1.0}))
    # THEN the step is the name sequence's (101 kernels), not four steps read from the gaps
    assert d.op_count == 101 and not any("idle gaps" in r for r in d.reasons), d.reasons


def test_a_few_stray_stalls_inside_steps_neither_skew_nor_undo_the_steps_read_from_gaps() -> None:
    # GIVEN the one-kernel loop (ten 21 ms kernels a step, 40 ms of host work), 40 steps, and 5 ms
    # stalls inside three steps (after kernels 104, 204 and 304)
    k = _one_kernel_loop(40, 10, 21_000_000, 3_000, 40_000_000)
    for after in (104, 204, 304):
        k["start"][after + 1:] += np.uint64(5_000_000)
        k["end"][after + 1:] += np.uint64(5_000_000)
    d = one(advise(snap(1.0, proc(1, dev(), recent_kernels=k)), DEFAULT, reuse={(1, 0): 1.0}))
    # THEN still 10 kernels a step, and the mean step is the true one (three stalls of 5 ms in 38
    # steps of 250 ms: 250.4 ms), not 2.5 % low
    assert d.op_count == 10 and d.decision == "capture", d.reasons
    assert abs(d.step_seconds - (38 * 0.250 + 0.015) / 38) < 0.0005, d  # type: ignore[operator]
