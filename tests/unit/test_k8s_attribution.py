"""Sidecar attribution from the Downward API environment; DaemonSet attribution from
cgroup fixtures + a pod list (a stateful fake PodSource, and the real stdlib client
against a local HTTP server)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.errors import ConfigError
from gpufootprint.k8s.apiserver import KubeApiPodSource, PodInfo, PodListError, pods_from_list
from gpufootprint.k8s.attribution import (
    DaemonSetAttributor,
    PodIdentity,
    SidecarAttributor,
    build_attributor,
    parse_extra_labels,
    prom_label_name,
    read_downward_labels,
)

from tests.kube_api import FakeKubeApi

DATA = Path(__file__).resolve().parents[1] / "data" / "cgroup"
PODS = json.loads((DATA / "pods.json").read_text())
UNRESOLVED = {"pod": "", "namespace": "", "container": "", "attribution": "unresolved"}


# --- sidecar ---------------------------------------------------------------------------


def test_sidecar_labels_every_pid_with_the_downward_api_pod(tmp_path: Path) -> None:
    labels = tmp_path / "labels"
    # The kubelet writes a Downward API labels volume like this (Go-quoted values, sorted keys).
    labels.write_text('app.kubernetes.io/name="trainer"\npod-template-hash="7d9f8"\nteam="vision \\"A\\""\n')
    env = {"POD_NAME": "trainer-7d9f8-abcde", "POD_NAMESPACE": "ml-team", "CONTAINER_NAME": "trainer"}
    att = SidecarAttributor(env, labels_file=str(labels), extra_labels=("team", "app.kubernetes.io/name", "absent"))
    for pid in (1, 77, 4242):
        assert att.identify(pid).labels() == {
            "pod": "trainer-7d9f8-abcde", "namespace": "ml-team", "container": "trainer",
            "attribution": "sidecar", "label_team": 'vision "A"', "label_app_kubernetes_io_name": "trainer",
            "label_absent": ""}


def test_sidecar_reads_configured_variable_names() -> None:
    env = {"MY_POD": "p", "MY_NS": "n", "WORKLOAD": "w", "POD_NAME": "wrong"}
    att = SidecarAttributor(env, pod_env="MY_POD", namespace_env="MY_NS", container_env="WORKLOAD")
    assert att.identify(1) == PodIdentity("p", "n", "w", "sidecar")


def test_sidecar_without_downward_api_env_exports_unresolved(caplog: pytest.LogCaptureFixture) -> None:
    att = SidecarAttributor({"POD_NAME": "only-a-name"})
    assert att.identify(5).labels() == UNRESOLVED
    assert "POD_NAMESPACE" in caplog.text


def test_downward_labels_file_missing_or_damaged_is_empty(tmp_path: Path) -> None:
    assert read_downward_labels(tmp_path / "nope") == {}
    bad = tmp_path / "labels"
    bad.write_text('no-equals-sign\nk="unterminated\nok=plain\n')
    assert read_downward_labels(bad) == {"k": "unterminated", "ok": "plain"}


# --- daemonset -------------------------------------------------------------------------


class FakePods:
    """Stateful stand-in for the API: a pod list that can change and fail, and counts calls."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.pods = pods_from_list(doc)
        self.calls = 0
        self.failing = False

    def list_pods(self) -> list[PodInfo]:
        self.calls += 1
        if self.failing:
            raise PodListError("GET https://10.96.0.1/api/v1/pods: connection refused")
        return list(self.pods)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def proc_tree(tmp_path: Path, layout: dict[int, str]) -> Path:
    for pid, fixture in layout.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text((DATA / fixture).read_text())
    return tmp_path


