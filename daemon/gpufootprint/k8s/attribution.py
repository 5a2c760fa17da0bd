"""Attributors: pid -> (pod, namespace, container) plus allowlisted pod labels.

Two modes, chosen by ``kubernetes.mode``:

- ``sidecar``: the daemon runs in the workload's pod, so every process it sees is
  that pod's. Pod and namespace come from the Downward API environment
  (POD_NAME / POD_NAMESPACE by default), the workload's container name from an
  environment variable set in the manifest (CONTAINER_NAME), pod labels from a
  Downward API volume file.
- ``daemonset``: one daemon per node with hostPID. /proc/PID/cgroup gives the
  container id; this node's pod list (``PodSource``) gives its pod. The pod list
  is refreshed every ``pod_refresh_seconds`` and, on a miss, at most every
  ``unresolved_retry_seconds``, so a new pod is found quickly without turning
  every scrape into an API call.

A pid that cannot be resolved keeps its series, with empty pod labels and
``attribution="unresolved"``. ``identify`` never raises.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpufootprint.errors import ConfigError, GpuFootprintError
from gpufootprint.k8s.apiserver import KubeApiPodSource, PodInfo, PodSource, in_cluster_server
from gpufootprint.k8s.cgroup import read_container

log = logging.getLogger(__name__)

POD_LABELS = ("pod", "namespace", "container", "attribution")
_LABEL_NAME = re.compile(r"^(?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def prom_label_name(pod_label: str) -> str:
    """kube-state-metrics' convention: app.kubernetes.io/name -> label_app_kubernetes_io_name."""
    return "label_" + re.sub(r"[^A-Za-z0-9_]", "_", pod_label)


def parse_extra_labels(text: str, where: str = "exporter.extra_pod_labels") -> tuple[str, ...]:
    """The allowlist: comma-separated Kubernetes label keys."""
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    for key in keys:
        if not _LABEL_NAME.match(key) or len(key) > 317:
            raise ConfigError(f"{where}: {key!r} is not a Kubernetes label key")
    if len({prom_label_name(k) for k in keys}) != len(keys):
        raise ConfigError(f"{where}: {text!r} names two keys that map to the same Prometheus label")
    return keys


@dataclass(frozen=True, slots=True)
class PodIdentity:
    pod: str
    namespace: str
    container: str
    attribution: str  # sidecar | resolved | unresolved
    extra: tuple[tuple[str, str], ...] = ()  # (prometheus label name, value), in allowlist order

    def labels(self) -> dict[str, str]:
        out = {"pod": self.pod, "namespace": self.namespace, "container": self.container,
               "attribution": self.attribution}
        out.update(self.extra)
        return out


class Attributor(Protocol):
    def identify(self, pid: int) -> PodIdentity: ...


