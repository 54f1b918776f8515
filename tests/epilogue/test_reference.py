"""The reference interpreter against hand-written float64 torch, op by op, plus its rounding rules."""

from __future__ import annotations

import math

import pytest
import torch

from epicute import ops
from epicute.epilogue.operands import Tile
from epicute.epilogue.reference import evaluate
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import EpilogueError, ShapeError
from tests.epilogue.conftest import away_from_zero, randn

L, M, N = 2, 5, 7
F32 = {"rtol": 2e-6, "atol": 1e-6}  # fp32 evaluation against float64 math


def run(fn, acc, *, compute_dtype=torch.float32, out_dtypes=None, **operands) -> dict[str, torch.Tensor]:
    """Resolve, trace and evaluate ``fn`` on ``acc`` (L, M, N); D is stored fp32 unless asked otherwise."""
    epi = as_epilogue(fn)
    l, m, n = acc.shape
    specs = epi.operands(operands, m, n, l)
    graph = epi.trace({k: s.kind for k, s in specs.items()}, {k: s.dtype for k, s in specs.items()}, out_dtypes)
    return evaluate(graph, acc, specs, compute_dtype=compute_dtype)


def as_lmn(value, kind: str) -> torch.Tensor:
    """An operand as the float64 (L, M, N) tensor it stands for."""
    v = torch.as_tensor(value, dtype=torch.float64)
    return {"scalar": v, "row": v.reshape(1, 1, -1), "col": v.reshape(1, -1, 1), "tile": v}[kind].expand(L, M, N)


def operand(gen, kind: str, nonzero_lo: float | None = None):
    """A random operand of ``kind`` (values exactly representable in fp32, so float64 math sees the same)."""
    shape = {"scalar": (1,), "row": (N,), "col": (M, 1), "tile": (L, M, N)}[kind]
    t = randn(gen, *shape) if nonzero_lo is None else away_from_zero(gen, *shape, lo=nonzero_lo)
    return float(t) if kind == "scalar" else t


UNARY = {
    "neg": (ops.neg, lambda x: -x, "any"),
    "unary minus": (lambda x: -x, lambda x: -x, "any"),
    "abs": (ops.abs, lambda x: torch.where(x < 0, -x, x), "any"),
    "abs()": (abs, lambda x: torch.where(x < 0, -x, x), "any"),
    "exp": (ops.exp, torch.exp, "any"),
    "exp2": (ops.exp2, lambda x: torch.pow(2.0, x), "any"),
    "log": (ops.log, torch.log, "positive"),
    "sqrt": (ops.sqrt, lambda x: x**0.5, "positive"),
    "rsqrt": (ops.rsqrt, lambda x: 1 / x**0.5, "positive"),
    "tanh": (ops.tanh, lambda x: 1 - 2 / (torch.exp(2 * x) + 1), "any"),
    "sigmoid": (ops.sigmoid, lambda x: 1 / (1 + torch.exp(-x)), "any"),
    "relu": (ops.relu, lambda x: torch.where(x > 0, x, 0.0), "any"),
    "gelu_erf": (ops.gelu, lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), "any"),
    "gelu_tanh": (
        lambda x: ops.gelu(x, approximate="tanh"),
        lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
        "any",
    ),
    "silu": (ops.silu, lambda x: x / (1 + torch.exp(-x)), "any"),
    "softplus": (ops.softplus, lambda x: torch.log1p(torch.exp(x)), "any"),
}


@pytest.mark.parametrize("name", list(UNARY))
@pytest.mark.parametrize("on", ["acc", "row operand"])
def test_unary_op(gen, name, on):
    op, hand, domain = UNARY[name]
    acc = 3 * randn(gen, L, M, N) if domain == "any" else away_from_zero(gen, L, M, N, positive=True)
    bias = 3 * randn(gen, N) if domain == "any" else away_from_zero(gen, N, positive=True)
    if on == "acc":
        out = run(lambda acc: op(acc), acc)["D"]
        ref = hand(acc.double())
    else:
        out = run(lambda acc, bias: acc + op(bias), acc, bias=bias)["D"]
        ref = acc.double() + hand(as_lmn(bias, "row"))
    assert out.dtype == torch.float32 and out.shape == (L, M, N)
    torch.testing.assert_close(out.double(), ref, **F32)


