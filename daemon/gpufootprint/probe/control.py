"""CONTROL frames from the daemon, applied in the probe (sender thread).

The daemon may ask for: a flush interval (the adaptive sampler), a kernel window
(the CUDA Graph advisor), a resync, TOTALS with each watermark (and, with
``cupti_buffers`` 1 or 2, CUPTI's buffers forwarded unread), and two PyTorch
allocator actions. An unknown or malformed message is counted (``control_unknown``), never
raised: a daemon newer than the probe may ask for things it does not know.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Protocol

from gpufootprint.wire import framing
from gpufootprint.wire.framing import Frame, FrameType


class ControlTarget(Protocol):
    """What a CONTROL frame can change in the probe."""

    counters: Counter[str]

    def set_flush_interval(self, ms: int) -> None: ...
    def open_kernel_window(self, ms: int, wid: int, records: str = "kernels", steps: int = 0,
                           max_records: int = 0, min_ms: int = 0) -> None: ...
    def request_resync(self) -> None: ...
    def send_totals(self, cupti_buffers: int) -> None: ...


def apply_control(frame: Frame, target: ControlTarget) -> None:
    body: dict[str, Any] = {}  # not a CONTROL frame, or not JSON: no op, counted as unknown below
    try:
        if frame.type is FrameType.CONTROL:
            body = frame.json()
    except Exception:  # noqa: BLE001
        body = {}
    op = body.get("op")
    counters = target.counters
    try:
        if op == "flush_interval":
            target.set_flush_interval(int(body["ms"]))
        elif op == "kernel_window":
            records = body.get("records", "kernels")
            # steps, max_records (launch windows): the probe closes the window itself once it has
            # counted that many whole steps or calls (0 or absent: only when its lease ends), and has
            # been open min_ms.
            target.open_kernel_window(int(body["ms"]), int(body.get("id", 0)),
                                      "launches" if records == "launches" else "kernels",
                                      max(0, int(body.get("steps", 0))), max(0, int(body.get("max_records", 0))),
                                      max(0, int(body.get("min_ms", 0))))
        elif op == "resync":
            target.request_resync()
            counters["resyncs_requested"] += 1
        elif op == "verify":
            # Levels are cumulative: a later daemon's higher level still means "at least 2".
            target.send_totals(framing.cupti_buffers_level(body))
        elif op == "torch_empty_cache":
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        elif op == "torch_memory_fraction":
            _torch_memory_fraction(body)
        else:
            counters["control_unknown"] += 1
    except Exception:  # noqa: BLE001 - a bad control message is counted, never raised
        counters["control_unknown"] += 1


def _torch_memory_fraction(body: dict[str, Any]) -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.cuda.set_per_process_memory_fraction(float(body["fraction"]), int(body.get("device", 0)))
