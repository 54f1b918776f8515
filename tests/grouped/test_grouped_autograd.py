"""Autograd of epicute.grouped_gemm on the CPU: the kernel replaced by the reference backend (same op, backward plan,
gradient epilogue, scatter of gathered rows, variable-K weight gradient), gradients against float64 autograd group
by group. The kernels' run is tests/grouped/test_grouped_autograd_gpu.py."""

from __future__ import annotations

import re
import sys

import pytest
import torch

import epicute
from epicute.gemm.autograd import RECOMPUTE_BELOW_K
from tests.grouped.autograd_cases import CASES, run_grouped_case

TOL = 1e-2  # bf16 outputs and gradients, fp32 accumulation
SIZES = [5, 0, 17, 11]  # an empty group, odd sizes


@pytest.fixture
def reference_kernels(monkeypatch):
    """The op's real implementation computed by the reference backend (while torch.compile traces, the op's fake
    implementation stands for it)."""
    api = sys.modules["epicute.grouped.api"]
    kernel_grouped = api.grouped_gemm
    monkeypatch.setattr(api, "grouped_gemm",
                        lambda a, b, offsets, /, **kwargs: kernel_grouped(a, b, offsets, **kwargs, backend="reference"))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("k", [40, RECOMPUTE_BELOW_K + 8], ids=["recompute", "save"])
@pytest.mark.parametrize("tokens", [None, 19], ids=["rows", "gathered"])
def test_gradients_match_float64_autograd(reference_kernels, name, k, tokens):
    errors = run_grouped_case(name, SIZES, k, 24, "cpu", tokens=tokens)
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("name", ["bias_gelu", "swiglu_times_router_weight"])
def test_compiled_training_matches_eager(reference_kernels, name):
    compiled = torch.compile(epicute.grouped_gemm, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    for sizes in (SIZES, [s + 3 for s in SIZES]):
        torch.manual_seed(len(sizes) + sum(sizes))
        eager = run_grouped_case(name, sizes, RECOMPUTE_BELOW_K + 8, 24, "cpu", tokens=19)
        torch.manual_seed(len(sizes) + sum(sizes))
        traced = run_grouped_case(name, sizes, RECOMPUTE_BELOW_K + 8, 24, "cpu", tokens=19, call=compiled)
        assert traced == pytest.approx(eager, rel=1e-6, abs=1e-9)  # the same errors: the same gradients


def _bf16(*shape, grad=False):
    return torch.randn(*shape, dtype=torch.bfloat16).requires_grad_(grad)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda offs: epicute.grouped_gemm(_bf16(16, 10, grad=True), _bf16(33, 24), offs),
         "a variable-K grouped GEMM (a 2-D b: weight gradients) records no backward"),
        (lambda offs: epicute.grouped_gemm(_bf16(33, 16, grad=True), _bf16(3, 16, 24), offs, out=_bf16(33, 24)),
         "out=/outs= were given"),
    ],
    ids=["variable-k", "out"],
)  # fmt: skip
def test_what_has_no_gradient_is_refused_before_anything_else(call, words):
    offsets = torch.tensor([10, 20, 33], dtype=torch.int32)
    with pytest.raises(epicute.GradientError, match=re.escape(words)):
        call(offsets)
    with torch.no_grad(), pytest.raises(epicute.DeviceError, match="cuda"):
        call(offsets)


def test_explain_grouped_prints_the_backward_plan(capsys):
    meta = {"device": "meta", "dtype": torch.bfloat16}
    x, w = torch.empty(16384, 4096, **meta), torch.empty(8, 2048, 4096, **meta)
    offsets = torch.empty(8, dtype=torch.int32, device="meta")
    score = torch.empty(16384, 1, device="meta")
    epicute.explain_grouped(x, w.transpose(-2, -1), offsets, gated=True, score=score,
                            epilogue=lambda gate, up, score: epicute.ops.silu(gate) * up * score)  # fmt: skip
    backward = capsys.readouterr().out.split("under autograd")[1]
    assert "backward: save (the forward also stores acc (64.0 MiB)" in backward
    assert "D, D_up, d_score <- " in backward and "row_sum" in backward  # the router weight's gradient: per row
    epicute.explain_grouped(x.t(), torch.empty(16384, 4096, **meta), offsets)
    assert "a variable-K call takes no gradient" in capsys.readouterr().out
