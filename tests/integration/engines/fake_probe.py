"""A stand-in probe process: connects to the daemon's socket like the real probe,
sends a HELLO, allocations and a kernel window, then prints every CONTROL frame
it receives as a JSON line until it has ``want`` of them or times out."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy as np
from gpufootprint.records import KERNEL_DTYPE, MEMORY_DTYPE, RecordKind
from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, FrameType, encode_batch, encode_json, encode_watermark


def main(path: str, want: int, alloc_bytes: int) -> int:
    pid = os.getpid()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    t0 = time.time_ns() - 3_000_000_000  # well behind the daemon's reorder window
    mem = np.zeros(1, MEMORY_DTYPE)
    mem["ts"], mem["op"], mem["addr"], mem["bytes"], mem["mk"], mem["pid"] = t0, 1, 0x7000_0000, alloc_bytes, 3, pid
    k = np.zeros(60, KERNEL_DTYPE)
    k["start"] = t0 + np.arange(60) * 1_000_000
    k["end"] = k["start"] + 800_000
    k["pid"], k["stream"], k["name_id"] = pid, 7, np.arange(60) % 12
    sock.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": 1}) +
                 encode_batch(RecordKind.MEMORY, mem) + encode_batch(RecordKind.KERNEL, k) +
                 encode_watermark(t0 + 100_000_000))
    decoder = FrameDecoder()
    got = 0
    sock.settimeout(0.5)
    deadline = time.monotonic() + 20
    while got < want and time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        if not data:
            break
        for frame in decoder.feed(PREAMBLE + data if decoder.offset == 0 and not decoder.pending else data):
            if frame.type is FrameType.CONTROL:
                print(json.dumps(frame.json()), flush=True)
                got += 1
    sock.sendall(encode_json(FrameType.GOODBYE, {"ts": time.time_ns(), "counters": {}}))
    sock.close()
    return 0 if got >= want else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
