"""epicute.nn.functional on the CPU: the GEMMs computed by the reference backend (the same call sequence, the
fused MLP backward's derived epilogues included), against float64 autograd. The kernels' run:
tests/nn/test_functional_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import epicute
from epicute.epilogue.backward import SAVED, gradient_graph, read_from_accumulator
from epicute.nn import functional as EF
from tests.nn.functional_cases import gated_mlp_step, linear_step, mlp_step

TOL = 1e-2  # bf16 storage of h, the pre-activation and the gradients between the GEMMs (8 significant bits)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_gradients(reference_layers, activation, bias):
    errors = mlp_step((3, 11), 48, 80, "cpu", activation, bias)
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_mlp_gradients(reference_layers, activation):
    errors = gated_mlp_step((37,), 48, 80, "cpu", activation)
    assert all(e < TOL for e in errors.values()), errors


def test_linear_with_bias_and_an_epilogue(reference_layers):
    errors = linear_step((3, 11), 48, 40, "cpu")
    assert all(e < TOL for e in errors.values()), errors


def test_linear_stores_the_out_dtype_asked_for(reference_layers):
    """``out_dtype=torch.float32`` on bf16 inputs: an fp32 output (no rounding to bf16 first) whose gradients reach
    the bf16 inputs; against float64 autograd."""
    x = torch.randn(3, 17, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(40, 64) / 8).to(torch.bfloat16).requires_grad_()
    b = torch.randn(40, dtype=torch.bfloat16, requires_grad=True)
    y = EF.linear(x, w, b, epilogue=lambda acc: epicute.ops.gelu(acc), out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (3, 17, 40)
    grad = torch.randn_like(y)
    y.backward(grad)
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = F.gelu(F.linear(*ref))
    want.backward(grad.double())
    for got, expected in ((y, want.detach()), *((t.grad, r.grad) for t, r in zip((x, w, b), ref))):
        assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-2


def test_the_down_projections_backward_epilogue_reads_its_accumulator_as_dh():
    """The fused backward's epilogue: no grad_D operand (dh is the accumulator), the saved pre-activation, and the
    bias gradient as a col_sum of dacc."""
    graph = epicute.epilogue(lambda acc: epicute.ops.gelu(acc)).trace({})
    fused = read_from_accumulator(gradient_graph(graph, {"D": "bf16"}, saved_acc=True), "D", "d_bias")
    assert [name for name, _ in fused.inputs] == [SAVED["acc"]]
    assert fused.output_node("d_bias").op == "col_sum"
    assert fused.output_node("d_bias").args == (dict(fused.outputs)["D"],)


def test_bad_shapes_are_shape_errors():
    x, w1, w2 = torch.randn(4, 16), torch.randn(32, 16), torch.randn(16, 24)
    with pytest.raises(epicute.ShapeError, match=r"do not chain: need the down weight \(d_out, 32\)"):
        EF.mlp(x, w1, None, w2, None)
    with pytest.raises(epicute.ShapeError, match=r"its last dimension must be 16"):
        EF.linear(torch.randn(4, 15), w1)
    with pytest.raises(epicute.EpilogueError, match=r"activation='swish'"):
        EF.mlp(x, w1, None, torch.randn(16, 32), None, activation="swish")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_bad_routing_is_refused_with_the_fix(reference_layers, fp8):
    from epicute.nn import fp8_moe_experts

    experts = fp8_moe_experts if fp8 else EF.moe_experts
    x = torch.randn(6, 128, dtype=torch.bfloat16)
    gate_up, down = torch.randn(4, 128, 128, dtype=torch.bfloat16), torch.randn(4, 128, 64, dtype=torch.bfloat16)
    index, weights = torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    cases = [
        ((index.float(), weights, "silu"), epicute.DtypeError, r"top_k_index has dtype torch.float32: pass"),
        ((index.bool(), weights, "silu"), epicute.DtypeError, r"top_k_index has dtype torch.bool"),
        ((index, weights.long(), "silu"), epicute.DtypeError, r"top_k_weights has dtype torch.int64"),
        ((index, weights, "swish"), epicute.EpilogueError, r"activation='swish': the experts take one of"),
        ((index + 3, weights, "silu"), epicute.ShapeError, r"expert ids 3\.\.6: the layer has 4 experts"),
        ((index - 1, weights, "silu"), epicute.ShapeError, r"expert ids -1\.\.2"),
    ]
    for (idx, w, activation), error, message in cases:
        with pytest.raises(error, match=message):
            experts(x, gate_up, down, idx, w, activation)


@pytest.mark.parametrize("interleaved", [False, True], ids=["transformers_layout", "interleaved"])
def test_moe_experts_gradients(reference_layers, interleaved):
    """Against float64 autograd of the HF expert loop's math; every input gets its gradient (the routing weights
    too); an expert no token picks is fine; the result is the same bits run to run (tokens sum their rows in slot
    order, no atomics). ``interleaved``: the layer's own interleaved gate/up weight, its gradient interleaved too."""
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 37, 48, 40, 5, 2
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) / hidden**0.5).requires_grad_()
    down = (torch.randn(experts, hidden, inter, dtype=torch.bfloat16) / inter**0.5).requires_grad_()
    index = torch.stack([torch.randperm(experts - 1)[:top_k] for _ in range(tokens)])  # expert 4 never picked
    weights = torch.softmax(torch.randn(tokens, top_k), -1).requires_grad_()
    weight = epicute.interleave_gate_up(*gate_up.detach().chunk(2, dim=-2)).requires_grad_() if interleaved else gate_up
    y = EF.moe_experts(x, weight, down, index, weights, interleaved=interleaved)
    assert torch.equal(y, EF.moe_experts(x, weight, down, index, weights, interleaved=interleaved))  # same bits
    grad = torch.randn_like(y)
    y.backward(grad)
    if interleaved:  # the gradient in the weight's layout: de-interleaved, it is the transformers-layout gradient
        blocks = weight.grad.unflatten(1, (inter // 8, 2, 8))
        gate_up.grad = torch.cat([blocks[:, :, 0].flatten(1, 2), blocks[:, :, 1].flatten(1, 2)], dim=1)
    x64, gu64, d64, w64 = (t.detach().double().requires_grad_() for t in (x, gate_up, down, weights))
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            e = int(index[t, j])
            g, u = F.linear(x64[t], gu64[e]).chunk(2)
            want = want.index_add(0, torch.tensor([t]), (w64[t, j] * F.linear(F.silu(g) * u, d64[e]))[None])
    want.backward(grad.double())
    errors = {name: ((got.double() - ref).norm() / ref.norm()).item() for name, got, ref in (
        ("out", y, want.detach()), ("x", x.grad, x64.grad), ("gate_up", gate_up.grad, gu64.grad),
        ("down", down.grad, d64.grad), ("weights", weights.grad, w64.grad))}  # fmt: skip
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("gated", [False, True])
def test_explain_mlp_shows_the_step_s_gemms_and_where_the_derivative_runs(gated):
    """On meta tensors: the six GEMMs of a training step, the derivative in dh's epilogue, b1's gradient its
    column sum (with a bias), d gate and d up its two outputs (gated)."""
    import io

    meta = dict(device="meta", dtype=torch.bfloat16)
    x, w2 = torch.empty(4, 1001, 512, **meta), torch.empty(512, 1048, **meta)
    w1 = torch.empty(2 * 1048 if gated else 1048, 512, **meta)
    b1, b2 = (None, None) if gated else (torch.empty(1048, **meta), torch.empty(512, **meta))
    text = io.StringIO()
    plans = EF.explain_mlp(x, w1, w2, b1, b2, activation="silu", gated=gated, file=text)
    assert list(plans) == ["up", "down", "dh", "dx", "dw1", "dw2"]
    shapes = {name: (p.problem.m, p.problem.n, p.problem.k) for name, p in plans.items()}
    assert shapes["up"] == (4004, w1.shape[0], 512) and shapes["dh"] == (4004, 1048, 512)  # gated: B's 2N columns
    assert shapes["dx"] == (4004, 512, w1.shape[0]) and shapes["dw1"] == (w1.shape[0], 512, 4004)
    dh = text.getvalue().split("=== dh")[1].split("=== dx")[0]
    assert "sigmoid" in dh  # silu's derivative, traced from silu
    assert ("d_bias = col_sum" in dh) == (not gated)
    assert ("D_up" in dh) == gated
    with pytest.raises(epicute.ShapeError, match="gated MLP has no biases"):
        EF.explain_mlp(x, w1, w2, torch.empty(1048, **meta), None, gated=True, file=None)


def test_the_mlp_programs_are_traced_once(monkeypatch):
    """The MLPs' saving epilogues name a module table (SAVED): their trace keys hold its contents, so a repeat call
    reuses the trace and plan of the first (a key of None would trace, lower and plan them on every call)."""
    from epicute.epilogue.tracer import Epilogue, trace_key
    from epicute.gemm import api as gemm_api

    programs = [EF._programs(act, gated, bias) for act, gated, bias in
                (("silu", True, False), ("gelu", False, True), ("gelu", False, False))]  # fmt: skip
    programs.append(EF._expert_programs("silu"))
    assert all(trace_key(fn) is not None for pair in programs for fn in pair)
    traces = []
    trace = Epilogue.trace
    monkeypatch.setattr(Epilogue, "trace", lambda self, *a, **k: traces.append(self.name) or trace(self, *a, **k))
    forward, _ = EF._programs("silu", True, False)
    a, b = (torch.empty(*s, dtype=torch.bfloat16, device="meta") for s in ((64, 128), (128, 256)))

    def prepare_call():  # the kernel path's preparation of gated_mlp's forward GEMM (no GPU needed to prepare)
        request = gemm_api.describe_call(a, b, forward, None, None, None, None, None, {}, False, (None, None), True)[2]
        return gemm_api._prepare_memo(request)

    first = prepare_call()
    assert traces
    traces.clear()
    assert prepare_call() is first and traces == []


def test_a_repeated_experts_step_traces_no_epilogue(reference_layers, monkeypatch):
    """The fp8 experts' grouped GEMMs (forward and derivative epilogues) prepare once: a second step traces none."""
    from epicute.epilogue.tracer import Epilogue
    from epicute.nn import fp8_moe_experts

    x = torch.randn(37, 128, dtype=torch.bfloat16, requires_grad=True)
    experts = ((torch.randn(3, 128, 128) * 0.1).bfloat16().requires_grad_(),
               (torch.randn(3, 128, 64) * 0.1).bfloat16().requires_grad_())  # fmt: skip
    route = torch.randint(0, 3, (37, 2)), torch.rand(37, 2, requires_grad=True)
    traces = []
    trace = Epilogue.trace
    monkeypatch.setattr(Epilogue, "trace", lambda self, *a, **k: traces.append(self.name) or trace(self, *a, **k))
    fp8_moe_experts(x, *experts, *route).float().sum().backward()
    assert traces
    traces.clear()
    fp8_moe_experts(x, *experts, *route).float().sum().backward()
    assert traces == []
