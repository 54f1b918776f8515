"""ops.quantize_groups on the GPU: D quantized per row and group of 128 columns in the GEMM's epilogue,
its scales M-major, against the float32 reference; and the chain it exists for, a blockwise fp8 GEMM
whose quantized output feeds the next blockwise fp8 GEMM with no quantize kernel between them."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from epicute.epilogue.group_quant import group_quantize
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def silu_quantized(dtype=E4M3, ue8m0=False):
    def epi(acc, bias):
        q, scales = ops.quantize_groups(ops.silu(acc + bias), dtype, ue8m0=ue8m0)
        return {"D": q, "scales": scales, "rows": ops.row_sum(acc)}

    return epi


def dequantize(q, scales):
    return q.float() * scales.repeat_interleave(128, dim=-1)[..., : q.shape[-1]]


@pytest.mark.parametrize(("dtype", "ue8m0"), [(E4M3, False), (E4M3, True), (E5M2, True)])
@pytest.mark.parametrize("mnk", [(1, 128, 64), (129, 400, 72), (1000, 4112, 1000)])
def test_quantized_d_and_scales_match_the_reference(mnk, dtype, ue8m0):
    m, n, k = mnk
    for _ in range(2):  # the whole path, then the cached path's replay of it (new values)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda").to(dtype)  # fp8 NaN poison
        got = epicute.gemm(a, b, epilogue=silu_quantized(dtype, ue8m0), bias=bias, out=out)
        assert got["D"].data_ptr() == out.data_ptr() and got["scales"].shape == (m, -(-n // 128))
        assert got["scales"].stride(0) == 1  # M-major: the blockwise a_scale layout
        acc = a.float() @ b.float()
        x = torch.nn.functional.silu(acc + bias.float())
        _, scales_ref = group_quantize(x[None], {E4M3: "fp8e4m3", E5M2: "fp8e5m2"}[dtype], ue8m0)
        # A scale is amax / fp8_max: off by the accumulation's rounding, or (UE8M0) equal unless amax sits
        # within that rounding of a power of two.
        if ue8m0:
            assert (got["scales"] == scales_ref[0]).float().mean() > 0.99
        else:
            assert rel_err(got["scales"], scales_ref[0]) < 1e-5
        step = 2.0**-4 if dtype == E4M3 else 2.0**-3
        assert rel_err(dequantize(got["D"], got["scales"]), x) < step
        assert rel_err(got["rows"], acc.sum(-1)) < 1e-4


def test_quantized_output_feeds_the_next_blockwise_gemm():
    """y = gemm(x, w1.t(), blockwise) quantized in its epilogue feeds gemm(y["D"], w2.t(), a_scale=y["scales"])."""
    m, k, hidden, n = 1000, 1024, 2816, 1040
    x = (torch.randn(m, k, device="cuda") * 8).to(E4M3)
    w1, w2 = (torch.randn(hidden, k, device="cuda") * 8).to(E4M3), (torch.randn(n, hidden, device="cuda") * 8).to(E4M3)
    xs = torch.rand(k // 128, m, device="cuda").t() / 64
    w1s, w2s = torch.rand(hidden // 128, k // 128, device="cuda") / 64, torch.rand(-(-n // 128), hidden // 128,
                                                                                    device="cuda") / 64  # fmt: skip

    def silu_then_quantize(acc):
        q, scales = ops.quantize_groups(ops.silu(acc), ue8m0=True)
        return {"D": q, "scales": scales}

    y = epicute.gemm(x, w1.t(), a_scale=xs, b_scale=w1s, epilogue=silu_then_quantize)
    out = epicute.gemm(y["D"], w2.t(), a_scale=y["scales"], b_scale=w2s)

    def deq(t, s, rows_per_scale):
        return t.float() * s.repeat_interleave(rows_per_scale, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]

    h = torch.nn.functional.silu(deq(x, xs, 1) @ deq(w1, w1s, 128).t())
    q_ref, s_ref = group_quantize(h[None], "fp8e4m3", True)
    want = deq(q_ref[0], s_ref[0], 1) @ deq(w2, w2s, 128).t()
    assert rel_err(out, want) < 2e-2
