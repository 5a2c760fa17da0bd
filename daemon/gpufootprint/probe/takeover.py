"""torch.profiler takes CUPTI away: see it coming, give way, take it back.

On the H200 a torch.profiler session re-registered CUPTI's activity callbacks
and tore CUPTI down at its end; the probe received nothing afterwards. PyTorch's
profilers all go through ``torch.autograd.profiler.profile``: ``_prepare_trace``
is where Kineto takes CUPTI, ``__exit__`` where it lets go. The probe wraps
both (the user's profiler runs unchanged, and its exceptions pass through):

* before: force a flush of our records and stop calling CUPTI;
* after: re-register our callbacks, re-enable our kinds, and rebuild the live
  table: PyTorch's segments now (``torch.cuda.memory_snapshot``) replace every
  entry PyTorch owned before or after, and the probe's own entries outside
  PyTorch's segments (CUDA libraries, pinned, managed) are kept. Then resync.

The wrapper is installed as soon as ``torch.autograd.profiler`` is imported (a
post-import hook), so a profiler started right after ``import torch`` is seen.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufootprint.probe.core import Probe

_TARGET = "torch.autograd.profiler"
_MARK = "_gpufootprint_wrapped"


def torch_segments() -> list[tuple[int, int, int]]:
    """(device, address, bytes) of PyTorch's caching-allocator segments; [] when unknown."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    try:
        if not torch.cuda.is_initialized():
            return []
        return [(int(s["device"]), int(s["address"]), int(s["total_size"])) for s in torch.cuda.memory_snapshot()]
    except Exception:  # noqa: BLE001 - cudaMallocAsync backend and others: no segment list
        return []


def wrap(module: ModuleType, probe: Probe) -> bool:
    cls = getattr(module, "profile", None)
    if cls is None or getattr(cls, _MARK, False):
        return cls is not None
    enter_name = "_prepare_trace" if hasattr(cls, "_prepare_trace") else "__enter__"
    orig_enter = getattr(cls, enter_name)
    orig_exit = cls.__exit__

    @functools.wraps(orig_enter)
    def enter(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if not getattr(self, "_gpufootprint_before", None) and not probe.in_gap:
                self._gpufootprint_before = torch_segments()
                probe.takeover_begin()
        except Exception:  # noqa: BLE001 - never break the user's profiler
            probe.counters["takeover_errors"] += 1
        return orig_enter(self, *args, **kwargs)

    @functools.wraps(orig_exit)
    def exit_(self: Any, *args: Any) -> Any:
        try:
            return orig_exit(self, *args)
        finally:
            before = getattr(self, "_gpufootprint_before", None)
            if before is not None:
                self._gpufootprint_before = None
                try:
                    probe.takeover_end(before, torch_segments)
                except Exception:  # noqa: BLE001
                    probe.counters["takeover_errors"] += 1

    setattr(cls, enter_name, enter)
    cls.__exit__ = exit_
    setattr(cls, _MARK, True)
    return True


class _PostImport(importlib.abc.MetaPathFinder):
    """Wraps the profiler class the moment its module finishes importing."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader = spec.loader
                orig = loader.exec_module
                probe = self.probe

                def exec_module(module: ModuleType, orig: Any = orig, probe: Probe = probe) -> None:
                    orig(module)
                    try:
                        wrap(module, probe)
                    except Exception:  # noqa: BLE001
                        probe.counters["takeover_errors"] += 1

                spec.loader = _Loader(loader, exec_module)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, exec_module: Any) -> None:
        self._inner = inner
        self._exec = exec_module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._exec(module)


def install(probe: Probe) -> None:
    module = sys.modules.get(_TARGET)
    if module is not None:
        wrap(module, probe)
        return
    if not any(isinstance(f, _PostImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport(probe))
