"""The hub's launch windows: what it asks a probe for, and when it stops following a window."""

from __future__ import annotations

from typing import Any

import numpy as np
from gpufootprint.config import SamplerConfig
from gpufootprint.hub import FeatureHub
from gpufootprint.records import API_DTYPE, ApiRole

S = 1_000_000_000


def _hub() -> tuple[FeatureHub, list[dict[str, Any]]]:
    hub = FeatureHub(sampler=SamplerConfig())
    sent: list[dict[str, Any]] = []
    hub.control = lambda pid, body: sent.append(body) is None
    return hub, sent


def _open(hub: FeatureHub, sent: list[dict[str, Any]], pid: int, t0: int) -> dict[str, Any]:
    hub.sampler(pid)
    hub.on_watermark(pid, t0, "probe")
    hub.on_watermark(pid, t0 + 6 * S, "probe")  # past kernel_window_first_seconds (5)
    (opened,) = [b for b in sent if b["op"] == "kernel_window"]
    return opened


def test_a_launch_window_asks_the_probe_to_close_it_at_the_daemons_step_count() -> None:
    hub, sent = _hub()
    opened = _open(hub, sent, 7, 100 * S)
    cfg = hub.config
    assert opened["records"] == "launches" and opened["steps"] == cfg.kernel_window_steps
    assert opened["max_records"] == cfg.kernel_window_max_records and opened["min_ms"] == cfg.kernel_window_ms


def test_a_window_the_probe_closed_at_its_count_is_followed_no_more() -> None:
    # GIVEN a window the daemon follows, whose calls it cannot count to the end (refused past a bound, say)
    hub, sent = _hub()
    t0 = 100 * S
    opened = _open(hub, sent, 7, t0)
    api = np.zeros(3, API_DTYPE)
    api["role"] = [ApiRole.LAUNCH, ApiRole.SYNC, ApiRole.LAUNCH]
    hub.on_launches(7, api)
    # WHEN the probe's heartbeat says it closed the window at its count
    hub.note_window_closed(7, opened["id"], t0 + 6 * S + 300_000_000)
    # THEN no renewal goes out for it, and the next window may open after the usual gap, not after
    # kernel_window_max_ms (12 s) of renewals the probe would ignore
    sent.clear()
    hub.on_watermark(7, t0 + 7 * S + 500_000_000, "probe")  # where its 2 s lease would be renewed
    assert not [b for b in sent if b["op"] == "kernel_window"], sent
    hub.on_watermark(7, t0 + 37 * S, "probe")  # the next periodic window (every 30 s)
    later = [b for b in sent if b["op"] == "kernel_window"]
    assert later and later[0]["id"] != opened["id"] and later[0]["ms"] > 1, later


def test_a_close_of_another_window_leaves_the_followed_one_alone() -> None:
    hub, sent = _hub()
    opened = _open(hub, sent, 7, 100 * S)
    hub.note_window_closed(7, opened["id"] + 1, 107 * S)  # not the one it follows (an old daemon's)
    sent.clear()
    hub.on_watermark(7, 107 * S + 500_000_000, "probe")  # its 2 s lease nearly spent: renewed
    assert [b["id"] for b in sent if b["op"] == "kernel_window"] == [opened["id"]], sent
