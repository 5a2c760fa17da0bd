"""The CUDA Graph advisor's three held-out training loops, for tests/gpu/test_graph_advice_gpu.py.

``python graph_workloads.py MODE SECONDS STEPLOG [STOPFILE]`` (it ends after SECONDS, or at the first step
after STOPFILE exists: a normal exit, so the probe's recording is complete):

* ``matmul``: ten 8192x8192 fp32 matmuls (PyTorch) and a synchronize per step (about 266 ms on the H200):
  few, long kernels, the case a graph costs nothing and the seed's policy captures;
* ``matmul2s``: the same matmuls, 75 a step (about 2 s: the longest step the advice promises to follow);
* ``tiny``: 96 tiny CuPy launches and a synchronize per step (about 2.6 ms): launch-bound, microsecond
  kernels (the seed's minimum mean kernel duration fails);
* ``transformer``: a training step of a 6-layer d=1024 bf16 encoder, batch 16x512, AdamW, ``loss.item()``
  (the bench's step, bench/overhead.py).

Each step's end (wall clock ns) and duration go to STEPLOG, one ``ns seconds`` line per step, so the
test can compare step times before and after a window (a lasting cost). "ready" is printed after the
warm-up steps, with a probe mark "warm" (and "steady_end" after the last step) in the recording.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def _matmul(per_step: int = 10) -> Callable[[], None]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(8192, 8192, device="cuda")
    b = torch.randn(8192, 8192, device="cuda")
    out = torch.empty(8192, 8192, device="cuda")

    def step() -> None:
        for _ in range(per_step):
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize()

    return step


def _matmul_2s() -> Callable[[], None]:
    """75 of the same matmuls a step: about 2 s, the longest step the advice promises to follow."""
    return _matmul(75)


def _tiny() -> Callable[[], None]:
    import cupy

    x = cupy.zeros(256, dtype=cupy.float32)
    dev = cupy.cuda.Device()

    def step() -> None:
        for _ in range(96):
            cupy.add(x, 1.0, out=x)  # one elementwise kernel each
        dev.synchronize()

    return step


def _transformer() -> Callable[[], None]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 6).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 512, 1024, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


MODES: dict[str, Callable[[], Callable[[], None]]] = {"matmul": _matmul, "matmul2s": _matmul_2s, "tiny": _tiny,
                                                     "transformer": _transformer}


def main() -> int:
    import os

    mode, seconds, steplog = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    stopfile = sys.argv[4] if len(sys.argv) > 4 else None
    step = MODES[mode]()
    from gpufootprint import probe  # marks for the recording (None when no probe runs)

    for _ in range(3):
        step()
    probe.mark("warm", 0, mode=mode)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    n = 0
    with open(steplog, "w", buffering=1 << 16) as log:
        while time.monotonic() < end and not (stopfile and os.path.exists(stopfile)):
            t0 = time.perf_counter()
            step()
            log.write(f"{time.time_ns()} {time.perf_counter() - t0:.6f}\n")
            n += 1
    probe.mark("steady_end", 0, mode=mode, steps=n)
    print(f"{mode}: {n} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
