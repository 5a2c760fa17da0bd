"""A probe in a container knows itself by its namespace pid; the daemon maps it to the peer's pid."""

from __future__ import annotations

import numpy as np
from gpufootprint.configload import load_config
from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import MEMORY_DTYPE, RecordKind
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameDecoder, FrameType


def feed(session: Session, *frames: bytes) -> None:
    dec = FrameDecoder()
    for f in dec.feed(framing.PREAMBLE + b"".join(frames)):
        session.handle(f)


def test_namespace_pid_from_hello_is_mapped_to_the_peer_credentials_pid() -> None:
    pipeline = Pipeline(load_config(env={}).footprint)
    marks: list[dict] = []  # type: ignore[type-arg]
    session = Session(pipeline, source="probe", name="probe pid=4321", peer_pid=4321, on_mark=marks.append)
    recs = np.zeros(1, MEMORY_DTYPE)
    recs[0] = (1000, 0x1000, 4096, 0, 0, 0, 0, 7, 0, 1, 7, 1, 1, 3, 0, 0)  # pid 7 inside the container
    feed(session,
         framing.encode_json(FrameType.HELLO, {"pid": 7, "start_time": 1}),
         framing.encode_batch(RecordKind.MEMORY, recs),
         framing.encode_json(FrameType.MARK, {"label": "m", "ts": 2000, "pid": 7, "dev": 0,
                                              "expect_live_bytes": {"device": 4096}}),
         framing.encode_json(FrameType.HEARTBEAT, {"ts": 3000, "pid": 7, "counters": {"records_sent": 1}}))
    assert set(pipeline.processes) == {4321}
    assert marks[0]["pid"] == 4321 and marks[0]["matches"]
    assert pipeline.processes[4321].probe_counters["records_sent"] == 1
    assert pipeline.processes[4321].info["pid"] == 7
    assert pipeline.errors.counts.get("pid_mismatch", 0) == 0


def test_records_for_a_third_pid_are_still_refused() -> None:
    pipeline = Pipeline(load_config(env={}).footprint)
    session = Session(pipeline, source="probe", name="p", peer_pid=4321)
    recs = np.zeros(1, MEMORY_DTYPE)
    recs[0] = (1000, 0x1000, 4096, 0, 0, 0, 0, 99, 0, 1, 7, 1, 1, 3, 0, 0)
    feed(session, framing.encode_json(FrameType.HELLO, {"pid": 7}), framing.encode_batch(RecordKind.MEMORY, recs))
    assert pipeline.errors.counts["pid_mismatch"] == 1


def _memory2_buffer(*records: tuple[int, int, int]) -> bytes:
    """CUPTI's MEMORY2 structs (ts, address, op) as a probe forwards them, on GPU 0, 4 KiB each."""
    from gpufootprint.wire import cupti_layout

    raw = np.zeros(len(records), cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
    raw.view(np.uint8).reshape(len(records), -1)[:, :4].view("<i4")[:, 0] = cupti_layout.MEMORY2
    for i, (ts, addr, op) in enumerate(records):
        raw[i]["timestamp"], raw[i]["address"], raw[i]["op"] = ts, addr, op
    raw["bytes"], raw["mk"] = 4096, 3  # CUPTI_ACTIVITY_MEMORY_KIND_DEVICE
    return raw.tobytes()


def test_a_cupti_buffer_is_the_peers_under_its_namespace_pid_and_refused_under_a_third_pid() -> None:
    """A forwarded buffer claims one pid for all its records (checked once, not record by record): the
    probe's namespace pid maps to the peer's, a buffer under any other pid is refused whole."""
    pipeline = Pipeline(load_config(env={}).footprint)
    marks: list[dict] = []  # type: ignore[type-arg]
    session = Session(pipeline, source="probe", name="probe pid=4321", peer_pid=4321, on_mark=marks.append)
    feed(session,
         framing.encode_json(FrameType.HELLO, {"pid": 7, "start_time": 1}),
         framing.encode_cupti_buffer(7, _memory2_buffer((1000, 0x1000, 1), (1100, 0x2000, 1))),
         framing.encode_cupti_buffer(99, _memory2_buffer((1200, 0x3000, 1), (1300, 0x4000, 1), (1400, 0x1000, 2))),
         framing.encode_cupti_buffer(4321, _memory2_buffer((1500, 0x1000, 2))),
         framing.encode_json(FrameType.MARK, {"label": "m", "ts": 2000, "pid": 7, "dev": 0,
                                              "expect_live_bytes": {"device": 4096}}))
    assert set(pipeline.processes) == {4321}
    assert pipeline.errors.counts["pid_mismatch"] == 1  # the third pid's buffer, none of its records applied
    assert marks[0]["pid"] == 4321 and marks[0]["matches"], marks  # 0x2000 live: 0x1000 freed by the peer's own pid
