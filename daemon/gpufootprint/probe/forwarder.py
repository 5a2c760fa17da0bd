"""The sender's side of the C forwarder (probe/native/cuptibuf.c, ``gfp_fwd_*``).

With the C buffer callbacks the sender thread still woke for every buffer CUPTI completed and, holding the
GIL, read it, framed it and queued the frame for its socket: about 80 us a 64 KiB buffer on the development
VM, about a hundred buffers a second under cudaMallocAsync, each in whatever step the program was in. A
forwarder is a thread of C on the buffer pool that does that per-buffer work while the sender says it may
(``set``): connected to a daemon that reads CUPTI's buffers unchecked, no launch window taking API records,
no failed allocation waiting to be judged, no tee. The sender then wakes for the forwarder's frames in bulk
(``swap``: what it framed since the last swap, with each frame's record count, and the MEMORY2 structs for
the probe's own table) and moves them behind what its link holds; a buffer the forwarder may not forward (a
kind the daemon does not read, an API call that failed, one its walk cannot read) it hands to the sender,
which reads it as before (``NativeDelivery.take``). Before a watermark or a mark the sender waits (``sync``)
until every buffer queued by then is dealt with, so its frames go ahead of what the sender sends next.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufootprint.probe.nativecallbacks import (
    _API_KINDS,
    _API_KINDS_AT,
    _COUNTED_MASK,
    _SIZES_AT,
    _WALK_SIZES,
    NativeDelivery,
    loaded,
)
from gpufootprint.wire import cupti_layout, framing

_INFO = 12  # gfp_fwd_swap's answer
_STATS = ("forwarded", "to_sender", "dropped", "alloc_failures", "cpu_ns", "handed_waiting", "lag", "bytes")
_MEMORY2 = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2]


@dataclass(frozen=True)
class Side:
    """What the forwarder framed since the last swap (its memory is the forwarder's until ``release``).

    ``frames``: the CUPTI_BUFFER frames back to back; ``ends`` and ``records``: each frame's end in ``frames``
    and the records the daemon counts in it; ``stale``: how many of the first frames were framed for an
    earlier connection (to be dropped); ``structs``: the MEMORY2 structs of every buffer read (sent or
    dropped); ``buffers``/``records``: every buffer read and its records; ``dropped_*``: those whose frame
    found no room (their structs are in ``structs``; ``dropped_max_ts``: the newest of them, 0 if none)."""

    frames: memoryview
    ends: np.ndarray
    records_per_frame: np.ndarray
    stale: int
    structs: np.ndarray
    buffers: int
    records: int
    dropped_buffers: int
    dropped_records: int
    dropped_max_ts: int


def _at(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B") if nbytes else memoryview(b"")


class Forwarder:
    """One pool's forwarder (its thread runs from construction to ``stop``)."""

    def __init__(self, delivery: NativeDelivery, pid: int, wake_bytes: int) -> None:
        lib = loaded()
        self._lib = lib
        self._delivery = delivery
        head = framing.cupti_buffer_parts(pid, b"", checked=False)[0]
        extra = len(head) - 12  # the payload's length counts the raw header (pid, flags) beside the buffer
        fields = _MEMORY2.fields
        assert fields is not None  # a structured dtype
        ts_offset = int(fields["timestamp"][1])
        fwd = lib.gfp_fwd_new_nogil(delivery.pool, _SIZES_AT, len(_WALK_SIZES), cupti_layout.MEMORY2, _API_KINDS_AT,
                                    len(_API_KINDS), cupti_layout.API_RET_OFFSET, _COUNTED_MASK, ts_offset, head,
                                    len(head), 0, extra, wake_bytes)
        if not fwd:
            raise OSError("gfp_fwd_new: the forwarder did not start (no memory or no thread)")
        self._fwd = ctypes.c_void_p(fwd)
        self._info = (ctypes.c_uint64 * _INFO)()
        self._stats = (ctypes.c_uint64 * len(_STATS))()
        self._held = False
        self.stopped = False
        delivery.forwarder = self._fwd

    def set(self, on: bool, forward_mask: int, room: int, epoch: int) -> None:
        """The sender's word at each wake: forward while ``on`` the buffers whose kinds are all in
        ``forward_mask``, into at most ``room`` bytes of frames; a new ``epoch`` (a new connection) makes what
        was framed so far stale. API records stay the sender's, whatever ``forward_mask`` says, while buffers it
        handed over wait to be taken, and from the moment it hands over a failed call until the sender's next word."""
        self._lib.gfp_fwd_set(self._fwd, int(on), forward_mask, max(0, room), epoch)

    def lag(self) -> int:
        """Buffers the pool queued that the forwarder has not dealt with yet."""
        return int(self._lib.gfp_fwd_lag(self._fwd))

    def sync(self, timeout_s: float) -> int:
        """Wait (the GIL let go) until every buffer queued by now is dealt with; returns how many were not."""
        if self.stopped or not self.lag():
            return 0
        return int(self._lib.gfp_fwd_sync_nogil(self._fwd, max(1, int(timeout_s * 1000))))

    def swap(self) -> Side | None:
        """The side the forwarder wrote since the last swap (None: nothing in it); ``release`` it once read."""
        if self._held:
            raise RuntimeError("Forwarder.swap: the side taken before was not released")
        info = self._info
        if int(self._lib.gfp_fwd_swap(self._fwd, info, _INFO)) != 0:
            return None
        self._held = True
        out, out_len, ledger, frames, structs, n_structs = (int(info[i]) for i in range(6))
        pairs = np.frombuffer(_at(ledger, frames * 16), np.uint64).reshape(frames, 2) if frames else \
            np.zeros((0, 2), np.uint64)
        return Side(frames=_at(out, out_len), ends=pairs[:, 0], records_per_frame=pairs[:, 1], stale=int(info[11]),
                    structs=np.frombuffer(_at(structs, n_structs * _MEMORY2.itemsize), _MEMORY2),
                    buffers=int(info[6]), records=int(info[7]), dropped_buffers=int(info[8]),
                    dropped_records=int(info[9]), dropped_max_ts=int(info[10]))

    def release(self) -> None:
        """The side taken by ``swap`` is read: back to the forwarder (its views must not be used after)."""
        if self._held:
            self._lib.gfp_fwd_release(self._fwd)
            self._held = False

    def stats(self) -> dict[str, int]:
        if not self._fwd:  # freed: what it last said
            return {name: int(v) for name, v in zip(_STATS, self._stats, strict=True)}
        self._lib.gfp_fwd_stats(self._fwd, self._stats, len(_STATS))
        return {name: int(v) for name, v in zip(_STATS, self._stats, strict=True)}

    def stop(self) -> list[tuple[int, int]]:
        """The thread stops (joined, the GIL let go) and the pool wakes the sender for every buffer again; returns
        the buffers handed over and not yet taken (the sender's to read). A side not yet swapped stays
        readable by ``swap``."""
        if self.stopped:
            return []
        self._lib.gfp_fwd_stop_nogil(self._fwd)
        self.stopped = True
        left = self._delivery.take()  # the forwarder's ring still (it is attached until this returns)
        self._delivery.forwarder = None
        return left

    def free(self) -> None:
        """After ``stop``, the side released: the forwarder's memory goes back (nothing of it may be used after)."""
        if self.stopped and not self._held and self._fwd:
            self._lib.gfp_fwd_free(self._fwd)
            self._fwd = ctypes.c_void_p(None)


def start(delivery: Any, pid: int, wake_bytes: int) -> Forwarder | None:
    """A forwarder on ``delivery``'s pool, or None where there is none to be had (Python callbacks, no thread)."""
    if not isinstance(delivery, NativeDelivery) or delivery.forwarder is not None:
        return None
    try:
        return Forwarder(delivery, pid, wake_bytes)
    except OSError:
        return None


@dataclass
class TakenIn:
    """What ``take_in`` moved: records sent (to the link), records dropped for want of a connection (``away``:
    frames of an earlier connection, or none now) or of room (``full``, their newest struct's time in
    ``full_max_ts``, 0 if they had none)."""

    sent: int = 0
    frames_sent: int = 0
    away: int = 0
    full: int = 0
    full_max_ts: int = 0


def take_in(side: Side, link: Any) -> TakenIn:
    """A swapped side's frames behind what ``link`` holds (``SocketLink.put_chunk``): the stale ones dropped."""
    out = TakenIn(full=side.dropped_records, full_max_ts=side.dropped_max_ts)
    n = len(side.ends)
    stale = min(side.stale, n)
    if stale:
        out.away += int(side.records_per_frame[:stale].sum())
    if stale < n:
        start = int(side.ends[stale - 1]) if stale else 0
        records = int(side.records_per_frame[stale:].sum())
        if link is not None and link.put_chunk(side.frames[start:], side.ends[stale:] - start,
                                               side.records_per_frame[stale:]):
            out.sent, out.frames_sent = records, n - stale
        else:
            out.away += records
    return out