def test_gelu_takes_its_limits_at_infinity():
    # The kernel computes gelu(-inf) = 0 and gelu(inf) = inf; the reference agrees (torch's gelu gives NaN at both).
    acc = torch.tensor([float("-inf"), float("inf"), -1.0]).reshape(1, 1, 3)
    out = run(lambda acc: ops.gelu(acc), acc)["D"].flatten()
    assert out[0] == 0 and out[1] == float("inf")
    # Finite inputs keep the erf form; compared in float64, not against torch's gelu, whose scalar and
    # vectorised CPU paths differ by an ulp between machines.
    exact = -0.5 * (1.0 + math.erf(-1.0 / math.sqrt(2.0)))
    assert abs(out[2].item() - exact) <= 1e-6 * abs(exact)


def test_softplus_is_linear_above_the_threshold():
    acc = torch.tensor([20.5, 30.0, 100.0]).reshape(1, 1, 3)
    torch.testing.assert_close(run(ops.softplus, acc)["D"], acc)


BINARY = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "sub": (lambda a, b: a - b, lambda a, b: a - b),
    "rsub": (lambda a, b: b - a, lambda a, b: b - a),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "div": (lambda a, b: a / b, lambda a, b: a / b),
    "rdiv": (lambda a, b: b / a, lambda a, b: b / a),
    "minimum": (ops.minimum, lambda a, b: torch.where(a < b, a, b)),
    "maximum": (ops.maximum, lambda a, b: torch.where(a > b, a, b)),
    "fma": (lambda a, b: ops.fma(a, b, a), lambda a, b: a * b + a),
}


@pytest.mark.parametrize("name", list(BINARY))
@pytest.mark.parametrize("kind", ["scalar", "row", "col", "tile"])
def test_binary_op_broadcasts_each_operand_kind(gen, name, kind):
    op, hand = BINARY[name]
    divides = name in ("div", "rdiv")
    acc = away_from_zero(gen, L, M, N) if divides else randn(gen, L, M, N)
    y = operand(gen, kind, nonzero_lo=0.5 if divides else None)
    out = run(lambda acc, y: op(acc, y), acc, y=Tile(y) if kind == "tile" else y)["D"]
    torch.testing.assert_close(out.double(), hand(acc.double(), as_lmn(y, kind)), **F32)


COMPARE = {
    "<": (lambda a, b: a < b, torch.lt), "<=": (lambda a, b: a <= b, torch.le),
    ">": (lambda a, b: a > b, torch.gt), ">=": (lambda a, b: a >= b, torch.ge),
    "lt": (ops.lt, torch.lt), "le": (ops.le, torch.le), "gt": (ops.gt, torch.gt), "ge": (ops.ge, torch.ge),
    "eq": (ops.eq, torch.eq), "ne": (ops.ne, torch.ne),
}  # fmt: skip


@pytest.mark.parametrize("name", list(COMPARE))
def test_comparison_gives_a_0_1_fp32_mask(gen, name):
    op, hand = COMPARE[name]
    acc = randn(gen, L, M, N)
    # Half the elements equal, so eq/ne/<=/>= see ties as well as both orders.
    y = torch.where(torch.rand(L, M, N, generator=gen) < 0.5, acc, randn(gen, L, M, N))
    out = run(lambda acc, y: op(acc, y), acc, y=y)["D"]
    ref = hand(acc, y).float()
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    assert 0 < ref.sum() < ref.numel(), "both outcomes must occur"


def test_comparison_against_a_number_reflects(gen):
    acc = randn(gen, L, M, N)
    assert torch.equal(run(lambda acc: acc > 0.25, acc)["D"], (acc > 0.25).float())


def test_where_selects_on_nonzero(gen):
    acc, other = randn(gen, L, M, N), randn(gen, N)
    cond = torch.tensor([0.0, 1.0, -2.5, float("nan")])[torch.randint(0, 4, (L, M, N), generator=gen)]
    out = run(lambda acc, c, b: ops.where(c, acc, b), acc, c=cond, b=other)["D"]
    assert torch.equal(out, torch.where(cond != 0, acc, other.expand(L, M, N)))
    masked = run(lambda acc: ops.where(acc > 0, acc, 0.5 * acc), acc)["D"]
    torch.testing.assert_close(masked.double(), torch.where(acc > 0, acc, 0.5 * acc).double(), **F32)


