"""ingest/tenants.py: fair shares of the node-wide bounds, and who makes room at max_connections."""

from __future__ import annotations

from pathlib import Path

from gpufootprint.ingest.tenants import CEILING, Census, Holder, Room, make_room, share, tenant_of
from gpufootprint.ingest.validate import METADATA_VALUE_CHARGE, bounded_metadata, metadata_charge

from tests.conftest import DATA


def _census(**tenants: list[int]) -> Census:
    c = Census()
    for tenant, pids in tenants.items():
        for pid in pids:
            c.connect(pid, 0, tenant)
    return c


def test_the_tenant_is_the_pod_of_the_cgroup_else_the_uid(tmp_path: Path) -> None:
    (tmp_path / "10").mkdir()
    (tmp_path / "10" / "cgroup").write_text((DATA / "cgroup" / "v1-systemd-containerd.txt").read_text())
    (tmp_path / "11").mkdir()
    (tmp_path / "11" / "cgroup").write_text((DATA / "cgroup" / "v2-host-session.txt").read_text())
    assert tenant_of(10, 1000, tmp_path).startswith("pod/")
    assert tenant_of(11, 1000, tmp_path) == "uid/1000"
    assert tenant_of(12, 7, tmp_path) == "uid/7"  # gone already: its uid


def test_a_tenant_alone_takes_all_then_others_get_their_share_up_to_the_ceiling() -> None:
    census = _census(a=[1])
    room = Room("live")
    assert room.room(1, 100, census) == 100
    room.add(1, 100, census)
    census.connect(2, 0, "b")
    # the first tenant is over its new share: it cannot grow; the newcomer gets its whole share
    assert room.room(1, 100, census) == 0
    assert room.room(2, 100, census) == 50
    room.add(2, 50, census)
    census.connect(3, 0, "c")
    assert room.room(3, 100, census) == min(share(100, 3), CEILING * 100 - 150)
    # inside a tenant, by process
    census.connect(4, 0, "c")
    assert room.room(4, 100, census) == share(share(100, 3), 2)


def test_at_max_connections_the_biggest_tenants_newest_idle_connection_makes_room() -> None:
    hog = [Holder(i, 1, "uid/9", float(i), idle=i != 3) for i in range(4)]
    assert make_room(hog, 2, "uid/0", 8) is True
    victim = make_room(hog, 2, "uid/0", 4)
    assert isinstance(victim, Holder) and victim.key == 2  # the newest idle one, not the reporting one (3)
    # the hog itself, at its share, is refused
    assert make_room(hog, 1, "uid/9", 4) is False
    # inside one tenant, a second process takes room from the process holding the most
    victim = make_room(hog, 5, "uid/9", 4)
    assert isinstance(victim, Holder) and victim.pid == 1


def test_metadata_is_charged_per_value_so_many_empty_ones_are_not_free() -> None:
    assert metadata_charge({"a": ""}) == len('{"a": ""}') + 3 * METADATA_VALUE_CHARGE
    many = {f"k{i}": "" for i in range(250)}
    assert len('{"k0": ""}') * 250 < 8192  # the JSON alone would fit
    assert not bounded_metadata({}, many, 8192)
    assert bounded_metadata({}, {"pid": 1, "host": "n1", "argv": ["python", "train.py"]}, 8192)


def test_offenders_are_counted_by_a_bounded_set_of_uids_and_logged_once_a_minute_per_tenant(caplog) -> None:
    import logging

    from gpufootprint.ingest.tenants import MAX_OFFENDER_UIDS, Offenders

    now = [0.0]
    off = Offenders(logging.getLogger("test.offenders"), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.offenders"):
        for uid in range(MAX_OFFENDER_UIDS + 8):
            off.note(uid, f"uid/{uid}", 100 + uid, "allocation_limit", 5, "tenant")
        for _ in range(10):  # the same tenant again within the minute: counted, not logged
            off.note(0, "uid/0", 100, "device_limit", 1, "process")
        now[0] = 61.0
        off.note(0, "uid/0", 100, "device_limit", 1, "process")
    labels = {uid for uid, _ in off.refused}
    assert len(labels) == MAX_OFFENDER_UIDS + 1 and "other" in labels
    assert off.refused[("other", "allocation_limit")] == 8 * 5
    assert off.refused[("0", "device_limit")] == 11
    lines = [r.getMessage() for r in caplog.records if "uid/0 " in r.getMessage()]
    assert len(lines) == 2 and "device_limit=11" in lines[1], lines


def test_past_max_processes_the_tenant_holding_the_most_forgets_its_own_exited_processes_first() -> None:
    from gpufootprint.config import FootprintConfig
    from gpufootprint.ingest.tick import bound_processes
    from gpufootprint.pipeline import Pipeline

    p = Pipeline(FootprintConfig())
    owner = {}
    # an honest tenant: 3 processes, 2 of them exited long ago; a churning tenant: 9 processes, all
    # exited more recently
    for pid, t, exited in [(1, "honest", 10.0), (2, "honest", 11.0), (3, "honest", None)] + [
            (100 + i, "churn", 50.0 + i) for i in range(9)]:
        p.process(pid, "probe").exited_at = exited
        owner[pid] = t
    bound_processes(p, 8, owner.__getitem__)
    # 4 over the bound: all four are the churning tenant's, its oldest exits first
    assert sorted(p.processes) == [1, 2, 3, 104, 105, 106, 107, 108]
    assert p.errors.counts["process_limit"] == 4
    # with a bound of 4 (2 a tenant) both are past their share: the churning one gives up its own down to
    # its share, then the honest one its oldest
    bound_processes(p, 4, owner.__getitem__)
    assert sorted(p.processes) == [2, 3, 107, 108]
    # while the churning tenant's processes are alive, nothing of the honest one (within its share of 4)
    # is forgotten: the churning tenant's exited ones go, then the table waits over the bound
    for pid in range(200, 210):
        p.process(pid, "probe")
        owner[pid] = "churn"
    bound_processes(p, 8, owner.__getitem__)
    assert sorted(p.processes) == [2, 3, *range(200, 210)]


def test_the_nodes_metadata_is_shared_by_tenant_a_tenant_alone_cannot_keep_a_later_one_out() -> None:
    from gpufootprint.ingest.validate import METADATA_PROCESSES, Guard, Limits

    guard = Guard(Limits(max_metadata_bytes=1024))
    total = 1024 * METADATA_PROCESSES
    # GIVEN a tenant alone whose processes hold the node's whole metadata total
    for pid in range(1, METADATA_PROCESSES + 1):
        guard.census.connect(pid, 65534, "uid/65534")
        assert guard.take_metadata(pid, 1024)
    guard.census.connect(999, 65534, "uid/65534")
    assert not guard.take_metadata(999, 1024)  # its next process finds no room: the total is used
    assert guard.metadata.used == total
    # WHEN another tenant's process arrives
    guard.census.connect(5000, 0, "uid/0")
    # THEN it takes its fields (the ceiling's room), while the first cannot grow past its share
    assert guard.take_metadata(5000, 1024)
    assert not guard.take_metadata(1, 2048)
    # ... a process may shrink its fields, and a forced identity is always kept (and counted)
    assert guard.take_metadata(1, 100)
    assert guard.take_metadata(999, 300, force=True)
    assert guard.metadata.by_pid[999] == 300
