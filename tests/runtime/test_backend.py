"""epicute.use_backend: the backend of calls that name none."""

from __future__ import annotations

import re

import pytest
import torch

import epicute
from epicute.nn import GatedMLP


def test_calls_naming_no_backend_follow_the_block_and_the_default_comes_back():
    a, b = torch.randn(5, 24, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16)
    with epicute.use_backend("reference"):
        got = epicute.gemm(a, b)
        with epicute.use_backend("kernel"), pytest.raises(epicute.DeviceError, match="CUDA device"):
            epicute.gemm(a, b)  # the inner block's kernel backend: a CPU tensor is refused
        assert epicute.gemm(a, b).shape == (5, 16)  # the outer block's again
    want = a.double() @ b.double()
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2  # bf16 output
    with pytest.raises(epicute.DeviceError, match="CUDA device"):
        epicute.gemm(a, b)  # outside: the kernels


def test_an_explicit_backend_wins_and_unknown_names_are_refused():
    a, b = torch.randn(5, 24, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16)
    with epicute.use_backend("kernel"):
        assert epicute.gemm(a, b, backend="reference").shape == (5, 16)
    with pytest.raises(epicute.ConfigError, match=r"backend='cpu': use 'kernel' or 'reference'"):
        epicute.use_backend("cpu").__enter__()
    with pytest.raises(epicute.ConfigError, match=r"backend='cpu'"):
        epicute.grouped_gemm(a, b.unsqueeze(0), torch.tensor([5], dtype=torch.int32), backend="cpu")


def test_layers_train_on_the_reference_backend():
    """A layer's forward and backward GEMMs all name no backend: the block decides for all of them."""
    layer = GatedMLP(32, 48, dtype=torch.bfloat16)
    x = torch.randn(7, 32, dtype=torch.bfloat16, requires_grad=True)
    with epicute.use_backend("reference"):
        layer(x).sum().backward()
    assert x.grad is not None and layer.gate_up.grad is not None and torch.isfinite(layer.gate_up.grad).all()


def test_a_traced_call_refuses_another_backend_with_the_fix():
    from epicute.runtime.backend import check_traced_backend

    check_traced_backend(None)
    check_traced_backend("kernel")
    with pytest.raises(epicute.ConfigError, match="cannot be compiled with torch.compile; use backend='kernel'"):
        check_traced_backend("reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_scalar_operand_trains_on_the_reference_backend(dtype):
    """A 0-d tensor scalar that requires grad gets its gradient (the kernel reads the number; the reference backend
    computes with the tensor itself), against float64 autograd of the same math."""
    a = torch.randn(7, 40, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(40, 24, dtype=torch.bfloat16, requires_grad=True)
    alpha = (torch.rand((), dtype=dtype) + 0.5).requires_grad_()
    with epicute.use_backend("reference"):
        d = epicute.gemm(a, b, epilogue=lambda acc, alpha: epicute.ops.tanh(acc * alpha), alpha=alpha)
    grad = torch.randn_like(d)
    d.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (a, b, alpha)]
    torch.tanh((leaves[0] @ leaves[1]) * leaves[2]).backward(grad.double())
    for got, want in zip((a.grad, b.grad, alpha.grad), (t.grad for t in leaves)):
        assert got is not None
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2  # bf16 output and operands


def test_a_tensor_scalar_operand_trains_a_grouped_gemm_on_the_reference_backend():
    a = torch.randn(30, 16, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([11, 30], dtype=torch.int32)
    alpha = (torch.rand(()) + 0.5).requires_grad_()
    with epicute.use_backend("reference"):
        d = epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc, alpha: acc * alpha, alpha=alpha)
    grad = torch.randn_like(d)
    d.backward(grad)
    a64, b64 = a.detach().double(), b.detach().double()
    want = torch.cat([a64[:11] @ b64[0], a64[11:] @ b64[1]]).mul(grad.double()).sum()
    assert alpha.grad is not None and abs(alpha.grad.double() - want).item() / want.abs().item() < 2e-2


def test_attention_hook_operands_train_on_the_reference_backend_as_on_the_kernels():
    """A score_mod's per-head vector gets its gradient on the reference backend, against float64 autograd of the
    same math; what the kernels' backward refuses (a number's gradient, an epilogue's operand, an output epilogue
    while training) is refused the same way on both backends."""
    batch, seqlen, heads, dim = 2, 37, 2, 64
    q, k, v = (torch.randn(batch, seqlen, heads, dim, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    slope = torch.rand(heads, requires_grad=True)  # a per-head position bias (ALiBi-like): not shift-invariant

    def score_mod(score, b, h, q_idx, kv_idx, temperature, slope):
        return score * temperature - slope * (q_idx - kv_idx)

    def call(temperature, **epilogue):
        return epicute.attention(q, k, v, causal=True, score_mod=score_mod, temperature=temperature, slope=slope,
                                 **epilogue)  # fmt: skip

    gain = torch.randn(dim)
    with epicute.use_backend("reference"):
        out = call(0.8)
        with pytest.raises(epicute.ConfigError, match="'temperature' requires grad, but a one-element tensor"):
            call(torch.tensor(0.8, requires_grad=True))
        with pytest.raises(epicute.ConfigError, match="'gain' requires grad: only the score_mod's per-head vectors"):
            call(0.8, epilogue=lambda o, gain: o * gain, gain=gain.clone().requires_grad_())
        with pytest.raises(epicute.ConfigError, match="epilogue=: an output epilogue has no backward"):
            call(0.8, epilogue=lambda o, gain: o * gain, gain=gain)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, slope)]
    q64, k64, v64, s64 = leaves
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64) / dim**0.5
    position = torch.arange(seqlen, dtype=torch.float64)
    scores = scores * 0.8 - s64.view(1, -1, 1, 1) * (position.view(-1, 1) - position.view(1, -1))
    scores = scores.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v64)
    want.backward(grad.double())
    for name, got, ref in zip(("q", "k", "v", "slope"), (q, k, v, slope), leaves):
        assert got.grad is not None, name
        assert ((got.grad.double() - ref.grad).norm() / ref.grad.norm()).item() < 2e-2, name  # bf16 inputs, output


def _fp8(*shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: epicute.gemm(_fp8(8, 32), _fp8(16, 32).t(), a_scale=torch.rand(8, 1).requires_grad_(),
                              b_scale=torch.rand(1, 16)),
         "a_scale requires grad: fp8 dequantization scales take no gradient"),
        (lambda: epicute.gemm(torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True),
                              torch.randn(32, 16, dtype=torch.bfloat16), out=torch.empty(8, 16, dtype=torch.bfloat16)),
         "out=/outs= were given"),
        (lambda: epicute.grouped_gemm(torch.randn(16, 10, dtype=torch.bfloat16, requires_grad=True),
                                      torch.randn(10, 24, dtype=torch.bfloat16),
                                      torch.tensor([4, 10], dtype=torch.int32)),
         "a variable-K grouped GEMM (a 2-D b: weight gradients) records no backward"),
    ],
    ids=["scale-alone", "out", "variable-k"],
)  # fmt: skip
def test_what_the_kernels_give_no_gradient_is_refused_on_both_backends(backend, call, words):
    """The reference backend is differentiable torch, but a program tried on it must meet the kernels' rules: the
    same typed error, before any computation (a scale that alone requires grad included: the output would
    otherwise carry no gradient)."""
    with epicute.use_backend(backend), pytest.raises(epicute.GradientError, match=re.escape(words)):
        call()