@pytest.mark.parametrize(("lo", "hi"), [(-0.5, None), (None, 0.75), (-0.5, 0.75)])
def test_clamp(gen, lo, hi):
    acc = randn(gen, L, M, N)
    ref = acc.double()
    ref = ref if lo is None else torch.where(ref < lo, lo, ref)
    ref = ref if hi is None else torch.where(ref > hi, hi, ref)
    assert torch.equal(run(lambda acc: ops.clamp(acc, lo, hi), acc)["D"].double(), ref)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Hand-written saturating round: fp8 formats clamp to their largest finite value first."""
    limit = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}.get(dtype)
    return (x if limit is None else x.clamp(-limit, limit)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_cast_rounds_then_computes_on_in_fp32(gen, dtype):
    acc = randn(gen, L, M, N) * 300  # some elements beyond fp8 e4m3's 448
    out = run(lambda acc: ops.cast(acc, dtype) * 3, acc)["D"]
    assert out.dtype == torch.float32
    assert torch.equal(out, _rounded(acc, dtype).float() * 3)
    stored = run(lambda acc: ops.cast(acc, dtype), acc)["D"]
    assert stored.dtype == dtype and torch.equal(stored.float(), _rounded(acc, dtype).float())


# Ties between neighbours in [1, 2) (spacing 2^-3 for e4m3, 2^-2 for e5m2) round to the even mantissa.
@pytest.mark.parametrize(
    ("dtype", "limit", "ties", "rounded"),
    [(torch.float8_e4m3fn, 448.0, [1.0625, 1.1875], [1.0, 1.25]),
     (torch.float8_e5m2, 57344.0, [1.125, 1.375], [1.0, 1.5])],
)  # fmt: skip
def test_quantize_saturates_and_rounds_to_nearest_even(dtype, limit, ties, rounded):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([1e6, -1e6, inf, -inf, limit, *ties, nan]).reshape(1, 1, -1)
    out = run(lambda acc, s: ops.quantize(acc, s, dtype), x / 2, s=2.0)["D"]
    assert out.dtype == dtype
    got = out.float()[0, 0]
    assert got[:-1].tolist() == [limit, -limit, limit, -limit, limit, *rounded] and got[-1].isnan()


def test_quantize_random_values_match_hand_written(gen):
    acc, s = randn(gen, L, M, N) * 200, float(away_from_zero(gen, 1))
    out = run(lambda acc, s: ops.quantize(acc, s), acc, s=s)["D"]
    assert torch.equal(out.float(), _rounded(acc * s, torch.float8_e4m3fn).float())


def test_tile_outputs_are_stored_in_their_dtype(gen):
    acc = randn(gen, L, M, N) * 1000
    outs = run(
        lambda acc: {"D": acc, "aux": acc * 2}, acc, out_dtypes={"D": torch.bfloat16, "aux": torch.float8_e4m3fn}
    )
    assert outs["D"].dtype == torch.bfloat16 and torch.equal(outs["D"], acc.to(torch.bfloat16))
    assert outs["aux"].dtype == torch.float8_e4m3fn
    assert torch.equal(outs["aux"].float(), _rounded(acc * 2, torch.float8_e4m3fn).float())


def test_evaluate_out_dtypes_override_the_graphs(gen):
    acc = randn(gen, L, M, N)
    epi = as_epilogue(lambda acc: acc * 2)
    out = evaluate(epi.trace({}), acc, {}, out_dtypes={"D": torch.float16})["D"]
    assert out.dtype == torch.float16 and torch.equal(out, (acc * 2).half())


def test_row_and_scalar_results_of_a_tile_output_broadcast(gen):
    acc, b = randn(gen, L, M, N), randn(gen, N)
    out = run(lambda acc, b: {"D": acc * 0 + b}, acc, b=b)["D"]
    assert out.shape == (L, M, N) and torch.equal(out, b.expand(L, M, N))


def test_compute_dtype_is_honoured(gen):
    acc = away_from_zero(gen, L, M, N, lo=0.5)
    fn = lambda acc: (acc + 1e-8) - acc  # 1e-8 is below half an fp32 ulp of |acc| >= 0.5
    assert torch.equal(run(fn, acc)["D"], torch.zeros(L, M, N))
    torch.testing.assert_close(
        run(fn, acc, compute_dtype=torch.float64)["D"], torch.full((L, M, N), 1e-8), rtol=1e-4, atol=0
    )


def test_scalars_and_constants_are_rounded_to_fp32_as_the_kernel_receives_them(gen):
    acc = randn(gen, L, M, N)
    out = run(lambda acc, alpha: acc * 0 + (alpha * 3 - 0.3), acc, compute_dtype=torch.float64, alpha=0.1)["D"]
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).double()
    expected = 3 * f32(0.1) - f32(0.3)  # about -7.5e-9; with unrounded operands it would be ~5.6e-17
    torch.testing.assert_close(out.double(), expected.expand(L, M, N), rtol=1e-6, atol=0)


REDUCE = {
    "row_sum": (ops.row_sum, lambda y: y.sum(2)),
    "row_max": (ops.row_max, lambda y: y.amax(2)),
    "row_amax": (ops.row_amax, lambda y: y.abs().amax(2)),
    "col_sum": (ops.col_sum, lambda y: y.sum(1)),
    "col_max": (ops.col_max, lambda y: y.amax(1)),
    "col_amax": (ops.col_amax, lambda y: y.abs().amax(1)),
    "amax": (ops.amax, lambda y: y.abs().amax()),
}


@pytest.mark.parametrize("name", list(REDUCE))
@pytest.mark.parametrize("lmn", [(3, 37, 53), (1, 1, 9), (2, 130, 1)])
def test_reduction_on_ragged_shapes(gen, name, lmn):
    op, hand = REDUCE[name]
    l, m, n = lmn
    acc, bias, scale = randn(gen, l, m, n), randn(gen, n), randn(gen, l, m, 1)
    outs = run(lambda acc, bias, scale: {"D": acc, "r": op(acc * bias + scale)}, acc, bias=bias, scale=scale)
    y = acc.double() * bias.double() + scale.double()
    ref = hand(y)
    expected_shape = {"row": (l, m), "col": (l, n), "amax": ()}[name.split("_")[0]]
    assert outs["r"].dtype == torch.float32 and outs["r"].shape == expected_shape
    torch.testing.assert_close(outs["r"].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("op", "shape", "identity"),
    [(ops.row_sum, (2, 3), 0.0), (ops.row_max, (2, 3), float("-inf")), (ops.row_amax, (2, 3), 0.0),
     (ops.col_max, (2, 0), None), (ops.amax, (), 0.0)],
)  # fmt: skip
def test_reductions_over_an_empty_extent_give_the_identity(op, shape, identity):
    outs = run(lambda acc: {"D": acc, "r": op(acc)}, torch.ones(2, 3, 0))
    assert outs["r"].shape == shape
    if identity is not None:
        assert torch.equal(outs["r"], torch.full(shape, identity))


def test_evaluate_checks_operands_against_the_graph_and_the_accumulator(gen):
    epi = as_epilogue(lambda acc, b: acc + b)
    graph = epi.trace({"b": "row"})
    acc = randn(gen, L, M, N)
    with pytest.raises(EpilogueError, match="no operand 'b'"):
        evaluate(graph, acc, {})
    with pytest.raises(EpilogueError, match="'b' is a col operand, but the graph was traced with it row"):
        evaluate(graph, acc, epi.operands({"b": randn(gen, M, 1)}, M, N, L))
    with pytest.raises(EpilogueError, match=r"canonical shape \(2, 8\).*needs \(2, 7\)"):
        evaluate(graph, acc, epi.operands({"b": randn(gen, N + 1)}, M, N + 1, L))
    with pytest.raises(ShapeError, match="evaluate needs"):
        evaluate(graph, acc[0], {})


@pytest.mark.parametrize("op", ["row_sum", "col_sum", "row_max", "col_amax", "amax"])
@pytest.mark.parametrize("shape", [(7, 5), (3, 7, 5), (0, 5), (3, 7, 0)])
def test_reduce_tile_reduces_as_the_kernel_does(op, shape):
    """Row reductions over N, column ones over M, amax over all; a 16-bit tile's sums accumulate in fp32, a float64
    one's in float64; an empty extent gives the reduction's identity (0 for sums and amax, -inf for max)."""
    from epicute.epilogue.graph import REDUCTION_IDENTITY, REDUCTIONS
    from epicute.epilogue.reference import reduce_tile

    for dtype, wide in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        x = torch.randn(*shape, dtype=torch.float64).to(dtype)
        got = reduce_tile(x, op)
        assert got.dtype == wide
        combine = REDUCTIONS[op][1]
        x64 = x.double().abs() if combine == "amax" else x.double()
        dims = (-1,) if op.startswith("row_") else (-2,) if op.startswith("col_") else tuple(range(x.dim()))
        if x64.shape[dims[0]] == 0 or (x64.numel() == 0 and op == "amax"):
            kept = [s for i, s in enumerate(x64.shape) if i not in dims and i - x64.dim() not in dims]
            want = torch.full(kept, REDUCTION_IDENTITY[combine], dtype=torch.float64)
        else:
            want = x64.sum(dim=dims) if combine == "sum" else x64.amax(dim=dims)
        assert got.shape == want.shape
        if want.numel():
            assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max().clamp(min=1)))
