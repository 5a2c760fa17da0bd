"""The series cap holds under far more processes than the cap, keeps the sum, counts
what it folds, and keeps a process's series stable across scrapes; pod labels land
on every per-process series and nowhere else."""

from __future__ import annotations

import random
from collections import defaultdict

from gpufootprint.exporter.cardinality import OVERFLOW_PID, SeriesCap, build_postprocess
from gpufootprint.exporter.collector import FootprintCollector
from gpufootprint.k8s.attribution import PodIdentity
from gpufootprint.snapshot import DeviceSnapshot, PipelineSnapshot, ProcessSnapshot
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

MiB = 1 << 20


def device(dev: int, mib: int) -> DeviceSnapshot:
    return DeviceSnapshot(
        dev=dev, live_bytes={"device": mib * MiB, "pinned": MiB}, device_bytes=mib * MiB, async_device_bytes=0,
        pool_reserved_bytes=0, pool_used_bytes=0, window_peak_bytes=2 * mib * MiB, live_allocations=mib,
        allocations={"device": mib}, releases={}, allocated_bytes={"device": mib * MiB}, released_bytes={},
        memcpy_count={1: 3}, memcpy_bytes={1: 3 * MiB}, memcpy_seconds={1: 0.001}, memset_count=0, memset_bytes=0,
        kernel_count=0, kernel_seconds=0.0, um_count={}, um_value={})


def snapshot(pids: list[int]) -> PipelineSnapshot:
    procs = tuple(ProcessSnapshot(pid=pid, source="probe", exited=False, info={}, devices=(device(pid % 8, pid),),
                                  pending_records=0, as_of_ns=10**18) for pid in pids)
    return PipelineSnapshot(taken_at=1.0, processes=procs, records_ingested={"memory": 5}, ingest_errors={},
                            late_records=0, window_peak_seconds=60.0)


def scrape(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[s.name].append((s.labels, s.value))
    return out


class Pods:
    def identify(self, pid: int) -> PodIdentity:
        if pid % 10 == 0:
            return PodIdentity("", "", "", "unresolved")
        return PodIdentity(f"job-{pid % 7}", "ml", "trainer", "resolved")


def make(pids: list[int], cap: int, attributor: Pods | None = None) -> tuple[CollectorRegistry, list[list[int]]]:
    current = [pids]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FootprintCollector(lambda: snapshot(current[0]), postprocess=build_postprocess(attributor, cap)))
    return registry, current


def test_cap_holds_with_far_more_processes_than_the_cap_and_keeps_the_sum() -> None:
    cap = 50
    pids = list(range(1, 2001))  # 2,000 processes, 40x the cap
    registry, _ = make(pids, cap)
    got = scrape(registry)
    for name in ("gpufootprint_device_bytes", "gpufootprint_live_bytes", "gpufootprint_memcpy_bytes_total",
                 "gpufootprint_pending_records", "gpufootprint_watermark_timestamp_seconds"):
        series = got[name]
        assert len(series) == cap, name
        overflow = [v for labels, v in series if labels["pid"] == OVERFLOW_PID]
        assert len(overflow) == 1, name
    # Nothing is lost from a sum: kept + overflow == the uncapped total.
    total = sum(v for _, v in got["gpufootprint_device_bytes"])
    assert total == sum(pid * MiB for pid in pids)
    # The overflow series has every other label empty and is one series, not one per gpu.
    (ov_labels,) = [lab for lab, _ in got["gpufootprint_live_bytes"] if lab["pid"] == OVERFLOW_PID]
    assert ov_labels == {"pid": OVERFLOW_PID, "gpu": "", "source": "", "kind": ""}
    dropped = {lab["metric"]: v for lab, v in got["gpufootprint_series_dropped_total"]}
    assert dropped["gpufootprint_device_bytes"] == len(pids) - (cap - 1)
    assert dropped["gpufootprint_live_bytes"] == 2 * len(pids) - (cap - 1)  # two kinds per process
    assert dropped["gpufootprint_memcpy_bytes_total"] == len(pids) - (cap - 1)
    # Families without a pid label are untouched.
    assert got["gpufootprint_records_ingested_total"] == [({"kind": "memory"}, 5.0)]


def test_under_the_cap_nothing_is_folded() -> None:
    registry, _ = make(list(range(1, 11)), cap=50)
    got = scrape(registry)
    assert len(got["gpufootprint_device_bytes"]) == 10
    assert all(lab["pid"] != OVERFLOW_PID for lab, _ in got["gpufootprint_device_bytes"])
    assert {v for _, v in got["gpufootprint_series_dropped_total"]} == {0.0}


