"""The transformer training step the GPU benches share (needs torch and a CUDA GPU).

6 encoder layers, d=1024, 16 heads, bf16, AdamW: ``bench/overhead.py``'s workload (a), and the model
``bench/torch_numbers_cost.py`` and ``bench/probe_start_stress.py`` read PyTorch's allocator on.
"""

from __future__ import annotations

from collections.abc import Callable


def transformer_step(batch: int = 16, seq: int = 512) -> Callable[[], None]:
    """One training step (forward, backward, optimizer step, gradients dropped) on a fixed input of
    ``batch`` x ``seq`` tokens; the model and its optimizer are built once, here."""
    import torch

    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 6).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, seq, 1024, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
