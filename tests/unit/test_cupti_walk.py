"""``cupti_layout.walk`` and ``gather`` against a plain record-by-record reading.

The walk reads records one by one only until they repeat (a run of one kind, a cycle of a few
distinct kinds), then follows the run in vectorised looks and keeps its offsets as runs
(``cupti_layout.Runs``); ``gather`` reads a run as a view. Whatever the mix, both must give
exactly what reading one record after another gives, and the walk must still refuse a buffer it
cannot walk exactly.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from gpufootprint.wire import cupti_layout as cl

SIZES = {cl.MEMORY2: 128, cl.MEMORY_POOL: 80, cl.DRIVER: 40, cl.RUNTIME: 40, cl.MEMCPY: 96}
KINDS = list(SIZES)


def reference_walk(buf: bytes, valid: int) -> dict[int, list[int]] | None:
    """One record after another, as ``cuptiActivityGetNextRecord`` steps."""
    out: dict[int, list[int]] = {}
    off = 0
    while off < valid:
        if off + 4 > valid:
            return None
        kind = int.from_bytes(buf[off:off + 4], "little", signed=True)
        size = cl._SIZES.get(kind)
        if size is None or off + size > valid:
            return None
        out.setdefault(kind, []).append(off)
        off += size
    return out


def reference_gather(buf: bytes, kind: int, offsets: list[int]) -> np.ndarray:
    dt = cl.API_RAW_DTYPE if kind in cl.API_KINDS else cl.RAW_DTYPES[kind]
    return np.concatenate([np.frombuffer(buf[o:o + dt.itemsize], dtype=dt) for o in offsets]) if offsets \
        else np.zeros(0, dt)


def build(layout: list[int], rng: random.Random) -> bytearray:
    """Records of ``layout``'s kinds back to back, every byte past the kind random."""
    buf = bytearray(rng.randbytes(sum(SIZES.get(k, 64) for k in layout)))
    off = 0
    for k in layout:
        buf[off:off + 4] = k.to_bytes(4, "little", signed=True)
        off += SIZES.get(k, 64)
    return buf


def layouts(rng: random.Random, target: int) -> list[int]:
    """Kinds of one buffer of about ``target`` bytes, in one of the patterns CUPTI buffers show."""
    pattern = rng.choice(["runs", "alternating", "cycle", "cycle_repeating", "sparse", "random", "pairs"])
    out: list[int] = []
    while sum(SIZES[k] for k in out) < target:
        if pattern == "runs":
            out += [rng.choice(KINDS)] * rng.randint(1, 600)
        elif pattern == "alternating":  # a launch window: MEMORY2 and an API record, now and then a break
            api = rng.choice([cl.RUNTIME, cl.DRIVER])
            out += [cl.MEMORY2, api] * rng.randint(1, 300) + [rng.choice(KINDS)] * rng.randint(0, 3)
        elif pattern == "cycle":  # a cycle of distinct kinds, repeated a while
            cycle = rng.sample(KINDS, rng.randint(2, 5))
            out += cycle * rng.randint(1, 200) + cycle[:rng.randint(0, len(cycle) - 1)]
        elif pattern == "cycle_repeating":  # a kind twice in a cycle (A A B, A B A C)
            cycle = [rng.choice(KINDS) for _ in range(rng.randint(3, 6))]
            out += cycle * rng.randint(1, 100)
        elif pattern == "sparse":  # cudaMallocAsync: a pool record now and then among MEMORY2 records
            out += [cl.MEMORY2] * rng.randint(0, 600) + [cl.MEMORY_POOL] * rng.randint(1, 2)
        elif pattern == "pairs":
            out += [rng.choice(KINDS)] * rng.randint(1, 3)
        else:
            out.append(rng.choice(KINDS))
    return out


def check(buf: bytes | bytearray, valid: int, label: object) -> None:
    data = bytes(buf)
    expect = reference_walk(data, valid)
    got = cl.walk(memoryview(buf), valid)
    if expect is None:
        assert got is None, label
        return
    assert got is not None, label
    assert {k: list(v) for k, v in got.items()} == expect, label
    assert got == expect, label  # Runs compare equal to the lists they hold
    u8 = np.frombuffer(data, dtype=np.uint8, count=valid)
    for k, offs in got.items():
        assert len(offs) == len(expect[k]) and np.array_equal(np.asarray(offs), expect[k]), label
        want = reference_gather(data, k, expect[k])
        for rows in (cl.gather(u8, k, offs), cl.gather(u8, k, expect[k])):
            assert rows.dtype.names == want.dtype.names and len(rows) == len(want), (label, k)
            for name in want.dtype.names or ():
                assert np.array_equal(rows[name], want[name]), (label, k, name)


