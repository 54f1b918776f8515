"""Degenerate K on the GPU: K = 0 with every kind of epilogue output, K = 1 in every layout.

K = 0 means the epilogue of a zero accumulator (aux tiles and reductions
included); K = 1 is an ordinary GEMM whose A may be column-major. Both are
checked against the reference backend on NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, device="cuda", dtype=dtype)


EPILOGUES = {
    "bias_rowsum": lambda acc, bias: {"D": acc * 2.0 + bias, "rs": ops.row_sum(acc + bias)},
    "silu": lambda acc, bias: ops.silu(acc + bias) + 1.0,
    "where": lambda acc, bias: ops.where(acc + bias > 0.0, acc + bias, bias * 0.5),
    "aux_and_reductions": lambda acc, bias: {
        "D": ops.gelu(acc + bias),
        "pre": acc + bias,
        "cm": ops.col_max(acc + bias),
        "ca": ops.col_amax(acc - bias),
        "am": ops.amax(acc + bias),
        "rmax": ops.row_max(acc - bias),
    },  # fmt: skip
    "fp8_quant": lambda acc, bias: {
        "D": ops.quantize(acc + bias, 0.5, torch.float8_e4m3fn),
        "amax": ops.amax(acc + bias),
    },  # fmt: skip
}


def _check(got, ref) -> None:
    got, ref = (got, ref) if isinstance(got, dict) else ({"D": got}, {"D": ref})
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].shape == ref[name].shape and got[name].dtype == ref[name].dtype, name
        out, want = got[name].float().cpu(), ref[name].float()
        if want.abs().max() == 0:
            assert torch.equal(out, want), name  # every element is exactly 0 in both
        else:
            assert rel_err(out, want) < 1e-2, name


@pytest.mark.parametrize("name", list(EPILOGUES))
@pytest.mark.parametrize("shape", [(1, 127, 144), (1, 1000, 48), (2, 1000, 32)], ids=["127x144", "1000x48", "L2"])
@pytest.mark.parametrize("a_major", ["k", "m"])
def test_k0_applies_the_epilogue_to_a_zero_accumulator(name, shape, a_major):
    l, m, n = shape
    batched = l > 1
    a = rand(l, m, 0) if a_major == "k" else rand(l, 0, m).transpose(1, 2)
    b = rand(l, 0, n)
    bias = rand(l, n) if batched else rand(n)
    if not batched:
        a, b = a[0], b[0]
    got = epicute.gemm(a, b, epilogue=EPILOGUES[name], bias=bias)
    _check(got, epicute.gemm(a, b, epilogue=EPILOGUES[name], bias=bias, backend="reference"))


def test_k0_fills_a_poisoned_out_and_outs():
    a, b, bias = rand(127, 0), rand(0, 144), rand(144)
    out = torch.full((127, 144), float("nan"), device="cuda", dtype=torch.bfloat16)
    pre = torch.full((127, 144), float("nan"), device="cuda", dtype=torch.float32)
    got = epicute.gemm(a, b, epilogue=EPILOGUES["aux_and_reductions"], bias=bias, out=out, outs={"pre": pre})
    assert got["D"].data_ptr() == out.data_ptr() and got["pre"].data_ptr() == pre.data_ptr()
    _check(got, epicute.gemm(a, b, epilogue=EPILOGUES["aux_and_reductions"], bias=bias, backend="reference",
                             outs={"pre": pre.cpu()}))  # fmt: skip


def _k1_operands(m: int, n: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A (M, 1) and B (1, N) in one of the four ``a @ b`` layouts (row-major or a transpose view)."""
    a_rows, b_rows = layout[0] == "r", layout[1] == "r"
    a = rand(m, 1) if a_rows else rand(1, m).t()
    b = rand(1, n) if b_rows else rand(n, 1).t()
    return a, b


@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc"])
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias_gelu"])
def test_k1_in_every_layout(layout, epilogue):
    m, n = 257, 136
    a, b = _k1_operands(m, n, layout)
    if epilogue:
        bias = rand(n)
        fn = lambda acc, bias: ops.gelu(acc + bias)
        got = epicute.gemm(a, b, epilogue=fn, bias=bias)
        ref = epicute.gemm(a, b, epilogue=fn, bias=bias, backend="reference")
    else:
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = epicute.gemm(a, b, out=out)
        ref = a.float().cpu() @ b.float().cpu()
    assert rel_err(got.float().cpu(), ref.float()) < 1e-2


def test_reductions_propagate_nan_like_the_reference():
    m, n, k = 257, 136, 72
    a, b = rand(m, k), rand(k, n)
    a[100, 5] = float("nan")  # row 100 of the accumulator is NaN, so every column sees one NaN

    def fn(acc):
        return {"D": acc, "rmax": ops.row_max(acc), "rsum": ops.row_sum(acc), "cmax": ops.col_amax(acc),
                "am": ops.amax(acc)}  # fmt: skip

    got, ref = epicute.gemm(a, b, epilogue=fn), epicute.gemm(a, b, epilogue=fn, backend="reference")
    for name in ("rmax", "rsum", "cmax", "am"):
        assert torch.equal(got[name].isnan().cpu(), ref[name].isnan()), name
    assert got["rmax"][100].isnan() and got["am"].isnan() and got["cmax"].isnan().all()
    finite = torch.ones(m, dtype=torch.bool)
    finite[100] = False
    assert rel_err(got["rmax"][finite].cpu(), ref["rmax"][finite]) < 1e-2