LAYOUT = {
    101: "v2-systemd-containerd.txt",  # trainer in ml-team (containerd, systemd driver)
    102: "v1-systemd-containerd.txt",  # the same container seen on a cgroup v1 node
    103: "v2-private-cgroupns.txt",  # cri-o container read through a private cgroup namespace
    104: "v1-cgroupfs-docker.txt",  # docker, cgroupfs driver
    105: "v2-cgroupfs-containerd.txt",  # second container of a pod
    106: "v2-systemd-containerd-guaranteed.txt",
    107: "v2-unknown-pod.txt",  # pod not in the API's list
    108: "v2-host-session.txt",  # not in a container
    109: "v2-docker-no-pod.txt",
}


def test_daemonset_resolves_pids_of_both_cgroup_versions_to_pods(tmp_path: Path) -> None:
    pods = FakePods(PODS)
    att = DaemonSetAttributor(pods, proc_root=str(proc_tree(tmp_path, LAYOUT)), extra_labels=("team",),
                              clock=Clock())
    got = {pid: att.identify(pid) for pid in [*LAYOUT, 999]}
    assert got[101] == PodIdentity("trainer-7d9f8-abcde", "ml-team", "trainer", "resolved", (("label_team", "vision"),))
    assert got[102] == got[101]
    assert (got[103].pod, got[103].namespace, got[103].container) == ("notebook-0", "research", "jupyter")
    assert (got[104].pod, got[104].container) == ("legacy-job-x", "worker")
    assert (got[105].pod, got[105].container) == ("inference-5c6b", "sidecar-proxy")
    assert (got[106].pod, got[106].container) == ("inference-5c6b", "triton")
    for pid in (107, 108, 109, 999):  # unknown pod, host process, non-Kubernetes container, vanished pid
        assert got[pid].labels() == {**UNRESOLVED, "label_team": ""}


def test_daemonset_lists_pods_once_per_refresh_period_and_retries_misses_slowly(tmp_path: Path) -> None:
    pods, clock = FakePods(PODS), Clock()
    att = DaemonSetAttributor(pods, proc_root=str(proc_tree(tmp_path, LAYOUT)), refresh_s=30, retry_s=5, clock=clock)
    for _ in range(20):
        att.identify(101)
    assert pods.calls == 1  # a hot pid costs one file read, not one API call
    for _ in range(20):
        att.identify(107)  # unknown pod: at most one re-list per retry period
    assert pods.calls == 1
    clock.t += 5
    att.identify(107)
    assert pods.calls == 2
    clock.t += 31
    att.identify(101)
    assert pods.calls == 3


def test_daemonset_finds_a_new_pod_after_the_retry_period(tmp_path: Path) -> None:
    pods, clock = FakePods(PODS), Clock()
    att = DaemonSetAttributor(pods, proc_root=str(proc_tree(tmp_path, LAYOUT)), retry_s=5, clock=clock)
    assert att.identify(107).attribution == "unresolved"
    # GIVEN the pod of pid 107 is scheduled and started after the first list
    pods.pods.append(PodInfo("late-pod", "batch", "11111111-2222-3333-4444-555555555555", {},
                             {"e4da3b7fbbce2345d7772b0674a318d5e4da3b7fbbce2345d7772b0674a318d5": "main"}))
    assert att.identify(107).attribution == "unresolved"  # still inside the retry period
    clock.t += 5
    ident = att.identify(107)
    assert (ident.pod, ident.container, ident.attribution) == ("late-pod", "main", "resolved")


def test_daemonset_pod_known_but_container_not_yet_in_status_gives_pod_without_container(tmp_path: Path) -> None:
    doc = json.loads(json.dumps(PODS))
    doc["items"][0]["status"]["containerStatuses"] = []  # status not updated yet
    att = DaemonSetAttributor(FakePods(doc), proc_root=str(proc_tree(tmp_path, LAYOUT)), clock=Clock())
    ident = att.identify(101)
    assert (ident.pod, ident.namespace, ident.container, ident.attribution) == (
        "trainer-7d9f8-abcde", "ml-team", "", "resolved")


