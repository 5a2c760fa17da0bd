"""Wiring: config -> pipeline -> ingest thread -> snapshot -> collector -> HTTP.

``App`` is what ``daemon``, ``demo`` and ``replay --listen`` all run, so every
command exports through the same path.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType as _PyFrame

from prometheus_client.registry import CollectorRegistry

from gpufootprint.config import Config, parse_listen
from gpufootprint.exporter.collector import FootprintCollector, Postprocess
from gpufootprint.exporter.http import MetricsServer
from gpufootprint.ingest.pipeline import Pipeline
from gpufootprint.ingest.server import IngestServer

log = logging.getLogger(__name__)


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
        except Exception:  # noqa: BLE001
            pass
    return count > 0, f"{count} GPU(s), driver {driver}"


def _postprocess(config: Config) -> Postprocess:
    """Issue 6: pod labels (kubernetes.mode) and the per-metric series cap."""
    from gpufootprint.exporter.cardinality import build_postprocess
    from gpufootprint.k8s.attribution import build_attributor

    k = config.kubernetes
    attributor = build_attributor(
        k.mode, env=os.environ, extra_labels=config.exporter.extra_pod_labels, pod_env=k.pod_name_env,
        namespace_env=k.namespace_env, container_env=k.container_env, labels_file=k.labels_file,
        node_name_env=k.node_name_env, api_server=k.api_server, token_file=k.token_file, ca_file=k.ca_file,
        proc_root=k.proc_root, refresh_s=k.pod_refresh_seconds, retry_s=k.unresolved_retry_seconds,
        timeout_s=k.api_timeout_seconds)
    return build_postprocess(attributor, config.exporter.series_cap)


class App:
    def __init__(self, config: Config, *, socket_path: str | None, listen: str | None) -> None:
        self.config = config
        self.pipeline = Pipeline(config.footprint)
        self.gpu_present = 0.0
        self.ingest = IngestServer(config, self.pipeline, socket_path=socket_path,
                                   extra_daemon_values=self._daemon_values)
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = FootprintCollector(lambda: self.ingest.snapshot, postprocess=_postprocess(config))
        self.registry.register(self.collector)
        self.http: MetricsServer | None = None
        if listen:
            host, port = parse_listen(listen, "exporter.listen")
            self.http = MetricsServer(self.registry, host, port, ready=self.ingest.published.is_set)
        self._thread: threading.Thread | None = None

    def _daemon_values(self) -> dict[str, float]:
        age = 0.0
        if self.ingest.snapshot.taken_at:
            age = max(0.0, time.time() - self.ingest.snapshot.taken_at)
        return {"gpu_present": self.gpu_present, "snapshot_age_seconds": age}

    def start(self) -> None:
        self.ingest.open()
        self._thread = threading.Thread(target=self.ingest.run, name="gpufootprint-ingest", daemon=True)
        self._thread.start()
        if self.http is not None:
            self.http.start()

    def stop(self) -> None:
        self.ingest.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.http is not None:
            self.http.stop()

    def wait_for_signal(self, stop: threading.Event) -> None:
        def _handler(signum: int, _frame: _PyFrame | None) -> None:
            log.info("signal %s: shutting down", signal.Signals(signum).name)
            stop.set()

        signal.signal(signal.SIGTERM, _handler)
        signal.signal(signal.SIGINT, _handler)
        while not stop.wait(0.5):
            pass
