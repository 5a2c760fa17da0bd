"""bench/overhead.py's floor: what it switches on at CUPTI must be what the probe switches on.

The probe's cost is published as a ratio to that floor (docs/performance.md); a floor that
switched on less than the probe would charge CUPTI's own work to the probe.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings

from tests import probe_fakes as fk
from tests.script_module import load_script

ROOT = Path(__file__).resolve().parents[2]
SWITCHES = ("configure", "per_thread_buffer", "register_raw", "register", "enable", "disable", "driver_hooks",
            "driver_api_records", "oom_api_records", "launch_api_records", "flush_period", "configure_unified_memory")


def _overhead() -> Any:
    return load_script(ROOT / "bench" / "overhead.py", "bench_overhead")


class Recorded(fk.FakeRawCupti):
    """The raw fake CUPTI, with every switch call written down in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        for name in SWITCHES:
            inner = getattr(self, name)

            def logged(*args: Any, _name: str = name, _inner: Any = inner) -> Any:
                self.calls.append((_name, tuple(a if isinstance(a, (int, bool, type(None))) else type(a).__name__
                                                for a in args)))
                return _inner(*args)

            setattr(self, name, logged)


def _wait(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(cond())


def _until_priming_ends(calls: list[tuple[str, tuple[Any, ...]]]) -> list[tuple[str, tuple[Any, ...]]]:
    end = calls.index(("launch_api_records", (False,)))
    return calls[:end + 1]


def test_the_floor_switches_on_at_cupti_exactly_what_the_probe_does_and_ends_priming_as_it_does(tmp_path: Path) -> None:
    # GIVEN the probe's default settings (faster cadences so the test waits less: the same for both)
    settings = ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10, watermark_ms=20)
    probe_cupti, floor_cupti = Recorded(), Recorded()
    probe = Probe(settings, probe_cupti, discover_devices=False)
    assert probe.start()
    floor = _overhead().CuptiFloor(floor_cupti, settings=settings)
    try:
        # WHEN CUDA comes up in both processes (the first allocation record)
        for cupti in (probe_cupti, floor_cupti):
            cupti.alloc(0x1000, 4096)
        assert _wait(lambda: ("launch_api_records", (False,)) in probe_cupti.calls)
        assert _wait(lambda: ("launch_api_records", (False,)) in floor_cupti.calls)
        # THEN the floor made the probe's CUPTI calls, in the probe's order, up to the priming's end
        probe_calls = _until_priming_ends(probe_cupti.calls)
        assert _until_priming_ends(floor_cupti.calls) == probe_calls
        names = [c[0] for c in probe_calls]
        for switch in ("register_raw", "enable", "driver_api_records", "oom_api_records", "flush_period"):
            assert switch in names, switch
        assert ("launch_api_records", (True,)) in probe_calls
        # AND it reads nothing: every buffer it was handed went back to the pool
        assert _wait(lambda: floor.delivery.completed >= 1 and floor.delivery.outstanding == 0)
    finally:
        floor.stop()
        probe.stop()


def test_the_bare_floor_of_earlier_runs_leaves_out_the_oom_records_and_the_priming() -> None:
    cupti = Recorded()
    floor = _overhead().CuptiFloor(cupti, bare=True, settings=ProbeSettings(socket="", watermark_ms=20))
    try:
        names = [c[0] for c in cupti.calls]
        assert "oom_api_records" not in names and "launch_api_records" not in names
        assert "register_raw" in names and "driver_api_records" in names
    finally:
        floor.stop()


