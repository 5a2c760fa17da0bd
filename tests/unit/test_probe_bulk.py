"""Bulk packing reads CUPTI's raw structs: their layout against cupti-python's own dtypes.

Needs cupti-python only (no GPU): it is a dependency, so this runs everywhere, and on
the GPU machine it checks the library installed there. Records are built in real memory
with cupti-python's ``activity_*_dtype`` and read back through ``ptr``, as the
probe reads CUPTI's buffers; the result must equal the attribute-by-attribute
packing, field for field.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from cupti import cupti  # a pinned dependency: its absence is a failure, not a skip
from gpufootprint.probe import packing
from gpufootprint.records import DTYPES, RecordKind
from gpufootprint.wire import cupti_layout


class Rec:
    """A record object like cupti-python's: attributes over a struct in memory, plus ``ptr``."""

    def __init__(self, arr: np.ndarray, i: int) -> None:
        self._row = arr[i]
        self.ptr = arr.ctypes.data + i * arr.dtype.itemsize

    def __getattr__(self, name: str) -> Any:
        v = self._row[name]
        if v.dtype.names:  # nested struct
            row = v
            return SimpleNamespace(**{n: (SimpleNamespace(**{m: int(row[n][m]) for m in row[n].dtype.names})
                                          if row[n].dtype.names else int(row[n])) for n in row.dtype.names})
        return int(v)


def _records(rng: np.random.Generator) -> tuple[list[Any], list[np.ndarray]]:
    keep: list[np.ndarray] = []
    recs: list[Any] = []
    m = np.zeros(40, dtype=cupti.activity_memory4_dtype)
    m["kind"] = packing.CUPTI_MEMORY2
    for f in ("address", "bytes", "timestamp", "correlation_id", "device_id", "context_id", "stream_id"):
        m[f] = rng.integers(1, 2**31, len(m))
    m["memory_operation_type"] = rng.integers(1, 3, len(m))
    m["memory_kind"] = rng.integers(1, 6, len(m))
    m["is_async"] = np.arange(len(m)) % 2
    cfg = m["memory_pool_config"]
    cfg["memory_pool_type"] = np.arange(len(m)) % 3
    cfg["address"] = rng.integers(1, 2**40, len(m))
    cfg["release_threshold"] = rng.integers(1, 2**40, len(m))
    cfg["utilized_size"] = rng.integers(1, 2**40, len(m))
    cfg["pool"]["size_"] = rng.integers(1, 2**40, len(m))
    m["memory_pool_config"] = cfg
    c = np.zeros(7, dtype=cupti.activity_memcpy6_dtype)
    c["kind"] = packing.CUPTI_MEMCPY
    for f in ("bytes", "start", "end", "device_id", "context_id", "stream_id", "correlation_id", "graph_id"):
        c[f] = rng.integers(1, 2**31, len(c))
    c["copy_kind"], c["src_kind"], c["dst_kind"] = 1, 2, 3
    s = np.zeros(5, dtype=cupti.activity_memset4_dtype)
    s["kind"] = packing.CUPTI_MEMSET
    for f in ("bytes", "start", "end", "device_id", "stream_id", "correlation_id"):
        s[f] = rng.integers(1, 2**31, len(s))
    s["memory_kind"] = 3
    for arr in (m, c, s):
        keep.append(arr)
        recs.extend(Rec(arr, i) for i in range(len(arr)))
    order = rng.permutation(len(recs))
    return [recs[i] for i in order], keep


def _pack(records: list[Any], bulk: bool) -> tuple[dict[RecordKind, np.ndarray], packing.Packer]:
    out: dict[RecordKind, list[np.ndarray]] = {}
    p = packing.Packer(7, lambda ch: out.setdefault(ch[0], []).append(ch[1].copy()), capacity=16, bulk=bulk)
    assert p.pack(records) == len(records)
    p.flush()
    return {k: np.concatenate(v) for k, v in out.items()}, p


def test_bulk_packing_equals_attribute_packing_field_for_field() -> None:
    for seed in range(3):
        records, _keep = _records(np.random.default_rng(seed))
        slow, _ = _pack(records, bulk=False)
        fast, p = _pack(records, bulk=True)
        assert p.bulk and p.bulk_fallbacks == 0 and p.bulk_records == len(records)
        assert set(slow) == set(fast) == {RecordKind.MEMORY, RecordKind.MEMCPY, RecordKind.MEMSET}
        for kind in slow:
            # Bulk groups by kind; order within a kind is kept.
            assert slow[kind].dtype == DTYPES[kind]
            assert slow[kind].tobytes() == fast[kind].tobytes(), kind