@pytest.mark.parametrize("seed", range(8))
def test_walk_and_gather_equal_a_record_by_record_reading_on_random_mixed_buffers(seed: int) -> None:
    rng = random.Random(seed)
    for trial in range(25):
        target = rng.choice([64 << 10, 64 << 10, 8 << 10, 256 << 10])  # the last: looks that grow
        buf = build(layouts(rng, target), rng)
        check(buf, len(buf), (seed, trial, "whole"))
        # the last record cut short (CUPTI never does it; the walk must refuse, not read past)
        cut = len(buf) - rng.randint(1, 39)
        check(buf, cut, (seed, trial, "truncated"))
        # fewer than 4 bytes of a next record past the last whole one
        check(buf + bytes(rng.randint(1, 3)), len(buf) + rng.randint(1, 3), (seed, trial, "a stub"))


@pytest.mark.parametrize("seed", range(4))
def test_an_unknown_kind_anywhere_makes_the_walk_refuse_the_buffer(seed: int) -> None:
    rng = random.Random(100 + seed)
    for trial in range(30):
        layout = layouts(rng, rng.choice([16 << 10, 64 << 10]))
        layout.insert(rng.randrange(len(layout) + 1), rng.choice([999, cl.MEMSET + 100, 0]))
        buf = build(layout, rng)
        assert cl.walk(memoryview(buf), len(buf)) is None, (seed, trial)
        check(buf, len(buf), (seed, trial))


def test_a_run_inside_a_cycle_that_breaks_in_its_middle_and_runs_that_fill_the_buffer() -> None:
    rng = random.Random(7)
    m2, rt, drv, pool = cl.MEMORY2, cl.RUNTIME, cl.DRIVER, cl.MEMORY_POOL
    cases = [
        [m2] * 512,  # 64 KiB of MEMORY2: what churn fills
        [m2] * 3000,  # past the first look
        [pool] + [m2] * 430,  # a pool record, then the run
        [m2] * 200 + [pool] + [m2] * 230,
        [m2, rt] * 300 + [m2, drv] + [m2, rt] * 5,  # the cycle breaks in its second record
        [rt, drv, m2] * 200 + [rt, drv] + [pool],
        [m2, m2, rt] * 100,  # a kind twice in the cycle: read one by one
        [m2, rt, m2, drv] * 100,
        [m2],
        [m2, m2],
        [rt, m2],
    ]
    for i, layout in enumerate(cases):
        buf = build(layout, rng)
        check(buf, len(buf), i)
    assert cl.walk(b"", 0) == {}
    assert cl.walk(b"\x31\x00", 2) is None
    # what the walk is for: a run, or a cycle of distinct kinds, is one range per kind, not an int per record
    for layout, expect in (([m2] * 512, {m2: [range(0, 65536, 128)]}),
                           ([m2, rt] * 390, {m2: [range(0, 65520, 168)], rt: [range(128, 65520, 168)]}),
                           ([rt, drv, m2] * 300, {rt: [range(0, 62400, 208)], drv: [range(40, 62400, 208)],
                                                  m2: [range(80, 62400, 208)]}),
                           ([m2] * 200 + [pool] + [m2] * 230, {m2: [range(0, 25600, 128), range(25680, 55120, 128)],
                                                               pool: [[25600]]})):
        buf = build(layout, rng)
        got = cl.walk(buf, len(buf))
        assert got is not None and {k: v.pieces for k, v in got.items()} == expect


