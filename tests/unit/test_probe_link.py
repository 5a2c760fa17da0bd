"""The probe's socket link: frames given in parts arrive whole and in order, across partial sends."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.probe import nativecallbacks
from gpufootprint.probe.link import SocketLink
from gpufootprint.wire import framing
from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, FrameType


def test_a_cupti_buffer_given_in_parts_is_the_same_frame_as_encoded_whole() -> None:
    data = os.urandom(65_536)
    head, body = framing.cupti_buffer_parts(4242, memoryview(data))
    assert head + bytes(body) == framing.encode_cupti_buffer(4242, data)
    (frame,) = FrameDecoder().feed(PREAMBLE + head + bytes(body))  # the CRC covers every part
    assert frame.type is FrameType.CUPTI_BUFFER and framing.cupti_buffer(frame) == (4242, memoryview(data))


#: The link's two ways to the socket: Python's socket calls, and the probe's C library (they keep the GIL).
SENDS = ["python", pytest.param("c", marks=pytest.mark.skipif(
    not nativecallbacks.available(), reason=f"no C library: {nativecallbacks.load()[1]}"))]


#: ... and the library's send with Python's wait for the socket's room (native_pump off, the probe before gfp_pump)
WAITS = [*SENDS, pytest.param("c_python_wait", marks=pytest.mark.skipif(
    not nativecallbacks.available(), reason=f"no C library: {nativecallbacks.load()[1]}"))]


def _native(sends: str) -> Any:
    return nativecallbacks.load()[0] if sends in ("c", "c_python_wait") else None


def _connected(tmp: str, sends: str = "python") -> tuple[SocketLink, socket.socket, socket.socket]:
    """A link connected to a listening socket in ``tmp``: (link, the accepted peer, the listening socket)."""
    path = str(Path(tmp) / "d.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    link = SocketLink(path, buffer_bytes=64 << 20, backoff_max_s=1.0, on_control=lambda f: None, native=_native(sends),
                      native_pump=sends != "c_python_wait")
    assert link.try_connect()
    peer, _ = server.accept()
    return link, peer, server


def _reading(peer: socket.socket, link: SocketLink) -> tuple[threading.Thread, bytearray]:
    """A reader of ``peer`` (a Python thread of this process, so it needs the GIL), started: it takes 64 KiB at a
    time until it has all the link was given; (the thread, what it got)."""
    got = bytearray()

    def read() -> None:
        peer.settimeout(5)
        while len(got) < link._put_total:
            chunk = peer.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    return reader, got


def _buffers(got: bytes) -> list[bytes]:
    """The CUPTI buffers' bytes in a stream of frames, in order."""
    return [bytes(framing.cupti_buffer(f)[1]) for f in FrameDecoder().feed(got) if f.type is FrameType.CUPTI_BUFFER]


