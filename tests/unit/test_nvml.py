"""The NVML source against a stateful fake: every scenario ends in states and metrics, never a crash."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gpufootprint.config import NvmlConfig
from gpufootprint.exporter.collector import FootprintCollector
from gpufootprint.nvml.poller import NvmlPoller
from gpufootprint.snapshot import EMPTY_SNAPSHOT, PipelineSnapshot, ProcessSnapshot
from prometheus_client.registry import CollectorRegistry

sys.path.insert(0, str(Path(__file__).parents[1]))
from nvml_fake import GIB, SCENARIOS, FakeNvml


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def poller(fake: FakeNvml, clock: Clock | None = None, **cfg: object) -> NvmlPoller:
    p = NvmlPoller(fake, NvmlConfig(**cfg), monotonic=clock or Clock(), wall_ns=lambda: 1_000)  # type: ignore[arg-type]
    p.start()
    return p


def scrape(snap: PipelineSnapshot) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FootprintCollector(lambda: snap))
    out = {}
    for fam in reg.collect():
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def with_nvml(p: NvmlPoller, procs: tuple[ProcessSnapshot, ...] = ()) -> PipelineSnapshot:
    import dataclasses

    return dataclasses.replace(EMPTY_SNAPSHOT, nvml=p.snapshot(), processes=procs)


def test_healthy_driver_reports_every_field_and_processes_with_and_without_probe() -> None:
    fake = FakeNvml("healthy")
    fake.add_process(0, 1234, 950 << 20)  # has a probe
    fake.add_process(0, 999, 300 << 20)  # no probe
    p = poller(fake)
    p.poll()
    g0 = p.snapshot().gpus[0]
    assert (g0.up, g0.state, g0.memory_reserved_bytes, g0.memory_used_bytes) == (True, "ok", 512 << 20, 10 * GIB)
    assert g0.pcie_tx_bytes_per_second == 1024.0 * 1000 and g0.power_watts == 123.5
    assert all(g0.field_supported[f] for f in ("memory", "memory_reserved", "processes", "pcie", "power", "energy"))
    probed = ProcessSnapshot(pid=1234, source="probe", exited=False, info={}, devices=(), pending_records=0,
                             as_of_ns=0)
    m = scrape(with_nvml(p, (probed,)))
    assert m[("gpufootprint_nvml_process_used_bytes", (("gpu", "0"), ("pid", "1234"), ("source", "probe")))] \
        == 950 << 20
    assert m[("gpufootprint_nvml_process_used_bytes", (("gpu", "0"), ("pid", "999"), ("source", "nvml")))] \
        == 300 << 20
    lab = (("gpu", "0"), ("model", "NVIDIA H200"), ("uuid", "GPU-fake-0000"))
    assert m[("gpufootprint_nvml_memory_reserved_bytes", lab)] == 512 << 20
    assert m[("gpufootprint_nvml_up", lab)] == 1.0
    assert m[("gpufootprint_nvml_energy_joules_total", lab)] == 1010.0
    assert m[("gpufootprint_nvml_state", (("state", "ok"),))] == 1.0


def test_field_unsupported_becomes_a_zero_metric_and_is_not_asked_again() -> None:
    fake = FakeNvml("field_unsupported")
    p = poller(fake)
    for _ in range(5):
        p.poll()
    g = p.snapshot().gpus[0]
    assert g.field_supported["pcie"] is False and g.field_supported["power"] is False
    assert g.field_supported["memory"] is True and g.up
    assert g.pcie_tx_bytes_per_second is None and g.power_watts is None and g.energy_joules is None
    # pcie, power, energy, per-process utilisation on 2 gpus once each, xid once: then never again
    assert fake.unsupported_calls == 4 * 2 + 1  # pcie, power, energy, per-process util on 2 GPUs; xid once
    m = scrape(with_nvml(p))
    assert m[("gpufootprint_nvml_field_supported", (("field", "pcie"), ("gpu", "0")))] == 0.0
    assert m[("gpufootprint_nvml_field_supported", (("field", "xid"), ("gpu", "1")))] == 0.0
    assert not any(k[0] == "gpufootprint_nvml_power_watts" for k in m)
    assert m[("gpufootprint_nvml_errors_total", (("reason", "not_supported"),))] == 9


def test_gpu_lost_mid_run_marks_it_down_keeps_the_other_and_finds_it_again() -> None:
    clock = Clock()
    fake = FakeNvml("gpu_lost", lose_at=3)
    p = poller(fake, clock, lost_retry_seconds=10.0)
    for _ in range(4):
        p.poll()
        clock.t += 1
    g0, g1 = p.snapshot().gpus
    assert (g0.up, g0.state) == (True, "ok") and g0.memory_used_bytes == 10 * GIB
    assert (g1.up, g1.state) == (False, "lost") and g1.memory_used_bytes is None and g1.processes == {}
    m = scrape(with_nvml(p))
    assert m[("gpufootprint_nvml_up", (("gpu", "1"), ("model", "NVIDIA H200"), ("uuid", "GPU-fake-0001")))] == 0.0
    assert m[("gpufootprint_nvml_errors_total", (("reason", "gpu_lost"),))] >= 1
    # while lost, the GPU is not hammered: no call on it until the retry time
    calls = fake.calls
    p.poll()
    assert fake.calls - calls == 7  # gpu 0 only: memory, processes, util, per-process util, pcie(1 call), power, energy
    fake.recover()
    fake.scenario = "healthy"
    clock.t += 11
    p.poll()
    assert p.snapshot().gpus[1].up and p.snapshot().gpus[1].state == "ok"


def test_other_driver_without_v2_memory_falls_back_to_v1_and_hides_process_memory() -> None:
    fake = FakeNvml("other_driver")
    fake.add_process(0, 77, 1 << 30)
    p = poller(fake)
    p.poll()
    p.poll()
    snap = p.snapshot()
    assert snap.driver_version == "470.57.02"
    g = snap.gpus[0]
    assert g.memory_used_bytes == 10 * GIB and g.memory_reserved_bytes is None
    assert g.field_supported["memory_reserved"] is False and g.field_supported["memory"] is True
    assert g.processes == {77: None}
    m = scrape(with_nvml(p))
    assert not any(k[0] == "gpufootprint_nvml_process_used_bytes" for k in m)
    assert not any(k[0] == "gpufootprint_nvml_memory_reserved_bytes" for k in m)
    assert m[("gpufootprint_nvml_field_supported", (("field", "memory_reserved"), ("gpu", "0")))] == 0.0


def test_no_driver_is_a_state_and_init_is_retried_later() -> None:
    clock = Clock()
    fake = FakeNvml("no_driver")
    p = poller(fake, clock, lost_retry_seconds=5.0)
    assert p.state == "unavailable" and "libnvidia-ml" in p.detail
    p.poll()
    assert p.snapshot().gpus == ()
    m = scrape(with_nvml(p))
    assert m[("gpufootprint_nvml_state", (("state", "unavailable"),))] == 1.0
    fake.scenario = "healthy"
    p.poll()  # too early: not retried
    assert p.state == "unavailable"
    clock.t += 6
    p.poll()
    assert p.state == "ok" and len(p.snapshot().gpus) == 2


def test_xid_events_are_counted_per_gpu_and_xid() -> None:
    fake = FakeNvml("healthy")
    p = poller(fake)
    fake.raise_xid(1, 79)
    fake.raise_xid(1, 79)
    fake.raise_xid(0, 48)
    p.poll()
    m = scrape(with_nvml(p))
    assert m[("gpufootprint_nvml_xid_errors_total", (("gpu", "1"), ("xid", "79")))] == 2
    assert m[("gpufootprint_nvml_xid_errors_total", (("gpu", "0"), ("xid", "48")))] == 1


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_scenario_raises_even_when_the_client_misbehaves(scenario: str) -> None:
    fake = FakeNvml(scenario)
    p = poller(fake)
    for i in range(6):
        if i == 3:
            fake.lose(0)
        p.poll()
    fake.utilization = None  # type: ignore[assignment,method-assign]  # a broken binding: TypeError
    fake.recover()
    p.poll()
    scrape(with_nvml(p))


def test_poll_interval_follows_the_sampler_within_bounds() -> None:
    clock = Clock()
    p = poller(FakeNvml(), clock, min_poll_ms=20, max_poll_ms=1000)
    p.set_interval(0.005)
    assert p.interval_s == 0.02
    p.set_interval(None)
    assert p.interval_s == 1.0
    p.set_interval(0.2)
    assert p.maybe_poll() and not p.maybe_poll()
    clock.t += 0.21
    assert p.maybe_poll()
    assert p.polls == 2


def test_threaded_poller_polls_off_the_caller_thread_and_publishes_whole_snapshots() -> None:
    import threading
    import time

    fake = FakeNvml("healthy")
    seen_threads: set[str] = set()
    orig = fake.memory

    def memory(index: int):  # type: ignore[no-untyped-def]
        seen_threads.add(threading.current_thread().name)
        return orig(index)

    fake.memory = memory  # type: ignore[method-assign]
    p = NvmlPoller(fake, NvmlConfig(min_poll_ms=5, max_poll_ms=10))  # type: ignore[arg-type]
    assert p.snapshot().state == "unavailable"  # before start: a state, not an error
    p.start()
    assert p.snapshot().state == "ok"
    p.start_thread()
    try:
        deadline = time.monotonic() + 5
        while p.polls < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        p.close()
    assert p.polls >= 5
    assert seen_threads == {"gpufootprint-nvml"}
    snap = p.snapshot()
    assert len(snap.gpus) == 2 and all(g.memory_used_bytes is not None for g in snap.gpus)
    assert len(p.pcie_samples(0)) == p.polls


def test_per_process_utilisation_samples_are_kept_per_pid_in_order_each_once() -> None:
    # GIVEN a driver that samples two processes, and a poller polling faster than the driver's period
    fake = FakeNvml("healthy", gpus=1)
    wall = [1_700_000_000 * 10**9]
    p = NvmlPoller(fake, NvmlConfig(), monotonic=Clock(), wall_ns=lambda: wall[0])
    p.start()
    t_us = wall[0] // 1000
    fake.add_busy(0, 11, t_us, 0.9)
    fake.add_busy(0, 22, t_us, 0.1)
    p.poll()
    p.poll()  # nothing newer: nothing added twice
    fake.add_busy(0, 11, t_us + 166_667, 0.8)
    p.poll()
    busy = p.snapshot().gpus[0].process_busy
    # THEN each sample once, per pid, oldest first, in wall-clock ns
    assert busy[11] == ((t_us * 1000, 0.9), ((t_us + 166_667) * 1000, 0.8))
    assert busy[22] == ((t_us * 1000, 0.1),)
    assert p.snapshot().gpus[0].field_supported["process_utilization"] is True


def test_per_process_samples_stamped_on_the_monotonic_clock_are_moved_onto_the_wall_clock() -> None:
    import time

    fake = FakeNvml("healthy", gpus=1)
    p = NvmlPoller(fake, NvmlConfig(), monotonic=Clock())
    p.start()
    mono_us = time.monotonic_ns() // 1000
    fake.add_busy(0, 11, mono_us, 0.5)
    p.poll()
    ((ts, ratio),) = p.snapshot().gpus[0].process_busy[11]
    assert abs(ts - time.time_ns()) < 5 * 10**9 and ratio == 0.5


def test_a_driver_without_per_process_utilisation_marks_it_unsupported_and_keeps_the_rest() -> None:
    fake = FakeNvml("field_unsupported", gpus=1)
    p = poller(fake)
    p.poll()
    g = p.snapshot().gpus[0]
    assert g.field_supported["process_utilization"] is False and g.process_busy == {} and g.up


def test_the_simulated_h200_gives_one_sample_per_process_and_period_like_the_driver() -> None:
    from gpufootprint.nvml.simulated import SAMPLE_PERIOD_US, SimulatedNvml

    wall = [1_700_000_000_000_000]
    held = {5: 1 << 30, 6: 1 << 20}
    sim = SimulatedNvml(lambda: held, clock=lambda: 30.0, wall_us=lambda: wall[0], busy=lambda pid: 1.0 if pid == 5 else 0.5)
    sim.init()
    first = sim.process_utilization(0, 0)
    assert [b.pid for b in first] == [5, 6] and first[0].ts_us % SAMPLE_PERIOD_US == 0
    assert first[0].sm_ratio == sim.utilization(0) and first[1].sm_ratio == round(sim.utilization(0) * 0.5, 2)
    # within the same period nothing is newer; the next period brings one more sample per process
    assert sim.process_utilization(0, first[0].ts_us) == []
    wall[0] += SAMPLE_PERIOD_US
    assert len(sim.process_utilization(0, first[0].ts_us)) == 2
    # a process that is gone has no sample any more
    del held[6]
    wall[0] += SAMPLE_PERIOD_US
    assert [b.pid for b in sim.process_utilization(0, 0)] == [5]
