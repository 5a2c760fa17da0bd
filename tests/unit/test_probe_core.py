"""The probe's core with the fake CUPTI (and a fake NVML) at the hardware edge, writing to a file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from gpufootprint.probe import takeover
from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.records import MemoryKind, RecordKind
from gpufootprint.wire.framing import Frame, FrameType, iter_frames
from gpufootprint.wire.sources import TraceFile

from tests import probe_fakes as fk


def frames(path: Path) -> list[Frame]:
    return list(iter_frames(TraceFile(path).chunks()))


def test_untracked_kind_is_nvml_used_minus_what_cupti_reported(tmp_path: Path) -> None:
    # GIVEN CUDA was initialised before the probe, NVML says the process uses 5000 bytes
    nvml = {0: 5000}
    fake = fk.FakeCupti()
    probe = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), untracked_ms=20, flush_ms=10), fake,
                  discover_devices=False, nvml_used=lambda pid, devs: dict(nvml))
    probe.sender.cuda_before = True
    probe.sender.devices = [{"index": 0}]
    assert probe.start()
    try:
        fake.alloc(0x1000, 1200)
        time.sleep(0.15)
        first = probe.sender.table.live_by_kind(0)
        nvml[0] = 7000  # the process grew by something CUPTI cannot see
        time.sleep(0.15)
        second = probe.sender.table.live_by_kind(0)
    finally:
        probe.stop()
    assert first == {"device": 1200, "untracked": 3800}
    assert second == {"device": 1200, "untracked": 5800}
    untracked = [r for f in frames(tmp_path / "t.gfp") if f.type is FrameType.BATCH and f.tag == RecordKind.MEMORY
                 for r in f.records().tolist() if r[13] == MemoryKind.UNTRACKED]
    # each change is a release of the old figure and an allocation of the new one (if the
    # first poll ran before the allocation was flushed, 5000 came and went first)
    seq = [(r[12], r[2]) for r in untracked]
    assert seq[-3:] == [(1, 3800), (2, 3800), (1, 5800)]
    assert seq[:-3] in ([], [(1, 5000), (2, 5000)])


def test_a_probe_that_cannot_start_reports_why_and_raises_nothing() -> None:
    class NoDriver(fk.FakeCupti):
        def register(self, requested: Any, completed: Any) -> None:
            raise RuntimeError("CUDA driver is not found")

    probe = Probe(ProbeSettings(socket=""), NoDriver(), discover_devices=False)
    assert probe.start() is False
    assert "CUDA driver is not found" in probe.errors[0]
    assert probe.mark("x") is None


class _FakeProfile:
    """Stands in for torch.autograd.profiler.profile: the names the wrapper hooks."""

    events: ClassVar[list[str]] = []

    def _prepare_trace(self) -> None:
        self.events.append("prepare")

    def __exit__(self, *exc: object) -> None:
        self.events.append("exit")
        raise ValueError("the user's profiler failed")


def test_profiler_hand_over_calls_the_probe_around_the_users_profiler_and_passes_its_errors() -> None:
    import types

    import pytest

    module = types.ModuleType("fake_profiler")
    module.profile = _FakeProfile  # type: ignore[attr-defined]
    calls: list[str] = []

    class P:
        in_gap = False
        counters: ClassVar[dict[str, int]] = {}

        def takeover_begin(self) -> None:
            calls.append("begin")
            self.in_gap = True

        def takeover_end(self, before: list[Any], after_fn: Any) -> None:
            calls.append(f"end:{before}:{after_fn()}")
            self.in_gap = False

    assert takeover.wrap(module, P())  # type: ignore[arg-type]
    assert takeover.wrap(module, P())  # idempotent
    prof = _FakeProfile()
    prof._prepare_trace()
    with pytest.raises(ValueError, match="user's profiler"):
        prof.__exit__(None, None, None)
    assert _FakeProfile.events == ["prepare", "exit"]
    assert calls == ["begin", "end:[]:[]"]  # no torch here: no segments before or after


def test_post_import_hook_wraps_the_profiler_class_when_torch_imports_it(tmp_path: Path) -> None:
    # A stand-in ``torch`` package on the path: only the module the hook watches.
    import subprocess
    import sys

    pkg = tmp_path / "torch" / "autograd"
    pkg.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "profiler.py").write_text("class profile:\n    def _prepare_trace(self): pass\n"
                                     "    def __exit__(self, *a): pass\n")
    code = ("import sys\n"
            "from gpufootprint.probe import takeover\n"
            "class P:\n    in_gap = False\n    counters = {}\n"
            "takeover.install(P())\n"
            "assert 'torch.autograd.profiler' not in sys.modules\n"
            "import torch.autograd.profiler as m\n"
            "print(getattr(m.profile, '_gpufootprint_wrapped', False))\n")
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": f"{tmp_path}:{root / 'daemon'}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


@pytest.mark.parametrize("kind", ["concurrent", "serial"])
def test_a_kernel_window_beside_always_on_kernels_switches_nothing_on_or_off(tmp_path: Path, kind: str) -> None:
    """With kernels always on, a window must leave CUPTI's kinds as they were: a serial KERNEL kind
    left on beside CONCURRENT_KERNEL would serialise every kernel for the rest of the process."""
    fake = fk.FakeCupti()
    p = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10, kernels=True,
                            kernel_window_kind=kind), fake, discover_devices=False)
    assert p.start()
    try:
        before = set(fake.enabled)
        assert fk.CONCURRENT_KERNEL in before and fk.KERNEL not in before
        p.sender.open_kernel_window(50, 1)  # what a CONTROL kernel_window does
        assert fk.KERNEL not in fake.enabled
        deadline = time.monotonic() + 5
        while p.sender.windows.kernel_window is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.sender.windows.kernel_window is None and fake.enabled == before
        assert p.counters["kernel_windows"] == 1
    finally:
        p.stop()


def test_a_serial_window_switches_on_and_off_only_its_own_kind(tmp_path: Path) -> None:
    fake = fk.FakeCupti()
    p = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10, kernel_window_kind="serial"),
              fake, discover_devices=False)
    assert p.start()
    try:
        before = set(fake.enabled)
        p.sender.open_kernel_window(50, 1)
        assert fake.enabled == before | {fk.KERNEL}
        deadline = time.monotonic() + 5
        while p.sender.windows.kernel_window is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.enabled == before
    finally:
        p.stop()
