"""This node's pods from the Kubernetes API, with the standard library only.

Why the API and not the kubelet: the kubelet's pod-resources socket speaks gRPC
(grpcio + protobuf, two heavy dependencies) and lists pods by device, without
container ids, so it cannot map a pid; /var/lib/kubelet/pods/<uid>/ has no
namespace, pod name or container id. One ``GET /api/v1/pods?fieldSelector=
spec.nodeName=NODE`` gives all three, for the cost of a ClusterRole with
get/list/watch on pods (deploy/k8s/rbac.yaml). See docs/kubernetes.md.
"""

from __future__ import annotations

import json
import ssl
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gpufootprint.errors import GpuFootprintError

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True, slots=True)
class PodInfo:
    name: str
    namespace: str
    uid: str
    labels: dict[str, str] = field(default_factory=dict)
    containers: dict[str, str] = field(default_factory=dict)  # container id (hex) -> container name


class PodSource(Protocol):
    """Where pods come from: the API in production, a fixture list in tests."""

    def list_pods(self) -> list[PodInfo]: ...


class PodListError(GpuFootprintError):
    pass


def pods_from_list(doc: Mapping[str, Any]) -> list[PodInfo]:
    """A v1 PodList (as the API returns it) -> PodInfo, skipping malformed items."""
    out: list[PodInfo] = []
    for item in doc.get("items") or []:
        if not isinstance(item, dict):
            continue
        meta = item.get("metadata") or {}
        status = item.get("status") or {}
        name, ns, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
        if not (isinstance(name, str) and isinstance(ns, str) and isinstance(uid, str)):
            continue
        containers: dict[str, str] = {}
        for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
            for cs in status.get(key) or []:
                cid, cname = (cs or {}).get("containerID"), (cs or {}).get("name")
                if isinstance(cid, str) and isinstance(cname, str) and cid:
                    containers[cid.rpartition("://")[2]] = cname  # "containerd://<id>" -> "<id>"
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        out.append(PodInfo(name, ns, uid, labels, containers))
    return out


class KubeApiPodSource:
    """Lists the pods of one node; the token is read at every call (projected tokens rotate)."""

    def __init__(self, server: str, node_name: str, *, token_file: str = f"{SA_DIR}/token",
                 ca_file: str | None = f"{SA_DIR}/ca.crt", timeout_s: float = 2.0) -> None:
        self.server = server.rstrip("/")
        self.node_name = node_name
        self.token_file = token_file
        self.ca_file = ca_file
        self.timeout_s = timeout_s
        self._ssl: ssl.SSLContext | None = None  # built at the first call: a missing CA is a listing error

    @property
    def url(self) -> str:
        selector = urllib.parse.quote(f"spec.nodeName={self.node_name}", safe="")
        return f"{self.server}/api/v1/pods?fieldSelector={selector}"

    def list_pods(self) -> list[PodInfo]:
        headers = {"Accept": "application/json", "User-Agent": "gpufootprint"}
        try:
            token = Path(self.token_file).read_text().strip()
        except OSError as exc:
            raise PodListError(f"kubernetes.token_file: cannot read {self.token_file} ({exc.strerror})") from None
        headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url, headers=headers)
        if self._ssl is None and self.server.startswith("https://"):
            try:
                self._ssl = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else \
                    ssl.create_default_context()
            except (OSError, ssl.SSLError) as exc:
                raise PodListError(f"kubernetes.ca_file: cannot load {self.ca_file} ({exc})") from None
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                doc = json.load(resp)
        except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, bad JSON
            raise PodListError(f"GET {self.url}: {exc}") from None
        if not isinstance(doc, dict):
            raise PodListError(f"GET {self.url}: expected a PodList object")
        return pods_from_list(doc)


def in_cluster_server(env: Mapping[str, str]) -> str | None:
    """The API address a pod is given (KUBERNETES_SERVICE_HOST/PORT), or None outside a cluster."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return None
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"
