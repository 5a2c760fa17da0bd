"""Wiring: config -> pipeline -> ingest thread -> snapshot -> collector -> HTTP.

``App`` is what ``daemon``, ``demo`` and ``replay --listen`` all run, so every
command exports through the same path. It builds the parts and connects them;
what each part does is its own room's: the JSON routes are exporter/routes.py's,
which keys a reload changes live is configload.py's, the daemon process's signals
are cli/serve.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

from gpufootprint.config import Config
from gpufootprint.configload import parse_listen
from gpufootprint.engines.runner import EMPTY_OUTPUTS, EngineOutputs, Engines
from gpufootprint.exporter.collector import FootprintCollector, Postprocess
from gpufootprint.exporter.decisions import engine_families
from gpufootprint.exporter.exposition import ExpositionCache
from gpufootprint.exporter.http import MetricsServer
from gpufootprint.exporter.reliability import daemon_families, engine_error_families, http_families
from gpufootprint.exporter.routes import json_routes
from gpufootprint.exporter.webconfig import load_web_config
from gpufootprint.hub import FeatureHub
from gpufootprint.ingest.server import IngestServer
from gpufootprint.k8s.attribution import Attributor
from gpufootprint.nvml.client import NvmlClient
from gpufootprint.nvml.poller import NvmlPoller
from gpufootprint.oom.manager import OomManager, oom_families
from gpufootprint.pipeline import Pipeline
from gpufootprint.proctime import process_start_wall
from gpufootprint.snapshot import PipelineSnapshot
from gpufootprint.statedir import default_oom_directory

log = logging.getLogger(__name__)

#: The interpreter's thread switch interval while the daemon runs (Python's default is 5 ms).
SWITCH_INTERVAL_S = 0.001


def _postprocess(config: Config, attributor: Attributor | None,
                 preferred: Callable[[], set[str]] | None = None) -> Postprocess:
    """Pod labels (kubernetes.mode) and the per-metric series cap, so that the per-process series of a
    busy node stay bounded and say which pod they belong to."""
    from gpufootprint.exporter.cardinality import build_postprocess

    return build_postprocess(attributor, config.exporter.series_cap, config.exporter.max_label_value_length,
                             preferred)


def _attributor(config: Config) -> Attributor | None:
    from gpufootprint.k8s.attribution import build_attributor

    k = config.kubernetes
    return build_attributor(
        k.mode, env=os.environ, extra_labels=config.exporter.extra_pod_labels, pod_env=k.pod_name_env,
        namespace_env=k.namespace_env, container_env=k.container_env, labels_file=k.labels_file,
        node_name_env=k.node_name_env, api_server=k.api_server, token_file=k.token_file, ca_file=k.ca_file,
        proc_root=k.proc_root, refresh_s=k.pod_refresh_seconds, retry_s=k.unresolved_retry_seconds,
        timeout_s=k.api_timeout_seconds)


class App:
    def __init__(self, config: Config, *, socket_path: str | None, listen: str | None,
                 nvml_client: NvmlClient | None = None, clock_ns: Callable[[], int] | None = None) -> None:
        """``clock_ns``: the wall clock of snapshots, NVML polls and the cost ledger (a test's fake
        clock drives a daemon through minutes in a moment); the system clock by default."""
        self.config = config
        self.pipeline = Pipeline(config.footprint, hub=FeatureHub(config.features, config.sampler))
        self.gpu_present = 0.0
        self._clock_ns = clock_ns or time.time_ns
        # NVML only with a client (the daemon passes the real one when a GPU is present).
        self.nvml: NvmlPoller | None = None
        if nvml_client is not None and config.nvml.enabled:
            self.nvml = (NvmlPoller(nvml_client, config.nvml) if clock_ns is None else
                         NvmlPoller(nvml_client, config.nvml, monotonic=lambda: self._clock_ns() / 1e9,
                                    wall_ns=self._clock_ns))
        self.attributor = _attributor(config)
        # OOM capture: the applied records of each process's last seconds, and the probes' oom marks.
        # oom.directory unset: the default for this user (statedir: /var/lib as root, else XDG state).
        oom_config = config.oom if config.oom.directory else dataclasses.replace(
            config.oom, directory=default_oom_directory())
        self.oom = OomManager(oom_config, self.pipeline, pod_of=self._pod_labels,
                              monotonic=time.monotonic if clock_ns is None else lambda: self._clock_ns() / 1e9)
        self.pipeline.hub.taps.append(self.oom.on_records)
        self.ingest = IngestServer(config, self.pipeline, socket_path=socket_path, clock_ns=self._clock_ns,
                                   extra_daemon_values=self._daemon_values, nvml=self.nvml, on_mark=self.oom.on_mark)
        # The sampler's control path: its CONTROL frames (flush interval, kernel windows) go out
        # through the probes' connections, which the ingest loop holds.
        self.pipeline.hub.control = self.ingest.send_control
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = FootprintCollector(lambda: self.ingest.snapshot,
                                            postprocess=_postprocess(config, self.attributor, self._live_probe_pids),
                                            extra=self._extra_families)
        self.registry.register(self.collector)
        # The daemon's own CPU, memory and file descriptors (process_*), as every exporter has them.
        ProcessCollector(registry=self.registry)
        # The JSON routes beside /metrics (exporter/routes.py), built at request time.
        self.routes = json_routes(lambda: self.ingest.snapshot, lambda: self.engine_outputs,
                                  oom_events=self.oom.api, oom_counts=self.oom.counts_now,
                                  pod_of=self._pod_labels if self.attributor is not None else None,
                                  pcie_samples=self.nvml.pcie_samples if self.nvml is not None else None,
                                  nvml_snapshot=self.nvml.snapshot if self.nvml is not None else None)
        self.http: MetricsServer | None = None
        if listen:
            host, port = parse_listen(listen, "exporter.listen")
            self.http = MetricsServer(self.registry, host, port, ready=self.ingest.ready, json_routes=self.routes,
                                      web_config=load_web_config(config.exporter.web_config_file),
                                      exposition=ExpositionCache(self.registry,
                                                                 config.exporter.render_interval_ms / 1000))
        self._thread: threading.Thread | None = None
        self._switch_interval = sys.getswitchinterval()
        self._wire_engines(config)

    # --- decision engines ------------------------------------------------------------

    def _wire_engines(self, config: Config) -> None:
        self.pipeline.kernel_retention = config.graph_advisor.kernel_retention if config.graph_advisor.enabled else 0
        self.pipeline.snapshot_live_tables = config.leaks.enabled
        # The ledger prices GPUs from the daemon process's start (not from here, after the imports
        # and NVML's start); a test's fake clock starts it at its own now.
        started = process_start_wall() if self._clock_ns is time.time_ns else self._clock_ns() / 1e9
        self.engines = Engines(config, started_at=started)
        self.pipeline.live_table_wanted = self.engines.leaks.wants_table  # built for growing devices only
        self.engine_outputs: EngineOutputs = EMPTY_OUTPUTS
        self.engine_errors = 0
        self.ingest.on_snapshot = self._engine_tick

    def _engine_tick(self, snap: PipelineSnapshot) -> None:
        """Run the engines on the new snapshot (ingest thread): send actions, log events."""
        try:
            self.oom.tick()
        except Exception:  # a capture bug must not stop ingest
            log.exception("oom capture failed")
        try:
            out = self.engines.step(snap)
        except Exception:  # keep ingesting; the last outputs stay exported
            self.engine_errors += 1
            if self.engine_errors == 1 or self.engine_errors % 1000 == 0:
                log.exception("engines failed on a snapshot (%d times so far)", self.engine_errors)
            return
        self.engine_outputs = out
        for a in out.budget_actions:
            sent = self.ingest.send_control(a.pid, a.control())
            log.info("budget action scope=%s name=%s pid=%d action=%s sent=%s reason=%r",
                     a.scope, a.name, a.pid, a.action, sent, a.reason)
        for leak in out.new_leaks:
            log.warning("leak suspected pid=%d gpu=%d suspect_bytes=%d growth_bytes_per_second=%.0f sites=%s",
                        leak.pid, leak.dev, leak.suspect_bytes, leak.growth_bytes_per_second or 0.0,
                        ",".join(f"{s.label}x{s.count}" for s in leak.top_sites))
        for adv in out.new_degradation:
            log.info("degradation advice gpu=%d pid=%d advice=%s reason=%r", adv.gpu, adv.pid, adv.advice, adv.reason)

    def _extra_families(self) -> Iterator[Metric]:
        yield from engine_families(self.engine_outputs)
        yield from daemon_families(self.ingest.stats, self.ingest.snapshot, self.ingest.health())
        yield from engine_error_families(self.engine_errors)
        if self.http is not None:
            yield from http_families(self.http.counters())
        yield from oom_families(self.oom)

    def _live_probe_pids(self) -> set[str]:
        """Processes with a live probe now: their series are kept first under exporter.series_cap."""
        return {str(p.pid) for p in self.ingest.snapshot.processes if p.source == "probe" and not p.exited}

    def _daemon_values(self) -> dict[str, float]:
        # The snapshot's age is not here: a value inside the snapshot freezes with it. It is
        # computed at scrape time from the last successful tick (exporter/reliability.py).
        return {"gpu_present": self.gpu_present}

    def _pod_labels(self, pid: int) -> dict[str, str]:
        return self.attributor.identify(pid).labels() if self.attributor is not None else {}

    def start(self) -> None:
        # A scrape is a few short steps between socket calls, each waiting for the GIL
        # behind the ingest and render threads; at 1 ms instead of 5 the wait is bounded five times
        # lower (bench/load.py, 32,000 records/s: /metrics p99 9-13 ms against 20-39 ms).
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        if self.nvml is not None:
            self.nvml.start()  # failure is a state (gpufootprint_nvml_state), never an exception
            self.nvml.start_thread()  # NVML calls block (PCIe: 20 ms each): off the ingest thread
        self.ingest.open()
        self._thread = threading.Thread(target=self.ingest.run, name="gpufootprint-ingest", daemon=True)
        self._thread.start()
        # The first snapshot carries the daemon's own gauges (gpu_present, ...): a scrape before it
        # would miss them (seen once in CI's test_daemon). Its first tick comes at once.
        self.ingest.published.wait(5.0)
        if self.http is not None:
            self.http.start()

    def stop(self) -> None:
        self.ingest.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.http is not None:
            self.http.stop()
        self.oom.stop()
        if self.nvml is not None:
            self.nvml.close()
        sys.setswitchinterval(self._switch_interval)

    # --- SIGHUP ----------------------------------------------------------------------

    def reload(self, load: Callable[[], Config] | None) -> bool:
        """Re-read the configuration; apply what can change live, keep the rest, refuse a bad one."""
        from gpufootprint.configload import live_changes
        from gpufootprint.errors import GpuFootprintError
        from gpufootprint.exporter.webconfig import load_web_config as _load_web
        from gpufootprint.log import setup_logging

        if load is None:
            return False
        try:
            new = load()
            web = _load_web(new.exporter.web_config_file) if self.http is not None else None
        except GpuFootprintError as exc:
            self.ingest.config_reloads["refused"] += 1
            self.ingest.config_last_reload_ok = 0.0
            log.error("config reload refused, keeping the previous configuration: %s", exc)
            return False
        applied, live, later = live_changes(self.config, new)
        self.config = applied
        self.ingest.config = applied  # daemon.* limits are read per event
        setup_logging(applied.logging.level, applied.logging.format)
        self.collector.set_series_cap(applied.exporter.series_cap)
        if self.http is not None and web is not None:
            self.http.set_web_config(web)
        if self.http is not None and self.http.exposition is not None:
            self.http.exposition.interval_s = applied.exporter.render_interval_ms / 1000
        self.ingest.config_reloads["applied"] += 1
        self.ingest.config_last_reload_ok = 1.0
        log.info("config reloaded: applied=%s needs_restart=%s", ",".join(live) or "-", ",".join(later) or "-")
        return True
