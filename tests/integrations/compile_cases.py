"""A two-layer block for the torch.compile integration's tests: linear + bias, GELU, a scale and a residual, then a
linear without bias, SiLU and a bias-like vector; its float64 math is the same function. (Smooth activations: a ReLU
whose mask flips where bf16 rounds a value across zero moves its gradient by several percent in any bf16 run, torch's
own included.) And an MoE expert layer's shape over ``torch._grouped_mm``, with its float64 math."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block(x, w1, b1, r, w2, v):
    h = F.gelu(F.linear(x, w1, b1)) * 0.5 + r
    return F.silu(F.linear(h, w2)) + v


def block_leaves(tokens: tuple, device: str) -> dict[str, torch.Tensor]:
    d, hidden, out = 64, 136, 24

    def param(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(torch.bfloat16).requires_grad_()

    return {"x": param(*tokens, d), "w1": param(hidden, d, scale=d**-0.5), "b1": param(hidden),
            "r": param(*tokens, hidden), "w2": param(out, hidden, scale=hidden**-0.5), "v": param(out)}  # fmt: skip


def step_errors(compiled, leaves: dict[str, torch.Tensor], math=None) -> dict[str, float]:
    """Forward and backward of ``compiled`` on ``leaves`` (by parameter name) against float64 autograd of ``math``
    (default :func:`block`), from one random gradient of the output: relative errors, the output's and each leaf's."""
    y = compiled(**leaves)
    grad = torch.randn_like(y)
    y.backward(grad)
    ref = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    want = (math or block)(**ref)
    want.backward(grad.double())

    def rel(got, expected):
        return ((got.double() - expected).norm() / expected.norm()).item()

    return {"out": rel(y, want.detach())} | {name: rel(t.grad, ref[name].grad) for name, t in leaves.items()}


def experts(x, w, offs, weights):
    """The routed rows through their expert's weight (transformers' grouped_mm path), SiLU, times each row's router
    weight."""
    return F.silu(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)) * weights


def _experts64(x, w, offs: list[int], weights):
    starts = [0, *offs[:-1]]
    return F.silu(torch.cat([x[s:e] @ w[g].t() for g, (s, e) in enumerate(zip(starts, offs))])) * weights


def experts_errors(compiled, ends: list[int], device: str, k: int = 64, n: int = 40) -> dict[str, float]:
    """Forward and backward of ``compiled`` :func:`experts` against float64 autograd: relative errors."""
    leaves = {"x": torch.randn(ends[-1], k, device=device), "w": torch.randn(len(ends), n, k, device=device) * k**-0.5,
              "weights": torch.rand(ends[-1], 1, device=device)}  # fmt: skip
    leaves = {name: t.to(torch.bfloat16).requires_grad_() for name, t in leaves.items()}
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    y = compiled(leaves["x"], leaves["w"], offs, leaves["weights"])
    grad = torch.randn_like(y)
    y.backward(grad)
    ref = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    want = _experts64(ref["x"], ref["w"], ends, ref["weights"])
    want.backward(grad.double())

    def rel(got, expected):
        return ((got.double() - expected).norm() / expected.norm()).item()

    return {"out": rel(y, want.detach())} | {name: rel(t.grad, ref[name].grad) for name, t in leaves.items()}


def masked_sdpa(q, k, v, mask: str, repeat: str):
    """SDPA as GQA models feed it under torch.compile: keys and values widened to the query heads, a mask built
    from the sizes (transformers' causal mask, made explicit while compiling)."""
    b, h, n, d = k.shape
    rep = q.shape[1] // h
    if repeat == "repeat_kv":
        k, v = (t[:, :, None, :, :].expand(b, h, rep, n, d).reshape(b, h * rep, n, d) for t in (k, v))
    elif repeat == "repeat_interleave":
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    rows, cols = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    allowed = {"causal": cols <= rows, "everything": cols >= 0, "window": (cols <= rows) & (cols > rows - 8),
               "additive": cols <= rows}[mask]  # fmt: skip
    if mask == "additive":
        allowed = torch.zeros(n, n, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None].expand(b, 1, n, n)) * 2
