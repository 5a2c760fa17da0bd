"""PyTorch's allocator figures (allocated and reserved bytes by device), read on the workload's thread.

``torch.cuda.memory_allocated`` takes the caching allocator's mutex while it holds the GIL
(PyTorch releases the GIL for ``empty_cache``, not for its statistics). Read from the
probe's own thread it can hang the workload for good: the workload's thread, inside
``cudaMalloc`` with that mutex held, may be in CUPTI's buffer callback, which is Python
(ctypes) and waits for the GIL the probe's thread holds while it waits for the mutex.

So the figures are read only where the workload's thread already runs Python outside the
allocator: after an optimizer step (PyTorch's global optimizer step hook), at most once per
``min_interval_s`` (the sender passes its heartbeat period: the heartbeat sends only the last
reading). A workload that never steps an optimizer (inference) sends none.

That is safe for the workload's own thread, not for its other threads: CUPTI calls the probe's (Python)
buffer callbacks on whichever thread records, including another of the program's threads inside a
``cudaMalloc`` that PyTorch makes under the same mutex; that thread then waits for the GIL the stepping
thread holds while it waits for the mutex. So the reading is opt-in (``probe.torch_numbers``, off by
default), for programs that allocate CUDA memory on one thread at a time (docs/probe.md).

A reading is paid for in the workload's step, so it is one ``memory_stats_as_nested_dict`` call per
device: ``memory_allocated`` and ``memory_reserved`` each build the whole flattened, sorted
``memory_stats`` dictionary and throw all but one figure away. ``read_seconds`` counts the time
the readings took on the workload's thread (the heartbeat's ``torch_read_seconds``).
"""

from __future__ import annotations

import sys
import threading
import time
from types import FrameType
from typing import Any


class TorchNumbers:
    def __init__(self, min_interval_s: float = 1.0) -> None:
        self.min_interval_s = min_interval_s
        self.latest: dict[str, Any] = {}
        self.readings = 0
        self.read_seconds = 0.0  # wall time of the readings, on the workload's thread
        self._read_at = -float("inf")
        self._hooked = False
        self._closed = False

    def close(self) -> None:
        """The probe stopped: PyTorch keeps the hook (it is never removed: removing it from the sender's
        thread would race the step's loop as registering can), and from now on it does nothing."""
        self._closed = True

    def hook(self) -> bool:
        """Register the optimizer step hook once torch is imported; True once registered. Called from
        the sender's thread at each heartbeat until it is: see ``_no_step_in_the_hook_loop``."""
        if self._hooked or self._closed:
            return self._hooked
        if "torch" not in sys.modules:
            return False
        # From sys.modules, not as torch.optim.optimizer: torch/optim/__init__.py ends with
        # ``del optimizer``. Imported with torch itself; absent while torch is still importing.
        module = sys.modules.get("torch.optim.optimizer")
        register = getattr(module, "register_optimizer_step_post_hook", None)
        if register is None or not _no_step_in_the_hook_loop(module):
            return False
        try:
            register(self._after_step)
        except Exception:  # noqa: BLE001 - an older torch: no figures
            return False
        self._hooked = True
        return True

    def _after_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """On the workload's thread, after ``optimizer.step()``: never raises into it."""
        if self._closed:
            return
        now = time.monotonic()
        if now - self._read_at < self.min_interval_s:
            return
        self._read_at = now
        t0 = time.perf_counter()
        try:
            self.latest = read_now()
            self.readings += 1
        except Exception:  # noqa: BLE001, S110 - the figures are optional
            pass
        self.read_seconds += time.perf_counter() - t0


def _no_step_in_the_hook_loop(module: Any) -> bool:
    """Whether the hook may be inserted into PyTorch's global post hooks now, from the sender's thread.

    PyTorch's step wrapper loops over that OrderedDict, calling each hook: an insert while another
    thread is inside a hook that is not the last (another tool's, a tracker's) makes the loop's next
    step raise ``RuntimeError: OrderedDict mutated during iteration`` out of the user's
    ``optimizer.step()``. An empty dict cannot be half iterated (its iterator is made and ended in one C
    call), so it is always safe; otherwise no other thread may be running code of that module (a step's
    wrapper) when the threads are looked at; else the sender asks again at its next heartbeat. The look
    and the insert are a few bytecodes apart, not atomic: a thread that enters a step and reaches another
    tool's hook within one GIL switch in between still races, a far narrower window than before (any
    time a step spent in such a hook)."""
    hooks = getattr(module, "_global_optimizer_post_hooks", None)
    if not hooks:
        return True
    space = vars(module)
    me = threading.get_ident()
    for tid, frame in sys._current_frames().items():
        if tid == me:
            continue
        f: FrameType | None = frame
        while f is not None:
            if f.f_globals is space:
                return False
            f = f.f_back
    return True


def read_now() -> dict[str, Any]:
    """The figures, read on the calling thread (only the workload's own: see the module's doc)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    cuda = torch.cuda
    n = cuda.device_count()
    nested = getattr(cuda, "memory_stats_as_nested_dict", None)
    if nested is None:  # not in this torch: the two figures one flattened dictionary each
        return {"allocated": {str(d): int(cuda.memory_allocated(d)) for d in range(n)},
                "reserved": {str(d): int(cuda.memory_reserved(d)) for d in range(n)}}
    allocated: dict[str, int] = {}
    reserved: dict[str, int] = {}
    for d in range(n):
        stats = nested(d)
        # what memory_allocated and memory_reserved return: "<stat>.all.current", 0 when absent
        allocated[str(d)] = int(stats.get("allocated_bytes", {}).get("all", {}).get("current", 0))
        reserved[str(d)] = int(stats.get("reserved_bytes", {}).get("all", {}).get("current", 0))
    return {"allocated": allocated, "reserved": reserved}
