"""/metrics bodies rendered ahead of the scrape (exporter/exposition.py) and the lean
text writer (exporter/text.py), which must write exactly what prometheus_client writes."""

from __future__ import annotations

import gzip
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpufootprint.config import FootprintConfig
from gpufootprint.exporter import exposition
from gpufootprint.exporter.cardinality import build_postprocess
from gpufootprint.exporter.collector import FootprintCollector
from gpufootprint.exporter.exposition import ExpositionCache, _Families
from gpufootprint.exporter.text import render_text
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as text_string_metric_families_om
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from tests.conftest import DATA, SHARED_TRACES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def _replayed_families() -> list[Metric]:
    pipeline = Pipeline(FootprintConfig())
    for name in SHARED_TRACES[:2]:
        replay_file(DATA / name, pipeline)
    snap = pipeline.snapshot()
    collector = FootprintCollector(lambda: snap, postprocess=build_postprocess(None, 2000, 256))
    return list(collector.collect())


def _awkward_families() -> list[Metric]:
    g = GaugeMetricFamily("awkward_values", "Doc with a backslash \\ and a\nnewline.", labels=["pid", "v"])
    values: list[float] = [0, 1, -1, 7, 999_999, 1_000_000, 123_456_789, 2**53 + 1, -(10**15) + 1, -(10**15),
                           -(10**17), 0.5, -2.25, 1e-9, 1.5e300, math.inf, -math.inf, math.nan, True, False]
    for i, v in enumerate(values):
        g.add_metric([str(i), repr(v)], v)
    g.add_metric(["q", 'a "quoted" \\ back\nslash \u00e9 \u2603'], 3)
    c = CounterMetricFamily("awkward_events", "Counter.", labels=["pid"])
    c.add_metric(["1"], 5)
    c.add_metric(["2"], 2.5)
    created = CounterMetricFamily("awkward_created", "A counter with _created samples.", labels=["pid"])
    created.add_metric(["1"], 4, created=1_700_000_000.5)
    info = InfoMetricFamily("awkward_build", "Info.")
    info.add_metric([], {"version": "1.2\"3", "python": "3.11"})
    hist = HistogramMetricFamily("awkward_seconds", "Histogram.", buckets=[("0.1", 1), ("+Inf", 3)], sum_value=0.7)
    stamped = GaugeMetricFamily("awkward_stamped", "A sample with a timestamp.")
    stamped.add_metric([], 1.0, timestamp=1_700_000_000.25)
    utf8 = GaugeMetricFamily("awkward.dotted.name", "A name outside the legacy character set.")
    utf8.add_metric([], 1.0)
    odd_label = GaugeMetricFamily("awkward_labels", "A label name outside the legacy set.")
    odd_label.samples.append(Sample("awkward_labels", {"bad-name": "x", "pid": "1"}, 1.0))
    no_labels = GaugeMetricFamily("awkward_plain", "No labels.", value=12)
    empty = GaugeMetricFamily("awkward_empty", "No samples at all.", labels=["pid"])
    return [g, c, created, info, hist, stamped, utf8, odd_label, no_labels, empty]


@pytest.mark.parametrize("families", [_replayed_families, _awkward_families], ids=["replayed traces", "awkward"])
def test_the_lean_writer_writes_exactly_what_prometheus_client_writes(families) -> None:  # type: ignore[no-untyped-def]
    fams = families()
    expected = generate_latest(_Families(fams))
    assert render_text(fams) == expected
    assert len(expected) > 1000


def test_the_lean_writer_is_faster_than_prometheus_client_on_per_process_families() -> None:
    fams = _replayed_families()
    n = 20
    lib = lean = 0.0
    # CPU time of this thread, interleaved: wall time on a loaded machine (the suite's other workers)
    # measured the scheduler's time slices, about equal for both writers.
    for _ in range(n):
        t0 = time.thread_time()
        generate_latest(_Families(fams))
        t1 = time.thread_time()
        render_text(fams)
        t2 = time.thread_time()
        lib, lean = lib + t1 - t0, lean + t2 - t1
    assert lean < lib * 0.8, (lean / n, lib / n)


class CountingRegistry(Collector):
    """A registry whose value changes at each collection, so a test can tell renderings apart."""

    def __init__(self) -> None:
        self.collections = 0

    def collect(self) -> Iterator[Metric]:
        self.collections += 1
        g = GaugeMetricFamily("gpufootprint_test_generation", "Which collection this is.", labels=["pid"])
        g.add_metric(["1"], self.collections)
        yield g


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _generation(body: bytes) -> float:
    text = body.decode()
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "gpufootprint_test_generation")


def test_the_first_scrape_renders_at_once_and_later_scrapes_get_the_cached_body() -> None:
    reg, clock = CountingRegistry(), FakeClock()
    cache = ExpositionCache(reg, 1.0, clock=clock)
    first = cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False)
    assert _generation(first) == 1 and reg.collections == 1  # not empty: rendered on the request
    clock.now += 0.9
    assert cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False) is first
    assert reg.collections == 1  # the scrape did not collect again
    cache.render()  # what the render thread does every interval
    second = cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False)
    assert _generation(second) == 2 and reg.collections == 2


