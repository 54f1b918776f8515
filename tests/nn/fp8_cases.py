"""fp8 training of a linear layer against float64 autograd of the same math (shared by the CPU and GPU tests)."""

from __future__ import annotations

import torch

from epicute.nn import fp8_linear

#: Each GEMM's inputs are rounded to e4m3 (3 mantissa bits: at most 2^-4 relative per value), so each product term
#: carries at most 2 * 2^-4 + 2^-8 relative error; the result's norm-wise error is at most that where the terms
#: share a sign and well below it for random ones (measured 2.5-3.7 %): 2^-3 bounds it.
TOL = 2.0**-3


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def errors(recipe: str, lead: tuple[int, ...], in_features: int, out_features: int, bias: bool, device: str):
    """Relative errors of y, dx, dw (and db) against float64 autograd of ``x @ w.T + b``."""
    x = torch.randn(*lead, in_features, device=device).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(out_features, in_features, device=device) * in_features**-0.5).to(torch.bfloat16)
    w.requires_grad_()
    b = torch.randn(out_features, device=device, dtype=torch.bfloat16, requires_grad=True) if bias else None
    upstream = torch.randn(*lead, out_features, device=device, dtype=torch.bfloat16)
    y = fp8_linear(x, w, b, recipe=recipe)
    y.backward(upstream)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, *((b,) if bias else ()))]
    want = leaves[0] @ leaves[1].t() + (leaves[2] if bias else 0)
    want.backward(upstream.double())
    found = {"y": rel(y.detach(), want.detach()), "dx": rel(x.grad, leaves[0].grad), "dw": rel(w.grad, leaves[1].grad)}
    if bias:
        found["db"] = rel(b.grad, leaves[2].grad)
    assert y.dtype == x.dtype and x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    return found


def gated_errors(recipe: str, tokens: int, d: int, hidden: int, device: str,
                 compiled: bool = False) -> dict[str, float]:  # fmt: skip
    """Relative errors of y, dx and both weights' gradients of :func:`epicute.nn.fp8_gated_mlp` (SwiGLU) against
    float64 autograd of ``(silu(x w_gate^T) * (x w_up^T)) w_down^T``. Each GEMM rounds its inputs to e4m3 as
    fp8_linear's do, and h and the gradients between the GEMMs are bf16: :data:`TOL` bounds it as it does there.
    ``compiled``: the call under ``torch.compile(dynamic=True)`` (the ops' fake implementations trace it, sizes
    symbolic)."""
    from epicute import interleave_gate_up
    from epicute.nn import fp8_gated_mlp

    x = torch.randn(tokens, d, device=device).to(torch.bfloat16).requires_grad_()
    w_gate, w_up = ((torch.randn(hidden, d, device=device) * d**-0.5).to(torch.bfloat16) for _ in range(2))
    w_down = (torch.randn(d, hidden, device=device) * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    w_gate_up = interleave_gate_up(w_gate, w_up).requires_grad_()
    upstream = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
    mlp = torch.compile(fp8_gated_mlp, dynamic=True, fullgraph=True) if compiled else fp8_gated_mlp
    y = mlp(x, w_gate_up, w_down, recipe=recipe)
    y.backward(upstream)
    x64, g64, u64, d64 = (t.detach().double().requires_grad_() for t in (x, w_gate, w_up, w_down))
    want = (torch.nn.functional.silu(x64 @ g64.t()) * (x64 @ u64.t())) @ d64.t()
    want.backward(upstream.double())
    want_gate_up = interleave_gate_up(g64.grad, u64.grad)
    assert y.dtype == x.dtype and w_gate_up.grad.dtype == w_gate_up.dtype
    return {"y": rel(y.detach(), want.detach()), "dx": rel(x.grad, x64.grad),
            "dw_gate_up": rel(w_gate_up.grad, want_gate_up), "dw_down": rel(w_down.grad, d64.grad)}  # fmt: skip


def moe_errors(tokens: int, experts: int, hidden: int, intermediate: int, top_k: int, device: str,
               skip_expert: bool = True, compiled: bool = False) -> dict[str, float]:  # fmt: skip
    """Relative errors of the output and every gradient (x, gate_up, down_proj, top_k_weights) of
    :func:`epicute.nn.fp8_moe_experts` (SwiGLU experts, top-k routing) against float64 autograd of
    ``sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)``. ``skip_expert``: no token routes to the last expert
    (an empty group in every GEMM). Each GEMM rounds its inputs to e4m3: :data:`TOL` bounds it as for the MLP.
    ``compiled``: under ``torch.compile(dynamic=True)``."""
    from epicute import interleave_gate_up
    from epicute.nn import fp8_moe_experts

    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16).requires_grad_()
    gate, up = ((torch.randn(experts, intermediate, hidden, device=device) * hidden**-0.5).to(torch.bfloat16)
                for _ in range(2))  # fmt: skip
    down = (torch.randn(experts, hidden, intermediate, device=device) * intermediate**-0.5).to(torch.bfloat16)
    down.requires_grad_()
    gate_up = interleave_gate_up(gate, up).requires_grad_()
    used = experts - 1 if skip_expert else experts
    logits = torch.randn(tokens, used, device=device)
    weights, index = torch.softmax(logits, -1).topk(top_k, dim=-1)
    weights = weights.requires_grad_()
    upstream = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    experts_fn = torch.compile(fp8_moe_experts, dynamic=True, fullgraph=True) if compiled else fp8_moe_experts
    y = experts_fn(x, gate_up, down, index, weights)
    y.backward(upstream)
    x64, g64, u64, d64, w64 = (t.detach().double().requires_grad_() for t in (x, gate, up, down, weights))
    want = torch.zeros(tokens, hidden, dtype=torch.float64, device=device)
    for j in range(top_k):
        e = index[:, j]
        h = torch.nn.functional.silu(torch.einsum("th,tih->ti", x64, g64[e])) * torch.einsum("th,tih->ti", x64, u64[e])
        want = want + w64[:, j : j + 1] * torch.einsum("ti,thi->th", h, d64[e])
    want.backward(upstream.double())
    assert y.dtype == x.dtype and gate_up.grad.dtype == gate_up.dtype and down.grad.dtype == down.dtype
    return {"y": rel(y.detach(), want.detach()), "dx": rel(x.grad, x64.grad),
            "d_gate_up": rel(gate_up.grad, interleave_gate_up(g64.grad, u64.grad)), "d_down": rel(down.grad, d64.grad),
            "d_weights": rel(weights.grad, w64.grad)}  # fmt: skip