def _extra(allow: tuple[str, ...], labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((prom_label_name(k), labels.get(k, "")) for k in allow)


def unresolved(allow: tuple[str, ...]) -> PodIdentity:
    return PodIdentity("", "", "", "unresolved", _extra(allow, {}))


# --- sidecar ------------------------------------------------------------------------


def read_downward_labels(path: str | Path) -> dict[str, str]:
    """A Downward API ``metadata.labels`` file: one ``key="value"`` per line (Go-quoted)."""
    out: dict[str, str] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        try:
            value = json.loads(raw) if raw.startswith('"') else raw
        except ValueError:
            value = raw.strip('"')
        out[key.strip()] = str(value)
    return out


class SidecarAttributor:
    """Every process is the pod's: one identity, read once from the environment."""

    def __init__(self, env: Mapping[str, str], *, pod_env: str = "POD_NAME", namespace_env: str = "POD_NAMESPACE",
                 container_env: str = "CONTAINER_NAME", labels_file: str | None = None,
                 extra_labels: tuple[str, ...] = ()) -> None:
        pod, ns = env.get(pod_env, ""), env.get(namespace_env, "")
        container = env.get(container_env, "")
        labels = read_downward_labels(labels_file) if labels_file else {}
        if pod and ns:
            self.identity = PodIdentity(pod, ns, container, "sidecar", _extra(extra_labels, labels))
        else:
            missing = [n for n, v in ((pod_env, pod), (namespace_env, ns)) if not v]
            log.warning("kubernetes.mode=sidecar but %s unset: processes are exported as unresolved "
                        "(set them from the Downward API, deploy/k8s/sidecar-example.yaml)", ", ".join(missing))
            self.identity = unresolved(extra_labels)

    def identify(self, pid: int) -> PodIdentity:
        return self.identity


# --- daemonset ----------------------------------------------------------------------


class DaemonSetAttributor:
    def __init__(self, pods: PodSource, *, proc_root: str = "/proc", extra_labels: tuple[str, ...] = (),
                 refresh_s: float = 30.0, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pods = pods
        self.proc_root = proc_root
        self.extra_labels = extra_labels
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_container: dict[str, tuple[PodInfo, str]] = {}
        self._by_uid: dict[str, PodInfo] = {}
        self._fetched_at: float | None = None
        self.list_errors = 0
        self.lists = 0

    def identify(self, pid: int) -> PodIdentity:
        try:
            return self._identify(pid)
        except Exception:  # attribution must never cost a scrape
            log.exception("attribution of pid=%d failed", pid)
            return unresolved(self.extra_labels)

    def _identify(self, pid: int) -> PodIdentity:
        # The cgroup file is re-read every time (one small read): a reused pid can
        # never inherit the previous process's pod from a cache.
        ref = read_container(pid, self.proc_root)
        if ref is None:
            return unresolved(self.extra_labels)
        with self._lock:
            now = self._clock()
            found = self._lookup(ref.container_id, ref.pod_uid)
            stale = self._fetched_at is None or now - self._fetched_at >= self.refresh_s
            retry = found is None and (self._fetched_at is None or now - self._fetched_at >= self.retry_s)
            if stale or retry:
                self._refresh(now)
                found = self._lookup(ref.container_id, ref.pod_uid)
        if found is None:
            return unresolved(self.extra_labels)
        pod, container = found
        return PodIdentity(pod.name, pod.namespace, container, "resolved", _extra(self.extra_labels, pod.labels))

    def _lookup(self, container_id: str, pod_uid: str | None) -> tuple[PodInfo, str] | None:
        hit = self._by_container.get(container_id)
        if hit is not None:
            return hit
        if pod_uid is not None and pod_uid in self._by_uid:
            return self._by_uid[pod_uid], ""  # pod known, container not (yet) in its status
        return None

    def _refresh(self, now: float) -> None:
        self._fetched_at = now  # also on failure: do not hammer a failing API server
        try:
            pods = self.pods.list_pods()
        except GpuFootprintError as exc:
            self.list_errors += 1
            log.warning("cannot list pods: %s", exc)
            return
        self.lists += 1
        self._by_container = {cid: (p, name) for p in pods for cid, name in p.containers.items()}
        self._by_uid = {p.uid: p for p in pods}


# --- from configuration -------------------------------------------------------------


def build_attributor(mode: str, *, env: Mapping[str, str], extra_labels: str = "", pod_env: str = "POD_NAME",
                     namespace_env: str = "POD_NAMESPACE", container_env: str = "CONTAINER_NAME",
                     labels_file: str | None = None, node_name_env: str = "NODE_NAME", api_server: str | None = None,
                     token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token",
                     ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                     proc_root: str = "/proc", refresh_s: float = 30.0, retry_s: float = 5.0,
                     timeout_s: float = 2.0) -> Attributor | None:
    """None for mode ``off``: series keep exactly the foundation's labels."""
    allow = parse_extra_labels(extra_labels)
    if mode == "off":
        return None
    if mode == "sidecar":
        return SidecarAttributor(env, pod_env=pod_env, namespace_env=namespace_env, container_env=container_env,
                                 labels_file=labels_file, extra_labels=allow)
    if mode != "daemonset":
        raise ConfigError(f"kubernetes.mode: {mode!r} is not one of off, sidecar, daemonset")
    server = api_server or in_cluster_server(env)
    if not server:
        raise ConfigError("kubernetes.api_server: empty and KUBERNETES_SERVICE_HOST is not set "
                          "(daemonset mode runs in a cluster, or give the API address)")
    node = env.get(node_name_env, "")
    if not node:
        raise ConfigError(f"kubernetes.node_name_env: environment variable {node_name_env} is empty "
                          "(set it from spec.nodeName with the Downward API)")
    source = KubeApiPodSource(server, node, token_file=token_file, ca_file=ca_file or None, timeout_s=timeout_s)
    return DaemonSetAttributor(source, proc_root=proc_root, extra_labels=allow, refresh_s=refresh_s, retry_s=retry_s)
