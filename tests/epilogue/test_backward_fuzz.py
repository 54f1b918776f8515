"""The derived backward of random epilogues against torch's autograd of the same graph.

For each random program of the GEMM fuzzer (tests/gemm/epilogue_fuzz.py: every op of the op table, every operand
kind, several outputs), the forward graph is evaluated by the CPU reference in float64 with the accumulator and the
vector and tile operands requiring grad, and torch's autograd differentiates that evaluation (each op's reference
is a torch formula). :func:`epicute.epilogue.backward.gradient_graph` of the same graph, evaluated by the same
reference, must give the same ``dacc`` and operand gradients: the op table's tangent rules agree with torch's
derivatives of the op table's reference formulas, op by op, composed.

Inputs are continuous random values (not the fuzzer's grid): a comparison, ``where``, ``relu`` or ``clamp`` then
meets a tie with probability zero, where the two sides could legitimately pick different one-sided derivatives.
Roundings (``cast``, ``quantize``) pass the gradient straight through (the op table's rule, as ``.to(dtype)``
does): torch's autograd would also round the *gradient* to the cast's dtype and zero it where fp8 saturates, so
the oracle's roundings are made straight-through (their forward values unchanged). Tolerance 1e-6 relative:
float64 on both sides, the gradient graph's outputs stored as fp32 (about 6e-8 relative).
"""

from __future__ import annotations

import random

import pytest
import torch

from epicute.epilogue.backward import differentiable_outputs, grad_name, gradient_graph, operand_grad_name
from epicute.epilogue.operands import OperandSpec
from epicute.epilogue.reference import evaluate
from epicute.epilogue.tracer import as_epilogue
from tests.gemm.epilogue_fuzz import random_program

F64 = torch.float64
TOL = 1e-6
PROGRAMS = 300


def _leaf_values(program, m: int, n: int, l: int, rng: random.Random) -> dict[str, object]:
    values: dict[str, object] = {}
    for op in program.operands:
        if op.kind == "scalar":
            values[op.name] = round(rng.choice((-1, 1)) * rng.uniform(0.25, 3.0), 4)
        else:
            shape = {"row": (l, n), "col": (l, m), "tile": (l, m, n)}[op.kind]
            values[op.name] = (torch.randn(shape, dtype=F64) * 1.5).clamp(-3, 3)
    return values


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.norm()
    return ((got - want).norm() / scale).item() if scale > 0 else got.norm().item()


@pytest.fixture
def straight_through_roundings(monkeypatch):
    from epicute.epilogue import optable, reference

    rounded = optable.round_to

    def straight_through(x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x + (rounded(x, dtype).to(x.dtype) - x).detach()

    monkeypatch.setattr(optable, "round_to", straight_through)
    monkeypatch.setattr(reference, "round_to", straight_through)


@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_derived_gradients_match_autograd_of_the_reference(straight_through_roundings, seed):
    program = random_program(seed)
    rng = random.Random(seed)
    m, n, l = rng.choice((1, 3, 5)), rng.choice((2, 4, 6)), rng.choice((1, 2))
    epi = as_epilogue(program.fn)
    values = _leaf_values(program, m, n, l, rng)
    kinds = {op.name: op.kind for op in program.operands}
    graph = epi.trace(kinds, {}, program.out_dtypes(), d_dtype=program.d_dtype)
    outputs = differentiable_outputs(graph)
    if not outputs:
        pytest.skip("no output carries a gradient (fp8 D, reductions only)")
    wrt = tuple(name for name, kind in kinds.items() if kind != "scalar")

    # torch's autograd through the reference's evaluation of the forward graph, in float64
    acc = (torch.randn(l, m, n, dtype=F64) * 2).requires_grad_()
    leaves = {name: v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v for name, v in values.items()}
    specs = {name: OperandSpec(name, kinds[name], "fp32", v) for name, v in leaves.items()}
    forward = evaluate(graph, acc, specs, out_dtypes=dict.fromkeys(outputs, torch.float32), compute_dtype=F64)
    upstream = {name: torch.randn(l, m, n, dtype=F64) for name in outputs}
    traced = [name for name in outputs if forward[name].requires_grad]  # the others depend on no leaf that has one
    if traced:
        torch.autograd.backward([forward[name] for name in traced], [upstream[name] for name in traced])

    # the derived gradient graph, evaluated by the same reference
    backward = gradient_graph(graph, dict.fromkeys(outputs, "fp32"), wrt)
    given = {name: OperandSpec(name, kinds[name], "fp32", v) for name, v in values.items()}
    given |= {grad_name(name): OperandSpec(grad_name(name), "tile", "fp32", upstream[name]) for name in outputs}
    derived = evaluate(backward, acc.detach(), {name: given[name] for name, _ in backward.inputs},
                       compute_dtype=F64)  # fmt: skip

    def expected(t: torch.Tensor) -> torch.Tensor:
        return t.grad if t.grad is not None else torch.zeros_like(t)

    errors = {"acc": _rel(derived["D"].to(F64).expand(l, m, n), expected(acc))}
    for name in wrt:
        want = expected(leaves[name])
        errors[name] = _rel(derived[operand_grad_name(name)].to(F64).expand(want.shape), want)
    assert all(e < TOL for e in errors.values()), f"{errors}\n{program.source}"
