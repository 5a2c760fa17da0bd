"""pid -> container id from real-format /proc/PID/cgroup files (tests/data/cgroup/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpufootprint.k8s.cgroup import parse_cgroup, read_container

DATA = Path(__file__).resolve().parents[1] / "data" / "cgroup"
A = "3f1b2c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f809"
B = "9e8d7c6b5a49382716f5e4d3c2b1a0f9e8d7c6b5a49382716f5e4d3c2b1a0f9e"
C = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"
D = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00"
E = "5d41402abc4b2a76b9719d911017c5925d41402abc4b2a76b9719d911017c592"


@pytest.mark.parametrize(("fixture", "cid", "runtime", "pod_uid", "version"), [
    ("v1-systemd-containerd.txt", A, "containerd", "0b7632a2-a56e-4278-987a-22de18008dbe", 1),
    ("v1-cgroupfs-docker.txt", B, None, "729d2f46-480d-4796-a76c-e227e2671d31", 1),
    ("v1-systemd-docker.txt", B, "docker", "729d2f46-480d-4796-a76c-e227e2671d31", 1),
    ("v2-systemd-containerd.txt", A, "containerd", "0b7632a2-a56e-4278-987a-22de18008dbe", 2),
    ("v2-systemd-crio.txt", C, "cri-o", "099b88fb-2a99-45ad-af94-d91eb81a87e9", 2),
    ("v2-systemd-containerd-guaranteed.txt", D, "containerd", "d80f4a0e-576f-47a8-a0cf-69dc23dc1980", 2),
    ("v2-cgroupfs-containerd.txt", E, None, "d80f4a0e-576f-47a8-a0cf-69dc23dc1980", 2),
    ("v2-private-cgroupns.txt", C, "cri-o", "099b88fb-2a99-45ad-af94-d91eb81a87e9", 2),
])
def test_container_id_and_pod_uid_are_read_from_every_runtime_and_driver(
        fixture: str, cid: str, runtime: str | None, pod_uid: str, version: int) -> None:
    ref = parse_cgroup((DATA / fixture).read_text())
    assert ref is not None
    assert (ref.container_id, ref.runtime, ref.pod_uid, ref.cgroup_version) == (cid, runtime, pod_uid, version)


def test_docker_outside_kubernetes_has_a_container_but_no_pod() -> None:
    ref = parse_cgroup((DATA / "v2-docker-no-pod.txt").read_text())
    assert ref is not None and ref.runtime == "docker" and ref.pod_uid is None


@pytest.mark.parametrize("fixture", ["v2-host-session.txt", "v2-host-init.txt", "v2-systemd-crio-conmon.txt"])
def test_host_processes_and_crio_monitor_are_not_containers(fixture: str) -> None:
    assert parse_cgroup((DATA / fixture).read_text()) is None


@pytest.mark.parametrize("text", ["", "garbage", "0::", "x:y", "12:memory:/kubepods/pod-not-a-uid/short-id\n",
                                  "\x00\x01\n0::/" + "a" * 63])
def test_damaged_cgroup_text_gives_none_not_an_error(text: str) -> None:
    assert parse_cgroup(text) is None


def test_read_container_from_a_proc_tree_and_a_vanished_pid(tmp_path: Path) -> None:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text((DATA / "v2-systemd-containerd.txt").read_text())
    ref = read_container(4242, tmp_path)
    assert ref is not None and ref.container_id == A
    assert read_container(4243, tmp_path) is None  # exited between the scrape and the read


def test_own_process_on_this_machine_does_not_crash() -> None:
    # Whatever this machine is (container or not), reading a real /proc entry must answer.
    import os

    ref = read_container(os.getpid())
    assert ref is None or len(ref.container_id) == 64