def test_runs_index_slice_and_compare_as_the_offsets_they_hold() -> None:
    runs = cl.Runs([range(0, 384, 128), [500], range(600, 1272, 168), [2000, 2128]])
    flat = [0, 128, 256, 500, 600, 768, 936, 1104, 2000, 2128]
    assert list(runs) == flat and len(runs) == 10 and runs == flat and flat == runs and runs == tuple(flat)
    assert runs != flat[:-1] and runs != [*flat[:-1], 2129] and runs != {0: 1}
    assert [runs[i] for i in range(-10, 10)] == flat[-10:] + flat
    with pytest.raises(IndexError):
        runs[10]
    for a in range(-11, 12):
        for b in range(-11, 12):
            assert list(runs[a:b]) == flat[a:b], (a, b)
    assert list(runs[::3]) == flat[::3]
    assert np.array_equal(runs.array(), flat) and np.asarray(runs).dtype == np.intp
    assert cl.Runs().array().tolist() == [] and not cl.Runs()
    # a run joins what it continues: offsets read one by one just before it, a run before it
    assert cl.Runs([[0, 128], range(256, 1024, 128)]).pieces == [range(0, 1024, 128)]
    assert cl.Runs([[0, 40], range(208, 880, 168)]).pieces == [[0], range(40, 880, 168)]
    assert cl.Runs([range(0, 256, 128), range(256, 512, 128)]).pieces == [range(0, 512, 128)]
    assert cl.Runs([range(0, 168, 168), range(168, 512, 168)]).pieces == [range(0, 512, 168)]
    assert cl.Runs([range(0, 256, 128), range(300, 301, 1)]).pieces == [range(0, 256, 128), range(300, 301, 1)]
    assert cl.Runs([range(0, 80, 40), range(80, 208, 128)]) == [0, 40, 80]  # one offset that continues a run
    assert cl.Runs([range(0, 80, 40), range(80, 208, 128)]).pieces == [range(0, 120, 40)]
    assert cl.Runs([[0, 90], range(180, 270, 90), [300]]) == [0, 90, 180, 300]


def test_gather_of_a_chunk_of_runs_as_the_daemon_decodes_a_forwarded_buffer() -> None:
    rng = random.Random(3)
    layout = [cl.MEMORY2] * 700 + [cl.MEMORY_POOL] + [cl.MEMORY2, cl.RUNTIME] * 400 + [cl.MEMORY2] * 90
    buf = build(layout, rng)
    data = bytes(buf)
    got = cl.walk(data, len(data))
    assert got is not None
    offs = got[cl.MEMORY2]
    u8 = np.frombuffer(data, dtype=np.uint8)
    expect = reference_walk(data, len(data))
    assert expect is not None
    for at in range(0, len(offs), 333):
        rows = cl.gather(u8, cl.MEMORY2, offs[at:at + 333])
        want = reference_gather(data, cl.MEMORY2, expect[cl.MEMORY2][at:at + 333])
        assert np.array_equal(rows["address"], want["address"]) and np.array_equal(rows["timestamp"], want["timestamp"])


def test_runs_built_from_pieces_keep_every_offset() -> None:
    """``Runs`` is built from pieces by its constructor, ``append`` and ``add_run`` (not only by ``walk``):
    loose offsets joined to a run that follows a run of another step stay (found by review)."""
    assert list(cl.Runs([range(0, 256, 128), [256], range(296, 336, 40)])) == [0, 128, 256, 296]
    r = cl.Runs()
    r.add_run(range(0, 256, 128))
    r.append(256)
    r.append(296)
    r.add_run(range(336, 376, 40))
    assert list(r) == [0, 128, 256, 296, 336] and len(r) == 5
    r = cl.Runs()
    r.add_run(range(0, 256, 128))
    r.add_run(range(256, 296, 40))  # one record, the last run's next: joins it
    assert list(r) == [0, 128, 256] and len(r.pieces) == 1


def _convert_memory2_field_by_field(src: np.ndarray, pid: int) -> np.ndarray:
    """``convert`` for MEMORY2 as it was written before 2026-12-06: one assignment a field."""
    from gpufootprint.records import MEMORY_DTYPE

    out = np.zeros(len(src), dtype=MEMORY_DTYPE)
    out["pid"] = pid
    for ours, theirs in (("dev", "dev"), ("stream", "stream"), ("corr", "corr"), ("bytes", "bytes"),
                         ("ts", "timestamp"), ("addr", "address"), ("ctx", "ctx"), ("op", "op"), ("mk", "mk")):
        out[ours] = src[theirs]
    is_async = src["is_async"] != 0
    out["is_async"] = is_async
    ptype = np.where(is_async, src["pool_type"], 0)
    out["pool_type"] = ptype
    has_pool = ptype != 0
    out["pool_addr"] = np.where(has_pool, src["pool_addr"], 0)
    out["pool_thresh"] = np.where(has_pool, src["pool_thresh"], 0)
    out["pool_used"] = np.where(has_pool, src["pool_used"], 0)
    out["pool_size"] = np.where(ptype == cl.POOL_LOCAL, src["pool_size"], 0)
    return out


