"""The functional layers' calls and their float64 torch math, shared by the CPU and GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import epicute
from epicute.nn import functional as EF

BF16 = torch.bfloat16


def _param(*shape, device, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=BF16) * scale).requires_grad_()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def check_step(run, math, leaves: dict[str, torch.Tensor]) -> dict[str, float]:
    """``run()`` forward and backward against float64 autograd of ``math(**leaves)``: relative errors of the output
    and of every leaf's gradient."""
    y = run()
    grad = torch.randn_like(y)
    y.backward(grad)
    ref_leaves = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    ref = math(**ref_leaves)
    ref.backward(grad.double())
    errors = {"out": rel(y, ref.detach())}
    errors |= {name: rel(t.grad, ref_leaves[name].grad) for name, t in leaves.items()}
    return errors


def mlp_step(tokens: tuple, d: int, hidden: int, device: str, activation: str, bias: bool):
    x = _param(*tokens, d, device=device)
    w1, w2 = _param(hidden, d, device=device, scale=d**-0.5), _param(d, hidden, device=device, scale=hidden**-0.5)
    b1, b2 = (_param(hidden, device=device), _param(d, device=device)) if bias else (None, None)
    act = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
    leaves = {"x": x, "w1": w1, "w2": w2, **({"b1": b1, "b2": b2} if bias else {})}

    def math(x, w1, w2, b1=None, b2=None):
        return F.linear(act[activation](F.linear(x, w1, b1)), w2, b2)

    return check_step(lambda: EF.mlp(x, w1, b1, w2, b2, activation=activation), math, leaves)


def gated_mlp_step(tokens: tuple, d: int, hidden: int, device: str, activation: str):
    x = _param(*tokens, d, device=device)
    w_gate, w_up = _param(hidden, d, device=device, scale=d**-0.5), _param(hidden, d, device=device, scale=d**-0.5)
    w_down = _param(d, hidden, device=device, scale=hidden**-0.5)
    w13 = epicute.interleave_gate_up(w_gate.detach(), w_up.detach()).requires_grad_()
    act = {"gelu": F.gelu, "silu": F.silu}[activation]
    y = EF.gated_mlp(x, w13, w_down, activation=activation)
    grad = torch.randn_like(y)
    y.backward(grad)
    x64, g64, u64, d64 = (t.detach().double().requires_grad_() for t in (x, w_gate, w_up, w_down))
    ref = F.linear(act(F.linear(x64, g64)) * F.linear(x64, u64), d64)
    ref.backward(grad.double())
    return {
        "out": rel(y, ref.detach()), "x": rel(x.grad, x64.grad), "w_down": rel(w_down.grad, d64.grad),
        "w_gate_up": rel(w13.grad, epicute.interleave_gate_up(g64.grad, u64.grad)),
    }  # fmt: skip


def linear_step(tokens: tuple, d: int, out: int, device: str):
    x, w = _param(*tokens, d, device=device), _param(out, d, device=device, scale=d**-0.5)
    b = _param(out, device=device)
    residual = _param(*tokens, out, device=device)

    def run():
        return EF.linear(x, w, b, epilogue=lambda acc, residual: epicute.ops.gelu(acc) + residual,
                         residual=residual.reshape(-1, out)).reshape(*tokens, out)  # fmt: skip

    def math(x, w, b, residual):
        return F.gelu(F.linear(x, w, b)) + residual

    return check_step(run, math, {"x": x, "w": w, "b": b, "residual": residual})
