"""The exporter: families from a snapshot, names documented, and collect() never raises."""

from __future__ import annotations

import re
from pathlib import Path

from gpufootprint.config import FootprintConfig
from gpufootprint.exporter.collector import FootprintCollector
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file
from gpufootprint.snapshot import PipelineSnapshot
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from tests.conftest import DATA, SHARED_TRACES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _registry(snapshot: PipelineSnapshot) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FootprintCollector(lambda: snapshot))
    return reg


def _replayed() -> PipelineSnapshot:
    pipeline = Pipeline(FootprintConfig())
    replay_file(DATA / SHARED_TRACES[0], pipeline)
    return pipeline.snapshot()


def test_replayed_trace_exports_its_end_state() -> None:
    text = generate_latest(_registry(_replayed())).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    key = ("gpufootprint_live_bytes", (("gpu", "0"), ("kind", "device"), ("pid", "855"), ("source", "trace")))
    assert samples[key] == 291768320  # the trace's "end" mark
    cpy = ("gpufootprint_memcpy_bytes_total", (("direction", "htod"), ("gpu", "0"), ("pid", "855"), ("source", "trace")))
    assert samples[cpy] > 64 << 20


def test_every_exported_metric_is_documented() -> None:
    text = generate_latest(_registry(_replayed())).decode()
    documented = set(re.findall(r"`(gpufootprint_[a-z_]+)`", DOCS.read_text()))
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    exported = {re.sub(r"_created$", "", n) for n in exported}
    missing = sorted(n for n in exported if n not in documented)
    assert missing == [], f"add these to docs/metrics.md: {missing}"


def test_collect_survives_a_broken_snapshot() -> None:
    def broken() -> PipelineSnapshot:
        raise RuntimeError("boom")

    reg = CollectorRegistry(auto_describe=False)
    collector = FootprintCollector(broken)
    reg.register(collector)
    text = generate_latest(reg).decode()
    assert "gpufootprint_exporter_collect_errors_total 1.0" in text