def test_daemonset_api_failure_exports_unresolved_and_recovers(tmp_path: Path) -> None:
    pods, clock = FakePods(PODS), Clock()
    pods.failing = True
    att = DaemonSetAttributor(pods, proc_root=str(proc_tree(tmp_path, LAYOUT)), retry_s=5, clock=clock)
    assert att.identify(101).attribution == "unresolved"
    assert att.list_errors == 1
    pods.failing = False
    clock.t += 5
    assert att.identify(101).pod == "trainer-7d9f8-abcde"


def test_daemonset_reused_pid_gets_the_new_process_pod(tmp_path: Path) -> None:
    root = proc_tree(tmp_path, {101: "v2-systemd-containerd.txt"})
    att = DaemonSetAttributor(FakePods(PODS), proc_root=str(root), clock=Clock())
    assert att.identify(101).pod == "trainer-7d9f8-abcde"
    # GIVEN pid 101 exits and the kernel hands the number to a process in another pod
    (root / "101" / "cgroup").write_text((DATA / "v2-systemd-crio.txt").read_text())
    assert att.identify(101).pod == "notebook-0"


# --- the stdlib API client, against a real local HTTP server --------------------------------


@pytest.fixture()
def api_server() -> Iterator[FakeKubeApi]:
    with FakeKubeApi(json.dumps(PODS).encode()) as server:
        yield server


def test_api_client_lists_this_nodes_pods_with_the_token(tmp_path: Path, api_server: FakeKubeApi) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    source = KubeApiPodSource(api_server.url, "gpu-node-1", token_file=str(token), ca_file=None)
    pods = source.list_pods()
    assert [p.name for p in pods] == ["trainer-7d9f8-abcde", "notebook-0", "inference-5c6b", "legacy-job-x",
                                      "pending-pod"]
    assert pods[0].containers["3f1b2c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f809"] == "trainer"
    assert pods[4].containers == {}  # a waiting container has no id yet
    path, auth = api_server.requests[0]
    assert path == "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1"
    assert auth == "Bearer s3cret-token"
    token.write_text("rotated")  # projected service-account tokens rotate: read at every call
    source.list_pods()
    assert api_server.requests[1][1] == "Bearer rotated"


def test_api_client_errors_are_one_line_errors(tmp_path: Path) -> None:
    token = tmp_path / "token"
    with pytest.raises(PodListError, match="kubernetes.token_file"):
        KubeApiPodSource("http://127.0.0.1:9", "n", token_file=str(token), ca_file=None).list_pods()
    token.write_text("t")
    with pytest.raises(PodListError, match=r"GET http://127.0.0.1:9/api/v1/pods"):
        KubeApiPodSource("http://127.0.0.1:9", "n", token_file=str(token), ca_file=None, timeout_s=1).list_pods()


# --- configuration -----------------------------------------------------------------------


def test_build_attributor_modes_and_errors() -> None:
    assert build_attributor("off", env={}) is None
    assert isinstance(build_attributor("sidecar", env={"POD_NAME": "p", "POD_NAMESPACE": "n"}), SidecarAttributor)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "NODE_NAME": "gpu-node-1"}
    att = build_attributor("daemonset", env=env)
    assert isinstance(att, DaemonSetAttributor)
    assert isinstance(att.pods, KubeApiPodSource)
    assert att.pods.url == "https://10.96.0.1:443/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1"
    with pytest.raises(ConfigError, match="NODE_NAME"):
        build_attributor("daemonset", env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    with pytest.raises(ConfigError, match="kubernetes.api_server"):
        build_attributor("daemonset", env={"NODE_NAME": "x"})
    with pytest.raises(ConfigError, match="exporter.extra_pod_labels: 'bad key!'"):
        build_attributor("off", env={}, extra_labels="team, bad key!")


def test_extra_label_names_follow_kube_state_metrics() -> None:
    assert parse_extra_labels(" team , app.kubernetes.io/name,") == ("team", "app.kubernetes.io/name")
    assert prom_label_name("app.kubernetes.io/name") == "label_app_kubernetes_io_name"
    with pytest.raises(ConfigError, match="same Prometheus label"):
        parse_extra_labels("a.b,a_b")