def test_replicas_pool_into_groups_and_the_verdict_reads_the_probe_against_the_floor_and_the_a_a_group() -> None:
    ov = _overhead()
    configs = ov.expand(ov.VERDICT_SPEC)
    assert configs[:4] == ["none", "none#2", "none#3", "none#4"] and len(configs) == 16
    # GIVEN steps where each worker has a bias of its own (+-2 %) and the probe is 1 % over the floor
    bias = {c: 1.0 + 0.02 * ((i % 4) - 1.5) / 1.5 for i, c in enumerate(configs)}
    factor = {"none": 1.0, "aa": 1.0, "cupti_floor": 1.004, "probe": 1.004 * 1.01}
    steps = {c: {w: [[0.010 * bias[c] * factor[ov.group_of(c)] * (1 + 0.001 * r)] * 5 for r in range(20)]
                 for w in ("a", "b")} for c in configs}
    rows = ov.pooled(steps, configs, seed=0)
    # THEN four workers make one group each, the A/A group reads 1, and the probe reads 1.01 against the floor
    assert rows["probe"]["workers"] == ["probe", "probe#2", "probe#3", "probe#4"]
    assert abs(rows["aa"]["a"]["median_ratio"] - 1.0) < 1e-3
    assert abs(rows["probe"]["a"]["vs_cupti_floor"] - 1.01) < 1e-3
    assert abs(rows["cupti_floor"]["a"]["median_ratio"] - 1.004) < 1e-3
    table = ov.verdict_table(rows)
    assert table.splitlines()[2].startswith("aa (4)")


def test_the_old_torch_reading_lever_reads_as_the_probe_did_before_and_the_default_does_not(
        monkeypatch: Any) -> None:
    """probe_torch_numbers_old against probe isolates the reading's cost: each must read its own way."""
    import sys

    from gpufootprint.probe import torchnumbers

    torch = fk.fake_torch(reserved=7, allocated=5)
    calls: list[str] = []
    torch.cuda.memory_allocated = lambda d=0: calls.append("allocated") or 5
    torch.cuda.memory_reserved = lambda d=0: calls.append("reserved") or 7
    nested = torch.cuda.memory_stats_as_nested_dict
    torch.cuda.memory_stats_as_nested_dict = lambda d=0: calls.append("nested") or nested(d)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delitem(sys.modules, "torch.optim.optimizer", raising=False)
    monkeypatch.setattr(torchnumbers, "read_now", torchnumbers.read_now)  # restored after the test
    probe = Probe(ProbeSettings(socket="", flush_ms=10, torch_numbers=True), fk.FakeRawCupti(), discover_devices=False)
    assert probe.start()
    try:
        assert probe.sender.torch_numbers.min_interval_s == 1.0  # one reading a heartbeat
        probe.sender.torch_numbers._after_step(None, (), {})
        assert calls == ["nested"]
        _overhead()._old_torch_numbers(probe)
        assert probe.sender.torch_numbers.min_interval_s == 0.5
        calls.clear()
        probe.sender.torch_numbers._read_at = -float("inf")
        probe.sender.torch_numbers._after_step(None, (), {})
        assert calls == ["allocated", "reserved"]
        assert probe.sender.torch_numbers.latest == {"allocated": {"0": 5}, "reserved": {"0": 7}}
    finally:
        probe.stop()


def test_the_workers_gc_clock_counts_the_collectors_time() -> None:
    import gc

    seconds = _overhead()._count_gc_time()
    try:
        junk = [[i] for i in range(200_000)]
        gc.collect()
        assert seconds[0] > 0
        del junk
    finally:
        gc.callbacks.pop()


def test_the_workers_thread_clock_sees_a_busy_thread_by_its_name() -> None:
    import threading

    m = _overhead()
    names: dict[int, str] = {}
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name="busy-one")
    before = m._threads_cpu_ns()
    t.start()
    try:
        time.sleep(0.3)
        after = m._threads_cpu_ns()
        name = m._thread_name(t.native_id, names)
    finally:
        stop.set()
        t.join()
    busy = {tid: ns - before.get(tid, 0) for tid, ns in after.items()}
    assert busy[t.native_id] > 20_000_000  # more than 20 ms of its 300
    assert name == "busy-one"
    assert m._thread_name(threading.main_thread().native_id, names) == "MainThread"
    assert threading.main_thread().native_id in after


def test_the_gc_clock_started_during_a_collection_ignores_that_collections_end() -> None:
    """A clock put on gc.callbacks while a collection runs (a finalizer's, another thread's) hears that
    collection's "stop" without its "start": it added perf_counter() - 0, the host's uptime, to the
    worker's GC seconds."""
    import gc

    clocks: list[list[float]] = []

    class StartsTheClockWhenCollected:
        def __init__(self) -> None:
            self.cycle = self

        def __del__(self) -> None:
            clocks.append(_overhead()._count_gc_time())

    gc.collect()
    n = len(gc.callbacks)
    StartsTheClockWhenCollected()
    try:
        t0 = time.perf_counter()
        gc.collect()
        wall = time.perf_counter() - t0
        assert len(clocks) == 1
        assert 0 <= clocks[0][0] <= wall
        gc.collect()  # a whole collection after: counted
        assert 0 < clocks[0][0] <= time.perf_counter() - t0
    finally:
        del gc.callbacks[n:]


