"""The issue's example end to end through ``reference_gemm``, against hand-written torch."""

from __future__ import annotations

import math

import pytest
import torch

import epicute
from epicute.epilogue.reference import reference_gemm
from epicute.errors import ShapeError
from tests.conftest import rel_err
from tests.epilogue.conftest import randn


@epicute.epilogue
def ffn_out(acc, bias, residual, alpha):
    return {"D": epicute.ops.gelu(alpha * acc + bias) + residual}


def by_hand(a, b, bias, residual, alpha):
    """gelu(alpha * (a @ b) + bias) + residual in float64, gelu written out with erf."""
    x = alpha * (a.double() @ b.double()) + bias.double().unsqueeze(-2)
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2))) + residual.double()


def test_ffn_out_2d_bf16(gen):
    m, n, k = 37, 53, 72
    a, b = randn(gen, m, k, dtype=torch.bfloat16), randn(gen, k, n, dtype=torch.bfloat16)
    bias, residual = randn(gen, n, dtype=torch.bfloat16), randn(gen, m, n, dtype=torch.bfloat16)
    alpha = 0.5
    out = reference_gemm(a, b, ffn_out, {"bias": bias, "residual": residual, "alpha": alpha})
    assert list(out) == ["D"]
    d = out["D"]
    assert d.shape == (m, n) and d.dtype == torch.bfloat16, "2-D inputs give 2-D outputs in a's dtype"
    assert rel_err(d, by_hand(a, b, bias, residual, alpha)) < 3e-3  # bf16 rounding of D only


def test_ffn_out_batched_fp32_out_with_a_transposed_weight(gen):
    l, m, n, k = 3, 29, 40, 64
    a = randn(gen, l, m, k, dtype=torch.bfloat16)
    w = randn(gen, l, n, k, dtype=torch.bfloat16)  # (N, K) weights, used as w.mT: a view
    bias, residual = randn(gen, l, n), randn(gen, m, n, dtype=torch.bfloat16)  # per-batch bias, shared residual
    alpha = float(randn(gen, 1))
    out = reference_gemm(a, w.mT, ffn_out, {"bias": bias, "residual": residual, "alpha": alpha},
                         out_dtypes={"D": torch.float32})  # fmt: skip
    d = out["D"]
    assert d.shape == (l, m, n) and d.dtype == torch.float32
    ref = by_hand(a, w.mT, bias, residual.expand(l, m, n), alpha)
    assert rel_err(d, ref) < 1e-5


def test_plain_function_float64_compute_and_aux_outputs(gen):
    m, n, k = 16, 24, 8
    a, b = randn(gen, m, k), randn(gen, k, n)

    def f(acc, scale):
        y = acc * scale
        return {"D": y, "rows": epicute.ops.row_sum(y), "peak": epicute.ops.amax(y)}

    scale = randn(gen, m, 1)  # one per row
    out = reference_gemm(a, b, f, {"scale": scale}, compute_dtype=torch.float64)
    y = (a.double() @ b.double()) * scale.double()
    assert out["D"].dtype == torch.float32 and out["rows"].shape == (m,) and out["peak"].shape == ()
    torch.testing.assert_close(out["D"].double(), y, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(out["rows"].double(), y.sum(1), rtol=1e-7, atol=1e-7)
    assert out["peak"].item() == pytest.approx(y.abs().max().item(), rel=1e-7)


@pytest.mark.parametrize(
    ("a_shape", "b_shape"), [((4, 8), (9, 5)), ((2, 4, 8), (8, 5)), ((2, 4, 8), (3, 8, 5)), ((8,), (8, 5))]
)
def test_inputs_that_do_not_multiply_raise_shape_error(a_shape, b_shape):
    with pytest.raises(ShapeError):
        reference_gemm(torch.ones(a_shape), torch.ones(b_shape), lambda acc: acc)