@pytest.mark.parametrize("sends", SENDS)
def test_frames_put_in_parts_reach_a_slow_reader_whole_and_in_order(sends: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        link, peer, server = _connected(tmp, sends)
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the socket takes a little at a time
        buffers = [os.urandom(n) for n in (128, 65_536, 1, 300_000, 4096) * 8]
        for i, data in enumerate(buffers):
            assert link.put_parts(framing.cupti_buffer_parts(i, data), records=1)
            if i % 3 == 0:
                assert link.put(framing.encode_watermark(i))
        decoder, frames = FrameDecoder(), []
        peer.settimeout(5)
        while link.buffered or len(frames) < len(buffers) + (len(buffers) + 2) // 3:
            link.pump()  # never blocks: sends what the socket takes, keeps the rest
            frames += decoder.feed(peer.recv(1 << 16))
        got = [framing.cupti_buffer(f) for f in frames if f.type is FrameType.CUPTI_BUFFER]
        assert [(pid, bytes(b)) for pid, b in got] == list(enumerate(buffers))
        marks = [f.watermark() for f in frames if f.type is FrameType.WATERMARK]
        assert marks == list(range(0, len(buffers), 3)) and decoder.error is None
        assert link.bytes_sent == len(PREAMBLE) + sum(len(f.payload) + framing.HEADER_SIZE for f in frames)
        peer.close()
        server.close()


def test_a_cupti_buffer_without_a_checksum_is_read_only_where_the_stream_allows_it() -> None:
    data = os.urandom(4096)
    unchecked = b"".join(bytes(p) for p in framing.cupti_buffer_parts(7, data, checked=False))
    assert unchecked == framing.encode_cupti_buffer(7, data, checked=False)
    damaged = bytearray(unchecked)
    damaged[-1] ^= 0xFF  # nothing finds this but the records' own checks (the daemon's decoding)
    probe_socket = frozenset({FrameType.CUPTI_BUFFER})
    (frame,) = FrameDecoder(unchecked=probe_socket).feed(PREAMBLE + bytes(damaged))
    assert framing.cupti_buffer(frame)[1].tobytes() == bytes(damaged[-4096:])
    # a file (or any stream not told otherwise) still needs every checksum: one clear error, naming where
    before = framing.encode_watermark(5)
    decoder = FrameDecoder()
    assert [f.watermark() for f in decoder.feed(PREAMBLE + before + unchecked)] == [5]
    assert str(decoder.error) == (f"byte {len(PREAMBLE) + len(before)}: a CUPTI_BUFFER frame without a checksum, "
                                  "which this stream does not allow")
    # and the flag frees no other frame type from its checksum, nor a checked buffer that is damaged
    bare = bytearray(framing.encode_watermark(9))
    bare[5] |= framing.UNCHECKED
    decoder = FrameDecoder(unchecked=probe_socket)
    assert decoder.feed(PREAMBLE + bytes(bare)) == [] and "WATERMARK frame without a checksum" in str(decoder.error)
    checked = bytearray(framing.encode_cupti_buffer(7, data))
    checked[-1] ^= 0xFF
    decoder = FrameDecoder(unchecked=probe_socket)
    assert decoder.feed(PREAMBLE + bytes(checked)) == [] and "checksum mismatch" in str(decoder.error)


@pytest.mark.parametrize("sends", WAITS)
def test_a_pump_that_may_wait_sends_what_a_reader_takes_meanwhile_and_no_longer_than_its_bound(sends: str) -> None:
    """A wake's pump may wait for the socket (the GIL let go) instead of leaving to the next wake what the
    kernel's buffer for the socket (about 200 KiB) did not take at once."""
    with tempfile.TemporaryDirectory() as tmp:
        link, peer, server = _connected(tmp, sends)
        waits: list[int] = []
        if sends == "c":  # the wait for room is one call of the C library's gfp_pump, the GIL let go
            pump = link._pump
            assert pump is not None

            def counted(*args: Any) -> int:
                waits.append(args[2])
                return int(pump(*args))
            link._pump = counted
        data = os.urandom(4 << 20)
        assert link.put_parts(framing.cupti_buffer_parts(1, data), records=1)
        # GIVEN no reader: the pump without a wait leaves most of it, and one that may wait 50 ms returns
        # after about that long with the rest still held (bounded: no reader ever comes)
        link.pump()
        assert link.buffered > 2 << 20
        t0 = time.monotonic()
        link.pump(0.05)
        assert 0.04 <= time.monotonic() - t0 < 1.0 and link.buffered > 2 << 20
        # WHEN a reader takes it, 64 KiB at a time: one pump that may wait 5 s sends it all, and returns
        # as soon as it has
        reader, got = _reading(peer, link)
        t0 = time.monotonic()
        link.pump(5.0)
        took = time.monotonic() - t0
        reader.join(10)
        # THEN nothing is left, in well under the bound, and the reader has the frame whole (a reader thread
        # of this process, which needs the GIL: a wait that held it would have kept it from reading)
        assert link.buffered == 0 and took < 4.0, (link.buffered, took)
        assert (len(waits) >= 2) == (sends == "c"), waits
        assert _buffers(bytes(got)) == [data]
        # AND a reader that goes away ends a waiting pump with the link closed, its frames counted lost
        assert link.put_parts(framing.cupti_buffer_parts(2, data), records=7)
        peer.close()
        link.pump(2.0)
        assert not link.connected and link.lost_records == 7
        server.close()


def _answering_daemon(server: socket.socket, answer: bytes | None) -> threading.Thread:
    """Accepts one connection, reads until the probe's HELLO has come, then sends ``answer`` (None: nothing)
    and keeps reading until the probe goes."""
    def run() -> None:
        peer, _ = server.accept()
        decoder, hello = FrameDecoder(), False
        while not hello:
            data = peer.recv(1 << 16)
            if not data:
                return
            hello = any(f.type is FrameType.HELLO for f in decoder.feed(data))
        if answer is not None:
            peer.sendall(answer)
        while peer.recv(1 << 16):
            pass
        peer.close()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _connect_sender(tmp_path: Path, answer: bytes | None) -> tuple[list[bool], float]:
    """A sender connected to a daemon that sends ``answer`` after the HELLO: whether it forwarded buffers
    unread when its connect drained what CUPTI had queued, and how long the connect took."""
    from gpufootprint.probe.sender import Sender
    from gpufootprint.probe.settings import ProbeSettings

    path = str(tmp_path / f"d{answer is None}.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    daemon = _answering_daemon(server, answer)
    sender = Sender(ProbeSettings(socket=path), None, os.getpid(), time.time_ns, None)
    forward_at_drain: list[bool] = []
    sender._flush_and_drain = lambda: forward_at_drain.append(sender._forward)  # type: ignore[method-assign]
    assert sender.link is not None and sender.link.try_connect()
    t = time.monotonic()
    sender._on_connect()
    waited = time.monotonic() - t
    sender.link.close("test")
    daemon.join(timeout=5)
    server.close()
    return forward_at_drain, waited


def test_at_connect_the_sender_waits_for_the_daemons_ask_before_it_reads_what_cupti_queued(tmp_path: Path) -> None:
    """Until the daemon asks for CUPTI's buffers unread the probe converts them itself, which behind busy
    Python threads falls behind and drops. A daemon asks in answer to the HELLO; the connect's drain of
    what CUPTI queued while the probe was away comes after that answer, not before."""
    from gpufootprint.probe.sender import CONNECT_ASK_WAIT_S

    ask = framing.encode_json(FrameType.CONTROL, {"op": "verify", "cupti_buffers": 3})
    forward_at_drain, waited = _connect_sender(tmp_path, ask)
    assert forward_at_drain == [True] and waited < CONNECT_ASK_WAIT_S, (forward_at_drain, waited)
    # an older daemon, which asks at the first watermark: the connect waits no longer than its bound
    forward_at_drain, waited = _connect_sender(tmp_path, None)
    assert forward_at_drain == [False] and CONNECT_ASK_WAIT_S <= waited < CONNECT_ASK_WAIT_S + 1.0, waited

@pytest.mark.parametrize("sends", SENDS)
def test_control_frames_are_read_whole_and_a_closed_peer_closes_the_link(sends: str) -> None:
    """What the daemon sends (CONTROL frames, one split across reads) reaches the link's handler whole and in
    order, through either way of reading; a peer that closes ends the link."""
    got: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "d.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        link = SocketLink(path, buffer_bytes=1 << 20, backoff_max_s=1.0, on_control=got.append, native=_native(sends))
        assert link.try_connect()
        peer, _ = server.accept()
        frames = b"".join(framing.encode_json(FrameType.CONTROL, {"op": "flush_interval", "ms": i, "pad": "x" * 30_000})
                          for i in range(5))
        peer.sendall(frames[:40_000])
        deadline = time.monotonic() + 5
        while len(got) < 1 and time.monotonic() < deadline:
            link.pump()
        assert len(got) == 1  # the second frame is cut: it waits for its rest
        peer.sendall(frames[40_000:])
        while len(got) < 5 and time.monotonic() < deadline:
            link.pump()
        assert [f.json()["ms"] for f in got] == list(range(5)) and link.connected
        assert peer.recv(1 << 16) == PREAMBLE  # read, so that its close is an end, not a reset
        peer.close()
        while link.connected and time.monotonic() < deadline:
            link.pump()
        assert not link.connected and link.disconnects["peer_closed"] == 1, link.disconnects
        server.close()


def test_the_wakeups_clear_through_the_c_library_takes_a_set_and_is_quiet_when_none_was_set() -> None:
    from gpufootprint.probe.wakeup import Wakeup

    native = nativecallbacks.load()[0]
    if native is None:
        pytest.skip(f"no C library: {nativecallbacks.load()[1]}")
    wake = Wakeup(native)
    if wake.fd is None:
        pytest.skip("no eventfd on this platform")
    wake.set()
    wake.set()
    t = time.monotonic()
    wake.wait(5.0)
    assert time.monotonic() - t < 1.0  # it was set
    wake.clear()
    t = time.monotonic()
    wake.wait(0.05)
    assert time.monotonic() - t >= 0.04  # cleared: the wait runs to its bound
    wake.clear()  # nothing set: returns at once, raises nothing
    wake.close()


@pytest.mark.skipif(not nativecallbacks.available(), reason=f"no C library: {nativecallbacks.load()[1]}")
def test_the_sender_waits_for_its_sockets_room_in_c_by_default_and_in_python_with_native_pump_off(
        tmp_path: Path) -> None:
    from gpufootprint.probe.sender import Sender
    from gpufootprint.probe.settings import ProbeSettings

    path = str(tmp_path / "none.sock")
    by_default = Sender(ProbeSettings(socket=path), None, os.getpid(), time.time_ns, None)
    assert by_default.link is not None and by_default.link._pump is not None
    off = ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_NATIVE_PUMP": "0"})
    assert off.native_pump is False
    python_wait = Sender(ProbeSettings(socket=path, native_pump=False), None, os.getpid(), time.time_ns, None)
    assert python_wait.link is not None and python_wait.link._pump is None
    no_library = Sender(ProbeSettings(socket=path, native_callbacks=False), None, os.getpid(), time.time_ns, None)
    assert no_library.link is not None and no_library.link._pump is None


@pytest.mark.skipif(not nativecallbacks.available(), reason=f"no C library: {nativecallbacks.load()[1]}")
def test_the_c_wait_for_room_returns_what_it_sent_stops_at_its_bound_and_names_a_peer_that_went() -> None:
    import ctypes
    import errno

    pump = nativecallbacks.loaded().gfp_pump_nogil
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    data = ctypes.create_string_buffer(os.urandom(4 << 20), 4 << 20)
    # a reader that takes it all: every byte sent in one call, well inside the bound
    got = bytearray()

    def read() -> None:
        while len(got) < len(data):
            got.extend(theirs.recv(1 << 16))
    reader = threading.Thread(target=read)
    reader.start()
    assert pump(ours.fileno(), ctypes.addressof(data), len(data), 10_000) == len(data)
    reader.join(10)
    assert bytes(got) == data.raw
    # no reader: it returns what the socket took, once its bound has passed (never earlier)
    t0 = time.monotonic()
    first = pump(ours.fileno(), ctypes.addressof(data), len(data), 50)
    took = time.monotonic() - t0
    assert 0 < first < len(data) and 0.05 <= took < 1.0, (first, took)
    assert pump(ours.fileno(), ctypes.addressof(data), len(data), 1) == 0  # full: nothing, at its bound
    assert pump(ours.fileno(), ctypes.addressof(data), 0, 100) == 0  # nothing to send: nothing done
    ours.close()
    theirs.close()
    # a peer that goes while it waits: -EPIPE as soon as it has gone, not 0 at the bound (a fresh socket filled
    # to the brim 64 KiB at a time: poll then says hang-up without room to write)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    while True:
        try:
            ours.send(b"x" * 65_536)
        except BlockingIOError:
            break
    threading.Timer(0.05, theirs.close).start()
    t0 = time.monotonic()
    assert pump(ours.fileno(), ctypes.addressof(data), len(data), 5_000) == -errno.EPIPE
    assert time.monotonic() - t0 < 2.0
    ours.close()


@pytest.mark.parametrize("sends", WAITS)
def test_a_drain_at_exit_delivers_what_is_buffered_to_a_reader_and_returns_at_its_bound_without_one(
        sends: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        link, peer, server = _connected(tmp, sends)
        data = os.urandom(6 << 20)
        assert link.put_parts(framing.cupti_buffer_parts(1, data), records=1)
        # no reader: it gives up at its bound, the frame still held
        t0 = time.monotonic()
        link.drain(0.1)
        assert 0.09 <= time.monotonic() - t0 < 1.0 and link.buffered > 4 << 20
        # a reader (a Python thread of this process: the drain's wait lets the GIL go) gets all of it
        reader, got = _reading(peer, link)
        link.drain(5.0)
        reader.join(10)
        assert link.buffered == 0
        assert _buffers(bytes(got)) == [data]
        link.close("test")
        peer.close()
        server.close()
