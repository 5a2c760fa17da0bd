"""The probe protocol on one connection: the order frames must come in, how one read's frames are
handed to the session (runs of batches joined), what a frame counts as received, and the resync
requests the daemon sends back.

The socket itself is ``transport.py``'s; the loop that ties the two is ``server.py``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpufootprint.errors import FrameError
from gpufootprint.ingest.session import MarkCallback, Session
from gpufootprint.ingest.validate import Guard
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import DTYPES, RecordKind
from gpufootprint.wire import cupti_layout
from gpufootprint.wire.framing import (
    CUPTI_BUFFERS_LEVEL,
    Frame,
    FrameDecoder,
    FrameType,
    cupti_buffer,
    cupti_buffers_level,
)

#: At most one resync request per process this often (a late record or a drift asked for it).
RESYNC_REQUEST_EVERY_S = 5.0

ControlSend = Callable[[int, dict[str, Any]], bool]


@dataclass
class Connection:
    sock: socket.socket
    decoder: FrameDecoder
    session: Session
    pid: int
    uid: int
    opened: float = field(default_factory=time.monotonic)
    tenant: str = ""  # the pod, container or uid whose shares of the node-wide bounds it uses (tenants.py)
    # The protocol's order: HELLO first, one GOODBYE last, RESYNC_BEGIN/END paired.
    hello: bool = False
    goodbye: bool = False
    resync: bool = False
    records: int = 0  # records received in BATCH frames outside resyncs (the probe counts these as sent)
    unsent: bytes = b""  # tail of a CONTROL frame the socket did not take at once (at most one frame)
    resync_records: int = 0
    verify_asked: bool = False  # the probe was asked for TOTALS with its watermarks
    # The forwarded-buffer level the probe said it reads in its HELLO (1 when it says nothing: a
    # probe from before RUNTIME records forwards only at exactly 1).
    cupti_buffers: int = 1
    names_cupti_buffers: bool = False  # its HELLO named a level: it is asked for its buffers at once
    # The probe opens launch windows (HELLO ``launch_windows``); an older one would read such a request
    # as a window of kernel records, whose lasting cost launch windows exist to avoid.
    launch_windows: bool = False


#: Frames a probe may send without a checksum (framing.UNCHECKED): its forwarded CUPTI buffers, once this
#: daemon's verify CONTROL named a level that allows it. Their records are checked as any others are.
PROBE_UNCHECKED = frozenset({FrameType.CUPTI_BUFFER})


def probe_connection(sock: socket.socket, pid: int, uid: int, tenant: str, pipeline: Pipeline, guard: Guard,
                     max_frame_bytes: int, *, on_mark: MarkCallback | None = None,
                     future_limit_ns: Callable[[], int] | None = None) -> Connection:
    """A live probe's connection, wired as the daemon wires every peer it accepts: its session bounded by
    ``guard``'s shares, its decoder by ``max_frame_bytes`` (forwarded CUPTI buffers unchecked), the peer
    counted in the guard's census under ``tenant``. One place, so that the benches and tests that read
    frames without a socket loop read them exactly as the daemon does."""
    session = Session(pipeline, source="probe", name=f"probe pid={pid}", peer_pid=pid, on_mark=on_mark)
    if future_limit_ns is not None:
        session.future_limit_ns = future_limit_ns  # a clock step on the probe's host is bounded
    session.guard, session.limits = guard, guard.limits
    conn = Connection(sock, FrameDecoder(max_frame_bytes, unchecked=PROBE_UNCHECKED), session, pid, uid)
    conn.tenant = tenant
    guard.census.connect(pid, uid, tenant)
    return conn


#: Why each order violation cuts a peer off, for the log line.
ORDER_TEXT = {
    "frame_after_goodbye": "after GOODBYE",
    "frame_before_hello": "before HELLO",
    "duplicate_hello": "twice on one connection",
    "unexpected_frame": "from a probe (daemon -> probe only)",
    "resync_mismatch": "out of place (RESYNC_BEGIN and RESYNC_END must pair)",
}
# The gpufootprint_ingest_errors_total reason a cut-off counts under (its own name if not listed):
# wire damage stays "bad_frame", order violations "unexpected_frame", the reasons that metric had
# before cut-offs got reasons of their own, so its series stay comparable.
SESSION_REASONS = {"bad_preamble": "bad_frame", "bad_version": "bad_frame", "frame_too_large": "bad_frame",
                   "bad_checksum": "bad_frame", "bad_frame_type": "bad_frame",
                   "frame_before_hello": "unexpected_frame", "frame_after_goodbye": "unexpected_frame",
                   "duplicate_hello": "unexpected_frame", "resync_mismatch": "unexpected_frame"}


def order_violation(conn: Connection, frame: Frame) -> str | None:
    """Why this frame breaks the protocol's order on a live connection, or None (and the
    connection's state moves on: HELLO seen, inside a resync, GOODBYE seen)."""
    ftype = frame.type
    if conn.goodbye:
        return "frame_after_goodbye"
    if not conn.hello:
        if ftype is not FrameType.HELLO:
            return "frame_before_hello"
        conn.hello = True
        body = _hello_body(frame)
        named = cupti_buffers_level(body)
        conn.names_cupti_buffers = named > 0
        conn.cupti_buffers = max(1, named)  # a probe that names none reads level 1
        said = body.get("launch_windows")
        conn.launch_windows = isinstance(said, int) and not isinstance(said, bool) and said == 1
        return None
    if ftype is FrameType.HELLO:
        return "duplicate_hello"
    if ftype is FrameType.CONTROL:
        return "unexpected_frame"
    if ftype is FrameType.RESYNC_BEGIN:
        if conn.resync:
            return "resync_mismatch"
        conn.resync = True
    elif ftype is FrameType.RESYNC_END:
        if not conn.resync:
            return "resync_mismatch"
        conn.resync = False
    elif ftype is FrameType.GOODBYE:
        conn.goodbye = True
    return None


