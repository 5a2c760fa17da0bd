"""The daemon's clock moves a live probe's watermark only as a fallback, behind its declared cadence."""

from __future__ import annotations

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

    load = LoopLoad()
    t = load._since
    seq = []
    for share in (0.1, 0.5, 0.7, 0.5, 0.35, 0.25, 0.5):
        load.worked(share * 0.1)
        t += 0.1
        seq.append(load.busy(t))
    assert seq == [False, False, True, True, True, False, False]