def test_the_worker_notes_each_window_of_its_probe_and_the_p99_outside_them() -> None:
    from gpufootprint.probe.windows import Windows

    m = _overhead()
    opened, closed = Windows.open_kernel_window, Windows.close_kernel_window
    seen = m._note_windows()
    try:
        probe = Probe(ProbeSettings(socket="", flush_ms=10), fk.FakeRawCupti(), discover_devices=False)
        assert probe.start()
        try:
            w = probe.sender.windows
            w.open_kernel_window(50, 7)
            assert _wait(lambda: w.kernel_window is None, 2.0)  # closed by the sender at its end
        finally:
            probe.stop()
    finally:
        Windows.open_kernel_window, Windows.close_kernel_window = opened, closed  # type: ignore[method-assign]
    assert len(seen) == 1 and 0 < seen[0][0] < seen[0][1]
    assert 0.04 <= seen[0][1] - seen[0][0] < 1.5
    # 100 steps of 10 ms, three of them slow inside a window: the p99 outside it is the plain one
    steps = [(i * 0.02, 0.010) for i in range(100)]
    steps[50] = steps[51] = steps[52] = (steps[50][0], 0.030)
    raw = {"steps": {"a": steps, "b": []}, "windows": [[1.0, 1.05]]}
    p_all, p_out, n_in = m.p99_outside_windows(raw, "a")
    assert n_in == 3 and p_all == 0.030 and p_out == 0.010


def test_the_benches_share_one_transformer_step_built_once() -> None:
    """bench/_workloads.py: overhead.py's workload (a) and the model torch_numbers_cost.py and
    probe_start_stress.py read the allocator on (on a stand-in torch: the calls, not the GPU)."""
    import sys
    from types import SimpleNamespace

    calls: list[Any] = []

    class Tensor:
        def __init__(self, name: str) -> None:
            self.name = name

        def float(self) -> Tensor:
            return self

        def pow(self, _e: int) -> Tensor:
            return self

        def mean(self) -> Tensor:
            return self

        def backward(self) -> None:
            calls.append("backward")

    class Model:
        def __call__(self, x: Tensor) -> Tensor:
            calls.append(("forward", x.name))
            return Tensor("loss")

        def cuda(self) -> Model:
            return self

        def to(self, dtype: str) -> Model:
            calls.append(("to", dtype))
            return self

        def parameters(self) -> str:
            return "params"

    class AdamW:
        def __init__(self, params: str, lr: float) -> None:
            calls.append(("AdamW", params, lr))

        def step(self) -> None:
            calls.append("step")

        def zero_grad(self, set_to_none: bool) -> None:
            calls.append(("zero_grad", set_to_none))

    def layer(*args: Any, **kwargs: Any) -> str:
        calls.append(("layer", args, kwargs))
        return "layer"

    def encoder(lay: str, n: int) -> Model:
        calls.append(("encoder", lay, n))
        return Model()

    def randn(*shape: int, device: str, dtype: str) -> Tensor:
        calls.append(("randn", shape, device, dtype))
        return Tensor("x")

    fake = SimpleNamespace(nn=SimpleNamespace(TransformerEncoderLayer=layer, TransformerEncoder=encoder),
                           optim=SimpleNamespace(AdamW=AdamW), randn=randn, bfloat16="bf16")
    saved = sys.modules.get("torch")
    sys.modules["torch"] = fake  # type: ignore[assignment]
    try:
        step = load_script(ROOT / "bench" / "_workloads.py", "bench_workloads").transformer_step(8, 256)
        built = list(calls)
        calls.clear()
        step()
        step()
    finally:
        if saved is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = saved
    assert built == [("layer", (1024, 16, 4096), {"batch_first": True, "dropout": 0.0}), ("encoder", "layer", 6),
                     ("to", "bf16"), ("AdamW", "params", 1e-4), ("randn", (8, 256, 1024), "cuda", "bf16")]
    assert calls == [("forward", "x"), "backward", "step", ("zero_grad", True)] * 2