def test_cap_stays_bounded_and_series_stay_put_under_process_churn() -> None:
    # GIVEN processes that come and go over 60 scrapes, 10x more than the cap alive at once
    rng = random.Random(7)
    cap = 20
    registry, current = make(list(range(1, 201)), cap)
    first = {lab["pid"] for lab, _ in scrape(registry)["gpufootprint_device_bytes"]} - {OVERFLOW_PID}
    assert len(first) == cap - 1
    next_pid = 201
    alive = list(range(1, 201))
    survivors = {int(p) for p in first}
    for _ in range(60):
        gone = set(rng.sample(alive, 15)) - survivors  # admitted processes survive in this scenario
        alive = [p for p in alive if p not in gone] + list(range(next_pid, next_pid + len(gone)))
        next_pid += len(gone)
        current[0] = alive
        got = scrape(registry)
        for name, series in got.items():
            if any("pid" in lab for lab, _ in series):
                keys = {tuple(sorted(lab.items())) for lab, _ in series}
                assert len(keys) <= cap, name
        kept = {lab["pid"] for lab, _ in got["gpufootprint_device_bytes"]} - {OVERFLOW_PID}
        assert kept == first  # a kept process does not flicker out because others came


def test_slot_of_an_exited_process_goes_to_a_waiting_one() -> None:
    registry, current = make([1, 2, 3, 4, 5], cap=3)
    kept = {lab["pid"] for lab, _ in scrape(registry)["gpufootprint_device_bytes"]} - {OVERFLOW_PID}
    assert kept == {"1", "2"}
    current[0] = [2, 3, 4, 5]  # pid 1 exits
    kept = {lab["pid"] for lab, _ in scrape(registry)["gpufootprint_device_bytes"]} - {OVERFLOW_PID}
    assert kept == {"2", "3"}


def test_memory_of_the_cap_is_bounded_by_the_cap() -> None:
    cap = SeriesCap(10)
    registry = CollectorRegistry(auto_describe=False)
    current = [list(range(1, 1501))]
    registry.register(FootprintCollector(lambda: snapshot(current[0]),
                                         postprocess=lambda fams: cap.apply(fams)))
    for start in (1, 1501, 3001):  # three generations of 1,500 processes, 150x the cap
        current[0] = list(range(start, start + 1500))
        scrape(registry)
        assert all(len(keys) <= 10 for keys in cap._admitted.values())


def test_pod_labels_on_every_per_process_series_and_unresolved_pids_kept() -> None:
    registry, _ = make([7, 10, 15], cap=1000, attributor=Pods())
    got = scrape(registry)
    per_process = 0
    for name, series in got.items():
        for labels, _ in series:
            if "pid" in labels:
                per_process += 1
                assert {"pod", "namespace", "container", "attribution"} <= labels.keys(), name
                if labels["pid"] == "10":
                    assert (labels["pod"], labels["attribution"]) == ("", "unresolved")
                else:
                    assert (labels["pod"], labels["namespace"], labels["container"], labels["attribution"]) == (
                        f"job-{int(labels['pid']) % 7}", "ml", "trainer", "resolved")
            else:
                assert "pod" not in labels, name
    assert per_process > 30
    assert {lab["pid"] for lab, _ in got["gpufootprint_device_bytes"]} == {"7", "10", "15"}


def test_a_failing_postprocess_never_serves_uncapped_per_process_series() -> None:
    def broken(_fams: list) -> list:  # type: ignore[type-arg]
        raise RuntimeError("bug")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FootprintCollector(lambda: snapshot(list(range(1, 100))), postprocess=broken))
    got = scrape(registry)
    assert "gpufootprint_device_bytes" not in got
    assert got["gpufootprint_exporter_collect_errors_total"][0][1] == 1.0
    assert got["gpufootprint_records_ingested_total"]


def test_past_the_cap_processes_with_a_live_probe_take_slots_before_exited_or_fake_ones() -> None:
    from prometheus_client.core import GaugeMetricFamily

    live = {"7", "8"}
    cap = SeriesCap(3, preferred=lambda: live)

    def fam(pids: list[str]) -> GaugeMetricFamily:
        g = GaugeMetricFamily("gpufootprint_x_bytes", "x", labels=["pid"])
        for p in pids:
            g.add_metric([p], 1.0)
        return g

    # GIVEN a hundred short-lived processes seen first, holding every slot
    fakes = [str(1000 + i) for i in range(100)]
    cap.apply([fam(fakes)])
    # WHEN two processes with live probes appear
    out = cap.apply([fam(fakes + ["7", "8"])])[0]
    shown = {s.labels["pid"] for s in out.samples}
    # THEN they are shown (two of the three slots, the third is the overflow) and the rest folded
    assert shown == {"7", "8", OVERFLOW_PID}
    assert [s.value for s in out.samples if s.labels["pid"] == OVERFLOW_PID] == [100.0]
