"""Finite differences (``torch.autograd.gradcheck``, float64) against the derived backward of epilogues: every
smooth op of the op table, operands of every kind, several outputs, a gated epilogue. Independent of torch's own
derivatives (tests/epilogue/test_backward_fuzz.py compares with those over random programs): the forward is the
CPU reference's evaluation of the graph, the backward the reference's evaluation of
:func:`epicute.epilogue.backward.gradient_graph`, wired together as one autograd Function.

Ops that jump (comparisons, ``where``, ``relu``, ``abs``, ``clamp``, ``minimum``/``maximum``) have one-sided
derivatives at their edges and roundings (``cast``, ``quantize``) are straight-through by design, so finite
differences would test the edge, not the rule: they are left to the fuzzer.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from epicute.epilogue.backward import (
    DACC,
    differentiable_outputs,
    grad_name,
    gradient_graph,
    operand_grad_name,
)
from epicute.epilogue.gated import gated_epilogue, split_gate_up
from epicute.epilogue.operands import OperandSpec
from epicute.epilogue.reference import evaluate

F64 = torch.float64
L, M, N = 2, 3, 8  # N: whole blocks of gate and up columns (GATE_BLOCK), for the gated case

EPILOGUES = {
    "gelu_bias_residual": (
        lambda acc, bias, residual: ops.gelu(acc + bias) + residual, {"bias": "row", "residual": "tile"}
    ),
    "transcendentals": (
        lambda acc, s: {"D": ops.exp(ops.tanh(acc) * s) + ops.log(acc * acc + 1.0),
                        "aux": ops.sqrt(acc * acc + 2.0) * ops.rsqrt(ops.softplus(acc) + 1.0)},
        {"s": "col"},
    ),
    "activations": (
        lambda acc, w: ops.silu(acc) * ops.sigmoid(w) + ops.gelu(acc, approximate="tanh") / (w * w + 1.0)
        + ops.exp2(-acc * acc) - ops.fma(acc, w, acc),
        {"w": "tile"},
    ),
}  # fmt: skip


class _Graphed(torch.autograd.Function):
    """The reference's forward of ``graph``; its backward evaluates the derived gradient graph."""

    @staticmethod
    def forward(ctx, graph, names, kinds, up, acc, *operands):
        values = dict(zip(names, operands))
        specs = {n: OperandSpec(n, kinds[n], "fp32", v) for n, v in values.items()}
        outputs = differentiable_outputs(graph)
        result = evaluate(graph, acc, specs, out_dtypes=dict.fromkeys(outputs, torch.float32), compute_dtype=F64,
                          up=up)  # fmt: skip
        ctx.save_for_backward(acc, up, *operands)
        ctx.graph, ctx.names, ctx.kinds, ctx.outputs = graph, names, kinds, outputs
        return tuple(result[name].to(F64) for name in outputs)

    @staticmethod
    def backward(ctx, *grads):
        acc, up, *operands = ctx.saved_tensors
        graph, names, kinds, outputs = ctx.graph, ctx.names, ctx.kinds, ctx.outputs
        backward = gradient_graph(graph, dict.fromkeys(outputs, "fp32"), names)
        values = {n: OperandSpec(n, kinds[n], "fp32", v) for n, v in zip(names, operands)}
        values |= {grad_name(o): OperandSpec(grad_name(o), "tile", "fp32", g) for o, g in zip(outputs, grads)}
        derived = evaluate(backward, acc, {n: values[n] for n, _ in backward.inputs}, compute_dtype=F64, up=up)
        # A gated graph's gradient comes paired: d gate and d up interleaved in one D (Graph.paired).
        d_acc, d_up = split_gate_up(derived[DACC].to(F64)) if backward.paired else (derived[DACC].to(F64), None)
        return (None, None, None, d_up, d_acc, *(derived[operand_grad_name(n)].to(F64).reshape(v.shape)
                                                 for n, v in zip(names, operands)))  # fmt: skip


@pytest.fixture(autouse=True)
def float64_storage(monkeypatch):
    """Outputs "stored" as fp32 stay float64: finite differences of 1e-6 need every digit."""
    from epicute.epilogue import reference

    rounded = reference.round_to
    monkeypatch.setattr(reference, "round_to", lambda x, dtype: x if dtype == "fp32" else rounded(x, dtype))


def _operand(kind: str) -> torch.Tensor:
    shape = {"row": (L, N), "col": (L, M), "tile": (L, M, N)}[kind]
    return (torch.rand(shape, dtype=F64) + 0.5).requires_grad_()


@pytest.mark.parametrize("name", list(EPILOGUES))
def test_derived_backward_passes_gradcheck(name):
    fn, kinds = EPILOGUES[name]
    graph = epicute.epilogue(fn).trace(kinds)
    acc = torch.randn(L, M, N, dtype=F64).requires_grad_()
    operands = [_operand(kinds[n]) for n in kinds]
    assert torch.autograd.gradcheck(
        lambda acc, *ops_: _Graphed.apply(graph, tuple(kinds), kinds, None, acc, *ops_), (acc, *operands),
        eps=1e-6, atol=1e-5, rtol=1e-4,
    )  # fmt: skip


def test_gated_derived_backward_passes_gradcheck():
    graph = gated_epilogue(lambda gate, up, s: ops.silu(gate) * up * s + ops.gelu(up)).trace({"s": "row"})
    gate, up = (torch.randn(L, M, N, dtype=F64).requires_grad_() for _ in range(2))
    s = _operand("row")
    assert torch.autograd.gradcheck(
        lambda gate, up, s: _Graphed.apply(graph, ("s",), {"s": "row"}, up, gate, s), (gate, up, s),
        eps=1e-6, atol=1e-5, rtol=1e-4,
    )  # fmt: skip
