"""The native framing: one byte stream for files and sockets alike.

A stream is an 8-byte preamble followed by frames. Each frame is a fixed 12-byte
header ``<u32 payload length, u8 frame type, u8 flags, u16 tag, u32 crc32>`` and
its payload; the CRC covers the first 8 header bytes and the payload, so a
damaged file is caught at the damaged frame instead of replaying wrong numbers.
Wire version 1 (no CRC, 8-byte header) is still read, for old recordings.
Record batches carry a ``RecordKind`` in ``tag`` and the packed records of that
kind as payload (``np.frombuffer`` decodes them); control-plane frames carry
JSON. A recorded file is exactly what a probe sends on its socket, so ``replay``
and the daemon run one decoder and one pipeline.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from gpufootprint.errors import FrameError
from gpufootprint.records import DTYPES, RecordKind
from gpufootprint.wire.checksum import crc32

WIRE_VERSION: Final = 2
READABLE_VERSIONS: Final = (1, 2)
PREAMBLE: Final = b"GPUFP" + bytes([WIRE_VERSION]) + b"\r\n"
_HEADER_V1: Final = struct.Struct("<IBBH")
_HEADER: Final = struct.Struct("<IBBHI")
HEADER_SIZE: Final = _HEADER.size
#: Frames longer than this are refused as corrupt (a probe batches far below it).
DEFAULT_MAX_PAYLOAD: Final = 16 * 1024 * 1024


class FrameType(enum.IntEnum):
    HELLO = 1  # probe -> daemon, JSON: who is speaking
    BATCH = 2  # records of kind ``tag``
    MARK = 3  # JSON: a synchronised point with the footprint it expects
    META = 4  # JSON: trace metadata (device, driver, scenario)
    HEARTBEAT = 5  # JSON: probe counters (sent, dropped, own memory)
    GOODBYE = 6  # JSON: clean exit, final counters
    CONTROL = 7  # daemon -> probe, JSON
    STRINGS = 8  # JSON {"id": "name"}: kernel names for KERNEL batches
    WATERMARK = 9  # u64 ns: every record with an earlier timestamp was sent
    RESYNC_BEGIN = 10  # JSON: the live allocation table follows as MEMORY batches
    RESYNC_END = 11
    # JSON {"ts", "pid", "devices": {dev: {kind: [bytes, allocations]}}}: the probe's own live
    # table as of the WATERMARK ``ts`` just sent, for the daemon to check its footprint against.
    TOTALS = 12
    # u32 pid, u32 reserved, then the valid bytes of one CUPTI activity buffer as CUPTI wrote them
    # (memory and pool records only): the daemon reads the records, so the workload's process does not.
    CUPTI_BUFFER = 13


# The decoder's own scanner (the C one where built), as json.loads uses it; typeshed leaves it out.
_SCAN: Final[Callable[[str, int], tuple[Any, int]]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _plain_object(payload: bytes) -> dict[str, Any] | None:
    """What probes send (UTF-8, one object, nothing around it), read by the C scanner alone; None for
    anything else, which ``json.loads`` then reads (or explains). ``json.loads`` would first guess the
    encoding and match whitespace in Python: a few microseconds of every control frame."""
    if payload[:1] != b"{" or payload[-1:] != b"}":
        return None
    try:
        text = payload.decode()
        obj, end = _SCAN(text, 0)
    except (StopIteration, ValueError, RecursionError):  # ValueError: UnicodeDecodeError and JSONDecodeError too
        return None
    return obj if end == len(text) and isinstance(obj, dict) else None


#: Frame types and record kinds by wire value: a dict lookup, not an enum call, for every frame read.
_FRAME_TYPES: Final[dict[int, FrameType]] = {t.value: t for t in FrameType}
RECORD_KINDS: Final[dict[int, RecordKind]] = {k.value: k for k in RecordKind}


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    tag: int
    payload: bytes
    offset: int  # byte offset of the frame header in the stream, for errors

    def json(self) -> dict[str, Any]:
        payload = self.payload
        obj = _plain_object(payload)
        if obj is not None:
            return obj
        try:
            value = json.loads(payload)
        # ValueError also where Python cannot build what the JSON says (an integer past its 4,300 digits),
        # RecursionError where it nests too deep: both hostile input, refused as the frame's damage.
        except (ValueError, RecursionError) as exc:
            raise FrameError(f"byte {self.offset}: {self.type.name} frame is not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise FrameError(f"byte {self.offset}: {self.type.name} frame is not a JSON object")
        return value

    def records(self) -> np.ndarray:
        kind = RECORD_KINDS.get(self.tag)
        if kind is None:
            raise FrameError(f"byte {self.offset}: unknown record kind {self.tag}")
        dtype = DTYPES[kind]
        if len(self.payload) % dtype.itemsize:
            raise FrameError(
                f"byte {self.offset}: {kind.name} batch of {len(self.payload)} bytes "
                f"is not a multiple of the record size {dtype.itemsize}"
            )
        return np.frombuffer(self.payload, dtype=dtype)

    def watermark(self) -> int:
        if len(self.payload) != 8:
            raise FrameError(f"byte {self.offset}: WATERMARK frame needs 8 bytes, got {len(self.payload)}")
        return int.from_bytes(self.payload, "little")


# --- encoding -----------------------------------------------------------------


def encode(frame_type: FrameType, payload: bytes = b"", tag: int = 0) -> bytes:
    head = _HEADER_V1.pack(len(payload), frame_type, 0, tag)
    return head + crc32(payload, crc32(head)).to_bytes(4, "little") + payload


def encode_json(frame_type: FrameType, obj: dict[str, Any]) -> bytes:
    return encode(frame_type, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def encode_batch(kind: RecordKind, records: np.ndarray) -> bytes:
    if records.dtype != DTYPES[kind]:
        raise TypeError(f"{kind.name} batch needs dtype {DTYPES[kind]}, got {records.dtype}")
    return encode(FrameType.BATCH, records.tobytes(), tag=kind)


_RAW_HEAD: Final = struct.Struct("<II")


def encode_cupti_buffer(pid: int, data: bytes | memoryview, *, checked: bool = True) -> bytes:
    """A CUPTI buffer's valid bytes, unread, for the daemon to decode (``FrameType.CUPTI_BUFFER``)."""
    head, body = cupti_buffer_parts(pid, data, checked=checked)
    return head + bytes(body)


