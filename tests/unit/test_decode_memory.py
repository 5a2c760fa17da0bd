"""A forwarded CUPTI buffer is decoded in memory bounded by a small multiple of its frame
(docs/reliability.md, Limits): kind by kind, and records at any offsets copied without an index
matrix (which took eight times the buffer: about 111 MiB for a 16 MiB frame of two kinds)."""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import numpy as np
from gpufootprint.configload import load_config
from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import RecordKind
from gpufootprint.wire import cupti_layout as cl
from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, encode_cupti_buffer

#: The documented bound: decoding takes at most this many times the frame's bytes beyond the frame.
DECODE_MULTIPLE = 1.0


def _mixed_buffer(megabytes: int) -> tuple[bytes, int]:
    """MEMORY2 and MEMCPY records alternating, back to back: no run of one kind to view in place."""
    m, c = cl.RAW_DTYPES[cl.MEMORY2].itemsize, cl.RAW_DTYPES[cl.MEMCPY].itemsize
    n = megabytes * (1 << 20) // (m + c)
    pair = np.zeros((n, m + c), np.uint8)
    pair[:, 0:4] = np.frombuffer(np.int32(cl.MEMORY2).tobytes(), np.uint8)
    pair[:, m:m + 4] = np.frombuffer(np.int32(cl.MEMCPY).tobytes(), np.uint8)
    now = time.time_ns()
    mem = pair[:, :m].copy().view(cl.RAW_DTYPES[cl.MEMORY2]).reshape(n)
    mem["op"], mem["mk"], mem["bytes"] = 1, 3, 4096
    mem["address"] = 0x7000_0000 + np.arange(n, dtype=np.uint64) * 4096
    mem["timestamp"] = now + np.arange(n, dtype=np.uint64)
    cpy = pair[:, m:].copy().view(cl.RAW_DTYPES[cl.MEMCPY]).reshape(n)
    cpy["bytes"], cpy["start"] = 64, now + np.arange(n, dtype=np.uint64)
    cpy["end"] = cpy["start"] + np.uint64(10)
    pair[:, :m] = mem.view(np.uint8).reshape(n, m)
    pair[:, m:] = cpy.view(np.uint8).reshape(n, c)
    return pair.tobytes(), 2 * n


def test_a_16_mib_buffer_of_two_kinds_decodes_within_a_small_multiple_of_its_frame() -> None:
    data, n = _mixed_buffer(16)
    (frame,) = FrameDecoder(32 << 20).feed(PREAMBLE + encode_cupti_buffer(4242, data))
    cfg = load_config(env={})
    session = Session(Pipeline(cfg.footprint), source="trace")
    seen: dict[RecordKind, int] = {}

    def keep_count(kind: RecordKind, recs: np.ndarray, offset: int, own: bool = False) -> Any:
        seen[kind] = seen.get(kind, 0) + len(recs)  # the records go no further: only decoding is measured

    session._records = keep_count  # type: ignore[method-assign]
    tracemalloc.start()
    try:
        session.handle(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == {RecordKind.MEMORY: n // 2, RecordKind.MEMCPY: n // 2}
    assert peak <= DECODE_MULTIPLE * len(data), f"{peak / 2**20:.1f} MiB to decode {len(data) / 2**20:.1f} MiB"


def test_a_16_mib_buffer_read_in_a_run_with_a_small_neighbour_decodes_within_the_same_bound() -> None:
    """A read's consecutive CUPTI buffers are read as one run (``Session.cupti_buffers``): records of one kind
    are joined up to ``DECODE_CHUNK`` at a time and handed on as each run ends, so a 16 MiB buffer read beside
    another is still decoded a chunk at a time (held whole, it took 20 MiB for a 16 MiB frame)."""
    for data in (_mixed_buffer(16)[0], _allocations_buffer(16)):
        frames = FrameDecoder(32 << 20).feed(PREAMBLE + encode_cupti_buffer(4242, data)
                                             + encode_cupti_buffer(4242, data[:256]))
        cfg = load_config(env={})
        session = Session(Pipeline(cfg.footprint), source="probe", peer_pid=4242)
        seen = [0]

        def keep_count(kind: RecordKind, recs: np.ndarray, offset: int, own: bool = False, seen: list[int] = seen) -> Any:
            seen[0] += len(recs)

        session._records = keep_count  # type: ignore[method-assign]
        tracemalloc.start()
        try:
            session.cupti_buffers(frames)  # what the batch merger does with the read's two frames
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert seen[0] > 0
        assert peak <= DECODE_MULTIPLE * len(data), f"{peak / 2**20:.1f} MiB to decode {len(data) / 2**20:.1f} MiB"


def _allocations_buffer(megabytes: int) -> bytes:
    """MEMORY2 records only, back to back: one run of one kind, which a walk views in place."""
    m = cl.RAW_DTYPES[cl.MEMORY2]
    n = megabytes * (1 << 20) // m.itemsize - 1
    r = np.zeros(n, m)
    r.view(np.uint8).reshape(n, -1)[:, :4] = np.frombuffer(np.int32(cl.MEMORY2).tobytes(), np.uint8)
    r["op"], r["mk"], r["bytes"] = 1, 3, 4096
    r["address"] = 0x7000_0000 + np.arange(n, dtype=np.uint64) * 4096
    r["timestamp"] = time.time_ns() + np.arange(n, dtype=np.uint64)
    return r.tobytes()
