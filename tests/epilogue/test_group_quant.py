"""ops.quantize_groups on the CPU: the reference's math, the errors, the plan and sm_90a compiles
(GPU correctness: tests/gemm/test_group_quant_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from epicute.epilogue.group_quant import AMAX_FLOOR, ceil_pow2, group_quantize
from epicute.gemm import GemmProblem, plan_gemm
from tests.conftest import rel_err

E4M3 = torch.float8_e4m3fn


def quantizing(ue8m0=False, dtype=E4M3):
    def epi(acc, bias):
        q, scales = ops.quantize_groups(ops.gelu(acc + bias), dtype, ue8m0=ue8m0)
        return {"D": q, "scales": scales}

    return epi


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2])
def test_reference_quantizes_per_row_and_group_of_128_columns(ue8m0, dtype):
    m, n, k = 37, 304, 64  # a ragged last group of 48 columns
    a, b, bias = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16(), torch.randn(n)
    got = epicute.gemm(a, b, epilogue=quantizing(ue8m0, dtype), bias=bias, backend="reference")
    x = torch.nn.functional.gelu(a.double() @ b.double() + bias.double())
    assert got["D"].dtype == dtype and got["D"].shape == (m, n) and got["scales"].shape == (m, 3)
    amax = torch.stack([x[:, g * 128 : (g + 1) * 128].abs().amax(dim=1) for g in range(3)], dim=1)
    fp8_max = torch.finfo(dtype).max
    want = amax.clamp(min=AMAX_FLOOR) / fp8_max
    scales = got["scales"].double()
    if ue8m0:
        assert torch.all(torch.log2(scales) == torch.round(torch.log2(scales)))  # powers of two
        assert torch.all((scales >= want * (1 - 1e-6)) & (scales < 2 * want))
    else:
        assert rel_err(scales, want) < 1e-6
    dequantized = got["D"].double() * scales.repeat_interleave(128, dim=1)[:, :n]
    assert rel_err(dequantized, x) < (2.0**-4 if dtype == E4M3 else 2.0**-3)
    assert got["D"].double().abs().amax() <= fp8_max


def test_all_zero_groups_get_the_floor_and_ceil_pow2_is_exact():
    zeros = torch.zeros(1, 2, 130)
    q, scales = group_quantize(zeros, "fp8e4m3", ue8m0=False)
    assert torch.all(scales == torch.tensor(AMAX_FLOOR, dtype=torch.float32) / 448) and torch.all(q == 0)
    values = torch.tensor([1.0, 1.5, 0.75, 2.0**-20, 3.0])
    assert ceil_pow2(values).tolist() == [1.0, 2.0, 1.0, 2.0**-20, 4.0]


@pytest.mark.parametrize(
    ("epilogue", "match"),
    [
        (lambda acc: {"D": acc, "q": ops.quantize_groups(acc)[0], "s": ops.quantize_groups(acc)[1]}, "return it as D"),
        (lambda acc: {"D": ops.quantize_groups(acc)[0]}, "return its scales too"),
        (lambda acc: {"D": ops.quantize_groups(acc)[0] * 2.0, "s": ops.quantize_groups(acc)[1]}, "ends the epilogue"),
        (lambda acc: {"D": ops.quantize_groups(acc)[0], "s": ops.quantize_groups(acc)[1], "pre": acc},
         "aux tile outputs"),
        (lambda acc: ops.quantize_groups(acc, torch.bfloat16)[0], "not an fp8 dtype"),
    ],
    ids=["not-D", "no-scales", "used-after", "aux-tile", "bf16"],
)  # fmt: skip
def test_misuse_gets_typed_errors(epilogue, match):
    a = torch.randn(16, 64).bfloat16()
    with pytest.raises(epicute.EpilogueError, match=match):
        epicute.explain(a, torch.randn(64, 256).bfloat16(), epilogue=epilogue, file=None)


def test_plans_hold_whole_groups_and_explain_shows_both_passes():
    a = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    b = torch.empty(4096, 8192, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(8192, dtype=torch.bfloat16, device="meta")
    for pins in ({}, {"schedule": "pingpong"}):
        plan = epicute.explain(a, b, epilogue=quantizing(True), bias=bias, config=pins, file=None)
        assert plan.config.tile_n % 128 == 0
        chain = [line.split()[1] for line in plan.epilogue.chain]
        assert chain.index("group_amax") < chain.index("group_scales") < chain.index("group_quantize")
    with pytest.raises(epicute.ConfigError, match="whole groups of 128 columns"):
        epicute.explain(a, b, epilogue=quantizing(), bias=bias, config={"tile_n": 64}, file=None)
    assert plan_gemm(GemmProblem(64, 64, 64), "h100-sxm").epilogue.group_n == 0


@pytest.mark.compile
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-blockwise"])
def test_quantizing_variants_compile_without_spills(fp8, ptxas_report):
    from epicute.gemm.api import describe_call
    from epicute.gemm.compile import compile_gemm
    from epicute.gemm.prepare import prepare

    m, n, k = 1000, 4096, 1024
    dtype = E4M3 if fp8 else torch.bfloat16
    a = torch.empty(m, k, dtype=dtype, device="meta")
    w = torch.empty(n, k, dtype=dtype, device="meta")
    scales = (torch.empty(m, 8, device="meta"), torch.empty(32, 8, device="meta")) if fp8 else (None, None)
    operands = {"bias": torch.empty(n, dtype=torch.bfloat16, device="meta")}
    _, _, request, _ = describe_call(a, w.t(), quantizing(True), None, None, None, None, None, operands, False, scales)
    prepared = prepare(request)
    assert prepared.fusion.group_quant is not None and prepared.plan.problem.block_scaled == fp8
    assert callable(compile_gemm(prepared.variant()))
    spills, _ = ptxas_report()
    assert max(spills) == 0
