"""PyTorch's allocator figures reach the heartbeat without the probe's thread ever asking torch.

``torch.cuda.memory_allocated`` takes the allocator's mutex holding the GIL; asked from the
probe's thread while the workload's thread holds that mutex inside cudaMalloc and waits in
CUPTI's (Python) buffer callback for the GIL, neither thread moves again (two of three
16-worker starts of bench/overhead.py on the H200 hung in a probed worker, 2026-12-04). The
figures are read after an optimizer step, on the workload's thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.probe.torchnumbers import TorchNumbers
from gpufootprint.wire.framing import FrameType, iter_frames
from gpufootprint.wire.sources import TraceFile

from tests import probe_fakes as fk


def _torch_that_records_its_callers(allocated: int, reserved: int, devices: int = 1,
                                    nested: bool = True) -> tuple[Any, list[str], list[Any]]:
    """A torch whose allocator statistics note the thread and the call that asked for them."""
    callers: list[str] = []
    hooks: list[Any] = []
    torch = fk.fake_torch(reserved=reserved, allocated=allocated)
    torch.calls = []

    def stat(name: str, value: int) -> Any:
        def read(d: int = 0) -> int:
            callers.append(threading.current_thread().name)
            torch.calls.append((name, d))
            return value + d
        return read

    def stats(d: int = 0) -> dict[str, Any]:
        callers.append(threading.current_thread().name)
        torch.calls.append(("nested", d))
        return {"allocated_bytes": {"all": {"current": allocated + d}, "large_pool": {"current": 1}},
                "reserved_bytes": {"all": {"current": reserved + d}}, "num_ooms": 0}

    torch.cuda.memory_allocated, torch.cuda.memory_reserved = stat("allocated", allocated), stat("reserved", reserved)
    torch.cuda.device_count = lambda: devices
    if nested:
        torch.cuda.memory_stats_as_nested_dict = stats
    else:
        del torch.cuda.memory_stats_as_nested_dict  # an older torch
    _install_optim(torch, hooks)
    return torch, callers, hooks


def _install_optim(torch: Any, hooks: list[Any]) -> None:
    """PyTorch's layout: ``torch/optim/__init__.py`` ends with ``del optimizer``, so the hook's module is
    in ``sys.modules`` but not an attribute of ``torch.optim`` (the probe looked for the attribute until
    2026-12-06 and so never registered its hook on a real torch)."""
    torch.optim = SimpleNamespace(Optimizer=object)
    torch.optimizer_module = SimpleNamespace(register_optimizer_step_post_hook=hooks.append)


def _use(monkeypatch: pytest.MonkeyPatch, torch: Any) -> None:
    """``torch`` (and its optimizer module, where it has one) imported, for the test's duration."""
    monkeypatch.setitem(sys.modules, "torch", torch)
    if hasattr(torch, "optimizer_module"):
        monkeypatch.setitem(sys.modules, "torch.optim.optimizer", torch.optimizer_module)
    else:
        monkeypatch.delitem(sys.modules, "torch.optim.optimizer", raising=False)


def _probe(path: Path | None = None, *, heartbeat_ms: int = 50, **settings: Any) -> Probe:
    """A probe on the fake raw CUPTI (not started), its frames written to ``path`` where given."""
    return Probe(ProbeSettings(socket="", tee=str(path) if path is not None else "", flush_ms=10,
                               heartbeat_ms=heartbeat_ms, **settings), fk.FakeRawCupti(), discover_devices=False)


def _until_hooked(hooks: list[Any]) -> None:
    """Until the probe registered its optimizer hook (from a heartbeat), 5 s at most."""
    deadline = time.monotonic() + 5
    while not hooks and time.monotonic() < deadline:
        time.sleep(0.01)


def _heartbeats(path: Path) -> list[dict[str, Any]]:
    return [f.json() for f in iter_frames(TraceFile(path).chunks()) if f.type is FrameType.HEARTBEAT]


