"""Shared fixtures: paths to the committed traces, small record builders, and daemons to run (``daemons``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
SHARED_TRACES = ("h200_caching.jsonl.gz", "h200_expandable.jsonl.gz")

# Run the package from the source tree even when it is not installed.
sys.path.insert(0, str(ROOT / "daemon"))

from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp

#: Workers when the command line names none. Most tests wait on subprocesses, sockets and timers
#: rather than compute, so four keep two cores busy: on the 2-core development machine the suite
#: took 10 minutes in one process and 5 with four workers.
WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``pytest -q`` runs the suite on WORKERS pytest-xdist workers (``--dist loadgroup``: the files
    marked ``xdist_group`` stay on one worker). Nothing changes where xdist is not installed (the
    GPU machines' images), where the command line says how many (``-n 0``: this process alone), or
    inside a worker. Set here, not in addopts, so that a pytest without xdist still runs the tests."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if hasattr(config, "workerinput"):
        # A worker's options come from the command line alone: the grouping is passed on below.
        if config.workerinput.get("gpufootprint_loadgroup"):
            config.option.loadgroup = True
        return
    # A GPU run (``-m gpu``) stays in one process: one GPU, tests that fill it (OOM captures, 20 GiB
    # spikes) and timings. On the H200 on 2026-12-04 `-m gpu` on four workers started the PyTorch OOM
    # test's workload while another worker's CuPy workload held the whole GPU (its first
    # torch.zeros failed); the same two tests passed in one process.
    # So does a run of tests/gpu's files alone (as bench/device_native.sh ran them on 2026-12-06: on four
    # workers the OOM tests' workloads filled the GPU beside each other, and four failed that way).
    gpu_run = "gpu" in (config.option.markexpr or "") and "not gpu" not in (config.option.markexpr or "")
    gpu_run = gpu_run or bool(config.args) and all(_under_gpu_tests(a, config.invocation_params.dir)
                                                   for a in config.args)
    if config.option.numprocesses is None and config.option.dist == "no" and not gpu_run:
        config.option.numprocesses = WORKERS
        config.option.dist = "loadgroup"


def _under_gpu_tests(arg: str, cwd: Path) -> bool:
    """Whether a command line path (``tests/gpu``, ``gpu/`` from tests/, a file ``::`` a test, absolute)
    names tests/gpu or something in it; relative paths are the invocation directory's."""
    path = cwd / arg.split("::", 1)[0]  # an absolute path stays itself
    return path.resolve().is_relative_to(ROOT / "tests" / "gpu")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(pytest-xdist) Tell each worker to send its xdist_group names with its tests."""
    node.workerinput["gpufootprint_loadgroup"] = node.config.option.dist == "loadgroup"


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``cupti_layout.walk`` of a CUPTI buffer from now on, by its valid bytes: what tests count to show
    a buffer is walked once (a walk costs about 4 us a 512-record buffer), not once a reader."""
    from gpufootprint.wire import cupti_layout

    seen: list[int] = []
    walk = cupti_layout.walk

    def counted(buf: Any, valid: int) -> Any:
        seen.append(valid)
        return walk(buf, valid)

    monkeypatch.setattr(cupti_layout, "walk", counted)
    return seen


def mem(ts: int, op: int, addr: int, size: int, *, kind: int = MemoryKind.DEVICE, pid: int = 100,
        dev: int = 0, is_async: int = 0, corr: int = 0) -> tuple:
    """A MEMORY record as a tuple; the CUDA call's correlation id only where a test names one."""
    row = (ts, op, addr, size, kind, pid, dev, is_async)
    return (*row, corr) if corr else row


def mem_batch(rows: list[tuple]) -> np.ndarray:
    """MEMORY records from (ts, op, addr, bytes, kind, pid, dev, is_async[, corr]) tuples."""
    out = np.zeros(len(rows), dtype=MEMORY_DTYPE)
    for i, row in enumerate(rows):
        ts, op, addr, size, kind, pid, dev, is_async = row[:8]
        out[i]["ts"], out[i]["op"], out[i]["addr"], out[i]["bytes"] = ts, op, addr, size
        out[i]["mk"], out[i]["pid"], out[i]["dev"], out[i]["is_async"] = kind, pid, dev, is_async
        out[i]["corr"] = row[8] if len(row) > 8 else 0
    return out


ALLOC, FREE = MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value


def cli_env() -> dict[str, str]:
    """Environment for running the CLI in a child process from the source tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "daemon") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("GPUFOOTPRINT_CONFIG", None)
    return env


@pytest.fixture
def daemons(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Starts ``gpufootprint daemon`` processes (tests/daemon_process.py); each is stopped when the test ends.

    ``daemons(*args, config=None, nofile=None, env=None, cwd=None)``: ``args`` are its settings beyond
    the socket and port it gets, e.g. ``"--set", "footprint.reorder_window_ms=0"``; call ``.ready()``
    on the result to wait until it serves."""
    from tests.daemon_process import DaemonProcess

    made: list[DaemonProcess] = []

    def start(*args: str, config: Path | None = None, nofile: int | None = None, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> DaemonProcess:
        d = DaemonProcess(tmp_path, *args, config=config, nofile=nofile, env=env, cwd=cwd)
        made.append(d)
        return d

    yield start
    for d in made:
        d.stop()
