"""A recording's heartbeat counters are taken in when read: the same values, in the same order, as taking
each heartbeat in as it came (what the daemon did before, and still does for a live peer's)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from gpufootprint import probecounters
from gpufootprint.probecounters import ProbeCounters, clean_counters, counter_value

ODD_VALUES: tuple[Any, ...] = (math.nan, math.inf, -math.inf, 10**400, -(10**400), "7", None, [1], {"a": 1})


def _eager(heartbeats: list[dict[str, Any]]) -> dict[str, float]:
    kept: dict[str, float] = {}
    for counters in heartbeats:
        kept.update(clean_counters(counters))
    return kept


def _heartbeats(rng: random.Random, n: int) -> list[dict[str, Any]]:
    keys = [f"k{i}" for i in range(12)]
    out = []
    for _ in range(n):
        chosen = rng.sample(keys, rng.randint(0, len(keys)))  # keys in a new order each time, some missing
        out.append({k: rng.choice((rng.randint(0, 99), rng.random(), True, *ODD_VALUES)) for k in chosen})
    return out


def test_counters_taken_in_when_read_are_those_taken_in_at_once_in_their_order() -> None:
    rng = random.Random(29)
    for _ in range(400):
        beats = _heartbeats(rng, rng.randint(1, 12))
        lazy = ProbeCounters()
        cut = rng.randint(0, len(beats))
        for counters in beats[:cut]:
            lazy.add(counters)
        middle = dict(lazy.values()) if rng.random() < 0.5 else None  # a snapshot read between heartbeats
        for counters in beats[cut:]:
            lazy.add(counters)
        if middle is not None:
            assert list(middle.items()) == list(_eager(beats[:cut]).items())
        assert list(lazy.values().items()) == list(_eager(beats).items()), beats


def test_the_newest_kept_value_wins_and_an_older_one_fills_a_newer_odd_one() -> None:
    lazy = ProbeCounters()
    for counters in ({"a": 1, "b": 2}, {"b": 3, "c": math.nan}, {"c": 5}, {"a": math.inf, "d": 1}):
        lazy.add(counters)
    assert list(lazy.values().items()) == [("a", 1.0), ("b", 3.0), ("c", 5.0), ("d", 1.0)]


def test_a_live_peers_checked_counters_come_after_the_waiting_ones() -> None:
    lazy = ProbeCounters()
    lazy.add({"a": 1, "b": 2})
    lazy.add_clean({"a": 7.0})
    lazy.add({"b": 9})
    assert lazy.values() == {"a": 7.0, "b": 9.0}


def test_counters_never_read_wait_in_bounded_number(monkeypatch: pytest.MonkeyPatch) -> None:
    lazy = ProbeCounters()
    beat = {f"k{i}": i for i in range(40)}  # a heartbeat of this build's probe has about 40
    waiting = []
    for _ in range(200):
        lazy.add(dict(beat))
        waiting.append(sum(map(len, lazy._pending)))
    assert max(waiting) < probecounters.MAX_PENDING
    huge = {f"x{i}": 1 for i in range(5 * probecounters.MAX_PENDING)}
    lazy.add(huge)
    assert lazy._pending == [] and len(lazy.values()) == 40 + len(huge)


def test_a_counter_is_kept_only_as_a_finite_float() -> None:
    assert [counter_value(v) for v in (3, 2.5, True, -1)] == [3.0, 2.5, 1.0, -1.0]
    assert all(counter_value(v) is None for v in ODD_VALUES)
    assert clean_counters({"a": 1, "n": math.nan, "h": 10**400, "s": "1"}) == {"a": 1.0}


def test_a_recordings_heartbeat_waits_to_be_read_and_a_live_peers_is_checked_at_once() -> None:
    from gpufootprint.configload import load_config
    from gpufootprint.ingest.session import Session
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.wire import framing
    from gpufootprint.wire.framing import FrameDecoder, FrameType

    beat = framing.encode_json(FrameType.HEARTBEAT, {"pid": 7, "counters": {"sent": 3, "Bad-Key": 1, "odd": "x"}})
    for source, peer, waiting, kept in (("trace", None, 1, {"sent": 3.0, "Bad-Key": 1.0}),
                                        ("probe", 7, 0, {"sent": 3.0})):
        pipeline = Pipeline(load_config(env={}).footprint)
        session = Session(pipeline, source=source, name="t", peer_pid=peer)
        for f in FrameDecoder().feed(framing.PREAMBLE + beat):
            session.handle(f)
        proc = pipeline.process(7, source)
        assert len(proc.counters._pending) == waiting
        assert proc.probe_counters == kept
        assert pipeline.snapshot().processes[0].probe_counters == kept