def _hello_body(hello: Frame) -> dict[str, Any]:
    """A HELLO's JSON object, or {} when it is not one (the session reports a malformed HELLO itself)."""
    try:
        return hello.json()
    except FrameError:
        return {}


def control_allowed(conn: Connection, body: dict[str, object]) -> bool:
    """Whether this probe may be sent this CONTROL: a launch window only to a probe that opens them."""
    return not (body.get("op") == "kernel_window" and body.get("records") == "launches" and not conn.launch_windows)


def verify_request(conn: Connection) -> dict[str, object]:
    """The CONTROL that asks a probe for TOTALS and tells it which forwarded buffers this daemon reads:
    the lower of the probe's level and this daemon's."""
    return {"op": "verify", "cupti_buffers": min(conn.cupti_buffers, CUPTI_BUFFERS_LEVEL)}


def wants_verify(conn: Connection, frame: Frame) -> bool:
    """True once per connection: a probe that sends watermarks is asked for its table's totals with each
    of them, and told that this daemon reads CUPTI buffers itself (CUPTI_BUFFER frames).

    A probe whose HELLO names the level of buffers it forwards is asked at that HELLO: until it is asked it
    reads CUPTI's buffers itself, which behind busy Python threads falls behind (numpy lets the GIL go)
    and, asked only at its first watermark (about half a watermark period in), it did so that long or more
    after each connect.
    Any other probe is asked at its first WATERMARK, as before: one that does not know the op counts it
    and goes on; an older daemon never asks, so never meets either frame."""
    if conn.verify_asked:
        return False
    if frame.type is FrameType.WATERMARK or (frame.type is FrameType.HELLO and conn.names_cupti_buffers):
        conn.verify_asked = True
        return True
    return False


def count_received(conn: Connection, frame: Frame, received: dict[int, list[int]]) -> None:
    """Count a BATCH or CUPTI_BUFFER frame's records as received from the peer, inside or outside a
    resync (``received``: pid -> [records, resync records], kept across its connections)."""
    if frame.type is not FrameType.BATCH and frame.type is not FrameType.CUPTI_BUFFER:
        return
    n = own_records(frame, conn.pid, conn.session.ns_pid, conn.session)
    counts = received.setdefault(conn.pid, [0, 0])
    if conn.resync:
        conn.resync_records += n
        counts[1] += n
    else:
        conn.records += n
        counts[0] += n


#: CUPTI_BUFFER frames read as one run at most: a read of many tiny frames (a 256 KiB read holds about
#: 13,000 empty ones) is read in runs of this many, each frame walked once (``Session.WALKS_KEPT``).
MAX_RUN_FRAMES = 64


