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


class _Driver:
    """CUDA's driver at the hardware edge, as far as the probe meets it: nothing is started before the first
    ``cuInit``, which fixes the devices the process sees from ``CUDA_VISIBLE_DEVICES`` as it is then."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self.visible: list[int] | None = None
        self.init_calls: list[str] = []

    def cu_init(self, caller: str) -> None:
        self.init_calls.append(caller)
        if self.visible is None:
            import os

            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            self.visible = list(range(self.gpus)) if env is None else [int(x) for x in env.split(",") if x.strip()]

    def started(self) -> bool:  # hostinfo.cuda_started
        return self.visible is not None

    def devices(self) -> tuple[list[dict[str, Any]], bool]:  # hostinfo.cuda_devices: cuInit, then the devices seen
        self.cu_init("probe")
        assert self.visible is not None
        return [{"index": i, "name": f"Fake GPU {g}", "total_bytes": 80 << 30} for i, g in enumerate(self.visible)], True


def test_the_probe_never_starts_cuda_so_the_workloads_own_visible_devices_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe started with the interpreter, a script that picks its GPU afterwards
    (``os.environ["CUDA_VISIBLE_DEVICES"] = "1"``, as training scripts do by rank): the workload's first
    ``cuInit`` sees its own choice. The devices reach the daemon once CUDA is up, in a META, and a
    replay of the recording keeps them in the process's info (what the cost engine prices)."""
    from gpufootprint.config import FootprintConfig
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.probe import hostinfo
    from gpufootprint.replay import replay_file

    driver = _Driver(gpus=2)
    monkeypatch.setattr(hostinfo, "cuda_started", driver.started, raising=False)
    monkeypatch.setattr(hostinfo, "cuda_devices", driver.devices)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "t.gfp"
    probe = Probe(ProbeSettings(socket="", tee=str(path), heartbeat_ms=20, flush_ms=10), fk.FakeCupti())
    assert probe.start()
    try:
        time.sleep(0.1)  # heartbeats before the workload starts CUDA: none may start it
        assert driver.init_calls == [] and probe.sender.devices == []
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        driver.cu_init("workload")
        assert driver.visible == [1], "the probe started CUDA before the workload chose its GPU"
        deadline = time.monotonic() + 5
        while not probe.sender.devices and time.monotonic() < deadline:
            time.sleep(0.01)
        assert probe.sender.devices == [{"index": 0, "name": "Fake GPU 1", "total_bytes": 80 << 30}]
    finally:
        probe.stop()
    got = frames(path)
    hello = next(f.json() for f in got if f.type is FrameType.HELLO)
    assert hello["devices"] == [] and hello["cuda_initialised_before_probe"] is False
    metas = [f.json() for f in got if f.type is FrameType.META]
    assert [m["devices"] for m in metas] == [probe.sender.devices]
    assert probe.sender.hello["devices"] == probe.sender.devices  # a reconnection's HELLO has them
    pipeline = Pipeline(FootprintConfig())
    replay_file(path, pipeline)
    assert pipeline.processes[probe.pid].info["devices"] == probe.sender.devices


def test_cuda_started_before_the_probe_gives_its_devices_in_the_hello(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufootprint.probe import hostinfo

    driver = _Driver(gpus=1)
    monkeypatch.setattr(hostinfo, "cuda_started", driver.started, raising=False)
    monkeypatch.setattr(hostinfo, "cuda_devices", driver.devices)
    driver.cu_init("workload")
    path = tmp_path / "t.gfp"
    probe = Probe(ProbeSettings(socket="", tee=str(path), heartbeat_ms=20, flush_ms=10), fk.FakeCupti())
    assert probe.start()
    time.sleep(0.1)
    probe.stop()
    got = frames(path)
    hello = next(f.json() for f in got if f.type is FrameType.HELLO)
    assert hello["devices"] == [{"index": 0, "name": "Fake GPU 0", "total_bytes": 80 << 30}]
    assert hello["cuda_initialised_before_probe"] is True
    assert not [f for f in got if f.type is FrameType.META]  # nothing more to tell


def test_cuda_started_reads_the_drivers_answer_without_loading_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda_started`` opens libcuda only if the process has it already (RTLD_NOLOAD), once, and reads
    cuDeviceGetCount's answer: 0 started, NOT_INITIALIZED not yet, anything else failed for good."""
    import ctypes
    import os

    from gpufootprint.probe import hostinfo

    opened: list[tuple[str, int]] = []
    answer = {"rc": 3}

    class Driver:
        def cuDeviceGetCount(self, _count: object) -> int:
            return answer["rc"]

    def cdll(name: str, mode: int = 0) -> Driver:
        opened.append((name, mode))
        if not loaded:
            raise OSError(f"{name}: cannot open shared object file")  # what dlopen(RTLD_NOLOAD) says
        return Driver()

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(hostinfo, "_driver", [])
    loaded = False
    assert hostinfo.cuda_started() is False  # no driver in the process: not started
    loaded = True
    assert hostinfo.cuda_started() is False  # loaded, cuInit not called yet
    answer["rc"] = 0
    assert hostinfo.cuda_started() is True
    answer["rc"] = 100  # CUDA_ERROR_NO_DEVICE: cuInit ran and failed
    assert hostinfo.cuda_started() is None
    assert [n for n, _ in opened] == ["libcuda.so.1"] * 2  # kept once found
    assert all(mode & os.RTLD_NOLOAD for _, mode in opened)
    assert hostinfo.started_cuda_devices() == ([], False)


def test_a_failed_cuinit_stops_the_lookups_and_a_failure_before_the_heartbeat_finds_the_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufootprint.probe import hostinfo

    asked: list[int] = []

    def failed() -> None:  # cuInit ran and failed
        asked.append(1)

    monkeypatch.setattr(hostinfo, "cuda_started", failed)
    probe = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), heartbeat_ms=20, flush_ms=10), fk.FakeCupti())
    assert probe.start()
    time.sleep(0.2)
    probe.stop()
    assert probe.sender.discover_pending is False and probe.sender.devices == []
    assert len(asked) == 2  # at start, then one heartbeat: a driver whose cuInit failed is not asked again

    driver = _Driver(gpus=1)
    monkeypatch.setattr(hostinfo, "cuda_started", driver.started)
    monkeypatch.setattr(hostinfo, "cuda_devices", driver.devices)
    probe = Probe(ProbeSettings(socket="", heartbeat_ms=60_000, flush_ms=10), fk.FakeCupti())
    assert probe.start()
    probe.stop()  # the sender's thread gone: the judgement below is the only one
    assert probe.sender.discover_pending and probe.sender.devices == []
    driver.cu_init("workload")
    probe.sender.oom.pending = lambda: True  # type: ignore[method-assign]  # a failure waits to be judged
    probe.sender.oom.marks = lambda *a, **k: []  # type: ignore[method-assign]
    probe.sender._queue_oom_marks()
    assert probe.sender.devices == [{"index": 0, "name": "Fake GPU 0", "total_bytes": 80 << 30}]


def test_cuda_started_asks_only_a_driver_the_process_has_loaded() -> None:
    """On this machine no CUDA driver is loaded into the test process: not started, and still not loaded."""
    from gpufootprint.probe import hostinfo

    def loaded() -> bool:
        return any("libcuda.so" in line for line in Path("/proc/self/maps").read_text().splitlines())

    if loaded():
        pytest.skip("a CUDA driver is loaded in this process (a GPU machine): the question is for one without")
    assert hostinfo.cuda_started() is False
    assert not loaded()
