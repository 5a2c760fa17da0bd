"""Workloads that live through failure, for tests/gpu/test_live_failure_gpu.py (run as a child).

  python survive_workload.py SCENARIO SYNC_DIR

Scenarios: ``oom_torch``, ``oom_cupy``, ``oom_numba``, ``oom_jax_platform``, ``oom_jax_arena`` (allocate
4 GiB blocks until the framework raises, catch it, free half, allocate again, go on), and
``threads_nocache``, ``threads_async`` (four PyTorch threads allocating and freeing random sizes,
handing tensors to each other, so addresses move between threads).

At each quiet point the workload writes ``SYNC_DIR/<n>_<label>.json`` with the framework's own
figure of the device bytes it holds (``held``) and waits for ``SYNC_DIR/<n>_<label>.ack``: the test
reads the daemon's live view meanwhile, while this process still runs. It also sends a probe MARK
with the same figure, so the recording (the probe's tee) replays to it on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufootprint import probe

if not probe.status().get("started"):
    probe.start()  # before any framework: CUPTI must see the first allocation

GiB = 1 << 30
MiB = 1 << 20
BLOCK = 4 * GiB
SYNC = Path(sys.argv[2])
_step = [0]


def driver_used() -> int | None:
    """Device memory in use as the driver counts it (cuMemGetInfo: total - free), for the test's record."""
    try:
        from cuda.bindings import driver

        err, free, total = driver.cuMemGetInfo()
        return int(total) - int(free) if int(err) == 0 else None
    except Exception:  # noqa: BLE001 - no current context yet
        return None


def quiet_point(label: str, held: int, **extra: Any) -> None:
    """Tell the test what the framework holds, mark it for the recording, wait for the test's look."""
    extra.setdefault("driver_used", driver_used())
    _step[0] += 1
    name = f"{_step[0]:02d}_{label}"
    probe.mark(label, 0, framework_held_bytes=held)
    body = {"label": label, "held": held, "t": time.time(), "pid": os.getpid(), **extra}
    tmp = SYNC / f"{name}.tmp"
    tmp.write_text(json.dumps(body))
    tmp.rename(SYNC / f"{name}.json")
    deadline = time.monotonic() + 120
    while not (SYNC / f"{name}.ack").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no ack for {name}")
        time.sleep(0.01)