class BatchMerger:
    """Hands one read's frames to the session, joining runs of BATCH frames of one kind, and runs of
    CUPTI_BUFFER frames.

    The pipeline's cost is mostly per batch (sorting, frames, sampler), not per record, so when
    the daemon falls behind and one read holds many small batches of a connection, they are
    applied as one: the busier the daemon, the larger its batches. Watermarks between BATCH frames are
    reduced to the highest, applied after the joined batch (records it covers are applied at once, as
    before; only ``late`` counting differs). A busy probe's flush is several CUPTI buffers of 512 records
    and a watermark: the buffers up to a watermark are read as one (``Session.cupti_buffers``), and the
    watermark ends the run, so a run the ingest guard sends buffer by buffer meets each share as the
    buffers one by one did. Resync contents, damaged batches and every other frame go through one by one,
    in order.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.run: list[Frame] = []
        self.mark: Frame | None = None
        self.mark_ts = -1

    def add(self, frame: Frame) -> None:
        ftype = frame.type
        if ftype is FrameType.BATCH and not self.conn.resync and self._whole(frame):
            if self.run and (self.run[0].type is not FrameType.BATCH or self.run[0].tag != frame.tag):
                self.flush()
            self.run.append(frame)
        elif ftype is FrameType.CUPTI_BUFFER and not self.conn.resync:
            if self.run and self.run[0].type is not FrameType.CUPTI_BUFFER:
                self.flush()
            self.run.append(frame)
            if len(self.run) >= MAX_RUN_FRAMES:  # the session keeps each unread frame's walk: a bounded few
                self.flush()
        elif ftype is FrameType.WATERMARK and len(frame.payload) == 8 and self.run \
                and self.run[0].type is FrameType.BATCH:
            ts = int.from_bytes(frame.payload, "little")
            if ts > self.mark_ts:
                self.mark, self.mark_ts = frame, ts
        else:
            self.flush()
            self.conn.session.handle(frame)

    def flush(self) -> None:
        run, mark = self.run, self.mark
        self.run, self.mark, self.mark_ts = [], None, -1
        if len(run) == 1:
            self.conn.session.handle(run[0])
        elif run and run[0].type is FrameType.CUPTI_BUFFER:
            self.conn.session.cupti_buffers(run)
        elif run:
            joined = b"".join(f.payload for f in run)
            self.conn.session.handle(Frame(FrameType.BATCH, run[0].tag, joined, run[0].offset))
        if mark is not None:
            self.conn.session.handle(mark)

    @staticmethod
    def _whole(frame: Frame) -> bool:
        try:
            return len(frame.payload) % DTYPES[RecordKind(frame.tag)].itemsize == 0
        except ValueError:
            return False


def records_in(frame: Frame, session: Session | None = None) -> int:
    """Records a BATCH or CUPTI_BUFFER frame carries (0 when it cannot tell). ``session``: the one that
    reads the frame next, which keeps the walk of a CUPTI buffer for it (``Session.cupti_walk``)."""
    if frame.type is FrameType.CUPTI_BUFFER:
        try:
            if session is not None:
                _pid, _data, offsets = session.cupti_walk(frame)
            else:
                _pid, data = cupti_buffer(frame)
                offsets = cupti_layout.walk(data, len(data))
        except FrameError:
            return 0
        return sum(len(v) for k, v in offsets.items() if k in cupti_layout.RECORD_KIND) if offsets else 0
    try:
        return len(frame.payload) // DTYPES[RecordKind(frame.tag)].itemsize
    except ValueError:
        return 0


def own_records(frame: Frame, pid: int, ns_pid: int | None, session: Session | None = None) -> int:
    """Records of a BATCH or CUPTI_BUFFER that speak for the peer (the rest are dropped as
    pid_mismatch, so they are not "received" from this probe either)."""
    if frame.type is FrameType.CUPTI_BUFFER:
        try:
            claimed, _data = cupti_buffer(frame)
        except FrameError:
            return 0
        return records_in(frame, session) if claimed == pid or (ns_pid is not None and claimed == ns_pid) else 0
    try:
        recs = frame.records()
    except Exception:  # noqa: BLE001 - a damaged batch is counted by the session
        return 0
    pids = recs["pid"]
    mine = pids == pid
    if ns_pid is not None:
        mine |= pids == ns_pid
    return int(mine.sum())


def decoder_reason(error: Exception) -> str:
    """A short, bounded label for why a stream broke (the message itself goes to the log)."""
    text = str(error)
    for needle, reason in (("wire version", "bad_version"), ("preamble", "bad_preamble"),
                           ("exceeds the limit", "frame_too_large"), ("checksum", "bad_checksum"),
                           ("unknown frame type", "bad_frame_type")):
        if needle in text:
            return reason
    return "bad_frame"


class ResyncRequests:
    """Asks the probes of processes whose state a late record or a drift made doubtful
    (``Pipeline.resync_wanted``) for their whole table, at most once per process every
    ``RESYNC_REQUEST_EVERY_S``: the answer to the last request may still be on its way."""

    def __init__(self) -> None:
        self._asked: dict[int, float] = {}  # pid -> monotonic time of the last request
        self.sent = 0

    def request(self, pipeline: Pipeline, send_control: ControlSend, mono: float) -> None:
        wanted = pipeline.resync_wanted
        if not wanted:
            return
        for pid in list(wanted):
            if mono - self._asked.get(pid, -RESYNC_REQUEST_EVERY_S) < RESYNC_REQUEST_EVERY_S:
                continue  # asked recently: the answer is on its way; ask again later if still wanted
            wanted.discard(pid)
            if send_control(pid, {"op": "resync", "reason": "verify"}):
                self._asked[pid] = mono
                self.sent += 1
        for pid in [p for p in self._asked if p not in pipeline.processes]:
            del self._asked[pid]
