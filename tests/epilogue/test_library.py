"""The ready epilogues (CK Tile's default, row/col-quant and tensor-quant schedules) against hand-written torch."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.epilogue.reference import reference_gemm
from epicute.epilogue.schedule import schedule
from epicute.epilogue.tracer import Epilogue
from tests.conftest import rel_err
from tests.epilogue.conftest import away_from_zero, randn

E4M3_MAX = 448.0


def test_library_is_exported_and_made_of_epilogues():
    for name in ("plain", "row_col_quant", "tensor_quant"):
        assert isinstance(getattr(epicute.epilogues, name), Epilogue)
    assert epicute.epilogues.plain.params == ("alpha", "beta", "C")
    assert epicute.epilogues.row_col_quant.params == ("scale_m", "scale_n")
    assert epicute.epilogues.tensor_quant.params == ("scale",)


@pytest.mark.parametrize("c_shape", ["tile", "row", "col"])
def test_plain(gen, c_shape):
    m, n, k = 33, 48, 16
    a, b = randn(gen, m, k), randn(gen, k, n)
    c = {"tile": randn(gen, m, n), "row": randn(gen, n), "col": randn(gen, m, 1)}[c_shape]
    alpha, beta = float(randn(gen, 1)), float(randn(gen, 1))
    out = reference_gemm(a, b, epicute.epilogues.plain, {"alpha": alpha, "beta": beta, "C": c})["D"]
    ref = alpha * (a.double() @ b.double()) + beta * c.double()
    assert out.shape == (m, n) and rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_row_col_quant_on_a_square_problem(gen, out_dtype):
    l, m, k = 2, 40, 32
    a = randn(gen, l, m, k).to(torch.float8_e4m3fn).float()  # fp8-valued inputs, dequantized by the scales
    b = randn(gen, l, k, m).to(torch.float8_e4m3fn).float()
    scale_m = away_from_zero(gen, l, m, positive=True) * 8  # per token (row); M == N: kinds come from annotations
    scale_n = away_from_zero(gen, m, positive=True)  # per channel (column), shared by the batches
    out = reference_gemm(a, b, epicute.epilogues.row_col_quant, {"scale_m": scale_m, "scale_n": scale_n},
                         out_dtypes={"D": out_dtype})["D"]  # fmt: skip
    ref = (a.double() @ b.double()) * scale_m.double()[:, :, None] * scale_n.double()
    assert out.dtype == out_dtype and out.shape == (l, m, m)
    if out_dtype == torch.float8_e4m3fn:
        assert ref.abs().max() > E4M3_MAX, "the test must exercise saturation"
        assert torch.equal(out.float(), ref.float().clamp(-E4M3_MAX, E4M3_MAX).to(out_dtype).float())
    else:
        assert rel_err(out, ref) < 3e-3


def test_tensor_quant(gen):
    l, m, n, k = 2, 24, 40, 32
    a, b = randn(gen, l, m, k, dtype=torch.bfloat16), randn(gen, l, k, n, dtype=torch.bfloat16)
    scale = 30.0
    out = reference_gemm(a, b, epicute.epilogues.tensor_quant, {"scale": scale})
    y = (a.double() @ b.double()) * scale
    assert set(out) == {"D", "amax"}
    assert out["D"].dtype == torch.float8_e4m3fn and out["D"].shape == (l, m, n)
    assert y.abs().max() > E4M3_MAX, "the test must exercise saturation"
    # The reference rounds its fp32 product to e4m3, this test's float64 one may sit across a rounding boundary from
    # it: every value within one e4m3 step (3 mantissa bits; 2^-9 below the normal range) of the saturated product,
    # and the saturated ones exactly at the format's largest value.
    got, want = out["D"].double(), y.clamp(-E4M3_MAX, E4M3_MAX)
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=2.0**-6))) - 3)
    assert ((got - want).abs() <= step).all()
    saturated = y.abs() > E4M3_MAX
    assert saturated.any() and (got[saturated] == torch.sign(y[saturated]) * E4M3_MAX).all()
    assert out["amax"].shape == () and out["amax"].dtype == torch.float32
    assert out["amax"].item() == pytest.approx(y.abs().max().item(), rel=1e-6)


def test_ready_epilogues_schedule_like_ck_tiles(gen):
    plain = epicute.epilogues.plain.trace({"alpha": "scalar", "beta": "scalar", "C": "tile"})
    assert [s.kind for s in schedule(plain).stages] == [
        "slice_acc", "load_tiles", "compute", "cast", "store_smem", "fence_barrier", "tma_store", "advance",
    ]  # fmt: skip
    rcq = schedule(epicute.epilogues.row_col_quant.trace({"scale_m": "col", "scale_n": "row"}))
    # Row vectors come first, then column vectors: the order of the kernel's vector buffers.
    assert rcq.stages[0].kind == "load_vectors" and rcq.vector_operands == ("scale_n", "scale_m")
    tq = schedule(epicute.epilogues.tensor_quant.trace({"scale": "scalar"}))
    assert tq.reductions == ("amax",) and tq.scalar_operands == ("scale",)
    assert "fp32 -> fp8e4m3 (saturating)" in str(tq)