def test_heartbeats_carry_figures_read_on_the_workloads_thread_only(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    torch, callers, hooks = _torch_that_records_its_callers(allocated=2 << 30, reserved=3 << 30)
    _use(monkeypatch, torch)
    path = tmp_path / "t.gfp"
    probe = _probe(path, torch_numbers=True)
    assert probe.start()
    try:
        _until_hooked(hooks)
        assert len(hooks) == 1
        time.sleep(0.2)  # heartbeats before any optimizer step: no figures, and torch never asked
        assert callers == []
        hooks[0](object(), (), {})  # optimizer.step() returned, on this (the workload's) thread
        time.sleep(0.3)
    finally:
        probe.stop()
    assert callers and set(callers) == {threading.main_thread().name}, callers
    beats = _heartbeats(path)
    with_torch = [b["torch"] for b in beats if "torch" in b]
    assert with_torch and with_torch[-1] == {"allocated": {"0": 2 << 30}, "reserved": {"0": 3 << 30}}
    assert "torch" not in beats[0]


def test_a_step_hook_reads_at_most_once_per_interval_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    torch, callers, hooks = _torch_that_records_its_callers(allocated=1, reserved=2)
    _use(monkeypatch, torch)
    numbers = TorchNumbers(min_interval_s=60)
    assert numbers.hook() and numbers.hook() and len(hooks) == 1  # registered once
    for _ in range(1000):  # a thousand steps in a minute: one reading
        hooks[0](None, (), {})
    assert numbers.readings == 1 and len(callers) == 1
    numbers._read_at = -float("inf")
    torch.cuda.memory_stats_as_nested_dict = lambda _d=0: 1 / 0  # a broken torch: the step still returns
    hooks[0](None, (), {})
    assert numbers.latest == {"allocated": {"0": 1}, "reserved": {"0": 2}}
    assert numbers.readings == 1 and numbers.read_seconds > 0  # a failed reading is timed, not counted


def test_without_an_optimizer_hook_there_are_no_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, fk.fake_torch(reserved=3, allocated=2))  # no torch.optim
    numbers = TorchNumbers()
    assert numbers.hook() is False and numbers.latest == {}


def test_a_reading_asks_torch_once_per_device_for_both_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading is paid for inside the workload's step: one nested statistics call per device.
    ``memory_allocated`` and ``memory_reserved`` would each build, flatten and sort the whole table."""
    torch, _, hooks = _torch_that_records_its_callers(allocated=10, reserved=20, devices=3)
    _use(monkeypatch, torch)
    numbers = TorchNumbers(min_interval_s=0)
    assert numbers.hook()
    hooks[0](None, (), {})
    assert torch.calls == [("nested", 0), ("nested", 1), ("nested", 2)]
    assert numbers.latest == {"allocated": {"0": 10, "1": 11, "2": 12}, "reserved": {"0": 20, "1": 21, "2": 22}}


def test_an_older_torch_without_nested_statistics_still_gives_both_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    torch, _, hooks = _torch_that_records_its_callers(allocated=10, reserved=20, devices=2, nested=False)
    _use(monkeypatch, torch)
    numbers = TorchNumbers(min_interval_s=0)
    assert numbers.hook()
    hooks[0](None, (), {})
    assert sorted(torch.calls) == [("allocated", 0), ("allocated", 1), ("reserved", 0), ("reserved", 1)]
    assert numbers.latest == {"allocated": {"0": 10, "1": 11}, "reserved": {"0": 20, "1": 21}}


def test_the_time_readings_take_on_the_workloads_thread_is_counted_and_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch, _, hooks = _torch_that_records_its_callers(allocated=1, reserved=2)
    slow = torch.cuda.memory_stats_as_nested_dict

    def stats(d: int = 0) -> dict[str, Any]:
        time.sleep(0.02)  # a slow torch: the step pays this
        return slow(d)

    torch.cuda.memory_stats_as_nested_dict = stats
    _use(monkeypatch, torch)
    path = tmp_path / "t.gfp"
    probe = _probe(path, torch_numbers=True)
    assert probe.start()
    try:
        # no more than one reading a heartbeat: the heartbeat sends only the last one
        assert probe.sender.torch_numbers.min_interval_s == pytest.approx(0.05)
        _until_hooked(hooks)
        for _ in range(3):
            hooks[0](object(), (), {})
            time.sleep(0.06)
        time.sleep(0.2)
        status = probe.status()
    finally:
        probe.stop()
    assert status["torch_readings"] == 3
    assert 0.06 <= status["torch_read_seconds"] < 1.0
    beats = _heartbeats(path)
    assert beats[-1]["counters"]["torch_readings"] == 3


def test_by_default_the_probe_never_hooks_the_optimizer_nor_asks_torch(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Off unless asked for: PyTorch reads its figures under the allocator's mutex holding the GIL, and
    another thread of the program inside cudaMalloc under that mutex may be waiting for the GIL in the
    probe's CUPTI buffer callback."""
    torch, callers, hooks = _torch_that_records_its_callers(allocated=2 << 30, reserved=3 << 30)
    _use(monkeypatch, torch)
    path = tmp_path / "t.gfp"
    probe = _probe(path)
    assert probe.start()
    try:
        time.sleep(0.4)  # several heartbeats
    finally:
        probe.stop()
    assert hooks == [] and callers == []
    beats = _heartbeats(path)
    assert len(beats) >= 3 and not any("torch" in b for b in beats)
    assert beats[-1]["counters"]["torch_readings"] == 0


