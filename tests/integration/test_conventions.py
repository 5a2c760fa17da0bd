"""Conventions of the tools around us, checked in those tools' terms (issue 30, item 8):
Prometheus exporters' ``--web.listen-address``; Perfetto's integer thread ids; PyTorch memory
snapshots' stream 0 for synchronous allocations. (The PrometheusRule object is checked against
rules.yml in tests/unit/test_deploy_manifests.py.)"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpufootprint.records import RecordKind
from gpufootprint.wire.framing import FrameType
from gpufootprint.wire.sources import TraceFile

from tests.conftest import DATA, cli_env
from tests.daemon_process import free_port, scrape, wait

pytestmark = pytest.mark.integration


def _cli(tmp: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = cli_env()
    env.pop("GPUFOOTPRINT_PROBE", None)
    return subprocess.run([sys.executable, "-m", "gpufootprint", *argv], env=env, cwd=tmp, capture_output=True,
                          text=True, timeout=180, check=False)


def test_web_listen_address_is_accepted_as_listen(tmp_path: Path) -> None:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "gpufootprint", "demo", "--web.listen-address", f"127.0.0.1:{port}",
                          "--duration", "20"], env=cli_env(), cwd=tmp_path, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert wait(lambda: scrape(port).get("gpufootprint_device_bytes"), timeout=30)
    finally:
        p.terminate()
        p.wait(30)


@pytest.mark.parametrize("trace", ["h200_kernels_train.gfp.gz", "h200_caching.jsonl.gz", "synth_leak.gfp.gz"])
def test_perfetto_slices_carry_integer_thread_ids_each_named(trace: str, tmp_path: Path) -> None:
    r = _cli(tmp_path, "export", str(DATA / trace), "--to", "perfetto", "-o", "t.json")
    assert r.returncode == 0, r.stderr
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices  # kernels, copies or anomaly windows: there is something to check
    assert all(type(e["tid"]) is int and type(e["pid"]) is int for e in events), \
        [e for e in events if type(e["tid"]) is not int][:3]
    named = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in slices} <= set(named)
    for pid in {p for p, _ in named}:  # one number per track of a process, one track per number
        names = [n for (p, _), n in named.items() if p == pid]
        assert len(names) == len(set(names)), names


def test_memory_viz_puts_synchronous_allocations_on_stream_0(tmp_path: Path) -> None:
    trace = DATA / "h200_probe_pinned_managed.gfp.gz"
    streams = np.concatenate([f.records()["stream"] for f in TraceFile(trace).frames()
                              if f.type is FrameType.BATCH and f.tag == RecordKind.MEMORY])
    assert (streams == 0xFFFFFFFF).any()  # CUPTI's "no stream" is in the input
    r = _cli(tmp_path, "export", str(trace), "--to", "memory-viz", "-o", "s.pickle")
    assert r.returncode == 0, r.stderr
    snap = pickle.loads((tmp_path / "s.pickle").read_bytes())
    seen = {e["stream"] for t in snap["device_traces"] for e in t} | {s["stream"] for s in snap["segments"]}
    assert 0 in seen and max(seen) < 0xFFFFFFFF, sorted(seen)
    # Host kinds are left out on purpose (docs/exports.md says why); device kinds are there.
    kinds = {f["filename"] for t in snap["device_traces"] for e in t for f in e["frames"]}
    assert "gpufootprint:device" in kinds and "gpufootprint:pinned" not in kinds, kinds
