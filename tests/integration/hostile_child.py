"""A hostile local process for the fair-share tests: run as another uid beside an honest probe.

  python hostile_child.py SOCKET ATTACK [ARG ...]

With HOSTILE_UID set it becomes that user first (the test runs as root). It mounts one attack, prints ``ready`` once the attack is in place, then holds what it took (and
takes back what the daemon closes) until its stdin closes. Attacks:

  connections N        N connections, each after its HELLO idle; closed ones are opened again
  strings F MIB        F STRINGS frames of MIB MiB each of empty kernel names, on one connection
  open_resyncs N R     N connections each inside a resync of R allocations that never ends
  resyncs P R          P processes each completing a resync of R allocations, then idle
  devices P D          P processes each opening D device tables (one allocation each)
  allocations P R      P processes each holding R live allocations
  buffer F MIB         F CUPTI_BUFFER frames of MIB MiB mixing memory and copy records (another pid's)
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "daemon"))

import numpy as np
from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp, RecordKind
from gpufootprint.wire import cupti_layout as cl
from gpufootprint.wire.framing import (
    PREAMBLE,
    FrameType,
    encode,
    encode_batch,
    encode_cupti_buffer,
    encode_json,
    encode_watermark,
)


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": os.getpid(), "start_time": 3}))
    return s


def allocations(n: int, *, dev: int = 0, base: int = 0x7000_0000) -> np.ndarray:
    recs = np.zeros(n, MEMORY_DTYPE)
    recs["ts"] = time.time_ns() + np.arange(n)
    recs["addr"] = base + np.arange(n, dtype=np.uint64) * 4096
    recs["bytes"] = 4096
    recs["pid"], recs["dev"], recs["op"], recs["mk"] = os.getpid(), dev, MemoryOp.ALLOCATION, MemoryKind.DEVICE
    return recs


def mixed_buffer(mib: int) -> bytes:
    """A CUPTI buffer of MEMORY2 and MEMCPY records alternating (no run of one kind to view in place)."""
    m, c = cl.RAW_DTYPES[cl.MEMORY2].itemsize, cl.RAW_DTYPES[cl.MEMCPY].itemsize
    n = mib * (1 << 20) // (m + c)
    now = time.time_ns()
    mem = np.zeros(n, cl.RAW_DTYPES[cl.MEMORY2])
    mem["op"], mem["mk"], mem["bytes"] = 1, 3, 4096
    mem["address"] = 0x7000_0000 + np.arange(n, dtype=np.uint64) * 4096
    mem["timestamp"] = now + np.arange(n, dtype=np.uint64)
    cpy = np.zeros(n, cl.RAW_DTYPES[cl.MEMCPY])
    cpy["bytes"], cpy["start"] = 64, now + np.arange(n, dtype=np.uint64)
    cpy["end"] = cpy["start"] + np.uint64(10)
    pair = np.zeros((n, m + c), np.uint8)
    pair[:, :m] = mem.view(np.uint8).reshape(n, m)
    pair[:, m:] = cpy.view(np.uint8).reshape(n, c)
    pair[:, 0:4] = np.frombuffer(np.int32(cl.MEMORY2).tobytes(), np.uint8)
    pair[:, m:m + 4] = np.frombuffer(np.int32(cl.MEMCPY).tobytes(), np.uint8)
    return pair.tobytes()


def closed(s: socket.socket) -> bool:
    if s.fileno() < 0:
        return True
    s.setblocking(False)
    try:
        data = s.recv(65536)
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)
    return data == b""


def hold(socks: list[socket.socket], path: str, reopen: bool = False) -> None:
    """Print ready, then keep the connections (opening closed ones again) until stdin closes."""
    print("ready", len(socks), flush=True)
    while True:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0.1)
        if readable and os.read(sys.stdin.fileno(), 4096) == b"":
            return
        if reopen:
            for i, s in enumerate(socks):
                if closed(s):
                    s.close()
                    try:
                        socks[i] = connect(path)
                    except OSError:
                        pass


def in_children(p: int, work) -> None:  # type: ignore[no-untyped-def]
    """Run ``work`` in ``p`` processes (each its own pid, so its own process share); each holds its
    connection until the parent's stdin closes."""
    kids = []
    for _ in range(p):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            s = work()
            os.write(w, b"x")
            while s.fileno() >= 0:  # holds its connection until the parent kills it
                time.sleep(1)
            os._exit(0)
        os.close(w)
        os.read(r, 1)
        kids.append(pid)
    try:
        hold([], "")
    finally:
        for pid in kids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def main() -> None:
    path, attack, args = sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3:]]
    uid = int(os.environ.get("HOSTILE_UID", "-1"))
    if uid >= 0:
        # Started as root (the interpreter lives where only root may read), it becomes another user
        # before it opens the socket: the daemon sees that uid through SO_PEERCRED.
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if attack == "connections":
        socks = []
        for _ in range(args[0]):
            try:
                socks.append(connect(path))
            except OSError:
                break
        time.sleep(0.5)
        hold(socks, path, reopen=True)
    elif attack == "metadata":
        # processes each holding fields up to its own bound (HELLO, then META after META): together
        # past the node's metadata total
        def fields() -> socket.socket:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            pad = {"x": "y" * (args[1] // 2)}
            s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": os.getpid(), "start_time": 3, "pad": pad}))
            for i in range(4):
                s.sendall(encode_json(FrameType.META, {"pid": os.getpid(), f"m{i}": {"x": "z" * (args[1] // 4)}}))
            return s

        in_children(args[0], fields)
    elif attack == "churn":
        # processes one after another, each with a footprint of its own, each gone at once (a job that
        # starts workers by the thousand): exited processes the daemon keeps for their grace period
        for _ in range(args[0]):
            pid = os.fork()
            if pid == 0:
                s = connect(path)
                s.sendall(encode_batch(RecordKind.MEMORY, allocations(4)) + encode_watermark(time.time_ns()))
                time.sleep(0.05)
                s.close()
                os._exit(0)
            os.waitpid(pid, 0)
        hold([], path)
    elif attack == "strings":
        s = connect(path)
        per = args[1] * (1 << 20) // 14  # '"12345678":"",' is 14 bytes at most
        for f in range(args[0]):
            body = b"{" + b",".join(b'"%d":""' % (f * per + i) for i in range(per)) + b"}"
            assert len(body) <= args[1] * (1 << 20)
            s.sendall(encode(FrameType.STRINGS, body))
        hold([s], path)
    elif attack == "open_resyncs":
        socks = []
        for i in range(args[0]):
            s = connect(path)
            s.sendall(encode_json(FrameType.RESYNC_BEGIN, {"ts": time.time_ns()})
                      + encode_batch(RecordKind.MEMORY, allocations(args[1], base=0x1_0000_0000 * (i + 1))))
            socks.append(s)
        hold(socks, path)
    elif attack == "resyncs":
        def resync() -> socket.socket:
            s = connect(path)
            s.sendall(encode_json(FrameType.RESYNC_BEGIN, {"ts": time.time_ns()})
                      + encode_batch(RecordKind.MEMORY, allocations(args[1]))
                      + encode_json(FrameType.RESYNC_END, {}))
            return s
        in_children(args[0], resync)
    elif attack == "devices":
        def devices() -> socket.socket:
            s = connect(path)
            recs = allocations(args[1])
            recs["dev"] = np.arange(args[1])
            s.sendall(encode_batch(RecordKind.MEMORY, recs))
            return s
        in_children(args[0], devices)
    elif attack == "allocations":
        def live() -> socket.socket:
            s = connect(path)
            s.sendall(encode_batch(RecordKind.MEMORY, allocations(args[1])))
            return s
        in_children(args[0], live)
    elif attack == "buffer":
        s = connect(path)
        for _ in range(args[0]):
            # Records of another pid: decoded whole, then dropped (pid_mismatch), so what the daemon
            # takes for them is the decoding alone.
            s.sendall(encode_cupti_buffer(os.getpid() + 1, mixed_buffer(args[1])))
        s.sendall(encode_batch(RecordKind.MEMORY, allocations(1)))  # its own: says all came through
        hold([s], path)
    else:
        raise SystemExit(f"unknown attack {attack}")


if __name__ == "__main__":
    main()