def test_convert_of_memory2_equals_the_field_by_field_conversion() -> None:
    """Random bytes in every field (out of range ones too), some records stream-ordered, none or all (and
    all of those in a pool, or all in a local one: the shortcuts cudaMallocAsync's buffers take), as a
    view of a buffer and as a copy: ``convert`` gives the same bytes as the reference."""
    rng = np.random.default_rng(7)
    dt = cl.RAW_DTYPES[cl.MEMORY2]
    for trial in range(100):
        n = int(rng.integers(0, 700))
        raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
        src = raw.view(dt)
        if trial % 5 == 0:
            src["is_async"] = 0  # none stream-ordered: the pool fields are skipped
        elif trial % 5 == 1:
            src["is_async"] = rng.integers(0, 2, n)
            src["pool_type"] = rng.integers(0, 3, n)
        elif trial % 5 == 2:
            src["is_async"] = rng.integers(1, 1 << 31, n)  # all stream-ordered, any value that is not 0
            src["pool_type"] = rng.choice([1, 2, 3, 256, -1], n)  # all in a pool, some past the one byte we keep
        elif trial % 5 == 3:
            src["is_async"] = 1
            src["pool_type"] = cl.POOL_LOCAL  # all in a local pool: every pool field as it is
        if trial % 10 == 7 and n:
            src["pool_type"][int(rng.integers(0, n))] = 0  # all stream-ordered, one not in a pool
        elif trial % 10 == 9 and n > 1:
            src["is_async"][int(rng.integers(0, n))] = 0  # all in a pool by their type, one not stream-ordered
            src["pool_type"] = np.where(src["pool_type"] == 0, 1, src["pool_type"])
        for s in (src, src.copy(), src[::2]):
            assert cl.convert(cl.MEMORY2, s, 4242).tobytes() == _convert_memory2_field_by_field(s, 4242).tobytes()


def test_a_buffer_of_one_kind_is_read_in_one_look_as_record_by_record() -> None:
    """``walk`` answers a buffer of one kind with one vectorised look (``uniform_runs``): the same offsets as
    the record-by-record reference, one run; a mixed, truncated or empty buffer is not answered that way."""
    rng = random.Random(11)
    for _ in range(40):
        kind = rng.choice([cl.MEMORY2, cl.MEMORY_POOL, cl.RUNTIME, cl.MEMCPY])
        buf = bytes(build([kind] * rng.randrange(1, 600), rng))
        got = cl.walk(buf, len(buf))
        assert got == reference_walk(buf, len(buf)) and got is not None and len(got[kind].pieces) == 1
        assert cl.uniform_runs(buf, len(buf)) == got
    mixed = bytes(build([cl.MEMORY2] * 40 + [cl.MEMORY_POOL] + [cl.MEMORY2] * 40, rng))
    assert cl.uniform_runs(mixed, len(mixed)) is None and cl.walk(mixed, len(mixed)) == reference_walk(mixed, len(mixed))
    truncated = bytes(build([cl.MEMORY2] * 3, rng))[:-8]
    assert cl.uniform_runs(truncated, len(truncated)) is None and cl.walk(truncated, len(truncated)) is None
    assert cl.uniform_runs(b"", 0) is None


def test_walk_stop_names_a_place_exactly_where_walk_refuses() -> None:
    """``walk_stop`` (the daemon's and the probe's words for a refused buffer) says the buffer walks exactly
    when ``walk`` reads it, and otherwise names the byte of the first record a plain walk cannot read."""
    rng = random.Random(29)
    kinds = [cl.MEMORY2, cl.MEMORY_POOL, cl.RUNTIME, cl.DRIVER, cl.MEMCPY]
    for trial in range(400):
        layout = [rng.choice(kinds) for _ in range(rng.randrange(1, 40))]
        buf = build(layout, rng)
        valid = len(buf)
        if trial % 4 == 1:  # an unknown kind somewhere
            at = sum(SIZES[k] for k in layout[:rng.randrange(len(layout))])
            buf[at:at + 4] = (999).to_bytes(4, "little")
        elif trial % 4 == 2:  # a tail cut inside a record, or inside a kind word
            valid -= rng.choice([2, 8, SIZES[layout[-1]] - 8, SIZES[layout[-1]] - 2])
        elif trial % 4 == 3:  # a known kind of another size where one was
            at = sum(SIZES[k] for k in layout[:rng.randrange(len(layout))])
            buf[at:at + 4] = rng.choice(kinds).to_bytes(4, "little")
        said = cl.walk_stop(bytes(buf), valid)
        ref = reference_walk(bytes(buf), valid)
        assert (cl.walk(bytes(buf), valid) is None) == (ref is None) == (not said.startswith("none")), (trial, said)
        if ref is None:
            at = int(said.split("at byte ")[1].split()[0]) if "at byte " in said else None
            if "runs past" in said or "unknown record kind" in said:
                assert at is not None and at % 8 == 0 and at < valid, said
            else:
                assert said.endswith(f"of {valid}") and "bytes after the record ending" in said, said
