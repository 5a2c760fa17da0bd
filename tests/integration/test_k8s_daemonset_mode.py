"""DaemonSet mode end to end, in real processes: `gpufootprint replay --listen` with
kubernetes.mode=daemonset reads /proc/PID/cgroup from a proc tree (a real-format
cgroup v2 file for the trace's pid 855), asks a local HTTP server standing in for the
API server for this node's pods, and serves /metrics with the pod's labels."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.kube_api import FakeKubeApi

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


@pytest.fixture()
def api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi((DATA / "cgroup" / "pods.json").read_bytes()) as server:
        yield server


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str, timeout: float = 60) -> dict[str, list[dict[str, str]]]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            if "gpufootprint_device_bytes{" in text:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no per-process series at {url}")
        time.sleep(0.3)
    out: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s.labels)
    return out


@pytest.mark.parametrize(("fixture", "expect"), [
    ("v2-systemd-containerd.txt", ("trainer-7d9f8-abcde", "ml-team", "trainer", "resolved", "vision")),
    ("v1-cgroupfs-docker.txt", ("legacy-job-x", "batch", "worker", "resolved", "")),
    ("v2-host-session.txt", ("", "", "", "unresolved", "")),
])
def test_replayed_process_is_labelled_with_its_pod(tmp_path: Path, api: FakeKubeApi, fixture: str,
                                                    expect: tuple[str, ...]) -> None:
    (tmp_path / "proc" / "855").mkdir(parents=True)
    (tmp_path / "proc" / "855" / "cgroup").write_text((DATA / "cgroup" / fixture).read_text())
    (tmp_path / "token").write_text("t0ken")
    port = _port()
    env = {**os.environ, "GPUFOOTPRINT_KUBERNETES__MODE": "daemonset", "NODE_NAME": "gpu-node-1",
           "GPUFOOTPRINT_KUBERNETES__API_SERVER": api.url, "GPUFOOTPRINT_KUBERNETES__PROC_ROOT": str(tmp_path / "proc"),
           "GPUFOOTPRINT_KUBERNETES__TOKEN_FILE": str(tmp_path / "token"),
           "GPUFOOTPRINT_EXPORTER__EXTRA_POD_LABELS": "team"}
    proc = subprocess.Popen([sys.executable, "-m", "gpufootprint", "replay", str(DATA / "h200_caching.jsonl.gz"),
                             "--listen", f"127.0.0.1:{port}", "--linger", "30"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        got = _scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    per_process = [labels for series in got.values() for labels in series if "pid" in labels]
    assert len(per_process) >= 5  # the scrape may land mid-replay: fewer families, same labels
    for labels in per_process:
        assert labels["pid"] == "855"
        assert (labels["pod"], labels["namespace"], labels["container"], labels["attribution"],
                labels["label_team"]) == expect, labels
    if expect[3] == "resolved":
        assert api.paths == ["/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1"]  # one list, cached
    assert b"Traceback" not in err
