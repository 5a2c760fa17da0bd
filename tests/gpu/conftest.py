"""GPU tests run only where NVML finds a GPU and cupti-python is importable.

Each GPU test has a time limit (``GPUFOOTPRINT_GPU_TEST_TIMEOUT``, 150 s): a test that stalls fails
there with every thread's stack rather than hanging the suite (pytest-timeout's signal method dumps
all threads, then fails the test and the suite goes on; where pytest-timeout is missing, Python's
faulthandler dumps every thread and ends the run). Workload children get ``WORKLOAD_DUMP_AFTER`` so
their own stacks are written before the limit (tests/gpu/workload.py, survive_workload.py).
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator

import pytest

GPU_TEST_TIMEOUT_S = float(os.environ.get("GPUFOOTPRINT_GPU_TEST_TIMEOUT", "150"))
os.environ.setdefault("WORKLOAD_DUMP_AFTER", str(max(10.0, GPU_TEST_TIMEOUT_S - 30)))


def _gpu_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() < 1:
                return "NVML found no GPU"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001
        return f"no NVIDIA GPU ({exc})"
    try:
        import cupti  # noqa: F401
        import torch

        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
    except Exception as exc:  # noqa: BLE001
        return f"cupti-python or torch missing ({exc})"
    return None


_REASON = _gpu_reason()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks (its loadgroup ids)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    timeout_plugin = config.pluginmanager.hasplugin("timeout")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            # One GPU, and timings measured on it: with pytest-xdist the GPU tests run one after another
            # on a single worker (--dist loadgroup), never beside each other.
            item.add_marker(pytest.mark.xdist_group("gpu"))
            if _REASON is not None:
                item.add_marker(pytest.mark.skip(reason=_REASON))
            elif timeout_plugin and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S, method="signal"))


@pytest.fixture(autouse=True)
def _stacks_if_stalled(request: pytest.FixtureRequest) -> Iterator[None]:
    """Without pytest-timeout: every thread's stack, and the run ended, past the limit (a hang never)."""
    if _REASON is not None or request.config.pluginmanager.hasplugin("timeout"):
        yield
        return
    faulthandler.dump_traceback_later(GPU_TEST_TIMEOUT_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
