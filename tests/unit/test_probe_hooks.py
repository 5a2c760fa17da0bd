"""The driver-API hooks that keep CUPTI recording mappings made on any thread.

On the H200 (docs/probe.md, "Lost records") CUPTI delivered no MEMORY2 record for a virtual-memory
mapping made on a thread other than the main one unless driver-API hooks on cuMemMap/cuMemUnmap
were set: by a callback subscriber, or by CUPTI's per-API activity switch (the default, which needs
no subscriber). CUPTI has one subscriber place per process, so with ``driver_hooks_via="subscriber"``
the probe must hold it while it records, give it up before a torch.profiler session (Kineto
subscribes) and take it back after.
"""

from __future__ import annotations

import logging
import time

import pytest
from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings

from tests import probe_fakes as fk


def _probe(fake: fk.FakeCupti, **settings: object) -> Probe:
    settings.setdefault("driver_hooks_via", "subscriber")
    probe = Probe(ProbeSettings(socket="", flush_ms=10, torch_hook=False, **settings),  # type: ignore[arg-type]
                  fake, discover_devices=False)
    assert probe.start()
    return probe


def test_the_probe_holds_the_subscription_and_hands_it_to_a_profiler_and_back() -> None:
    fake = fk.FakeRawCupti()
    probe = _probe(fake)
    try:
        assert fake.subscribed and probe.status()["driver_hooks"] == 1
        # WHEN a profiler session starts: the probe has left before the profiler subscribes
        probe.takeover_begin()
        assert not fake.subscribed
        assert fake.other_tool_subscribes()
        fake.other_subscriber = False  # the profiler's teardown unsubscribes
        probe.takeover_end([], list)
        # THEN the probe holds it again, and records as before
        assert fake.subscribed and probe.status()["driver_hooks"] == 1
        assert probe.status()["driver_hooks_unavailable"] == 0
    finally:
        probe.stop()
    assert not fake.subscribed  # left at exit too


def test_a_subscriber_that_stays_is_counted_and_the_probe_records_on(caplog: pytest.LogCaptureFixture) -> None:
    # (Seen on the H200: Kineto kept its subscription after a torch.profiler session.)
    fake = fk.FakeRawCupti()
    probe = _probe(fake, heartbeat_ms=20)
    try:
        probe.takeover_begin()
        assert fake.other_tool_subscribes()  # and never lets go
        with caplog.at_level(logging.WARNING, logger="gpufootprint.probe.arming"):
            probe.takeover_end([], list)
        fake.alloc(0x1000, 4096)
        probe.mark("after")
        st = probe.status()
        assert st["driver_hooks"] == 0 and st["driver_hooks_unavailable"] == 1
        assert probe.sender.table.live_by_kind(0) == {"device": 4096}
        time.sleep(0.1)  # several heartbeats ask again: still one warning, one count
        warnings = [r.getMessage() for r in caplog.records if "driver-API hooks" in r.getMessage()]
        assert len(warnings) == 1 and "\n" not in warnings[0]
        assert probe.status()["driver_hooks_unavailable"] == 1
        # WHEN the other subscriber lets go, THEN a later heartbeat takes the place back
        fake.other_subscriber = False
        end = time.monotonic() + 5
        while not fake.subscribed and time.monotonic() < end:
            time.sleep(0.01)
        assert fake.subscribed and probe.status()["driver_hooks"] == 1
    finally:
        probe.stop()


def test_another_tool_holding_cupti_at_start_does_not_stop_the_probe() -> None:
    fake = fk.FakeRawCupti()
    fake.other_subscriber = True
    probe = _probe(fake)
    try:
        assert probe.started and probe.status()["driver_hooks_unavailable"] == 1
    finally:
        probe.stop()


def test_switched_off_the_probe_never_subscribes() -> None:
    fake = fk.FakeRawCupti()
    probe = _probe(fake, driver_hooks=False)
    try:
        assert not fake.subscribed and probe.status()["driver_hooks"] == 0
    finally:
        probe.stop()


def test_the_default_activity_switch_takes_no_subscriber_and_a_profiler_keeps_its_place() -> None:
    assert ProbeSettings().driver_hooks_via == "activity"
    fake = fk.FakeRawCupti()
    fake.other_subscriber = True  # a tool already holds CUPTI's subscriber place
    probe = _probe(fake, driver_hooks_via="activity")
    try:
        st = probe.status()
        assert fake.driver_api_switch and not fake.subscribed
        assert st["driver_hooks"] == 1 and st["driver_hooks_unavailable"] == 0
        probe.takeover_begin()  # switched off for the profiler's session, on again after it
        assert not fake.driver_api_switch
        probe.takeover_end([], list)
        assert fake.driver_api_switch and probe.status()["driver_hooks"] == 1
    finally:
        probe.stop()


def test_a_bad_hooks_via_value_falls_back_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpufootprint.probe.settings"):
        s = ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_DRIVER_HOOKS_VIA": "both"})
    assert s.driver_hooks_via == ProbeSettings().driver_hooks_via == "activity"
    assert [r.getMessage() for r in caplog.records if "DRIVER_HOOKS_VIA" in r.getMessage()]
