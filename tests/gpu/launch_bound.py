"""A launch-bound training loop for the GPU tests: a small MLP's step plus 100 tiny ``add_``
launches, for ``seconds`` (argv[1]). Its kernels are microseconds long; the GPU waits on the
CPU's launches, which is where a CUDA graph helps most."""

from __future__ import annotations

import sys
import time

import torch


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 90.0
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256, device="cuda")
    tiny = torch.zeros(256, device="cuda")
    end = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < end:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
        for _ in range(100):
            tiny.add_(1.0)
        torch.cuda.synchronize()
        steps += 1
    print(f"launch_bound: {steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