def test_the_p99_interval_resamples_rounds_and_excludes_one_only_where_the_slow_steps_differ(tmp_path: Path) -> None:
    """The verdict's p99 against the floor comes with an interval over rounds: a group whose slowest steps are 10 %
    slower in every round is told apart, an equal one is not; a finished run reads the same from its files."""
    import gzip
    import json
    import random

    ov = _overhead()
    rng = random.Random(3)

    def worker(slow: float) -> dict[str, list[list[float]]]:
        # 40 rounds of 50 steps: 1 ms, and one step a round of each worker slow (its p99)
        return {w: [[1e-3 * (1 + rng.random() * 0.05)] * 49 + [slow * (1 + rng.random() * 0.05)] for _ in range(40)]
                for w in ("a", "b")}

    steps = {"none": worker(2e-3), "none#2": worker(2e-3), "cupti_floor": worker(2e-3), "cupti_floor#2": worker(2e-3),
             "probe": worker(2.2e-3), "probe#2": worker(2.2e-3), "aa": worker(2e-3), "aa#2": worker(2e-3)}
    rows = ov.pooled(steps, list(steps), seed=0)
    lo, hi = rows["probe"]["a"]["p99_vs_cupti_floor_ci95"]
    assert 1.0 < lo < rows["probe"]["a"]["p99_vs_cupti_floor"] < hi, rows["probe"]["a"]
    lo, hi = rows["aa"]["b"]["p99_vs_cupti_floor_ci95"]
    assert lo < 1.0 < hi, rows["aa"]["b"]
    # the same from a run's files: the summary's rounds and every step in order, with its start
    out = tmp_path / "run.json"
    out.write_text(json.dumps({"rounds": 40, "steps_a": 50, "steps_b": 50}))
    with gzip.open(str(out) + ".steps.json.gz", "wt") as f:
        json.dump({c: {"steps": {w: [[0.0, t] for r in by_w[w] for t in r] for w in ("a", "b")}, "windows": []}
                   for c, by_w in steps.items()}, f)
    again = ov.reanalysed(str(out), seed=0)
    assert again["probe"]["a"]["p99_vs_cupti_floor_ci95"] == rows["probe"]["a"]["p99_vs_cupti_floor_ci95"]
    assert "p99 ci95" in ov.verdict_table(again)


def test_runs_of_one_machine_pool_their_rounds_and_runs_of_two_machines_are_refused(tmp_path: Path) -> None:
    """Two calls of 20 rounds each read as the one run of 40 they make together; a run of another GPU or commit is
    not pooled with them (figures of different machines are a range)."""
    import gzip
    import json
    import random

    import pytest

    ov = _overhead()
    rng = random.Random(5)
    configs = ("none", "none#2", "aa", "aa#2", "cupti_floor", "cupti_floor#2", "probe", "probe#2")
    whole = {c: {w: [[1e-3 * (1 + rng.random() * 0.1) for _ in range(10)] for _ in range(40)] for w in ("a", "b")}
             for c in configs}
    machine = {"gpus": ["NVIDIA H200, GPU-1"], "commit": "abc"}

    def write(name: str, rounds: slice, mach: dict[str, Any]) -> str:
        out = tmp_path / name
        part = {c: {w: whole[c][w][rounds] for w in ("a", "b")} for c in configs}
        out.write_text(json.dumps({"rounds": len(part["none"]["a"]), "steps_a": 10, "steps_b": 10, "machine": mach}))
        with gzip.open(str(out) + ".steps.json.gz", "wt") as f:
            json.dump({c: {"steps": {w: [[0.0, t] for r in by_w[w] for t in r] for w in ("a", "b")}, "windows": []}
                       for c, by_w in part.items()}, f)
        return str(out)

    one, two = write("one.json", slice(0, 20), machine), write("two.json", slice(20, 40), machine)
    assert ov.reanalysed([one, two], seed=0) == ov.pooled(whole, list(configs), seed=0)
    other = write("other.json", slice(20, 40), {**machine, "gpus": ["NVIDIA H100, GPU-2"]})
    with pytest.raises(SystemExit, match="gpus"):
        ov.reanalysed([one, other], seed=0)
