"""Autograd of epicute.gemm on the GPU: every backward plan on the kernels, eager and under torch.compile.

Gradients of a, b and every operand against float64 autograd of the same math (tests/gemm/autograd_cases.py),
fresh random inputs each run, ragged sizes (M odd, N not a multiple of the tile, K not one of the k-tile):
K = 200 plans ``recompute`` (the gradient epilogue fused into a GEMM recomputing a @ b), K = 520 plans ``save``
(the forward stores acc, a zero-K pass reads it), and linear epilogues plan ``operands`` (a zero-K pass over the
gradients alone).
"""

from __future__ import annotations

import sys

import pytest
import torch

import epicute
from epicute.gemm.autograd import RECOMPUTE_BELOW_K
from tests.gemm.autograd_cases import cases, forward_backward, gradients, run_case

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
M, N = 333, 264
TOL = 1e-2  # bf16 outputs and gradients, fp32 accumulation
K_PLANS = {"recompute": 200, "save": 520}
assert K_PLANS["recompute"] < RECOMPUTE_BELOW_K <= K_PLANS["save"]


@pytest.mark.parametrize("name", list(cases(M, N, DEVICE)))
@pytest.mark.parametrize("plan", list(K_PLANS))
def test_gradients_match_float64_autograd(name, plan):
    errors = run_case(cases(M, N, DEVICE)[name], M, N, K_PLANS[plan], DEVICE)
    errors.pop("differentiable outputs")
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("name", ["bias", "gelu_bias_residual", "swiglu"])
def test_batched_calls(name):
    errors = run_case(cases(M, N, DEVICE)[name], M, N, K_PLANS["save"], DEVICE, batch=3)
    errors.pop("differentiable outputs")
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("name", ["plain", "gelu_bias_residual", "swiglu", "tanh_scaled_with_aux"])
def test_compiled_training_step(name):
    """torch.compile(fullgraph=True, dynamic=True): the op's registered backward, two sizes on one graph."""
    torch._dynamo.reset()
    compiled = torch.compile(epicute.gemm, fullgraph=True, dynamic=True)
    for m in (M, 2 * M + 1):
        errors = run_case(cases(m, N, DEVICE)[name], m, N, K_PLANS["save"], DEVICE, call=compiled)
        errors.pop("differentiable outputs")
        assert all(e < TOL for e in errors.values()), (m, errors)


@pytest.mark.parametrize("name", ["bias", "gelu_bias_residual", "tanh_scaled_with_aux", "swiglu"])
@pytest.mark.parametrize("plan", list(K_PLANS))
def test_gradients_are_bitwise_identical_run_to_run(name, plan):
    """Every reduction in the backward (a bias's column sums, a scalar's total, the row sums of an aux output)
    combines its partials in a fixed order: the same inputs give the same bits, run after run."""
    runs = []
    for _ in range(3):
        torch.manual_seed(1234)
        a, b, operands, outs, _ = forward_backward(cases(M, N, DEVICE)[name], M, N, K_PLANS[plan], DEVICE)
        runs.append({"a": a.grad, "b": b.grad, **gradients(operands), **{f"out {o}": t for o, t in outs.items()}})
    first = runs[0]
    assert all(t is not None for t in first.values()), sorted(first)
    for again in runs[1:]:
        assert all(torch.equal(first[key], again[key]) for key in first), [
            key for key in first if not torch.equal(first[key], again[key])
        ]


