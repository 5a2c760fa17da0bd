"""Packing cupti-python record objects (faked at that boundary only) into the record dtypes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from gpufootprint.probe.packing import Packer
from gpufootprint.records import DTYPES, MemoryKind, RecordKind

from tests import probe_fakes as fk


def packer(capacity: int = 8) -> tuple[Packer, list[tuple[RecordKind, np.ndarray]]]:
    out: list[tuple[RecordKind, np.ndarray]] = []
    return Packer(pid=4242, sink=out.append, capacity=capacity), out


def by_kind(out: list[tuple[RecordKind, np.ndarray]], kind: RecordKind) -> np.ndarray:
    parts = [a for k, a in out if k is kind]
    return np.concatenate(parts) if parts else np.zeros(0, DTYPES[kind])


def test_memory_records_keep_every_field_and_the_stream_ordered_pool_configuration() -> None:
    p, out = packer()
    plain = fk.memory_record(1, 0x7F00_0000_0000, 2 << 20, ts=111, mk=3, dev=1, stream=0xFFFFFFFF)
    pooled = fk.memory_record(1, 0x7F00_0020_0000, 4096, ts=222, is_async=1, pool_type=1, pool_addr=0xABC000,
                              pool_size=32 << 20, pool_used=8 << 20)
    pooled.context_id = 0xFFFFFFFF  # expandable-segment records carry this context id
    assert p.pack([plain, pooled]) == 2
    p.flush()
    recs = by_kind(out, RecordKind.MEMORY)
    assert recs["ts"].tolist() == [111, 222]
    assert recs["addr"].tolist() == [0x7F00_0000_0000, 0x7F00_0020_0000]
    assert recs["bytes"].tolist() == [2 << 20, 4096]
    assert recs["dev"].tolist() == [1, 0]
    assert recs["pid"].tolist() == [4242, 4242]  # the probe's own pid, never the record's
    assert recs["stream"][0] == 0xFFFFFFFF and recs["ctx"][1] == 0xFFFFFFFF
    assert recs["is_async"].tolist() == [0, 1]
    assert recs["pool_type"].tolist() == [0, 1]
    assert recs["pool_addr"][1] == 0xABC000 and recs["pool_size"][1] == 32 << 20 and recs["pool_used"][1] == 8 << 20
    assert recs["op"].tolist() == [1, 1] and recs["mk"].tolist() == [MemoryKind.DEVICE] * 2


def test_copy_peer_copy_memset_pool_and_unified_memory_records_are_packed() -> None:
    p, out = packer()
    p.pack([fk.memcpy_record(1000, ck=2), fk.peer_copy_record(64, src=0, dst=3), fk.memset_record(77),
            fk.pool_record(3, 0xABC000, 16 << 20, 1 << 20), fk.um_record(2, 4096, 0x5000)])
    p.flush()
    cpy = by_kind(out, RecordKind.MEMCPY)
    assert cpy["bytes"].tolist() == [1000, 64]
    assert cpy["ck"].tolist() == [2, 10]
    assert (cpy["src_dev"][1], cpy["dst_dev"][1]) == (0, 3)
    assert by_kind(out, RecordKind.MEMSET)["bytes"].tolist() == [77]
    pool = by_kind(out, RecordKind.MEMORY_POOL)
    assert (pool["op"][0], pool["size"][0], pool["used"][0]) == (3, 16 << 20, 1 << 20)
    um = by_kind(out, RecordKind.UNIFIED_MEMORY)
    assert (um["ck"][0], um["value"][0], um["addr"][0]) == (2, 4096, 0x5000)


def test_kernel_names_become_ids_and_each_new_name_is_announced_once() -> None:
    p, out = packer()
    p.pack([fk.kernel_record("ampere_gemm"), fk.kernel_record("vec_add", graph=5, node=9),
            fk.kernel_record("ampere_gemm")])
    p.flush()
    k = by_kind(out, RecordKind.KERNEL)
    assert k["name_id"].tolist() == [1, 2, 1]
    assert (k["graph"][1], k["node"][1]) == (5, 9)
    assert p.take_new_names() == [(1, "ampere_gemm"), (2, "vec_add")]
    assert p.take_new_names() == []


def test_unknown_kinds_and_broken_records_are_counted_never_raised() -> None:
    p, out = packer()
    broken = SimpleNamespace(kind=49, memory_operation_type=1)  # lacks most attributes
    assert p.pack([SimpleNamespace(kind=12), broken, fk.memset_record(5)]) == 1
    assert (p.unknown_kinds, p.bad_records) == (1, 1)
    p.flush()
    assert len(by_kind(out, RecordKind.MEMSET)) == 1


def test_full_arrays_are_handed_off_at_capacity_and_recycled_without_new_allocations() -> None:
    p, out = packer(capacity=4)
    warm = None
    for round_ in range(5):
        p.pack([fk.memset_record(i) for i in range(9)])
        p.flush()
        for kind, arr in out:
            p.give_back(kind, arr.base if arr.base is not None else arr)
        got = sum(len(a) for _, a in out)
        assert got == 9, round_
        out.clear()
        if round_ == 0:
            warm = p.arrays_allocated
    assert p.arrays_allocated == warm  # after the first burst, arrays are only reused