# PyTorch's own code for the global step hooks (torch/optim/optimizer.py, 2.x): an OrderedDict, inserted into
# by register_optimizer_step_post_hook and iterated by the step's wrapper after the step, calling each hook.
_OPTIMIZER_SOURCE = '''
from collections import OrderedDict
from itertools import chain, count

_global_optimizer_post_hooks = OrderedDict()
_ids = count()


def register_optimizer_step_post_hook(hook):
    _global_optimizer_post_hooks[next(_ids)] = hook


def step(optimizer):
    """Optimizer.profile_hook_step's wrapper, after ``func(*args, **kwargs)``."""
    for post_hook in chain(optimizer._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
        post_hook(optimizer, (), {})
'''


def _torch_with_pytorchs_hook_loop(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    import types

    torch, _, _ = _torch_that_records_its_callers(allocated=1, reserved=2)
    module = types.ModuleType("torch.optim.optimizer")
    exec(compile(_OPTIMIZER_SOURCE, "torch/optim/optimizer.py", "exec"), vars(module))  # noqa: S102
    torch.optimizer_module = module
    _use(monkeypatch, torch)
    return torch, module


def test_registering_from_the_senders_thread_never_raises_into_a_step_running_another_tools_hook(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender registers the hook from a heartbeat, on its own thread. Inserted into PyTorch's
    OrderedDict while the workload's thread is inside its loop over the global post hooks, running a
    hook another tool registered (a tracker, a profiler) that is not the last one, it raised
    ``RuntimeError: OrderedDict mutated during iteration`` out of the user's ``optimizer.step()``."""
    _, module = _torch_with_pytorchs_hook_loop(monkeypatch)
    inside, tried = threading.Event(), threading.Event()

    def tracker(_o: Any, _a: Any, _k: Any) -> None:  # another tool's global hook, Python
        inside.set()
        tried.wait(2)

    module.register_optimizer_step_post_hook(tracker)
    module.register_optimizer_step_post_hook(lambda _o, _a, _k: None)  # and one more after it
    numbers = TorchNumbers(min_interval_s=0)
    answered: list[bool] = []

    def heartbeat() -> None:  # the sender's thread
        inside.wait(5)
        answered.append(numbers.hook())
        tried.set()

    sender = threading.Thread(target=heartbeat, name="gpufootprint-probe")
    sender.start()
    optimizer = SimpleNamespace(_optimizer_step_post_hooks={})
    try:
        module.step(optimizer)  # the workload's optimizer.step(): must return
    finally:
        sender.join(5)
    assert answered == [False]  # not while a step may be in the loop: asked again at the next heartbeat
    tried.set()
    assert numbers.hook() is True  # no step running: registered
    module.step(optimizer)
    assert numbers.readings == 1


def test_with_no_other_global_hook_the_sender_registers_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty dict cannot be half iterated: registering needs no look at the other threads."""
    _, module = _torch_with_pytorchs_hook_loop(monkeypatch)
    numbers = TorchNumbers(min_interval_s=0)
    monkeypatch.setattr(sys, "_current_frames", lambda: 1 / 0)
    assert numbers.hook() is True
    module.step(SimpleNamespace(_optimizer_step_post_hooks={}))
    assert numbers.readings == 1


def test_a_stopped_probe_reads_nothing_more_in_the_workloads_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch keeps the hook after the probe stops (the probe never removes it: removing from the sender's
    thread would race the step's loop as registering did); the hook must then do nothing."""
    torch, callers, hooks = _torch_that_records_its_callers(allocated=1, reserved=2)
    _use(monkeypatch, torch)
    probe = _probe(heartbeat_ms=20, torch_numbers=True)
    assert probe.start()
    try:
        _until_hooked(hooks)
        hooks[0](object(), (), {})
        assert probe.sender.torch_numbers.readings == 1
    finally:
        probe.stop()
    probe.sender.torch_numbers._read_at = -float("inf")
    hooks[0](object(), (), {})
    assert probe.sender.torch_numbers.readings == 1 and len(callers) == 1


def test_a_forked_child_runs_unprobed_so_the_parents_hook_reads_nothing_in_its_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The child of a fork inherits PyTorch's global hooks, the parent's TorchNumbers among them; the probe
    leaves the child unprobed (probe/__init__.py), so that hook must not read the child's allocator."""
    import gpufootprint.probe as probe_module

    torch, callers, hooks = _torch_that_records_its_callers(allocated=1, reserved=2)
    _use(monkeypatch, torch)
    probe = _probe(heartbeat_ms=20, torch_numbers=True)
    monkeypatch.setattr(probe_module, "_probe", probe)
    monkeypatch.setattr(probe_module, "_lock", probe_module._lock)
    assert probe.start()
    try:
        _until_hooked(hooks)
        probe_module._after_fork_in_child()  # what os.register_at_fork runs in a child
        hooks[0](object(), (), {})  # the child's optimizer.step()
        assert callers == [] and probe.sender.torch_numbers.readings == 0
    finally:
        probe.stop()


# Another thread of the program inside cudaMalloc, under PyTorch's allocator mutex, where CUPTI calls the
# probe's (Python, ctypes) buffer callback, while the stepping thread's optimizer hook asks PyTorch for its
# statistics, which take the same mutex holding the GIL. Modelled with a lock C code takes and calls back
# under: glibc's dl_iterate_phdr holds the loader's lock while it calls its callback. The "allocating"
# thread calls it through ctypes.CDLL (the GIL released, as a C library's thread would run); the "statistics"
# take that lock through ctypes.PyDLL (the GIL kept, as PyTorch's binding does). Run in a child: a deadlock
# is for good.
_HAZARD = r"""
import ctypes, sys, threading, time
from types import SimpleNamespace
from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings
from tests import probe_fakes as fk

mode = sys.argv[1]  # "0": the probe's default; "1": probe.torch_numbers; "native": on, the callback in C
VISIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
keeps_gil, frees_gil = ctypes.PyDLL(None), ctypes.CDLL(None)
stop = VISIT(lambda info, size, data: 1)  # the first object ends the walk (Python: needs the GIL)

def nested(d=0):  # PyTorch's statistics: the lock, taken holding the GIL
    keeps_gil.dl_iterate_phdr(stop, None)
    return {"allocated_bytes": {"all": {"current": 1}}, "reserved_bytes": {"all": {"current": 2}}}

hooks = []
torch = fk.fake_torch(reserved=2, allocated=1)
torch.cuda.memory_stats_as_nested_dict = nested
sys.modules["torch"] = torch
sys.modules["torch.optim.optimizer"] = SimpleNamespace(register_optimizer_step_post_hook=hooks.append)
cupti = fk.FakeRawCupti()
# "1": the ctypes callbacks, Python under the lock (the C ones cannot be: tests/unit/test_probe_native.py)
probe = Probe(ProbeSettings(socket="", flush_ms=10, heartbeat_ms=20, torch_numbers=mode != "0",
                            native_callbacks=mode != "1"), cupti, discover_devices=False)
assert probe.start()
time.sleep(0.3)  # heartbeats: the hook is registered where the setting asks for it
holding = threading.Event()

def in_malloc(info, size, data):  # under the lock: CUPTI asks the probe's Python callback for a buffer
    holding.set()
    time.sleep(1.0)  # (the GIL released: the stepping thread reaches its optimizer hook meanwhile)
    buf, n, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    cupti.delivery._req(ctypes.byref(buf), ctypes.byref(n), ctypes.byref(most))
    return 1

def malloc_thread():
    if mode == "native":  # the same lock taken by C alone, no Python under it: a control
        frees_gil.dl_iterate_phdr(ctypes.cast(frees_gil.abs, VISIT), None)
        holding.set()
    else:
        frees_gil.dl_iterate_phdr(VISIT(in_malloc), None)

t = threading.Thread(target=malloc_thread)
t.start()
holding.wait()
for hook in hooks:  # optimizer.step() returned on this (the stepping) thread
    hook(None, (), {})
t.join()
probe.stop()
print("done", len(hooks), probe.sender.torch_numbers.readings, flush=True)
"""


def _hazard(mode: str) -> subprocess.CompletedProcess[str] | None:
    """The scenario in a child; None if it did not end within 10 s (killed)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "daemon"),
                                                        os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, "-c", _HAZARD, mode], check=False, cwd=root,
                              env=env, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None


def test_by_default_a_thread_allocating_while_the_optimizer_steps_never_deadlocks_with_the_probe() -> None:
    done = _hazard("0")
    assert done is not None and done.returncode == 0, done
    assert done.stdout.split() == ["done", "0", "0"]  # no hook: PyTorch's mutex never asked for under the GIL


def test_the_opt_in_reading_deadlocks_with_a_python_callback_under_the_allocators_lock() -> None:
    """Why ``probe.torch_numbers`` is off by default (docs/probe.md), reproduced: the reading alone is
    harmless (the control, where the lock's holder runs no Python, reads once and ends); with the probe's
    Python buffer callback called under the lock, the two threads wait for each other for good. The probe's
    callbacks are C by default now (probe/nativecallbacks.py); this is the case of its ctypes callbacks (no
    library, or ``native_callbacks`` off). tests/unit/test_probe_native.py calls the C one under the lock:
    it returns."""
    control = _hazard("native")
    assert control is not None and control.returncode == 0, control
    assert control.stdout.split() == ["done", "1", "1"]
    assert _hazard("1") is None
