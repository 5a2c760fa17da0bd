from __future__ import annotations

from gpufootprint.exporter.collector import FootprintCollector
from gpufootprint.snapshot import EMPTY_SNAPSHOT, PipelineSnapshot, ProcessSnapshot
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry


def test_probe_counters_from_heartbeats_become_per_process_metrics() -> None:
    proc = ProcessSnapshot(pid=77, source="probe", exited=False, info={}, devices=(), pending_records=0, as_of_ns=0,
                           probe_counters={"records_sent": 10.0, "records_dropped": 3.0, "reconnects": 1.0,
                                           "cupti_dropped_records": 97.0, "driver_hooks": 1.0,
                                           "callback_seconds": 0.25, "cupti_gap_seconds": 0.5,
                                           "own_device_bytes": 8388608.0, "own_host_bytes": 1000.0,
                                           "connections_ok": 2.0, "connections_missing": 5.0,
                                           "disconnects_peer_closed": 1.0})
    snap = PipelineSnapshot(taken_at=1.0, processes=(proc,), records_ingested={}, ingest_errors={}, late_records=0,
                            window_peak_seconds=60.0)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FootprintCollector(lambda: snap))
    text = generate_latest(reg).decode()
    for line in ('gpufootprint_probe_records_sent_total{pid="77",source="probe"} 10.0',
                 'gpufootprint_probe_records_dropped_total{pid="77",source="probe"} 3.0',
                 'gpufootprint_probe_reconnects_total{pid="77",source="probe"} 1.0',
                 'gpufootprint_probe_cupti_dropped_records_total{pid="77",source="probe"} 97.0',
                 'gpufootprint_probe_callback_seconds_total{pid="77",source="probe"} 0.25',
                 'gpufootprint_probe_cupti_gap_seconds_total{pid="77",source="probe"} 0.5',
                 'gpufootprint_probe_device_bytes{pid="77",source="probe"} 8.388608e+06',
                 'gpufootprint_probe_host_bytes{pid="77",source="probe"} 1000.0',
                 'gpufootprint_probe_driver_hooks{pid="77",source="probe"} 1.0',
                 'gpufootprint_probe_connections_total{pid="77",result="missing",source="probe"} 5.0',
                 'gpufootprint_probe_disconnects_total{pid="77",reason="peer_closed",source="probe"} 1.0'):
        assert line in text, line
    assert "gpufootprint_exporter_collect_errors_total 0.0" in text


def test_no_probe_series_without_heartbeats() -> None:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FootprintCollector(lambda: EMPTY_SNAPSHOT))
    assert 'gpufootprint_probe_records_sent_total{' not in generate_latest(reg).decode()
