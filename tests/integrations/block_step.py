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


def generate_logits_error(original, patched, prompt, cache: str, new_tokens: int = 5) -> float:
    """Greedy ``generate()`` on the patched model with a ``cache`` ("static": allocated at its full length, the
    unused slots empty; "dynamic": grown per step): the relative error of every step's logits against the
    unpatched model's full forward over the same tokens."""
    import torch

    out = patched.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                           cache_implementation=cache)  # fmt: skip
    logits = torch.stack(out.logits, dim=1).double()
    with torch.no_grad():
        want = original(input_ids=out.sequences[:, :-1]).logits[:, prompt.shape[1] - 1 :].double()
    return ((logits - want).norm() / want.norm()).item()
