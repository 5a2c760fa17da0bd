"""Wiring: config -> pipeline -> ingest thread -> snapshot -> collector -> HTTP.

``App`` is what ``daemon``, ``demo`` and ``replay --listen`` all run, so every
command exports through the same path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType as _PyFrame

from prometheus_client import ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

from gpufootprint.config import Config, parse_listen
from gpufootprint.engines.runner import EMPTY_OUTPUTS, EngineOutputs, Engines, engine_report
from gpufootprint.exporter.collector import FootprintCollector, Postprocess
from gpufootprint.exporter.decisions import engine_families
from gpufootprint.exporter.exposition import ExpositionCache
from gpufootprint.exporter.http import MetricsServer
from gpufootprint.exporter.reliability import daemon_families, engine_error_families, http_families
from gpufootprint.exporter.webconfig import load_web_config
from gpufootprint.ingest.server import IngestServer
from gpufootprint.k8s.attribution import Attributor
from gpufootprint.nvml.client import NvmlClient
from gpufootprint.nvml.poller import NvmlPoller
from gpufootprint.oom.manager import OomManager, oom_families
from gpufootprint.pipeline import Pipeline
from gpufootprint.proctime import process_start_wall
from gpufootprint.sampler.hub import FeatureHub
from gpufootprint.snapshot import PipelineSnapshot
from gpufootprint.statedir import default_oom_directory

log = logging.getLogger(__name__)

# Configuration keys a SIGHUP applies without a restart: each is read where it is used, per event or per
# tick, so a new value takes effect at once. The rest are reported as needing one.
LIVE_PREFIXES = ("logging.",)
LIVE_KEYS = frozenset({"daemon.tick_ms", "daemon.max_frame_bytes", "daemon.hello_timeout_seconds",
                       "daemon.max_connections", "daemon.max_buffered_bytes", "daemon.max_future_seconds",
                       "exporter.series_cap", "exporter.web_config_file", "exporter.render_interval_ms",
                       # the bounds on what a local process can make the daemon hold (ingest/validate.py)
                       "daemon.max_record_bytes", "daemon.max_devices_per_process", "daemon.max_device_footprints",
                       "daemon.max_live_allocations_per_process", "daemon.max_live_allocations",
                       "daemon.max_pending_records_per_process", "daemon.max_pending_records",
                       "daemon.max_metadata_bytes", "daemon.max_retained_kernels", "daemon.max_processes",
                       "daemon.max_resync_records", "daemon.max_string_bytes",
                       "daemon.tick_stall_seconds"})


#: The interpreter's thread switch interval while the daemon runs (Python's default is 5 ms).
SWITCH_INTERVAL_S = 0.001


def _flatten(tree: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not prefix:  # sections only; tables (prices, rules) compare whole
            out.update(_flatten(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def detect_gpu() -> tuple[bool, str]:
    """Is there an NVIDIA driver with at least one GPU? Imports pynvml lazily."""
    try:
        import pynvml
    except ImportError as exc:
        return False, f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError subclasses, or a missing library
        return False, f"NVML could not start ({exc})"
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # noqa: BLE001
        return False, f"NVML started but could not list devices ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - the check's answer is already known; a failed shutdown changes nothing
            pass
    return count > 0, f"{count} GPU(s), driver {driver}"


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
        self.http: MetricsServer | None = None
        if listen:
            host, port = parse_listen(listen, "exporter.listen")
            self.http = MetricsServer(self.registry, host, port, ready=self.ingest.ready,
                                      json_routes={"/api/anomalies": self.anomalies_json,
                                                   "/api/migrations": self.migrations_json,
                                                   "/api/processes": self.processes_json,
                                                   "/api/oom": self.oom.api,
                                                   "/api/nvml": self.nvml_json},
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
        self.engine_outputs: EngineOutputs = EMPTY_OUTPUTS
        self.engine_errors = 0
        self.ingest.on_snapshot = self._engine_tick
        if self.http is not None:
            self.http.json_routes["/api/engines"] = lambda: engine_report(self.engine_outputs)

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

    def processes_json(self) -> dict[str, object]:
        """GET /api/processes: per GPU and per process, what ``gpufootprint top`` shows."""
        from gpufootprint.exporter.processes import processes_document

        return processes_document(self.ingest.snapshot, self.engine_outputs, oom_counts=self.oom.counts_now(),
                                  pod_of=self._pod_labels if self.attributor is not None else None)

    def nvml_json(self) -> dict[str, object]:
        """GET /api/nvml: NVML's per-process utilisation samples the daemon holds, per GPU and pid (what
        the CUDA Graph advisor bounds launch windows with; ``abtest`` reads the same document saved beside
        a trace as ``TRACE.nvml.json``)."""
        snap = self.nvml.snapshot() if self.nvml is not None else None
        if snap is None:
            return {"state": "unavailable", "process_busy": {}}
        return {"state": snap.state, "process_busy": {
            str(g.index): {str(pid): [list(s) for s in samples] for pid, samples in g.process_busy.items()}
            for g in snap.gpus}}

    def anomalies_json(self) -> list[dict[str, object]]:
        """GET /api/anomalies: recent anomaly windows, oldest first (Grafana annotations)."""
        return [w.to_json() for w in self.ingest.snapshot.anomaly_windows]

    def migrations_json(self) -> list[dict[str, object]]:
        """GET /api/migrations: each (pid, gpu)'s page-migration windows of the last second, with the
        NVML PCIe throughput sampled inside the same window (CUDA ordinal taken as the NVML index)."""
        from gpufootprint.features.frames import align_pcie

        out: list[dict[str, object]] = []
        for f in self.ingest.snapshot.features:
            if not f.migration_windows:
                continue
            samples = self.nvml.pcie_samples(f.dev) if self.nvml is not None else []
            for w in align_pcie(list(f.migration_windows), samples):
                out.append({"pid": f.pid, "gpu": f.dev, "start": w.start_ns, "end": w.start_ns + w.width_ns,
                            "um_transfers": w.um_transfers, "um_bytes": w.um_bytes, "page_faults": w.page_faults,
                            "copies": w.copies, "copy_bytes": w.copy_bytes, "frequency_hz": w.frequency_hz,
                            "pcie_tx_bytes_per_second": w.pcie_tx_bytes_per_second,
                            "pcie_rx_bytes_per_second": w.pcie_rx_bytes_per_second})
        return out

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

    @staticmethod
    def install_signal_handlers(stop: threading.Event, hup: threading.Event) -> None:
        """SIGTERM/SIGINT set ``stop``, SIGHUP sets ``hup``. Call it first thing, before the
        configuration is read and the daemon starts: until then a SIGHUP would kill the process."""

        def _handler(signum: int, _frame: _PyFrame | None) -> None:
            log.info("signal %s: shutting down", signal.Signals(signum).name)
            stop.set()

        def _hup(_signum: int, _frame: _PyFrame | None) -> None:
            hup.set()  # the work happens on a reload thread, never in the handler

        signal.signal(signal.SIGTERM, _handler)
        signal.signal(signal.SIGINT, _handler)
        signal.signal(signal.SIGHUP, _hup)

    def wait_for_signal(self, stop: threading.Event, reload: Callable[[], Config] | None = None,
                        hup: threading.Event | None = None) -> None:
        """Until ``stop``: each SIGHUP reloads on a thread of its own (one at a time), so a reload
        that hangs or grows (a hostile file) never delays SIGTERM, which this loop checks every 0.1 s."""
        if hup is None:
            hup = threading.Event()
            self.install_signal_handlers(stop, hup)
        worker: threading.Thread | None = None
        while not stop.wait(0.1):
            if hup.is_set() and (worker is None or not worker.is_alive()):
                hup.clear()
                if reload is None:
                    continue
                worker = threading.Thread(target=self.reload, args=(reload,), name="gpufootprint-reload", daemon=True)
                worker.start()
        if worker is not None and worker.is_alive():
            log.warning("a configuration reload is still running at shutdown: abandoned")

    # --- SIGHUP ----------------------------------------------------------------------

    def reload(self, load: Callable[[], Config] | None) -> bool:
        """Re-read the configuration; apply what can change live, keep the rest, refuse a bad one."""
        from gpufootprint.config import config_to_dict
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
        old_flat, new_flat = _flatten(config_to_dict(self.config)), _flatten(config_to_dict(new))
        changed = sorted(k for k in new_flat.keys() | old_flat.keys() if old_flat.get(k) != new_flat.get(k))
        live = [k for k in changed if k.startswith(LIVE_PREFIXES) or k in LIVE_KEYS]
        later = [k for k in changed if k not in live]
        # Keep the running values of what needs a restart, so the config object tells the truth.
        applied = self.config
        for key in live:
            section, name = key.split(".", 1)
            applied = dataclasses.replace(applied, **{section: dataclasses.replace(getattr(applied, section),
                                                                                 **{name: getattr(getattr(new, section),
                                                                                                  name)})})
        self.config = applied
        self.ingest.config = applied  # daemon.* limits are read per event
        setup_logging(applied.logging.level, applied.logging.format)
        cap = getattr(self.collector._postprocess, "cap", None)
        if cap is not None:
            cap.max_series = applied.exporter.series_cap
        if self.http is not None and web is not None:
            self.http.set_web_config(web)
        if self.http is not None and self.http.exposition is not None:
            self.http.exposition.interval_s = applied.exporter.render_interval_ms / 1000
        self.ingest.config_reloads["applied"] += 1
        self.ingest.config_last_reload_ok = 1.0
        log.info("config reloaded: applied=%s needs_restart=%s", ",".join(live) or "-", ",".join(later) or "-")
        return True