def cupti_buffer_parts(pid: int, data: bytes | memoryview, *, checked: bool = True) -> tuple[bytes, bytes | memoryview]:
    """``encode_cupti_buffer`` in two parts, the frame's first 20 bytes and ``data`` itself, for a sink
    that copies them straight into its own buffer (``SocketLink.put_parts``): the buffer is copied
    once in the workload's process instead of three times.

    ``checked=False``: no checksum (``UNCHECKED`` in the flags, 0 in its place), only for a daemon
    that said it takes such frames (``CUPTI_BUFFERS_UNCHECKED``)."""
    raw_head = _RAW_HEAD.pack(pid & 0xFFFFFFFF, 0)
    if not checked:
        head = _HEADER_V1.pack(len(raw_head) + len(data), FrameType.CUPTI_BUFFER, UNCHECKED, 0)
        return head + b"\0\0\0\0" + raw_head, data
    head = _HEADER_V1.pack(len(raw_head) + len(data), FrameType.CUPTI_BUFFER, 0, 0)
    crc = crc32(data, crc32(raw_head, crc32(head)))
    return head + crc.to_bytes(4, "little") + raw_head, data


def cupti_buffer(frame: Frame) -> tuple[int, memoryview]:
    """(pid, the buffer's bytes) of a ``CUPTI_BUFFER`` frame."""
    if len(frame.payload) < _RAW_HEAD.size:
        raise FrameError(f"byte {frame.offset}: CUPTI_BUFFER frame shorter than its 8-byte header")
    pid, _ = _RAW_HEAD.unpack_from(frame.payload)
    return pid, memoryview(frame.payload)[_RAW_HEAD.size:]