def test_raw_offsets_agree_with_cupti_pythons_dtypes_for_every_kind() -> None:
    # Our field name -> cupti-python's, where they differ; pool fields live in the nested config.
    names = {"op": "memory_operation_type", "mk": "memory_kind", "corr": "correlation_id", "dev": "device_id",
             "ctx": "context_id", "stream": "stream_id", "ck": "copy_kind", "src": "src_kind", "dst": "dst_kind",
             "graph": "graph_id", "src_dev": "src_device_id", "dst_dev": "dst_device_id", "node": "graph_node_id"}
    per_kind = {cupti_layout.MEMORY_POOL: {"ptype": "memory_pool_type", "op": "memory_pool_operation_type",
                                         "keep": "min_bytes_to_keep", "size": "size_", "thresh": "release_threshold",
                                         "used": "utilized_size"},
                cupti_layout.UNIFIED_MEMORY_COUNTER: {"ck": "counter_kind", "src": "src_id", "dst": "dst_id"}}
    pool = {"pool_type": "memory_pool_type", "pool_addr": "address", "pool_thresh": "release_threshold",
            "pool_size": "pool", "pool_used": "utilized_size"}
    assert set(cupti_layout.CUPTI_PYTHON_NAMES) | {cupti_layout.KERNEL} == set(cupti_layout.RAW_DTYPES)
    for k, struct_name in cupti_layout.CUPTI_PYTHON_NAMES.items():
        ours = cupti_layout.RAW_DTYPES[k]
        dt = getattr(cupti, f"activity_{struct_name}_dtype")
        assert ours.itemsize == dt.itemsize, struct_name
        for name, (fmt, off) in ours.fields.items():
            if k == cupti_layout.MEMORY2 and name in pool:
                base = dt.fields["memory_pool_config"][1]
                sub = dt.fields["memory_pool_config"][0]
                assert off == base + sub.fields[pool[name]][1], name
                continue
            theirs = per_kind.get(k, {}).get(name) or names.get(name, name)
            t, o = dt.fields[theirs][:2]
            assert (o, t.itemsize) == (off, fmt.itemsize), (struct_name, name)


def test_records_without_ptr_fall_back_to_attributes_once() -> None:
    rec = SimpleNamespace(kind=packing.CUPTI_MEMSET, start=1, end=2, bytes=3, device_id=0, stream_id=1,
                          correlation_id=5, memory_kind=3)
    out, p = _pack([rec, rec], bulk=True)
    assert not p.bulk and p.bulk_fallbacks == 1 and len(out[RecordKind.MEMSET]) == 2


def test_driver_api_records_are_walked_over_counted_and_not_sent() -> None:
    # driver_hooks_via="activity": CUPTI writes a CUpti_ActivityAPI record per cuMemMap/cuMemUnmap
    # into the same buffers; the walk must step over it exactly and the packer must skip it.
    api = cupti.activity_api_dtype
    assert cupti_layout.SKIPPED_SIZES[cupti_layout.DRIVER] == api.itemsize
    mem = np.zeros(2, dtype=cupti.activity_memory4_dtype)
    mem["kind"] = cupti_layout.MEMORY2
    mem["memory_operation_type"] = 1
    mem["address"] = [0x7000_0000, 0x7020_0000]
    mem["bytes"] = 2 << 20
    call = np.zeros(1, dtype=api)
    call["kind"] = cupti_layout.DRIVER
    call["cbid"] = int(cupti.driver_api_trace_cbid.cuMemMap)
    buf = mem[:1].tobytes() + call.tobytes() + mem[1:].tobytes()
    offsets = cupti_layout.walk(buf, len(buf))
    m = mem.dtype.itemsize
    assert offsets == {cupti_layout.MEMORY2: [0, m + api.itemsize], cupti_layout.DRIVER: [m]}
    out: dict[RecordKind, list[np.ndarray]] = {}
    p = packing.Packer(7, lambda ch: out.setdefault(ch[0], []).append(ch[1].copy()), capacity=16, bulk=True)
    assert p.pack_raw(memoryview(bytearray(buf)), len(buf), offsets) == 2
    p.flush()
    assert (p.api_records, p.unknown_kinds, p.bad_records) == (1, 0, 0)
    assert list(np.concatenate(out[RecordKind.MEMORY])["addr"]) == [0x7000_0000, 0x7020_0000]
