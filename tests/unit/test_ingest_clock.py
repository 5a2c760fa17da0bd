"""The daemon's clock moves a live probe's watermark only as a fallback, behind its declared cadence."""

from __future__ import annotations

import pytest
from gpufootprint.config import Config
from gpufootprint.ingest.server import IngestServer
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import RecordKind

from tests.conftest import ALLOC, mem, mem_batch

S = 1_000_000_000


def _server(now: list[int]) -> tuple[IngestServer, Pipeline]:
    config = Config()
    pipeline = Pipeline(config.footprint)
    return IngestServer(config, pipeline, socket_path=None, clock_ns=lambda: now[0]), pipeline


def test_a_probe_that_sends_watermarks_every_second_is_not_overtaken_by_the_clock() -> None:
    now = [1_000 * S]
    server, pipeline = _server(now)
    proc = pipeline.process(7, "probe")
    proc.info.update({"flush_mode": "period", "watermark_ms": 1000})
    # A record stamped 1.2 s ago, still on its way when the clock ticks.
    server.tick()
    assert proc.applied_to == now[0] - int(2.5 * S)
    pipeline.submit(RecordKind.MEMORY, mem_batch([mem(now[0] - int(1.2 * S), ALLOC, 0x10, 4096, pid=7)]))
    assert pipeline.late_records == 0


def test_a_probe_without_a_declared_cadence_falls_back_to_the_reorder_window() -> None:
    now = [1_000 * S]
    server, pipeline = _server(now)
    proc = pipeline.process(8, "probe")
    server.tick()
    assert proc.applied_to == now[0] - Config().footprint.reorder_window_ms * 1_000_000
    proc.info["watermark_ms"] = "soon"  # nonsense is ignored, not trusted
    now[0] += S
    server.tick()
    assert proc.applied_to == now[0] - Config().footprint.reorder_window_ms * 1_000_000


def test_the_loop_is_busy_from_60_percent_of_its_time_until_it_falls_under_30() -> None:
    from gpufootprint.ingest.tick import LoopLoad

    load = LoopLoad()  # no loop thread bound: the wall-time rule alone
    t = load._since
    seq = []
    for share in (0.1, 0.5, 0.7, 0.5, 0.35, 0.25, 0.5):
        load.worked(share * 0.1)
        t += 0.1
        seq.append(load.busy(t))
    assert seq == [False, False, True, True, True, False, False]


def test_the_loop_is_busy_from_30_percent_of_a_core_until_it_falls_under_15() -> None:
    """A loop that keeps up (little wall time waiting on nothing) but burns a third of a core on many small
    flushes is busy too; the CPU share is the loop thread's own (its first reading is the baseline)."""
    from gpufootprint.ingest.tick import LoopLoad

    cpu = [100.0]  # the loop thread's CPU time so far: a baseline, not this period's
    load = LoopLoad(thread_time=lambda: cpu[0])
    t = load._since
    seq = []
    for used in (0.05, 0.2, 0.35, 0.2, 0.16, 0.1, 0.2, 0.31):
        cpu[0] += used * 0.1
        load.worked(0.05 * 0.1)  # the wall-time rule stays off: 5 % of the time working
        t += 0.1
        seq.append(load.busy(t))
    # the first period only takes the loop thread's baseline
    assert seq == [False, False, True, True, True, False, False, True]
    assert load.cpu_share == pytest.approx(0.31)


def test_the_cpu_rule_reads_the_loop_threads_clock_not_the_caller_of_tick() -> None:
    """A replay driving the pipeline on another thread calls tick() there: its CPU is not the loop's."""
    import threading
    import time as _time

    from gpufootprint.ingest.tick import LoopLoad

    load = LoopLoad()
    idle = threading.Event()
    bound = threading.Event()

    def loop_thread() -> None:  # bound, then waits without using CPU
        load.bind_thread(threading.get_ident())
        bound.set()
        idle.wait(5)

    t = threading.Thread(target=loop_thread)
    t.start()
    assert bound.wait(5)
    now = _time.monotonic()
    load.busy(now)  # baseline
    end = _time.thread_time() + 0.05
    while _time.thread_time() < end:  # this (calling) thread burns 50 ms of CPU in 50 ms
        pass
    assert load.busy(_time.monotonic()) is False and load.cpu_share < 0.15, load.cpu_share
    idle.set()
    t.join()


def test_a_tick_after_the_loop_thread_ended_falls_back_to_the_wall_rule() -> None:
    """The loop's CPU clock is gone once its thread has ended: busy() must not raise (a tick would fail)."""
    import threading
    import time as _time

    from gpufootprint.ingest.tick import LoopLoad

    load = LoopLoad()
    t = threading.Thread(target=lambda: load.bind_thread(threading.get_ident()))
    t.start()
    t.join()
    assert load.busy(_time.monotonic()) is False
    assert load.busy(_time.monotonic() + 0.1) is False