#: The forwarded-buffer level this code reads and writes: 3, CUPTI_BUFFER frames may hold DRIVER and
#: RUNTIME API records and may come without a checksum (2: the same, always checked; 1: DRIVER only,
#: what probes and daemons before RUNTIME records know). Levels are cumulative.
CUPTI_BUFFERS_LEVEL: Final = 3
#: The level from which a probe may leave its CUPTI_BUFFER frames unchecked (the daemon said so).
CUPTI_BUFFERS_UNCHECKED: Final = 3
#: Frame flag: the frame carries no checksum (0 in its place). Only CUPTI_BUFFER frames on a probe's
#: socket, and only where the decoder allows it: a checksum finds damage in a file at rest; the bytes
#: of a local socket arrive as written (the kernel copies them), and the CRC of a 64 KiB buffer cost
#: about 12 us in the workload's process and again in the daemon's, per buffer.
UNCHECKED: Final = 0x01


def cupti_buffers_level(body: dict[str, Any]) -> int:
    """The forwarded-buffer level a HELLO or a verify CONTROL names (``"cupti_buffers"``): which API
    records a CUPTI_BUFFER frame may hold (1: DRIVER; 2: DRIVER and RUNTIME). 0 when it names none
    or not a positive integer; levels are cumulative, so a higher one includes the lower."""
    level = body.get("cupti_buffers")
    return level if isinstance(level, int) and not isinstance(level, bool) and level > 0 else 0


def encode_watermark(ts_ns: int) -> bytes:
    return encode(FrameType.WATERMARK, int(ts_ns).to_bytes(8, "little"))


# --- decoding -----------------------------------------------------------------


_NEW = object.__new__
_SET_TYPE, _SET_TAG, _SET_PAYLOAD, _SET_OFFSET = (Frame.__dict__[name].__set__
                                                  for name in ("type", "tag", "payload", "offset"))


def _decoded(ftype: FrameType, tag: int, payload: bytes, offset: int) -> Frame:
    """``Frame(ftype, tag, payload, offset)`` for the decoder's loop: its four slots set through their
    descriptors, as the frozen dataclass's ``__init__`` sets them through ``object.__setattr__`` one by
    one (about 0.4 of 1 us a frame; a replay decodes one frame a record batch, watermark, mark, ...)."""
    frame: Frame = _NEW(Frame)
    _SET_TYPE(frame, ftype)
    _SET_TAG(frame, tag)
    _SET_PAYLOAD(frame, payload)
    _SET_OFFSET(frame, offset)
    return frame


