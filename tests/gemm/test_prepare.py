"""One path from call to kernel: what ``explain`` reports is what ``gemm`` launches.

``epicute.gemm`` runs here on CPU tensors up to the launch: the GPU check is
lifted and ``bind_gemm`` records the plan and fusion it is handed instead of
binding and running a kernel. Everything before it (validation, operand resolution, tracing,
D's dtype, planning) is the real code, so each case compares the plan explain
returns with the plan the launch got, field by field, over epilogues that settle
D's dtype in every way there is.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import epicute
from epicute import AlignmentError, ops
from epicute.epilogue import library
from epicute.epilogue.dtypes import TORCH_TO_IR
from epicute.gemm import GemmProblem, render_plan
from epicute.gemm import api as api_module
from epicute.gemm import validate as validate_module
from epicute.gemm.prepare import GemmRequest, prepare

M, N, K = 200, 144, 72


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, dtype=dtype)


@pytest.fixture
def launches(monkeypatch):
    """``epicute.gemm`` on CPU tensors as far as the launch; returns the list of (plan, fusion, out dtype) launched."""
    seen = []
    monkeypatch.setattr(validate_module, "check_on_one_hopper_gpu", lambda *named: None)

    def record(call, plan, fusion=None, *args, **kwargs):
        seen.append((plan, fusion, call.out_dtype))

    monkeypatch.setattr(api_module, "bind_gemm", record)
    monkeypatch.setattr(api_module, "_run_and_record", lambda launch, fast: torch.empty(0))
    return seen


def _cases():
    bias, scale_n = rand(N), rand(N, dtype=torch.float32)
    scale_m = rand(M, dtype=torch.float32)
    c_tile = rand(M, N)
    aux = lambda acc, bias: {"D": ops.gelu(acc + bias), "pre": acc + bias}
    reductions = lambda acc: {"D": acc, "rs": ops.row_sum(acc), "cm": ops.col_amax(acc), "am": ops.amax(acc)}
    return {
        "plain": ({}, {}),
        "pinned_plain": ({}, {"config": {"tile_n": 128, "cluster_m": 1}}),
        "plain_fp32_out": ({}, {"out_dtype": torch.float32}),
        "library_plain": ({"epilogue": library.plain, "C": c_tile, "alpha": 0.5, "beta": 2.0}, {}),
        "row_col_quant": (
            {"epilogue": library.row_col_quant, "scale_m": scale_m, "scale_n": scale_n},
            {"out_dtypes": {"D": torch.float8_e4m3fn}},
        ),
        "tensor_quant": ({"epilogue": library.tensor_quant, "scale": 0.05}, {}),
        "tensor_quant_e5m2_out": ({"epilogue": library.tensor_quant, "scale": 0.05}, {"out_dtype": torch.bfloat16}),
        "own_cast": ({"epilogue": lambda acc: ops.cast(acc, torch.float16)}, {}),
        "aux_tile": ({"epilogue": aux, "bias": bias}, {"out_dtypes": {"pre": torch.float32}}),
        "aux_fp8_via_outs": ({"epilogue": aux, "bias": bias},
                             {"outs": {"pre": torch.empty(M, N, dtype=torch.float8_e5m2)}}),
        "reductions": ({"epilogue": reductions}, {}),
        "pinned_epilogue": ({"epilogue": aux, "bias": bias}, {"config": {"tile_n": 64, "persistent": False}}),
        "out_given": ({"epilogue": lambda acc, bias: acc + bias, "bias": bias},
                      {"out": torch.empty(M, N, dtype=torch.float16)}),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_cases()))
def test_explain_reports_the_plan_gemm_launches(launches, name):
    epilogue_args, call_args = _cases()[name]
    a, b = rand(M, K), rand(K, N)
    explained = epicute.explain(a, b, file=None, **epilogue_args, **call_args)
    epicute.gemm(a, b, **epilogue_args, **call_args)
    ((launched, fusion, out_dtype),) = launches
    for field in dataclasses.fields(launched):
        assert getattr(explained, field.name) == getattr(launched, field.name), field.name
    assert render_plan(explained) == render_plan(launched)
    assert TORCH_TO_IR[out_dtype] == launched.problem.d_dtype  # D is stored as planned
    if fusion is not None:
        assert fusion.buffers() == launched.epilogue


def test_tensor_quant_is_explained_with_the_fp8_d_it_stores():
    a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    plan = epicute.explain(a, a, epilogue=epicute.epilogues.tensor_quant, scale=0.05, file=None)
    text = render_plan(plan)
    assert plan.problem.d_dtype == "fp8e4m3" and "D fp8e4m3 row-major" in text
    assert "-> bf16" not in text and "quantize" in text


def test_every_entry_point_refuses_an_fp8_aux_tile_tma_cannot_store():
    # N = 136 is a multiple of 8 (bf16 D is fine) but not of 16, which an fp8 aux tile's rows need.
    a, b, bias = rand(M, K), rand(K, 136), rand(136)
    fn = lambda acc, bias: {"D": acc + bias, "q": ops.quantize(acc, 1.0)}
    for call in (
        lambda: epicute.explain(a, b, epilogue=fn, bias=bias, file=None),
        lambda: epicute.gemm(a, b, epilogue=fn, bias=bias, backend="reference"),
    ):
        with pytest.raises(AlignmentError, match=r"aux output 'q' .* N=136 is a multiple of 16"):
            call()


def test_prepare_is_one_function_of_the_request():
    request = GemmRequest(GemmProblem(M, N, K), library.tensor_quant, (("scale", "scalar", "fp32"),))
    first, again = prepare(request), prepare(request)
    assert first.plan == again.plan and first.plan.problem.d_dtype == "fp8e4m3"
    assert first.output_dtypes == {"D": "fp8e4m3", "amax": "fp32"}