def test_fp8_inputs_train_their_epilogue_operands():
    """fp8 a and b take no gradient; the epilogue's operands do, through the scaled accumulator."""
    a = torch.randn(M, 256, device=DEVICE).to(torch.float8_e4m3fn)
    w = torch.randn(N, 256, device=DEVICE).to(torch.float8_e4m3fn)
    scale_a, scale_b = torch.rand(M, 1, device=DEVICE) + 0.5, torch.rand(1, N, device=DEVICE) + 0.5
    bias = torch.randn(N, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    d = epicute.gemm(a, w.t(), a_scale=scale_a, b_scale=scale_b,
                     epilogue=lambda acc, bias: epicute.ops.silu(acc + bias), bias=bias)  # fmt: skip
    grad = torch.randn_like(d)
    d.backward(grad)
    bias64 = bias.detach().double().requires_grad_()
    acc = (a.double() @ w.double().t()) * scale_a.double() * scale_b.double()
    torch.nn.functional.silu(acc + bias64).backward(grad.double())
    assert ((bias.grad.double() - bias64.grad).norm() / bias64.grad.norm()).item() < TOL


class _CountingForward:
    """A prepared forward launch that counts its replays (PreparedGemmCall has slots: it is wrapped, not patched)."""

    def __init__(self, inner) -> None:
        self.inner, self.replays = inner, 0

    def fits(self, sources) -> bool:
        return self.inner.fits(sources)

    def replay(self, sources):
        self.replays += 1
        return self.inner.replay(sources)


class _CountingBackward:
    """A prepared backward that counts its replays."""

    def __init__(self, inner) -> None:
        self.inner, self.replays = inner, 0

    def __call__(self, ctx, grads):
        self.replays += 1
        return self.inner(ctx, grads)


@pytest.mark.parametrize("name", ["plain", "bias", "gelu_bias_residual", "tanh_scaled_with_aux", "swiglu",
                                  "geglu_row_scale"])  # fmt: skip
@pytest.mark.parametrize("plan", list(K_PLANS))
def test_a_repeat_training_call_replays_its_prepared_forward_and_backward(name, plan):
    """The first eager training call of a signature goes through the op and leaves a PreparedTraining; the next
    one (fresh inputs) replays the forward launch it recorded and records its backward's launches, which the third
    replays (epicute.gemm.training); each trains as the first did (float64 reference)."""
    from epicute.gemm import api as gemm_api
    from epicute.gemm.training import PreparedBackward

    gemm_api._TRAINING_CALLS.clear()
    first = run_case(cases(M, N, DEVICE)[name], M, N, K_PLANS[plan], DEVICE)
    assert len(gemm_api._TRAINING_CALLS) == 1
    entry = next(iter(gemm_api._TRAINING_CALLS.values()))
    entry.forward = counting = _CountingForward(entry.forward)
    second = run_case(cases(M, N, DEVICE)[name], M, N, K_PLANS[plan], DEVICE)
    assert counting.replays == 1
    assert len(entry.backwards) == 1 and all(isinstance(p, PreparedBackward) for p in entry.backwards.values())
    entry.backwards = {key: _CountingBackward(p) for key, p in entry.backwards.items()}
    third = run_case(cases(M, N, DEVICE)[name], M, N, K_PLANS[plan], DEVICE)
    assert counting.replays == 2 and sum(p.replays for p in entry.backwards.values()) == 1
    for errors in (first, second, third):
        assert errors.pop("differentiable outputs")
        assert all(e < TOL for e in errors.values()), errors


def test_a_repeat_passing_one_tensor_twice_trains_both_uses():
    """Recorded with two operand tensors, repeated with one tensor in both places: the forward launch is replayed
    (two reads of one tensor), and the tensor's gradient sums both uses."""
    from epicute.gemm import api as gemm_api

    k = K_PLANS["save"]
    epilogue = lambda acc, r1, r2: epicute.ops.gelu(acc) * r1 + r2
    a = torch.randn(M, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = (torch.randn(k, N, device=DEVICE, dtype=torch.bfloat16) / k**0.5).requires_grad_()
    r1, r2 = (torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    gemm_api._TRAINING_CALLS.clear()
    epicute.gemm(a, b, epilogue=epilogue, r1=r1, r2=r2).sum().backward()
    entry = next(iter(gemm_api._TRAINING_CALLS.values()))
    entry.forward = counting = _CountingForward(entry.forward)
    r = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    d = epicute.gemm(a, b, epilogue=epilogue, r1=r, r2=r)
    grad = torch.randn_like(d)
    d.backward(grad)
    assert counting.replays == 1
    a64, b64, r64 = (t.detach().double().requires_grad_() for t in (a, b, r))
    want = torch.nn.functional.gelu(a64 @ b64) * r64 + r64
    want.backward(grad.double())
    rel = lambda got, ref: ((got.double() - ref).norm() / ref.norm()).item()
    assert rel(d, want.detach()) < TOL
    assert rel(r.grad, r64.grad) < TOL


def test_gelus_derivative_op_matches_float64_on_the_gpu():
    """``gelu_erf_grad``, the op GELU's gradient records, emitted in a kernel's epilogue over values spanning
    [-12, 12], the limits at +-inf, signed zeros and NaN: within 1e-6 of float64 (its erfc approximation 1.5e-7,
    ``rcp.approx`` 1 ulp, ``ex2.approx`` 2 ulp), NaN where the input is, every element written (NaN-poisoned)."""
    m, n = 333, 264
    x = torch.empty(m, n, device=DEVICE).uniform_(-12.0, 12.0)
    x.view(-1)[:6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, float("nan"), 1e-30], device=DEVICE)
    zeros_a, zeros_b = (
        torch.zeros(m, 16, device=DEVICE, dtype=torch.bfloat16),
        torch.zeros(16, n, device=DEVICE, dtype=torch.bfloat16),
    )
    out = torch.full((m, n), float("nan"), device=DEVICE)
    epicute.gemm(zeros_a, zeros_b, epilogue=lambda acc, x: epicute.ops.gelu_erf_grad(acc + x), x=x, out=out)
    x64 = x.double()
    want = 0.5 * (1.0 + torch.erf(x64 / 2**0.5)) + x64 * torch.exp(-0.5 * x64 * x64) / (2 * torch.pi) ** 0.5
    want = torch.where(x64.isinf(), (x64 > 0).double(), want)
    assert torch.equal(out.isnan(), x.isnan())
    finite = ~x.isnan()
    assert (out.double()[finite] - want[finite]).abs().max().item() < 1e-6


def test_a_training_call_finds_all_its_kernels_in_one_precompile_pass_on_the_gpu(monkeypatch, tmp_path):
    """While precompiling from an empty cache, each GEMM whose kernel is missing is computed by the reference on the
    GPU (its stand-in where the calls after it expect it), so one pass finds the forward's kernel and the backward's;
    the values and gradients are the reference's, against float64 autograd."""
    from epicute.gemm.launch import kernel_for
    from epicute.runtime.cache import KERNEL_CACHE
    from epicute.runtime.precompile import missing_kernels

    # nothing of this process's earlier tests: no kernel in memory, no repeated call bound to one
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(KERNEL_CACHE, "_fns", {})
    monkeypatch.setattr(KERNEL_CACHE, "events", {})
    monkeypatch.setattr(sys.modules["epicute.gemm.api"], "_PREPARED_CALLS", {})
    kernel_for.cache_clear()
    k = K_PLANS["save"] + 8  # a TMA-aligned K (a multiple of 8 bf16 elements) past the recomputing passes
    a = torch.randn(M, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = (torch.randn(k, N, device=DEVICE, dtype=torch.bfloat16) / k**0.5).requires_grad_()
    grad, out = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16), {}

    def step():
        out["d"] = epicute.gemm(a, b, epilogue=lambda acc: epicute.ops.tanh(acc))
        out["d"].backward(grad)

    found = missing_kernels(step)
    # the forward (storing acc), the zero-K gradient pass, and the data and weight gradients' GEMMs
    assert len(found) >= 3, [m.key.label for m in found]
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    want = torch.tanh(a64 @ b64)
    want.backward(grad.double())
    for got, expected in ((out["d"], want.detach()), (a.grad, a64.grad), (b.grad, b64.grad)):
        assert got.device == a.device and got.shape == expected.shape
        assert ((got.double() - expected).norm() / expected.norm()).item() < TOL