class FrameDecoder:
    """Incremental decoder: feed it bytes as they come, get whole frames back.

    The first bytes must be the preamble. A bad preamble, an unknown frame type or
    an absurd length raises ``FrameError`` naming the byte offset; the frames
    decoded before it have already been returned, so nothing before the damage
    is lost.
    """

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD, *, unchecked: frozenset[FrameType] = frozenset()) -> None:
        """``unchecked``: frame types that may come without a checksum (``UNCHECKED``): a daemon's probe
        connections allow CUPTI_BUFFER; files and every other frame are always checked."""
        self.error: FrameError | None = None  # set once the stream is broken
        self._unchecked = unchecked
        self._buf = bytearray()
        self._pos = 0  # stream offset of self._buf[0]
        self._preamble_seen = False
        self._max_payload = max_payload
        self.version = WIRE_VERSION
        self._scan_at = 0  # where ``_frames_in`` got to in the bytes it reads

    @property
    def offset(self) -> int:
        """Bytes of the stream consumed so far (whole frames only)."""
        return self._pos

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a whole frame."""
        return len(self._buf)

    @property
    def between_frames(self) -> bool:
        """The preamble read, no error, and no bytes held: the next byte begins a frame."""
        return self._preamble_seen and self.error is None and not self._buf

    def read_whole(self, read: Callable[[int], bytes]) -> Generator[Frame, None, bytes]:
        """The frames that ``read`` (a file's) gives from this decoder's offset (``between_frames``), read
        one at a time: each header, then its payload straight into its own bytes (``feed`` copies each
        out of the piece it was given), checked as ``feed`` checks it.

        Stops at the end, or at anything ``feed`` would refuse or hold (a damaged frame, one cut short),
        and returns the bytes read of it, nothing moved past them: the reader feeds them (and what
        follows), and ``feed`` names the damage, or holds the cut for ``close``, in its own words."""
        if not self.between_frames:
            return b""
        checked = self.version >= 2
        header = _HEADER if checked else _HEADER_V1
        hsize, unpack = header.size, header.unpack
        types, limit, unchecked = _FRAME_TYPES, self._max_payload, self._unchecked
        while True:
            head = read(hsize)
            if len(head) < hsize:
                return head
            if checked:
                length, ftype, flags, tag, crc = unpack(head)
            else:
                length, ftype, flags, tag = unpack(head)
            frame_type = types.get(ftype)
            if frame_type is None or length > limit:  # refused before its payload is read
                return head
            payload = read(length)
            if len(payload) < length:
                return head + payload
            if checked:
                if flags & UNCHECKED:
                    if frame_type not in unchecked:
                        return head + payload
                elif crc32(payload, crc32(head[:8])) != crc:
                    return head + payload
            at = self._pos
            self._pos = at + hsize + length
            yield _decoded(frame_type, tag, payload, at)

    def feed(self, data: bytes) -> list[Frame]:
        """Whole frames in ``data`` (and what was left over before it).

        On damage, the frames before it are still returned and ``error`` is set;
        feeding a broken decoder again raises that error.
        """
        if self.error is not None:
            raise self.error
        frames: list[Frame] = []
        try:
            self._decode(data, frames)
        except FrameError as exc:
            self.error = exc
        return frames

    def _decode(self, data: bytes, frames: list[Frame]) -> None:
        # Whole frames are read straight out of ``data``; only what the pieces cut (the preamble, a
        # frame begun in an earlier piece, the tail of this one) is gathered in ``_buf``. Appending
        # every piece to ``_buf`` first copied the whole stream once more (a 1 MiB piece holds about
        # 30 frames of 4,096 records and leaves part of one over).
        view = memoryview(data)
        try:
            pos = 0
            while (self._buf or not self._preamble_seen) and pos < len(view):
                take = min(len(view), pos + self._missing())
                self._buf += view[pos:take]
                pos = take
                try:
                    self._decode_buffered(frames)
                except FrameError:
                    self._buf += view[pos:]  # a broken stream keeps what it was not read of, as before
                    raise
            if pos < len(view):
                self._scan_at = pos
                try:
                    self._frames_in(view, pos, self._pos - pos, frames)  # view[pos] is stream byte _pos
                finally:  # even when raising: the frames before the damage were consumed, the rest is left
                    at = self._scan_at
                    self._pos += at - pos
                    self._buf += view[at:]
        finally:
            view.release()

    def _missing(self) -> int:
        """Bytes that ``_buf`` still lacks to hold the preamble, a frame's header or its whole frame."""
        have = len(self._buf)
        if not self._preamble_seen:
            return max(1, len(PREAMBLE) - have)
        hsize = HEADER_SIZE if self.version >= 2 else _HEADER_V1.size
        if have < hsize:
            return hsize - have
        length: int = _HEADER_V1.unpack_from(self._buf, 0)[0]
        return max(1, hsize + length - have)

    def _decode_buffered(self, frames: list[Frame]) -> None:
        """The preamble and whole frames gathered in ``_buf``; what was consumed leaves it."""
        buf = self._buf
        at = 0
        if not self._preamble_seen:
            if len(buf) < len(PREAMBLE):
                # A prefix of the preamble of any version: its version byte (5) is judged once all of it came.
                part = bytes(buf)
                if not (PREAMBLE.startswith(part[:5]) and PREAMBLE[6:].startswith(part[6:])):
                    raise FrameError(f"byte 0: not a gpufootprint stream (bad preamble {part!r})")
                return
            head = bytes(buf[: len(PREAMBLE)])
            if head[:5] != PREAMBLE[:5] or head[6:] != PREAMBLE[6:]:
                raise FrameError(f"byte 0: not a gpufootprint stream (bad preamble {head!r})")
            if head[5] not in READABLE_VERSIONS:
                raise FrameError(f"byte 5: unsupported wire version {head[5]} (this build reads "
                                 f"{', '.join(map(str, READABLE_VERSIONS))})")
            self.version = head[5]
            self._preamble_seen = True
            at = len(PREAMBLE)
        view = memoryview(buf)  # payloads are copied once, out of the view (a bytearray slice would copy twice)
        self._scan_at = at
        try:
            self._frames_in(view, at, self._pos, frames)
        finally:
            at = self._scan_at
            view.release()
            # Drop what was consumed even when raising, so offsets stay true.
            del buf[:at]
            self._pos += at

    def _frames_in(self, view: memoryview, at: int, base: int, frames: list[Frame]) -> None:
        """Every whole frame in ``view`` from ``at`` (``view[0]`` is stream byte ``base``); ``_scan_at``
        follows the end of the last one, also when damage raises ``FrameError`` (naming its stream byte)."""
        n = len(view)
        checked = self.version >= 2
        hsize = HEADER_SIZE if checked else _HEADER_V1.size
        while n - at >= hsize:
            if checked:  # the checksum read with the header: one unpack a frame
                length, ftype, _flags, tag, crc = _HEADER.unpack_from(view, at)
            else:
                length, ftype, _flags, tag = _HEADER_V1.unpack_from(view, at)
            if length > self._max_payload:
                raise FrameError(
                    f"byte {base + at}: frame length {length} exceeds the limit {self._max_payload}"
                )
            frame_type = _FRAME_TYPES.get(ftype)
            if frame_type is None:
                raise FrameError(f"byte {base + at}: unknown frame type {ftype}")
            end = at + hsize + length
            if end > n:
                break
            payload = view[at + hsize : end].tobytes()
            if checked and _flags & UNCHECKED:
                if frame_type not in self._unchecked:
                    raise FrameError(f"byte {base + at}: a {frame_type.name} frame without a checksum, "
                                     f"which this stream does not allow")
            elif checked and crc32(payload, crc32(view[at : at + 8])) != crc:
                raise FrameError(f"byte {base + at}: checksum mismatch in a {frame_type.name} frame "
                                 f"of {length} bytes (damaged data)")
            frames.append(_decoded(frame_type, tag, payload, base + at))
            at = self._scan_at = end

    def close(self) -> None:
        """Call at end of stream: leftover bytes mean a truncated frame."""
        if self.error is not None:
            raise self.error
        if self._buf or not self._preamble_seen:
            where = self._pos
            if not self._preamble_seen:
                raise FrameError(f"byte {where}: stream ended before the preamble")
            raise FrameError(f"byte {where}: stream truncated inside a frame ({len(self._buf)} bytes left over)")


def iter_frames(chunks: Iterator[bytes], max_payload: int = DEFAULT_MAX_PAYLOAD) -> Iterator[Frame]:
    decoder = FrameDecoder(max_payload)
    for chunk in chunks:
        yield from decoder.feed(chunk)
        if decoder.error is not None:
            raise decoder.error
    decoder.close()
