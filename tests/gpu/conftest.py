"""GPU tests run only where NVML finds a GPU and cupti-python is importable."""

from __future__ import annotations

import pytest


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if _REASON is not None:
                item.add_marker(pytest.mark.skip(reason=_REASON))
