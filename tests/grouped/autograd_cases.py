"""Training calls of epicute.grouped_gemm (MoE experts) and their float64 torch math, per group, shared by the
CPU tests (the kernel replaced by the reference backend) and the GPU tests (the kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import epicute
from epicute import ops
from tests.gemm.autograd_cases import _split_gate_up

BF16 = torch.bfloat16

#: name -> (epilogue, math(acc or gate/up, bias_g, score_rows), uses bias, uses score, gated)
CASES = {
    "plain": (None, lambda acc, bias, score: acc, False, False, False),
    "bias_gelu": (lambda acc, bias: ops.gelu(acc + bias), lambda acc, bias, score: F.gelu(acc + bias), True, False,
                  False),
    "swiglu_times_router_weight": (
        lambda gate, up, score: ops.silu(gate) * up * score,
        lambda gate, up, bias, score: F.silu(gate) * up * score, False, True, True,
    ),
}  # fmt: skip


def run_grouped_case(
    name: str, sizes: list[int], k: int, n: int, device: str, tokens: int | None = None, call=None
) -> dict[str, float]:
    """Forward and backward of one case through ``call`` (default :func:`epicute.grouped_gemm`) and through float64
    autograd, group by group; relative errors by gradient. ``tokens``: gather rows from that many tokens
    (``a_index``, as top-k routing does: a token may feed several groups)."""
    epilogue, math, uses_bias, uses_score, gated = CASES[name]
    groups, rows = len(sizes), sum(sizes)
    offsets = torch.cumsum(torch.tensor(sizes), 0).to(device=device, dtype=torch.int32)
    a = torch.randn(tokens or rows, k, device=device, dtype=BF16).requires_grad_()
    width = 2 * n if gated else n
    b = (torch.randn(groups, width, k, device=device, dtype=BF16) / k**0.5).transpose(-2, -1).requires_grad_()
    index = torch.randint(0, tokens, (rows,), device=device, dtype=torch.int32) if tokens else None
    operands = {}
    if uses_bias:
        operands["bias"] = torch.randn(groups, n, device=device, dtype=BF16).requires_grad_()
    if uses_score:
        operands["score"] = torch.rand(rows, 1, device=device).requires_grad_()
    call = call or epicute.grouped_gemm
    extra = {"a_index": index} if tokens else {}
    d = call(a, b, offsets, epilogue=epilogue, gated=gated, **extra, **operands) if epilogue else call(a, b, offsets,
                                                                                                      **extra)
    grad = torch.randn_like(d)
    d.backward(grad)

    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    ops64 = {key: t.detach().double().requires_grad_() for key, t in operands.items()}
    x = a64[index.long()] if tokens else a64
    ends = offsets.tolist()
    outs = []
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        acc = x[start:end] @ b64[g]
        args = _split_gate_up(acc) if gated else (acc,)
        bias = ops64["bias"][g] if uses_bias else None
        score = ops64["score"][start:end] if uses_score else None
        outs.append(math(*args, bias, score))
    torch.cat(outs).backward(grad.double())

    def rel(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    errors = {"a": rel(a.grad, a64.grad), "b": rel(b.grad, b64.grad)}
    errors |= {key: rel(t.grad, ops64[key].grad) for key, t in operands.items()}
    return errors


__all__ = ["CASES", "run_grouped_case"]
