"""Hostile JSON control frames: a one-line frame error naming the byte, never a crash."""

from __future__ import annotations

import pytest
from gpufootprint.config import FootprintConfig
from gpufootprint.errors import FrameError
from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.wire.framing import PREAMBLE, Frame, FrameDecoder, FrameType, encode, encode_json

HOSTILE_JSON = {
    "integer_past_python_digit_limit": b'{"pid": 100, "ts": ' + b"1" * 5000 + b"}",
    "integer_past_digit_limit_with_whitespace": b' {"pid": ' + b"9" * 5000 + b"} ",
    "nested_past_recursion_limit": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("payload", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
def test_json_control_frames_json_cannot_hold_are_frame_errors_naming_the_byte(payload: bytes) -> None:
    # GIVEN a control frame whose JSON Python refuses to build (an integer of 5,000 digits, nesting
    # deeper than the recursion limit)
    frame = Frame(FrameType.MARK, 0, payload, 1234)
    # THEN reading it is a frame error that says where, like any other JSON the daemon cannot read
    with pytest.raises(FrameError, match="byte 1234: MARK frame is not JSON"):
        frame.json()


@pytest.mark.parametrize("payload", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
def test_a_session_given_such_a_control_frame_counts_it_and_keeps_what_came_before(payload: bytes) -> None:
    # GIVEN a stream: a HELLO, then a hostile HEARTBEAT, then a good MARK
    marks: list[dict] = []
    session = Session(Pipeline(FootprintConfig(), monotonic=lambda: 0.0), source="trace", name="t",
                      on_mark=marks.append)
    decoder = FrameDecoder()
    stream = (PREAMBLE + encode_json(FrameType.HELLO, {"pid": 100}) + encode(FrameType.HEARTBEAT, payload)
              + encode_json(FrameType.MARK, {"ts": 5, "pid": 100, "dev": 0, "label": "after"}))
    # THEN the session does not raise: the bad frame is one problem naming its byte, the rest goes on
    for frame in decoder.feed(stream):
        session.handle(frame)
    session.close()
    assert any("HEARTBEAT frame is not JSON" in p and "byte " in p for p in session.problems)
    assert [m["label"] for m in marks] == ["after"]
