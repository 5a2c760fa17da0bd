"""Exact under allocation churn: the real probe (CUPTI faked as it behaves under churn) over a real
Unix socket into the real ingest server.

Under churn CUPTI hands a busy thread's full buffers over at once while a quiet thread's half-full
buffer waits for the next forced flush, and an API call can take its timestamp before a flush and
write its record after it. A daemon that advanced a probe by "newest record minus the reorder
window" applied the quiet thread's releases after the busy thread had reused the addresses
(double allocations, releases without allocation, late records: the footprint wrong, silently).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_probe_link import Daemon, child, finish
from tests.native import shim


@pytest.mark.parametrize("forward", ["c", "1", "0"],
                         ids=["buffers_forwarded_by_the_c_forwarder", "buffers_forwarded", "buffers_read_in_the_probe"])
def test_churn_across_threads_is_applied_in_time_order_with_no_late_record_and_no_drift(tmp_path: Path,
                                                                                         forward: str) -> None:
    # Two tries: on a starved 2-core test machine a thread held off its CPU longer than a watermark period
    # (200 ms here) can make one record late (docs/known-issues.md, "A record can come late on a starved
    # machine": once in about five full runs on 2026-12-06, once on 2026-12-07). The fault this test found
    # made 15 late records in every run, so a second try hides no regression of it.
    _twice(lambda where: _churn_across_threads(where, forward), tmp_path)


def _twice(run: Callable[[Path], str | None], tmp_path: Path, tries: int = 2, pause_s: float = 0.0) -> None:
    """``run`` in a fresh folder until it holds, two tries at most (the tests that call it say why), or
    ``tries``, ``pause_s`` apart (a neighbour's busy spell on a shared machine is often longer than one try)."""
    failures = []
    for attempt in range(tries):
        if attempt and pause_s:
            time.sleep(pause_s)
        where = tmp_path / f"try{attempt}"
        where.mkdir()
        failure = run(where)
        if failure is None:
            return
        failures.append(failure)
    pytest.fail("; ".join(failures))


def _failed(checks: list[tuple[bool, str]]) -> str | None:
    """What did not hold among ``checks``, or None."""
    bad = [detail for ok, detail in checks if not ok]
    return "; ".join(bad)[:2000] if bad else None


def _churn_across_threads(where: Path, forward: str) -> str | None:
    """One run of the test above: None when everything held, else what did not."""
    sock = str(where / "p.sock")
    daemon = Daemon(sock)
    try:
        p = child(sock, where, "sleep:0.3", "churn:3", "mark:end", FAKE_STREAMS="1", FAKE_BUFFER_RECORDS="64",
                  GPUFOOTPRINT_PROBE_WATERMARK_MS="200", GPUFOOTPRINT_PROBE_FORWARD_BUFFERS="0" if forward == "0" else "1",
                  GPUFOOTPRINT_PROBE_NATIVE_FORWARD="1" if forward == "c" else "0")
        status = finish(p)
        end = daemon.wait_mark("end")
    finally:
        daemon.stop()
    # The scenario happened: buffers handed over both ways, many watermarks and checks.
    assert status["fake"]["full_buffers"] > 50 and status["fake"]["partial_buffers"] > 5, status["fake"]
    # after its first watermark the daemon read CUPTI's buffers itself (the probe forwarded them unread)
    forwarded = status["status"]["forwarded_buffers"]
    assert forwarded > 50 if forward != "0" else forwarded == 0, status["status"]
    # by the C forwarder's thread (most: the probe reads those that come before the daemon asks), or never
    native = status["status"]["native_forwards"]
    assert native > forwarded // 2 if forward == "c" else native == 0, status["status"]
    # each without a checksum: this daemon said it takes them so (framing.CUPTI_BUFFERS_UNCHECKED)
    assert status["status"]["forwarded_unchecked"] == forwarded, status["status"]
    pipeline = daemon.pipeline
    (proc,) = pipeline.processes.values()
    checks = [(status["status"]["records_dropped"] == 0, "records_dropped", status["status"]["records_dropped"]),
              (dict(pipeline.errors.counts) == {}, "errors", dict(pipeline.errors.counts)),
              (pipeline.late_records == 0, "late_records", pipeline.late_records),
              (end["matches"], "end", end),
              (proc.drift_checks >= 5 and proc.drift_mismatches == 0 and proc.drift_bytes == 0, "drift",
               (proc.drift_checks, proc.drift_mismatches, proc.drift_bytes)),
              (pipeline.verify_results["match"] >= 5 and pipeline.verify_results["mismatch"] == 0, "verify",
               dict(pipeline.verify_results))]
    return _failed([(ok, f"{name}: {detail!r}") for ok, name, detail in checks])


def _wait_file(path: Path, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.01)


@pytest.mark.parametrize("native_forward", ["0", "1"], ids=["read_by_the_sender", "by_the_c_forwarder"])
def test_records_dropped_while_the_daemon_stalls_are_repaired_by_a_resync_on_the_same_connection(
        tmp_path: Path, native_forward: str) -> None:
    """A busy or stopped daemon fills the probe's socket buffer while the connection stays up: the
    probe drops batches (it never blocks the workload), then resyncs its table once it can, and the
    footprint equals the probe's table again (before: freed allocations stayed "live" for ever)."""
    sock = str(tmp_path / "p.sock")
    daemon = Daemon(sock)
    try:
        p = child(sock, tmp_path, "sleep:0.3", "touch:ready", "wait:go", "burst:20000", "touch:burst_done",
                  "wait:resume", "until:drop_resyncs:1", "mark:end", GPUFOOTPRINT_PROBE_BUFFER_BYTES="1048576",
                  GPUFOOTPRINT_PROBE_WATERMARK_MS="200", GPUFOOTPRINT_PROBE_NATIVE_FORWARD=native_forward)
        _wait_file(tmp_path / "ready")
        with daemon.server.lock:  # the ingest loop blocks at its next tick: nothing is read
            time.sleep(0.3)
            (tmp_path / "go").touch()
            _wait_file(tmp_path / "burst_done")
            time.sleep(1.0)  # the probe keeps flushing into a full socket
        (tmp_path / "resume").touch()
        status = finish(p)["status"]
        end = daemon.wait_mark("end")
    finally:
        daemon.stop()
    assert status["dropped_buffer_full"] > 0, status
    assert status["drop_resyncs"] >= 1, status
    assert status["forwarded_buffers"] > 0, status
    assert (status["native_forwards"] > 0) == (native_forward == "1"), status
    assert end["matches"], end
    (proc,) = daemon.pipeline.processes.values()
    assert proc.drift_bytes == 0


@pytest.mark.parametrize("forward", ["1", "0"], ids=["buffers_forwarded", "buffers_read_in_the_probe"])
def test_threads_that_reuse_each_others_addresses_read_exact_while_the_process_lives(tmp_path: Path, forward: str,
                                                                                      daemons) -> None:  # type: ignore[no-untyped-def]
    """A release stamped after the reuse of its address (two threads around the driver's lock) retires
    the old allocation, in the daemon's table and the probe's alike: the live view, read while the
    process still runs, is the truth; no ingest error, no drift, every repair counted."""
    from tests.daemon_process import scrape, wait
    from tests.integration.test_oom_live import _live_device
    from tests.probe_process import finish_probe_child, start_probe_child

    # the daemon as deployed (every timing at its default), its OOM captures kept in the test's folder
    daemon = daemons("--set", f"oom.directory={tmp_path / 'oom'}").ready()
    port, sock = daemon.port, daemon.sock
    try:
        p = start_probe_child(sock, tmp_path, "sleep:0.3", "alloc:0x1000:1048576", "reuse_inverted:300",
                              "touch:reused", "wait:checked", FAKE_BUFFER_RECORDS="64",
                              GPUFOOTPRINT_PROBE_FORWARD_BUFFERS=forward)
        _wait_file(tmp_path / "reused")
        truth = (1 << 20) + 300 * 65536
        assert wait(lambda: _live_device(port, p.pid) == truth, timeout=5)
        metrics = scrape(port)
        errors = {labels["reason"]: v for labels, v in metrics.get("gpufootprint_ingest_errors_total", [])}
        repairs = {labels["reason"]: v for labels, v in metrics.get("gpufootprint_ingest_repairs_total", [])}
        assert errors.get("double_allocation", 0) == 0 and errors.get("release_without_allocation", 0) == 0
        assert repairs == {"late_release_of_reused_address": 300.0}
        # the probe's own table agrees (its drift checks against the daemon read no mismatch)
        drift = [v for labels, v in metrics.get("gpufootprint_footprint_drift_mismatches_total", [])
                 if labels.get("pid") == str(p.pid)]
        assert not any(drift)
        assert p.poll() is None
        (tmp_path / "checked").touch()
        status = finish_probe_child(p)
        assert status["status"]["table_late_releases"] == 300 and status["status"]["table_lost_releases"] == 0
    finally:
        (tmp_path / "checked").touch()


@pytest.mark.parametrize("native_forward", ["0", "1"], ids=["read_by_the_sender", "by_the_c_forwarder"])
def test_bursts_of_full_buffers_behind_busy_python_threads_reach_a_daemon_that_keeps_up_with_none_dropped(
        tmp_path: Path, native_forward: str) -> None:
    """On the H100, four PyTorch threads under cudaMallocAsync made CUPTI's thread hand over about 14 MB of
    records a second, in bursts ten times a second, and the probe dropped 11,478 records for a full send
    buffer while the daemon, which reads a million records a second, kept up. Behind busy Python threads
    each wake of the sender waits for the GIL, and the sender sent only what the socket took at once (the
    kernel holds about 200 KiB of a Unix socket's data) each wake: the rest piled up. Here a C thread
    stands in for CUPTI's (no GIL) and two Python threads hold the GIL as a framework's do."""
    compiled = shim.build(tmp_path) if shim.compiler() else None
    if compiled is None:
        pytest.skip("no C compiler for tests/native/cupti_threads.c (CUPTI's thread, without the GIL)")
    # Three tries, 3 s apart: on a 2-core test machine whose other test worker is busy too, the probe's own
    # process and the daemon are starved. Beside four to six CPU-bound processes (2026-12-07, the 2-core VM)
    # 15 tries of 60 dropped records (4 of 8 beside six with the tree before the C pairing, 0fc1bae^); renicing
    # either the probe's process or the daemon's threads took most of that away. With the sender's wait for
    # the socket's room in one C call (gfp_pump) 7-9 of 40 tries beside five or six dropped, against 33-34 of 40
    # (python -m tests.integration.starved_tries; docs/known-issues.md). A suite run failed both of two
    # back-to-back tries once (2026-12-07 19:40 UTC), a neighbour's busy spell outlasting both. The fault
    # this test found failed every run (three of three on 20c0614), so more tries hide no regression of it.
    _twice(lambda where: _bursts_behind_busy_threads(where, compiled, GPUFOOTPRINT_PROBE_NATIVE_FORWARD=native_forward),
           tmp_path, tries=3, pause_s=3.0)


def _bursts_behind_busy_threads(where: Path, compiled: Path, **env: str) -> str | None:
    """One run of the test above: None when everything held, else what did not."""
    sock = str(where / "p.sock")
    daemon = Daemon(sock)
    try:
        # forwarding first: before the daemon's first control the probe reads buffers itself, a path that
        # still lets the GIL go (docs/known-issues.md)
        p = child(sock, where, "sleep:0.3", "forwarding", "mark:start", "stream:3:10:2", "mark:end",
                  STREAM_SHIM=str(compiled), **env)
        res = finish(p)
        end = daemon.wait_mark("end")
    finally:
        daemon.stop()
    status = res["status"]
    assert status["native_callbacks"] == 1, status
    # 16 buffers of 64 KiB, 30 times, none refused by the probe's pool
    checks = [(res["fake"]["buffers_delivered"] == 480 and res["fake"]["stream_refused_buffers"] == 0, res["fake"]),
              (status["raw_buffers"] == 480 and status["forwarded_buffers"] == 480, status),
              # the C forwarder's, where asked for: all but what came before the daemon asked for buffers unread
              ((status["native_forwards"] > 400) == (env.get("GPUFOOTPRINT_PROBE_NATIVE_FORWARD") == "1"), status),
              (status["records_dropped"] == 0 and status["drop_resyncs"] == 0, status),
              (dict(daemon.pipeline.errors.counts) == {} and daemon.pipeline.late_records == 0,
               dict(daemon.pipeline.errors.counts)),
              (end["matches"] and end["live_bytes"].get("device", 0) == 0, end)]
    return _failed([(ok, repr(detail)) for ok, detail in checks])


def test_a_probe_that_says_it_reads_forwarded_buffers_is_asked_for_them_at_its_hello(tmp_path: Path) -> None:
    """Until the daemon asks for CUPTI's buffers unread the probe reads them itself, a path whose numpy lets
    the GIL go and so, behind busy Python threads, falls behind and drops records. A daemon that asked only
    at the probe's first watermark left that open for half a watermark period or more after each connect
    (2.6-5.1 s measured with the default 1 s; 10.2 s here before the change); here watermarks come every 20 s,
    so only an ask at the HELLO passes."""
    sock = str(tmp_path / "p.sock")
    daemon = Daemon(sock)
    try:
        p = child(sock, tmp_path, "forwarding", "burst:200", "mark:end", GPUFOOTPRINT_PROBE_WATERMARK_MS="20000")
        res = finish(p)
        end = daemon.wait_mark("end")
    finally:
        daemon.stop()
    status = res["status"]
    assert res["waited"]["forwarding"] < 5.0, res["waited"]
    assert status["forwarded_buffers"] > 0 and status["records_dropped"] == 0, status
    assert dict(daemon.pipeline.errors.counts) == {} and daemon.pipeline.late_records == 0
    assert end["matches"], end


def test_a_buffer_our_walk_cannot_read_is_not_forwarded_and_the_daemon_stays_exact(tmp_path: Path) -> None:
    """Seen once on an H200 (2026-12-07, run of 392bc99 under cudaMallocAsync): the probe's walk refused a
    buffer, CUPTI's walk read it, and the probe forwarded it unread anyway; the daemon, whose walk is the
    probe's, could not walk it and dropped it whole (``bad_cupti_buffer``), and the footprint drifted until a
    resync. A buffer read by CUPTI's walk is now packed in the probe: the daemon gets what CUPTI's walk
    found, while the process runs. Here a record no walk can size ends a buffer (records in order), so
    CUPTI's walk reads the two before it: the daemon must hold them (3,072 bytes live, not the 1,536 it held
    before them)."""
    sock = str(tmp_path / "p.sock")
    daemon = Daemon(sock)
    try:
        p = child(sock, tmp_path, "forwarding", "alloc:0x1000:512", "alloc:0x2000:1024", "mark:before",
                  "alloc:0x3000:2048", "free:0x1000:512", "odd", "mark:after", "burst:200", "mark:end",
                  FAKE_BUFFER_RECORDS="64", FAKE_SHUFFLE="0")
        res = finish(p)
        before, after, end = daemon.wait_mark("before"), daemon.wait_mark("after"), daemon.wait_mark("end")
    finally:
        daemon.stop()
    status = res["status"]
    assert status["raw_walk_fallbacks"] == 1, status  # the scenario: one buffer our walk refused
    assert status["raw_walk_unread_bytes"] == 32, status  # the odd record itself, past CUPTI's last one
    assert status["forwarded_buffers"] > 0, status  # the others went out unread, as before
    assert "bad_cupti_buffer" not in daemon.pipeline.errors.counts, dict(daemon.pipeline.errors.counts)
    assert before["live_bytes"] == {"device": 1536} and before["matches"], before
    assert after["live_bytes"] == {"device": 3072} and after["matches"], after  # the packed buffer's two records
    assert end["live_bytes"] == {"device": 3072} and end["matches"], end
    (proc,) = daemon.pipeline.processes.values()
    assert proc.drift_mismatches == 0
    # and the probe says where its walk stopped, for the next one seen on a GPU
    assert any("our walk cannot read it (unknown record kind 999 at byte 256 of 288); CUPTI's walk found 2 of kind"
               in e for e in res["errors"]), res["errors"]


def test_a_buffer_whose_walks_disagree_is_not_forwarded(tmp_path: Path) -> None:
    """Checking its walk against CUPTI's (``raw_verify_walk``, as the GPU tests run), the probe that finds them
    apart takes CUPTI's: then it packs the buffer, since the daemon would walk it as the probe did. Here
    CUPTI's walk misses each buffer's last record: the daemon's view equals the probe's at every mark, and
    nothing went out unread."""
    sock = str(tmp_path / "p.sock")
    daemon = Daemon(sock)
    try:
        p = child(sock, tmp_path, "forwarding", "alloc:0x1000:512", "alloc:0x2000:1024", "mark:one",
                  "burst:50", "mark:two", FAKE_BUFFER_RECORDS="64", FAKE_SHUFFLE="0", FAKE_WALK_DISAGREES="1",
                  GPUFOOTPRINT_PROBE_RAW_VERIFY_WALK="1")
        res = finish(p)
        one, two = daemon.wait_mark("one"), daemon.wait_mark("two")
    finally:
        daemon.stop()
    status = res["status"]
    assert status["raw_walk_mismatches"] >= 2 and status["forwarded_buffers"] == 0, status
    assert one["matches"] and two["matches"], (one, two)
    assert any("our walk and CUPTI's disagree" in e for e in res["errors"]), res["errors"]
    assert "bad_cupti_buffer" not in daemon.pipeline.errors.counts
