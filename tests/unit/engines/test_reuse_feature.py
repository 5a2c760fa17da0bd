from __future__ import annotations

import numpy as np
from gpufootprint.features.reuse import ReuseTracker, steady_ratio
from gpufootprint.records import MEMORY_DTYPE, MemoryKind


def mem(rows: list[tuple[int, int, int, int]], pid: int = 1, kind: int = MemoryKind.DEVICE) -> np.ndarray:
    """rows: (ts, op, addr, bytes)"""
    r = np.zeros(len(rows), MEMORY_DTYPE)
    for i, (ts, op, addr, size) in enumerate(rows):
        r[i]["ts"], r[i]["op"], r[i]["addr"], r[i]["bytes"], r[i]["mk"], r[i]["pid"] = ts, op, addr, size, kind, pid
    return r


def test_reuse_is_the_share_of_allocations_at_a_freed_address_and_size() -> None:
    c = ReuseTracker()
    # same address and size reused twice (the first release omits its size); a different size at
    # a freed address is not a reuse
    c.add(mem([(1, 1, 16, 64), (2, 2, 16, 0), (3, 1, 16, 64), (4, 2, 16, 64), (5, 1, 16, 64), (6, 2, 16, 64),
               (7, 1, 16, 128)]))
    assert c.ratio == 2 / 4
    assert steady_ratio(c.events(), c.allocations, 3) == 2 / 3
    assert steady_ratio(c.events(), c.allocations, 100) == 1.0  # nothing allocated since: a static footprint
    assert ReuseTracker().ratio is None  # no memory records: unknown
    assert steady_ratio(ReuseTracker().events(), 0, 3) is None


def test_delivery_order_does_not_matter_and_only_device_allocations_count() -> None:
    c = ReuseTracker()
    c.add(mem([(3, 1, 16, 64), (2, 2, 16, 64), (1, 1, 16, 64)]))  # out of order in one batch
    # module globals and pinned host memory are not what a graph replays
    c.add(mem([(4, 1, 99, 8)], kind=MemoryKind.DEVICE_STATIC))
    c.add(mem([(5, 1, 98, 8)], kind=MemoryKind.PINNED))
    assert c.ratio == 0.5 and c.allocations == 2


def test_kept_history_is_bounded_but_totals_are_not() -> None:
    c = ReuseTracker(history=10)
    for i in range(50):
        c.add(mem([(2 * i, 1, 16, 64), (2 * i + 1, 2, 16, 64)]))
    assert c.allocations == 50 and c.reused == 49
    assert 10 <= len(c.events()) <= 20 and not c.events().flags.writeable


def test_events_a_snapshot_holds_stay_as_they_were_while_the_tracker_goes_on() -> None:
    # GIVEN a tracker's events taken as a snapshot takes them (a read-only view, not a copy), through enough
    # allocations to fill and replace its buffer several times, and a shrink of its history on the way
    c = ReuseTracker(history=300)
    seen: list[tuple[np.ndarray, list[tuple[int, bool]]]] = []
    buffers = set()
    for i in range(3000):
        c.add(mem([(2 * i, 1, 16 + i % 7, 64), (2 * i + 1, 2, 16 + i % 7, 64)]))
        buffers.add(id(c._buf))
        if i % 37 == 0:
            ev = c.events()
            seen.append((ev, ev.tolist()))
        if i == 1500:
            c.share(0.5)  # another process connected: its history shrinks to 256
    # THEN none changed while records were added and buffers replaced, and none can be written
    assert len(buffers) > 5 and len(c._buf) <= 2 * 300  # replaced, and bounded
    for ev, was in seen:
        assert ev.tolist() == was and not ev.flags.writeable
    # and the newest are the last allocations, in order, exactly the shrunk history
    last = c.events()
    assert last["ts"].tolist() == list(range(6000 - 2 * 256, 6000, 2))


def _reference_hits(batches: list[np.ndarray], capacity: int) -> list[bool]:
    """The tracker's rule written as the plain per-record loop it replaced: each batch in time order, an
    allocation hits when its (address, size) was released before it; sizeless releases take the size
    last allocated at their address; both memories start afresh when they reach ``capacity``."""
    freed: set[tuple[int, int]] = set()
    live: dict[int, int] = {}
    sizeless = False
    hits: list[bool] = []
    for b in batches:
        b = b[b["mk"] == MemoryKind.DEVICE]
        b = b[np.argsort(b["ts"], kind="stable")]
        if len(b) == 0:
            continue
        if len(live) >= capacity:
            live.clear()
        if len(freed) >= capacity:
            freed.clear()
        sizeless = sizeless or bool(((b["op"] == 2) & (b["bytes"] == 0)).any())
        for op, addr, size in zip(b["op"].tolist(), b["addr"].tolist(), b["bytes"].tolist()):
            if sizeless and op == 1:
                live[addr] = size
            if sizeless and op == 2 and size == 0:
                size = live.get(addr, 0)
            if op == 1:
                hits.append((addr, size) in freed)
            elif op == 2:
                freed.add((addr, size))
    return hits


def test_vectorised_tracker_matches_the_per_record_rule_on_random_batches() -> None:
    rng = np.random.default_rng(7)
    for trial in range(40):
        capacity = int(rng.choice([8, 64, 100_000]))
        batches = []
        t = 0
        for _ in range(int(rng.integers(1, 12))):
            n = int(rng.integers(1, 300))
            rows = [(t + int(rng.integers(0, 50)), int(rng.choice([1, 2, 2, 1, 3])), int(rng.integers(0, 20)) * 64,
                     int(rng.choice([0, 64, 128])) if trial % 3 == 0 else int(rng.choice([64, 128])))
                    for _ in range(n)]
            t += 40  # batches overlap a little in time and are unsorted inside
            kinds = rng.choice([MemoryKind.DEVICE, MemoryKind.DEVICE, MemoryKind.PINNED], size=n)
            b = mem(rows)
            b["mk"] = kinds
            batches.append(b)
        c = ReuseTracker(capacity=capacity, history=1 << 20)
        for b in batches:
            c.add(b)
        expected = _reference_hits(batches, capacity)
        assert c.events()["reused"].tolist() == expected, trial
        assert c.allocations == len(expected) and c.reused == sum(expected)