def test_each_body_says_when_it_was_collected_and_how_long_the_previous_rendering_took() -> None:
    reg, clock = CountingRegistry(), FakeClock()
    cache = ExpositionCache(reg, 1.0, clock=clock, wall=lambda: 1_700_000_123.5)
    text = cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False).decode()
    assert "gpufootprint_exporter_body_timestamp_seconds 1.7000001235e+09\n" in text
    assert "gpufootprint_exporter_render_duration_seconds" not in text  # no previous rendering yet
    cache.render()
    text = cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False).decode()
    assert re.search(r"\ngpufootprint_exporter_render_duration_seconds 0\.0\n", text)  # the fake clock stood still
    documented = set(re.findall(r"`(gpufootprint_[a-z_]+)`", DOCS.read_text()))
    assert {"gpufootprint_exporter_body_timestamp_seconds", "gpufootprint_exporter_render_duration_seconds"} \
        <= documented


def test_gzip_and_openmetrics_bodies_are_cached_like_the_text_one() -> None:
    reg, clock = CountingRegistry(), FakeClock()
    cache = ExpositionCache(reg, 1.0, clock=clock)
    plain = cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False)
    zipped = cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, True)
    assert gzip.decompress(zipped) == plain
    encoder, ctype = choose_encoder(OPENMETRICS)
    om = cache.body(encoder, ctype, True)
    assert reg.collections == 1  # a new format is written from the current families
    text = gzip.decompress(om).decode()
    assert text.endswith("# EOF\n") and "gpufootprint_test_generation{pid=\"1\"} 1.0" in text
    assert cache.body(encoder, ctype, True) is om
    cache.render()  # every format asked for is rendered from now on, plain and gzipped
    assert reg.collections == 2
    om2 = cache.body(encoder, ctype, True)
    assert om2 is not om and "gpufootprint_test_generation{pid=\"1\"} 2.0" in gzip.decompress(om2).decode()
    assert gzip.decompress(om2) == generate_openmetrics(_Families(cache._families or []))


def test_a_stale_cache_is_not_served() -> None:
    reg, clock = CountingRegistry(), FakeClock()
    cache = ExpositionCache(reg, 1.0, clock=clock)
    cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False)
    clock.now += exposition.STALE_INTERVALS * 1.0 - 0.01
    assert _generation(cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False)) == 1
    clock.now += 0.02  # the render thread has not rendered for five intervals: render on the request
    assert _generation(cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False)) == 2


def test_scrapes_that_find_no_body_at_the_same_time_render_once() -> None:
    class Slow(CountingRegistry):
        def collect(self) -> Iterator[Metric]:
            time.sleep(0.2)  # a rendering long enough for the other scrapes to queue behind it
            yield from super().collect()

    reg = Slow()
    cache = ExpositionCache(reg, 1.0)
    bodies: list[bytes] = []
    threads = [threading.Thread(target=lambda: bodies.append(cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4,
                                                                        False))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(bodies) == 4 and reg.collections == 1
    assert all(b is bodies[0] for b in bodies)


def test_formats_are_bounded_and_forgotten_when_nobody_asks_for_them() -> None:
    reg, clock = CountingRegistry(), FakeClock()
    cache = ExpositionCache(reg, 1.0, clock=clock)
    encoder, _ = choose_encoder(OPENMETRICS)
    for i in range(10):  # a client naming a new version each time
        body = cache.body(encoder, f"application/openmetrics-text; version=1.0.{i}", False)
        assert body.endswith(b"# EOF\n")
    assert len(cache._wanted) == exposition.MAX_FORMATS
    cache.render()
    assert len(cache._bodies) == exposition.MAX_FORMATS
    clock.now += exposition.FORGET_S + 1
    cache.body(encoder, OPENMETRICS, False)  # stale: renders, forgetting the formats nobody asked for
    assert set(cache._wanted) == {OPENMETRICS}
    assert set(cache._bodies) == {(OPENMETRICS, False)}


def test_the_render_thread_renders_every_interval_and_survives_a_failing_collection() -> None:
    class Flaky(CountingRegistry):
        def collect(self) -> Iterator[Metric]:
            if self.collections == 1:
                self.collections += 1
                raise RuntimeError("boom")
            yield from super().collect()

    reg = Flaky()
    cache = ExpositionCache(reg, 0.02)
    cache.start()
    try:
        end = time.monotonic() + 10
        while cache.renders < 3 and time.monotonic() < end:
            time.sleep(0.01)
        assert cache.renders >= 3 and cache.render_errors == 1
        assert _generation(cache.body(generate_latest, CONTENT_TYPE_PLAIN_0_0_4, False)) >= 3
    finally:
        cache.stop()
    assert cache._thread is not None and not cache._thread.is_alive()


def test_a_daemon_registry_is_served_through_the_cache_over_http() -> None:
    import urllib.request

    from gpufootprint.exporter.http import MetricsServer

    reg = CollectorRegistry(auto_describe=False)
    counting = CountingRegistry()
    reg.register(counting)
    server = MetricsServer(reg, "127.0.0.1", 0, ready=lambda: True, exposition=ExpositionCache(reg, 60.0))
    server.start()
    try:
        req = urllib.request.Request(server.url, headers={"Accept-Encoding": "gzip", "Accept": OPENMETRICS})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
            first = gzip.decompress(resp.read()).decode()
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            assert resp.headers["Content-Encoding"] is None
            plain = resp.read().decode()
    finally:
        server.stop()
    assert first.endswith("# EOF\n") and "gpufootprint_exporter_body_timestamp_seconds" in first
    om_generation = next(s.value for fam in text_string_metric_families_om(first) for s in fam.samples
                         if s.name == "gpufootprint_test_generation")
    assert _generation(plain.encode()) == om_generation  # one collection served both formats
