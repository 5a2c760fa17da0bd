from __future__ import annotations

import numpy as np
from gpufootprint.engines.kernels import detect_period, detect_recent_period, stream_stats
from gpufootprint.records import KERNEL_DTYPE

T0 = 1_000_000_000  # CUPTI's clock is never at zero: a zero start or end is a record without a time


def kernels(spec: list[tuple[int, int, int]], *, stream: int = 7, graph: int = 0) -> np.ndarray:
    """spec: (start ns, end ns, name id), from T0"""
    recs = np.zeros(len(spec), KERNEL_DTYPE)
    for i, (s, e, n) in enumerate(spec):
        recs[i] = (T0 + s, T0 + e, 0, 1, 0, stream, i, graph, n)
    return recs


def test_period_is_the_smallest_repeating_length_not_a_multiple() -> None:
    seq = np.array([1, 2, 1, 3] * 6)
    assert detect_period(seq, min_match=1.0) == (4, 1.0)


def test_period_tolerates_a_few_mismatches_up_to_min_match() -> None:
    seq = np.array([5, 6, 7, 8, 9] * 10)
    seq[17] = 99
    p, match = detect_period(seq, min_match=0.9)  # type: ignore[misc]
    assert p == 5 and 0.9 <= match < 1.0
    assert detect_period(seq, min_match=1.0) is None


def test_no_period_in_random_names_or_too_few_steps() -> None:
    rng = np.random.default_rng(1)
    assert detect_period(rng.integers(0, 50, 400)) is None
    assert detect_period(np.array([1, 2, 3, 1, 2, 3]), min_steps=3) is None  # only 2 steps
    assert detect_period(np.array([1, 2, 3] * 3), min_steps=3) == (3, 1.0)


def test_step_gaps_and_saveable_launch_overhead_exact() -> None:
    # GIVEN a step of 3 kernels (1 ms each), 10 us launch gaps inside, a 5 ms host gap after each step
    spec = []
    t = 0
    for _ in range(4):
        for name in (1, 2, 3):
            spec.append((t, t + 1_000_000, name))
            t += 1_000_000 + 10_000
        t += 5_000_000 - 10_000
    st = stream_stats(kernels(spec), host_gap_ns=1_000_000, graph_gap_ns=2_000)[(0, 7)]
    # THEN: period 3, 4 steps; per step: 3 ms busy, gaps 10 + 10 + 5000 us, step 8.02 ms
    assert (st.period, st.steps, st.kernels) == (3, 4, 12)
    assert abs(st.mean_kernel_seconds - 1e-3) < 1e-12
    assert abs(st.step_seconds - 8.02e-3) < 1e-12
    assert abs(st.step_gap_seconds - 5.02e-3) < 1e-12
    assert abs(st.launch_gap_seconds - 20e-6) < 1e-12  # the 5 ms host gap is not launch overhead
    assert abs(st.saveable_seconds - 16e-6) < 1e-12  # each 10 us gap becomes 2 us in a graph
    assert abs(st.gap_share - 5.02 / 8.02) < 1e-9


def test_overlapping_kernels_count_no_gap_and_streams_are_separate() -> None:
    a = kernels([(0, 100, 1), (50, 200, 2), (300, 400, 1), (350, 500, 2), (600, 700, 1), (650, 800, 2)], stream=1)
    b = kernels([(0, 10, 9)], stream=2, graph=4)
    stats = stream_stats(np.concatenate([a, b]), min_steps=3)
    assert set(stats) == {(0, 1), (0, 2)}
    assert stats[(0, 1)].period == 2
    assert stats[(0, 1)].step_gap_seconds == 100e-9  # 200->300 only; the overlaps count as no gap
    assert stats[(0, 2)].graph_kernels == 1 and stats[(0, 2)].period is None


def test_empty_input_has_no_streams() -> None:
    assert stream_stats(np.zeros(0, KERNEL_DTYPE)) == {}


def test_warm_up_step_with_other_kernels_does_not_hide_the_steady_period() -> None:
    # GIVEN a first step that launches different kernels (optimizer state init), then 4 steady steps
    warm = list(range(100, 112))
    steady = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    seq = np.array(warm + steady * 4)
    assert detect_period(seq) is None  # over the whole window only 3 of 4 steps match
    p, match, used = detect_recent_period(seq)  # type: ignore[misc]
    assert p == 12 and match >= 0.9 and used >= 36
    assert detect_recent_period(np.array(warm + steady * 2)) is None  # 2 steady steps are not enough


def test_a_step_of_identical_tiny_kernels_is_the_whole_step_not_one_kernel() -> None:
    seq = np.array(([1] * 100 + [2]) * 6)
    assert detect_period(seq) == (101, 1.0)
    noisy = seq.copy()
    noisy[[50, 333]] = 7  # a little noise does not bring period 1 back
    p, match = detect_period(noisy)  # type: ignore[misc]
    assert p == 101 and match > 0.99


def test_a_stray_kernel_after_the_last_step_does_not_hide_the_period() -> None:
    seq = np.array(list(range(1, 31)) * 5 + [99])
    p, match = detect_period(seq)  # type: ignore[misc]
    assert p == 30 and match == 120 / 121
