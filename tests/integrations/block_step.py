"""One training step of a patched model's block, shared by the CPU and GPU integration tests."""

from __future__ import annotations

import torch


def mlp_block_step(model, hidden: torch.Tensor, upstream: torch.Tensor) -> tuple:
    """Forward and backward of ``model``'s first layer's MLP block on ``hidden`` with gradient ``upstream``:
    ``(output, the input's gradient, every parameter's gradient by name)``."""
    block = model.model.layers[0].mlp
    x = hidden.clone().requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out  # MoE blocks of some versions return (out, router logits)
    out.backward(upstream)
    return out.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}
