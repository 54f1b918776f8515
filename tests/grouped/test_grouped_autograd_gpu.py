"""Autograd of epicute.grouped_gemm on the GPU (MoE experts): rows and gathered rows (top-k routing, tokens feeding
several experts), gated SwiGLU times a router weight, per-group biases, ragged groups with an empty one, both
backward plans (K = 200 recomputes a @ b with the gradient epilogue; K = 520 saves acc), eager and compiled.
Gradients against float64 autograd group by group (tests/grouped/autograd_cases.py)."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.gemm.autograd import RECOMPUTE_BELOW_K
from tests.grouped.autograd_cases import CASES, run_grouped_case

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
TOL = 1e-2
SIZES = [129, 0, 301, 77, 250]
N = 264
K_PLANS = {"recompute": 200, "save": 520}
assert K_PLANS["recompute"] < RECOMPUTE_BELOW_K <= K_PLANS["save"]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("plan", list(K_PLANS))
@pytest.mark.parametrize("tokens", [None, 401], ids=["rows", "gathered"])
def test_gradients_match_float64_autograd(name, plan, tokens):
    errors = run_grouped_case(name, SIZES, K_PLANS[plan], N, DEVICE, tokens=tokens)
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("name", ["bias_gelu", "swiglu_times_router_weight"])
def test_compiled_training_step(name):
    torch._dynamo.reset()
    compiled = torch.compile(epicute.grouped_gemm, fullgraph=True, dynamic=True)
    for sizes in (SIZES, [s + 3 for s in SIZES]):
        errors = run_grouped_case(name, sizes, K_PLANS["save"], N, DEVICE, tokens=401, call=compiled)
        assert all(e < TOL for e in errors.values()), (sizes, errors)