class Framework:
    """One framework's allocation, release and own figure of what it holds on the device."""

    name = ""
    def alloc(self, nbytes: int) -> Any: ...
    def held(self, blocks: list[Any]) -> int: ...
    def release_cache(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        return {}


class Torch(Framework):
    def __init__(self) -> None:
        import torch

        self.torch = torch
        torch.zeros(1, device="cuda")
        time.sleep(1.5)  # the probe attaches PyTorch's OOM observer at a heartbeat once CUDA is up

    def alloc(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")

    def held(self, blocks: list[Any]) -> int:
        self.torch.cuda.synchronize()
        return int(self.torch.cuda.memory_reserved())

    def release_cache(self) -> None:
        self.torch.cuda.empty_cache()


class Cupy(Framework):
    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.pool = cupy.get_default_memory_pool()
        cupy.zeros(1)

    def alloc(self, nbytes: int) -> Any:
        return self.cupy.empty(nbytes, dtype=self.cupy.uint8)

    def held(self, blocks: list[Any]) -> int:
        self.cupy.cuda.Device().synchronize()
        return int(self.pool.total_bytes())

    def release_cache(self) -> None:
        self.pool.free_all_blocks()


class Numba(Framework):
    """Numba's device arrays: one cuMemAlloc each, no pool, and no figure of its own for what it holds.
    Its arrays' sizes are not it: on the H200 (numba 0.68) 3 of 17 freed 4 GiB arrays, unreferenced
    and collected, stayed allocated (the driver counted them too). So the figure is the driver's:
    device memory in use (cuMemGetInfo) less what the context held before the first array."""

    def __init__(self) -> None:
        from numba import cuda

        self.cuda = cuda
        cuda.current_context()
        self.context_bytes = driver_used() or 0

    def alloc(self, nbytes: int) -> Any:
        return self.cuda.device_array(nbytes, dtype="u1")

    def held(self, blocks: list[Any]) -> int:
        self.cuda.synchronize()
        return (driver_used() or 0) - self.context_bytes

    def stats(self) -> dict[str, Any]:
        ctx = self.cuda.current_context()
        return {"pending_deallocs": len(getattr(ctx.deallocations, "_cons", ()))}

    def release_cache(self) -> None:
        import gc

        gc.collect()  # device arrays caught in reference cycles (seen on the H200: 3 of 17 stayed)
        self.cuda.current_context().deallocations.clear()  # Numba defers frees; make them now


class Jax(Framework):
    """JAX: ``platform`` (every buffer a cudaMalloc; its figure the arrays it holds) or its default
    arena without preallocation (the BFC pool; its figure ``memory_stats()["pool_bytes"]``)."""

    def __init__(self, arena: bool) -> None:
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp, self.arena = jax, jnp, arena
        self.dev = jax.devices()[0]

    def alloc(self, nbytes: int) -> Any:
        return self.jnp.zeros(nbytes, dtype=self.jnp.uint8).block_until_ready()

    def held(self, blocks: list[Any]) -> int:
        stats = self.dev.memory_stats() or {}
        if self.arena:
            return int(stats.get("pool_bytes", -1))
        return int(sum(b.nbytes for b in blocks))

    def stats(self) -> dict[str, Any]:
        return dict(self.dev.memory_stats() or {})

    def release_cache(self) -> None:
        pass


def survive_oom(fw: Framework) -> None:
    blocks: list[Any] = []
    quiet_point("baseline", fw.held(blocks), stats=fw.stats())
    failed_at = None
    error = ""
    for _ in range(64):
        try:
            blocks.append(fw.alloc(BLOCK))
        except Exception as exc:  # noqa: BLE001 - each framework's own OOM error (the test checks it was one)
            failed_at = time.time()
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
            break
    quiet_point("after_oom", fw.held(blocks), failed_at=failed_at, blocks=len(blocks), error=error, stats=fw.stats())
    # the program goes on: it frees half of what it holds and works again
    del blocks[: len(blocks) // 2]
    fw.release_cache()
    quiet_point("freed_half", fw.held(blocks), blocks=len(blocks), stats=fw.stats())
    blocks.append(fw.alloc(GiB))
    quiet_point("went_on", fw.held(blocks), blocks=len(blocks))
    del blocks
    fw.release_cache()
    quiet_point("end", fw.held([]), stats=fw.stats())


def threads(alloc: str) -> None:
    """Four threads allocate and free random sizes and hand tensors to each other; at each quiet point
    every thread has stopped and the tensors held are known."""
    import torch

    torch.zeros(1, device="cuda")
    lock = threading.Lock()
    shared: list[Any] = []
    calls = [0]

    def work(seed: int, seconds: float) -> None:
        rng = random.Random(seed)
        mine: list[Any] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if mine and rng.random() < 0.5:
                t = mine.pop(rng.randrange(len(mine)))
                if rng.random() < 0.3:
                    with lock:
                        shared.append(t)  # another thread frees it
                else:
                    del t
            elif rng.random() < 0.2:
                with lock:
                    t = shared.pop() if shared else None
                del t
            else:
                mine.append(torch.empty(rng.choice([512, 4096, 65536, 1 << 20, 3 << 20]) * rng.randint(1, 4),
                                        dtype=torch.uint8, device="cuda"))
            calls[0] += 1
        with lock:
            shared.extend(mine[: len(mine) // 2])

    def figure() -> int:
        torch.cuda.synchronize()
        if alloc == "async":
            return int(torch.cuda.memory_allocated())
        return int(sum(t.numel() for t in shared))  # caching off: every tensor is its own cudaMalloc

    seconds = float(os.environ.get("SURVIVE_THREAD_SECONDS", "3"))
    for rnd in range(3):
        ts = [threading.Thread(target=work, args=(rnd * 10 + i, seconds)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        quiet_point(f"round_{rnd}", figure(), calls=calls[0], tensors=len(shared))
    shared.clear()
    torch.cuda.synchronize()
    quiet_point("end", figure(), calls=calls[0])


SCENARIOS: dict[str, Callable[[], None]] = {
    "oom_torch": lambda: survive_oom(Torch()),
    "oom_cupy": lambda: survive_oom(Cupy()),
    "oom_numba": lambda: survive_oom(Numba()),
    "oom_jax_platform": lambda: survive_oom(Jax(arena=False)),
    "oom_jax_arena": lambda: survive_oom(Jax(arena=True)),
    "threads_nocache": lambda: threads("nocache"),
    "threads_async": lambda: threads("async"),
}


def main() -> int:
    dump_after = os.environ.get("WORKLOAD_DUMP_AFTER")
    if dump_after:  # every thread's stack once the workload has run this long (a stall's where)
        import faulthandler

        out = os.environ.get("GPUFOOTPRINT_GPU_OUT") or str(SYNC)
        faulthandler.dump_traceback_later(float(dump_after), exit=False,
                                          file=open(os.path.join(out, f"workload_stacks_{sys.argv[1]}.txt"), "w"))  # noqa: SIM115 - dumped into at exit
    SCENARIOS[sys.argv[1]]()
    cur = probe.current()
    print(json.dumps({"probe": cur.status() if cur is not None else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
