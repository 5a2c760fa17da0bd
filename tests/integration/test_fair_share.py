"""A shared node: a hostile local user beside an honest probe, each attack against a real daemon.

The daemon is a real ``gpufootprint daemon`` process; the honest probe is the real probe over the
fake CUPTI (tests/integration/probe_child.py), running as this test's uid (root); the hostile
process (tests/integration/hostile_child.py) runs under another uid (nobody: it calls setuid), so
the daemon sees two tenants by SO_PEERCRED, as it would two users of one node. Every attack must
leave the honest footprint exact at every scrape, its probe never refused and none of its records
dropped, and name the offender in gpufootprint_daemon_share_refusals_total{uid}.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, cli_env
from tests.daemon_process import DaemonProcess
from tests.integration.test_faults import _SETTINGS, _value, _wait
from tests.integration.test_local_attacks import _status
from tests.probe_process import finish_probe_child, start_probe_child

HOSTILE = str(ROOT / "tests" / "integration" / "hostile_child.py")
NOBODY = 65534
MIB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hostile tenant runs under another uid (setuid)")


class Node:
    """One daemon, its socket open to every uid, and the processes started beside it."""

    def __init__(self, tmp: Path, *settings: str) -> None:
        self.tmp = tmp
        args = ["--set", "daemon.socket_mode=0666", "--set", "exporter.render_interval_ms=100"]
        for s in settings:
            args += ["--set", s]
        self.daemon = DaemonProcess(tmp, *_SETTINGS, *args).ready()
        self.sock = str(self.daemon.sock)
        self.procs: list[subprocess.Popen[str]] = []

    def hostile(self, attack: str, *args: int, uid: int = NOBODY) -> subprocess.Popen[str]:
        env = dict(cli_env(), HOSTILE_UID=str(uid))
        p = subprocess.Popen([sys.executable, HOSTILE, self.sock, attack, *map(str, args)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("ready"), (line, p.stderr.read() if p.poll() is not None and p.stderr else "")
        return p

    def honest(self, *steps: str) -> subprocess.Popen[str]:
        p = start_probe_child(self.sock, self.tmp, *steps)
        self.procs.append(p)
        return p

    def metrics(self) -> dict[str, Any]:
        return self.daemon.metrics()

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.daemon.proc.pid}/status").read_text().splitlines()
        return int(next(ln for ln in status if ln.startswith("VmRSS")).split()[1]) / 1024

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        self.daemon.stop()


@pytest.fixture
def node() -> Iterator[Any]:
    # A directory every uid may traverse (pytest's tmp_path is root's alone).
    tmp = Path(tempfile.mkdtemp(prefix="fair-share-", dir="/tmp"))
    tmp.chmod(0o755)
    made: list[Node] = []

    def start(*settings: str) -> Node:
        n = Node(tmp, *settings)
        made.append(n)
        return n

    yield start
    for n in made:
        n.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def _honest_bytes(m: dict[str, Any], pid: int) -> float:
    return _value(m, "gpufootprint_live_bytes", pid=str(pid), kind="device") or 0.0


def _follow(node: Node, pid: int, before: int, after: int, scrapes: int = 5) -> None:
    """Every scrape shows the honest footprint before or after its step, never anything else; then
    ``scrapes`` scrapes in a row show it after, exactly."""
    end = time.monotonic() + 30
    seen = []
    while True:
        got = _honest_bytes(node.metrics(), pid)
        seen.append(got)
        assert got in (before, after), f"honest footprint {got} is neither {before} nor {after}: {seen}"
        if got == after:
            break
        assert time.monotonic() < end, f"the honest footprint never reached {after}: {seen[-5:]}"
        time.sleep(0.05)
    for _ in range(scrapes):
        got = _honest_bytes(node.metrics(), pid)
        assert got == after, f"honest footprint {got} after reaching {after}"
        time.sleep(0.05)


def _run_honest(node: Node, *, dev: int = 0) -> subprocess.Popen[str]:
    """The honest probe: 1 MiB, then 2 MiB more, each step followed scrape by scrape, then it ends."""
    sync = node.tmp
    for name in ("s1", "g1", "s2", "g2"):
        (sync / name).unlink(missing_ok=True)
    p = node.honest(f"alloc:0x10000:{MIB}:3:{dev}", "touch:s1", "wait:g1", f"alloc:0x400000:{2 * MIB}:3:{dev}",
                    "touch:s2", "wait:g2")
    _wait(lambda: (sync / "s1").exists(), 30)
    _follow(node, p.pid, 0, MIB)
    (sync / "g1").touch()
    _wait(lambda: (sync / "s2").exists(), 30)
    _follow(node, p.pid, MIB, 3 * MIB)
    return p


def _honest_clean(node: Node, p: subprocess.Popen[str]) -> None:
    """Its probe was never refused and dropped nothing; the daemon counted no record of it refused."""
    (node.tmp / "g2").touch()
    status = finish_probe_child(p, timeout=60)["status"]
    assert status["records_dropped"] == 0, status
    for line in node.daemon.log().splitlines():
        if f"pid={p.pid}" in line or f"pid {p.pid})" in line:
            assert not any(w in line for w in ("_limit", "refused", "cut off", "is at its")), line


def _refused(m: dict[str, Any], reason: str, uid: int = NOBODY) -> float:
    return _value(m, "gpufootprint_daemon_share_refusals_total", uid=str(uid), reason=reason) or 0.0


# --- (a) connections ---------------------------------------------------------------------------------


def test_idle_connections_of_one_tenant_do_not_keep_another_tenants_probe_out(node) -> None:
    n = node("daemon.max_connections=64")
    # GIVEN another uid holding every connection the daemon allows, each idle after its HELLO
    hostile = n.hostile("connections", 64)
    _wait(lambda: _value(n.metrics(), "gpufootprint_daemon_connections_total") == 64)
    # WHEN an honest probe starts later
    p = _run_honest(n)
    # THEN it got in (the hostile tenant's newest idle connection made room), its footprint is exact
    m = n.metrics()
    assert (_value(m, "gpufootprint_daemon_disconnects_total", reason="share_evicted") or 0) >= 1
    assert _value(m, "gpufootprint_daemon_probe_connections") == 64  # 63 of the hostile tenant's, one honest
    # AND the hostile tenant, trying to take its connections back, is refused and named
    _wait(lambda: _refused(n.metrics(), "max_connections") >= 1)
    assert any("uid/65534" in ln and "is at its" in ln for ln in n.daemon.log().splitlines())
    _honest_clean(n, p)
    assert hostile.poll() is None


def _peak_mib(node: Node) -> float:
    status = Path(f"/proc/{node.daemon.proc.pid}/status").read_text().splitlines()
    return int(next(ln for ln in status if ln.startswith("VmHWM")).split()[1]) / 1024


def _nothing_of_the_honest_refused(node: Node) -> None:
    m = node.metrics()
    mine = [(lab, v) for lab, v in m.get("gpufootprint_daemon_share_refusals_total", []) if lab.get("uid") == "0"]
    assert mine == [], mine


# --- (b) kernel names: every entry costs its charge -----------------------------------------------------


def test_empty_kernel_names_are_charged_and_cannot_grow_the_daemon(node) -> None:
    n = node()
    start = n.rss_mib()
    # GIVEN another uid sending six 15 MiB STRINGS frames of empty names (once charged nothing each)
    n.hostile("strings", 6, 15)
    _wait(lambda: _refused(n.metrics(), "strings_limit") == 6 * (15 * MIB // 14), 60)
    # THEN the daemon stayed small (it went from 46 to 827 MiB before), and the honest probe is exact
    assert _peak_mib(n) < start + 120, (start, _peak_mib(n))
    p = _run_honest(n)
    _nothing_of_the_honest_refused(n)
    _honest_clean(n, p)


# --- (c, d) resyncs count against the node-wide bounds ------------------------------------------------


def test_open_resyncs_are_bounded_in_total_and_shared_by_tenant(node) -> None:
    n = node("daemon.max_resync_records=50000")
    # GIVEN 16 connections of another uid, each inside a resync of 100,000 allocations that never ends
    n.hostile("open_resyncs", 16, 100_000)
    _wait(lambda: _refused(n.metrics(), "resync_limit") >= 16 * 100_000 - 50_000, 60)
    # THEN it holds at most the bound (it is alone: all of it), the honest probe's own resync and
    # records go through, exact
    p = _run_honest(n)
    _nothing_of_the_honest_refused(n)
    assert _refused(n.metrics(), "resync_limit") == 16 * 100_000 - 50_000
    _honest_clean(n, p)


@pytest.mark.parametrize("attack,args,reason", [
    ("resyncs", (6, 100_000), "allocation_limit"),  # completed resyncs of 6 processes
    ("allocations", (3, 100_000), "allocation_limit"),  # 3 processes fill the live-allocation bound
    ("devices", (4, 16), "device_limit"),  # 4 processes x 16 devices fill the device tables
])
def test_a_tenant_that_filled_a_node_bound_alone_leaves_room_for_a_later_honest_probe(
        node, attack: str, args: tuple[int, int], reason: str) -> None:
    n = node("daemon.max_live_allocations=250000", "daemon.max_device_footprints=48")
    # GIVEN another uid whose processes took all of a node-wide bound while alone on the node
    n.hostile(attack, *args)
    _wait(lambda: _refused(n.metrics(), reason) >= 1, 60)
    # WHEN an honest probe starts later, on a device of its own (a new device table)
    p = _run_honest(n, dev=5)
    # THEN none of its records is dropped and its footprint is exact at every scrape
    _nothing_of_the_honest_refused(n)
    _honest_clean(n, p)


# --- (g) forwarded buffers decode in bounded memory -------------------------------------------------------


def test_a_flood_of_forwarded_buffers_mixing_two_kinds_decodes_in_bounded_memory(node) -> None:
    n = node()
    start = n.rss_mib()
    # GIVEN another uid sending eight 15 MiB CUPTI buffers of MEMORY2 and MEMCPY records alternating
    h = n.hostile("buffer", 8, 15)
    # (its one record of its own pid comes after them on the same connection)
    _wait(lambda: _value(n.metrics(), "gpufootprint_daemon_records_received_total", pid=str(h.pid)) == 1, 120)
    # The connection counters are read live at a scrape, the ingest errors from the pipeline's snapshot,
    # which a busy loop rebuilds once a second: wait for the snapshot to catch up (each buffer is two
    # kinds, each counted at least once).
    _wait(lambda: (_value(n.metrics(), "gpufootprint_ingest_errors_total", reason="pid_mismatch") or 0) >= 16, 30)
    # THEN the daemon held at most the frame being read, the frame being decoded and what it decodes at
    # once (the decoding alone took ~90 MiB per frame before), and the honest probe is exact
    print(f"forwarded buffers: daemon from {start:.0f} MiB to a peak of {_peak_mib(n):.0f} MiB")
    assert _peak_mib(n) < start + 60, (start, _peak_mib(n))
    p = _run_honest(n)
    _nothing_of_the_honest_refused(n)
    _honest_clean(n, p)


# --- everything at once: the daemon stays under the DaemonSet's memory limit -------------------------


def test_the_attacks_combined_by_two_other_uids_keep_the_daemon_under_its_memory_limit(node) -> None:
    limit_mib = 512  # deploy/k8s: the DaemonSet's memory limit
    n = node()  # the default configuration
    began = time.monotonic()
    # GIVEN two other uids, each filling bounds while the other is there too, all attacks at once
    for uid in (NOBODY, NOBODY - 1):
        n.hostile("allocations", 3, 100_000, uid=uid)
        n.hostile("resyncs", 3, 100_000, uid=uid)
        n.hostile("open_resyncs", 8, 100_000, uid=uid)
        n.hostile("devices", 4, 16, uid=uid)
        n.hostile("strings", 3, 15, uid=uid)
        n.hostile("connections", 400, uid=uid)
    _wait(lambda: all(_refused(n.metrics(), r, uid) > 0 for r in ("allocation_limit", "resync_limit",
                                                                 "strings_limit") for uid in (NOBODY, NOBODY - 1)), 120)
    # THEN an honest probe of a third tenant is exact at every scrape and nothing of it is refused
    p = _run_honest(n, dev=3)
    _nothing_of_the_honest_refused(n)
    _honest_clean(n, p)
    # AND whoever is at a bound is named once a minute per tenant, while the daemon stays ready
    minutes = int((time.monotonic() - began) // 60)
    for tenant in (f"uid/{NOBODY}", f"uid/{NOBODY - 1}"):
        lines = [ln for ln in n.daemon.log().splitlines() if f"tenant {tenant} " in ln and "is at its" in ln]
        assert 1 <= len(lines) <= 1 + minutes, lines
    assert _status(n.daemon.port, "/readyz") == 200
    # AND the daemon's peak memory stayed under the DaemonSet's limit
    peak = _peak_mib(n)
    print(f"combined attack: daemon VmHWM {peak:.0f} MiB, VmRSS {n.rss_mib():.0f} MiB")
    assert peak < limit_mib, peak


# --- the process table ----------------------------------------------------------------------------------


def _pids(m: dict[str, Any]) -> set[str]:
    return {labels["pid"] for samples in m.values() for labels, _ in samples if "pid" in labels}


def test_a_tenant_that_churns_processes_past_max_processes_forgets_its_own_exited_ones_not_anothers(node) -> None:
    n = node("daemon.max_processes=16", "footprint.process_grace_seconds=600")
    # GIVEN an honest probe, exact at every scrape, that ended: its process is kept, exited, for its grace
    p = _run_honest(n)
    _honest_clean(n, p)
    _wait(lambda: str(p.pid) in _pids(n.metrics()))
    # WHEN another uid starts and ends 40 processes, each with a footprint, past daemon.max_processes
    hostile = n.hostile("churn", 40)
    # THEN at every scrape the honest process is still there, with its final footprint, while the daemon
    # forgets the churning tenant's own exited processes to stay within the bound
    end = time.monotonic() + 30
    while True:
        m = n.metrics()
        assert str(p.pid) in _pids(m), "the honest exited process was forgotten"
        assert _honest_bytes(m, p.pid) == 0  # released at its exit, as before the churn
        if (_value(m, "gpufootprint_ingest_errors_total", reason="process_limit") or 0) >= 40 + 1 - 16:
            break
        assert time.monotonic() < end, "the churn never went past the bound"
        time.sleep(0.1)
    assert hostile.poll() is None


def test_a_tenant_filling_the_nodes_metadata_leaves_an_honest_probe_its_fields_and_an_exact_footprint(node) -> None:
    # 4 KiB of fields a process, 1 MiB for the node
    n = node("daemon.max_metadata_bytes=4096")
    # GIVEN another uid whose 300 processes each hold fields up to their own bound (together past the node's)
    hostile = n.hostile("metadata", 300, 3600)
    _wait(lambda: _refused(n.metrics(), "metadata_limit") > 0, 60)
    # THEN an honest probe is exact at every scrape, its HELLO taken whole, nothing of it refused
    p = _run_honest(n)
    _nothing_of_the_honest_refused(n)
    _honest_clean(n, p)
    assert hostile.poll() is None
