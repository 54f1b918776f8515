"""Training calls of epicute.gemm and the float64 torch math each stands for, shared by the CPU tests (the kernel
replaced by the reference backend) and the GPU tests (the kernels).

Each case is ``(epilogue, math, operands, options)``: ``math(acc, **operands)`` (``math(gate, up, ...)`` when
gated) is the same function written in torch, run in float64 by autograd as the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import epicute
from epicute import ops
from epicute.epilogue.gated import GATE_BLOCK

BF16 = torch.bfloat16


def _split_gate_up(acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, m, n2 = acc.shape
    blocks = acc.reshape(*lead, m, n2 // (2 * GATE_BLOCK), 2, GATE_BLOCK)
    return blocks[..., 0, :].reshape(*lead, m, n2 // 2), blocks[..., 1, :].reshape(*lead, m, n2 // 2)


def cases(m: int, n: int, device: str) -> dict[str, tuple]:
    """name -> (epilogue, math, operand factories, options); operands are made fresh per run (random)."""

    def row(dtype=BF16):
        return lambda: torch.randn(n, device=device, dtype=dtype).requires_grad_()

    def tile():
        return lambda: torch.randn(m, n, device=device, dtype=BF16).requires_grad_()

    return {
        "plain": (None, lambda acc: acc, {}, {}),
        "bias": (lambda acc, bias: acc + bias, lambda acc, bias: acc + bias, {"bias": row()}, {}),
        "gelu_bias_residual": (
            lambda acc, bias, residual: ops.gelu(acc + bias) + residual,
            lambda acc, bias, residual: F.gelu(acc + bias) + residual,
            {"bias": row(), "residual": tile()}, {},
        ),
        "tanh_scaled_with_aux": (
            lambda acc, bias, alpha: {"D": ops.tanh(acc * alpha) + bias, "pre": acc * 2.0, "rs": ops.row_sum(acc)},
            lambda acc, bias, alpha: {"D": torch.tanh(acc * alpha) + bias, "pre": acc * 2.0},
            {"bias": row(torch.float32), "alpha": lambda: torch.tensor(0.7, device=device).requires_grad_()}, {},
        ),
        "swiglu": (lambda gate, up: ops.silu(gate) * up, lambda gate, up: F.silu(gate) * up, {}, {"gated": True}),
        "geglu_row_scale": (
            lambda gate, up, scale: ops.gelu(gate) * up * scale,
            lambda gate, up, scale: F.gelu(gate) * up * scale.unsqueeze(-1),
            {"scale": lambda: epicute.ColVector(torch.rand(m, device=device).requires_grad_())}, {"gated": True},
        ),
    }  # fmt: skip


def _leaf(value):
    return value.value if isinstance(value, epicute.ColVector | epicute.RowVector) else value


def forward_backward(case: tuple, m: int, n: int, k: int, device: str, batch: int | None = None, call=None):
    """One case forward and backward through ``call`` (default :func:`epicute.gemm`) on random inputs and random
    upstream gradients: ``(a, b, operands, outs, upstream)``, the leaves' ``.grad`` filled."""
    epilogue, _, factories, options = case
    gated = options.get("gated", False)
    lead = (batch,) if batch else ()
    a = torch.randn(*lead, m, k, device=device, dtype=BF16).requires_grad_()
    b = (torch.randn(*lead, k, 2 * n if gated else n, device=device, dtype=BF16) / k**0.5).requires_grad_()
    operands = {name: make() for name, make in factories.items()}
    call = call or epicute.gemm
    out = call(a, b, epilogue=epilogue, **options, **operands) if epilogue else call(a, b)
    outs = out if isinstance(out, dict) else {"D": out}
    upstream = {name: torch.randn_like(t) for name, t in outs.items() if t.requires_grad}
    torch.autograd.backward([outs[name] for name in upstream], [upstream[name] for name in upstream])
    return a, b, operands, outs, upstream


def gradients(operands: dict) -> dict[str, torch.Tensor]:
    """Each operand's gradient by name (a vector wrapper's from its tensor)."""
    return {name: _leaf(v).grad for name, v in operands.items()}


def run_case(case: tuple, m: int, n: int, k: int, device: str, batch: int | None = None, call=None) -> dict:
    """Run one case forward and backward through ``call`` (default :func:`epicute.gemm`) and through float64
    autograd of its math; the relative error of every gradient (and of each output), by name."""
    _, math, _, options = case
    gated = options.get("gated", False)
    a, b, operands, outs, upstream = forward_backward(case, m, n, k, device, batch, call)

    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    ops64 = {name: _leaf(v).detach().double().requires_grad_() for name, v in operands.items()}
    acc = a64 @ b64
    # A scalar operand enters as one value per output element, so its gradient's terms (before their sum) are
    # known: the scale its error is measured against (below).
    out_shape = (*acc.shape[:-1], acc.shape[-1] // 2 if gated else acc.shape[-1])
    spread = {name: v.detach().expand(out_shape).clone().requires_grad_() for name, v in ops64.items() if v.dim() == 0}
    ref = math(*(_split_gate_up(acc) if gated else (acc,)), **(ops64 | spread))
    ref = ref if isinstance(ref, dict) else {"D": ref}
    torch.autograd.backward([ref[name] for name in upstream], [upstream[name].double() for name in upstream])

    def rel(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    errors = {f"out {name}": rel(outs[name], ref[name].detach()) for name in upstream}
    errors |= {"a": rel(a.grad, a64.grad), "b": rel(b.grad, b64.grad)}
    errors |= {name: rel(_leaf(v).grad, ops64[name].grad) for name, v in operands.items() if name not in spread}
    # A scalar's gradient sums M x N terms of either sign, each carrying its bf16 roundings (the saved accumulator's,
    # 2^-9 relative): its error is bounded relative to the terms' norm, not to their sum, which cancellation makes
    # as small as chance has it (relative to the sum, 1e-2 failed for 5 seeds in 40 on the reference backend).
    errors |= {name: (abs(_leaf(operands[name]).grad.double() - terms.grad.sum()) / terms.grad.norm()).item()
               for name, terms in spread.items()}  # fmt: skip
    errors["differentiable outputs"] = sorted(upstream)
    return errors
