"""pid -> container id, from the text of /proc/PID/cgroup.

Formats handled (the last path component names the container):

- cgroup v2, one line ``0::PATH``; cgroup v1, one line per hierarchy
  ``ID:CONTROLLERS:PATH`` (all hierarchies of a container carry the same path).
- systemd driver: ``.../kubepods-burstable-pod<UID_with_underscores>.slice/
  cri-containerd-<ID>.scope`` (containerd), ``crio-<ID>.scope`` (CRI-O),
  ``docker-<ID>.scope`` (dockershim / cri-dockerd).
- cgroupfs driver: ``/kubepods/burstable/pod<UID>/<ID>``.
- a private cgroup namespace (the default for v2 containers) shows paths
  relative to the reader's own cgroup, e.g. ``0::/../../kubepods-...slice/
  cri-containerd-<ID>.scope``: only the components matter, so that works too.

CRI-O's ``crio-conmon-<ID>.scope`` is the container's monitor process, not the
container, and is not taken for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_ID = r"[0-9a-f]{64}"
# One path component that names a container, with the runtime it implies.
_SCOPE = re.compile(rf"^(?:(?P<prefix>cri-containerd|crio|docker|containerd|libpod)-)(?P<id>{_ID})(?:\.scope)?$")
_BARE = re.compile(rf"^(?P<id>{_ID})$")
_POD = re.compile(r"pod(?P<uid>[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_RUNTIMES = {"cri-containerd": "containerd", "containerd": "containerd", "crio": "cri-o",
             "docker": "docker", "libpod": "podman"}


@dataclass(frozen=True, slots=True)
class ContainerRef:
    container_id: str  # 64 hex digits, as in the pod status's containerID after "runtime://"
    runtime: str | None  # containerd | cri-o | docker | podman; None for the cgroupfs driver's bare id
    pod_uid: str | None  # with dashes, as in metadata.uid; None outside Kubernetes
    cgroup_version: int  # 1 or 2


def parse_cgroup(text: str) -> ContainerRef | None:
    """The container a process is in, or None (a host process, or a format we do not know)."""
    v2: ContainerRef | None = None
    v1: ContainerRef | None = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        ref = _from_path(path, 2 if hier == "0" and controllers == "" else 1)
        if ref is None:
            continue
        if ref.cgroup_version == 2:
            v2 = v2 or ref
        else:
            v1 = v1 or ref
    # On a hybrid host the v2 line may be empty ("0::/") while v1 names the container.
    return v2 or v1


def _from_path(path: str, version: int) -> ContainerRef | None:
    comps = [c for c in path.split("/") if c and c not in (".", "..")]
    pod_uid = None
    for comp in comps:
        m = _POD.search(comp)
        if m:
            pod_uid = m.group("uid").replace("_", "-")
    for comp in reversed(comps):
        m = _SCOPE.match(comp)
        if m:
            return ContainerRef(m.group("id"), _RUNTIMES[m.group("prefix")], pod_uid, version)
        m = _BARE.match(comp)
        if m:
            return ContainerRef(m.group("id"), None, pod_uid, version)
    return None


def read_container(pid: int, proc_root: str | Path = "/proc") -> ContainerRef | None:
    """Read /proc/PID/cgroup; None when the process is gone or not in a container."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    return parse_cgroup(text)
