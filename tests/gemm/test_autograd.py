"""Autograd of epicute.gemm on the CPU: the kernel replaced by the reference backend (same op, same backward
plan, gradient graph and routing), gradients against float64 autograd of the same math. The kernels' run is
tests/gemm/test_autograd_gpu.py."""

from __future__ import annotations

import sys

import pytest
import torch

import epicute
from epicute.epilogue.backward import differentiable_outputs, gradient_graph, reads_accumulator
from epicute.gemm.autograd import RECOMPUTE_BELOW_K, plan_backward
from tests.gemm.autograd_cases import cases, run_case

M, N = 33, 24
TOL = 1e-2  # bf16 outputs and gradients (8 significant bits), fp32 accumulation


@pytest.fixture
def reference_kernels(monkeypatch):
    """The op's real implementation computed by the reference backend (while torch.compile traces, the op's fake
    implementation stands for it)."""
    api = sys.modules["epicute.gemm.api"]
    kernel_gemm = api.gemm
    monkeypatch.setattr(api, "gemm", lambda a, b, /, **kwargs: kernel_gemm(a, b, **kwargs, backend="reference"))


@pytest.mark.parametrize("name", list(cases(M, N, "cpu")))
@pytest.mark.parametrize("k", [40, RECOMPUTE_BELOW_K + 8], ids=["recompute", "save"])
def test_gradients_match_float64_autograd(reference_kernels, name, k):
    errors = run_case(cases(M, N, "cpu")[name], M, N, k, "cpu")
    outputs = errors.pop("differentiable outputs")
    assert outputs == (["D", "pre"] if name == "tanh_scaled_with_aux" else ["D"])  # not the row_sum statistic
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("name", ["bias", "gelu_bias_residual"])
def test_batched_calls_sum_broadcast_operands_over_the_batch(reference_kernels, name):
    errors = run_case(cases(M, N, "cpu")[name], M, N, 40, "cpu", batch=3)
    errors.pop("differentiable outputs")
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("name", ["gelu_bias_residual", "swiglu", "tanh_scaled_with_aux"])
def test_compiled_training_matches_eager(reference_kernels, name):
    """torch.compile(fullgraph=True, dynamic=True) traces the op's registered backward, whose GEMMs are op calls
    too; the compiled step computes what the eager one does (both on the reference), at two sizes."""
    compiled = torch.compile(epicute.gemm, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    for m in (M, 2 * M + 1):
        torch.manual_seed(m)
        eager = run_case(cases(m, N, "cpu")[name], m, N, RECOMPUTE_BELOW_K + 8, "cpu")
        torch.manual_seed(m)
        traced = run_case(cases(m, N, "cpu")[name], m, N, RECOMPUTE_BELOW_K + 8, "cpu", call=compiled)
        assert traced.pop("differentiable outputs") == eager.pop("differentiable outputs")
        assert traced == pytest.approx(eager, rel=1e-6, abs=1e-9)  # the same errors: the same gradients


def test_only_the_inputs_that_need_a_gradient_get_one(reference_kernels):
    a, b = torch.randn(M, 40, dtype=torch.bfloat16), torch.randn(40, N, dtype=torch.bfloat16)
    bias = torch.randn(N, dtype=torch.bfloat16, requires_grad=True)
    d = epicute.gemm(a, b, epilogue=lambda acc, bias: epicute.ops.relu(acc) + bias, bias=bias)
    d.float().sum().backward()
    assert a.grad is None and b.grad is None
    want = torch.full((N,), float(M))  # d(sum)/d bias: the sum of M rows of ones
    assert ((bias.grad.float() - want).norm() / want.norm()).item() < 1e-6


def test_a_loss_of_an_aux_output_alone(reference_kernels):
    """D unused by the loss gets no gradient (None, not zeros): the backward runs on the aux output's alone."""
    a = torch.randn(M, 40, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(40, N, dtype=torch.bfloat16)
    out = epicute.gemm(a, b, epilogue=lambda acc: {"D": epicute.ops.relu(acc), "twice": acc * 2.0})
    out["twice"].float().sum().backward()
    want = 2.0 * b.double().sum(1).expand(M, -1)
    assert ((a.grad.double() - want).norm() / want.norm()).item() < TOL


def test_statistics_and_quantized_outputs_carry_no_gradient(reference_kernels):
    a = torch.randn(M, 128, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(128, 128, dtype=torch.bfloat16)
    out = epicute.gemm(a, b, epilogue=lambda acc: {"D": acc, "rs": epicute.ops.row_sum(acc),
                                                   "q": epicute.ops.cast(acc, torch.float8_e4m3fn)})  # fmt: skip
    assert out["D"].requires_grad and not out["rs"].requires_grad and not out["q"].requires_grad


def test_the_plan_follows_what_the_gradient_reads():
    def graph(fn, **kinds):
        return epicute.epilogue(fn).trace(kinds)

    assert plan_backward(None, 4096).mode == "plain"
    assert plan_backward(graph(lambda acc, bias: acc + bias, bias="row"), 4096).mode == "operands"
    gelu = graph(lambda acc, bias: epicute.ops.gelu(acc + bias), bias="row")
    assert plan_backward(gelu, 4096).mode == "save" and plan_backward(gelu, 4096).saved == ("saved_acc",)
    assert plan_backward(gelu, RECOMPUTE_BELOW_K - 8).mode == "recompute"
    quantized = graph(lambda acc: dict(zip(("D", "s"), epicute.ops.quantize_groups(acc))))
    assert plan_backward(quantized, 4096).mode == "none"


def test_the_gradient_graph_of_a_linear_epilogue_reads_no_accumulator():
    g = epicute.epilogue(lambda acc, bias, residual: 0.5 * acc + bias + residual).trace(
        {"bias": "row", "residual": "tile"}
    )
    gb = gradient_graph(g, {"D": "bf16"}, ("bias", "residual"))
    assert not reads_accumulator(gb)
    assert [name for name, _ in gb.inputs] == ["grad_D"]  # neither operand is read: none is loaded
    assert [gb.output_node(name).op for name in ("d_bias",)] == ["col_sum"]
    assert differentiable_outputs(g) == ("D",)


def test_a_compiled_backward_calls_the_op(reference_kernels):
    """AOTAutograd traces the backward with fake tensors (``is_compiling()`` need not say so): the backward's GEMMs
    must enter its graph as one ``epicute::gemm_backward`` op (which replays them from one record), never run eagerly
    on the fakes; a gradient the epilogue forwards as it is (the residual's: dD) is taken beside it."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = {}

    def backend(gm, example_inputs):
        def keep(name):
            def compiler(g, _):
                graphs[name] = g
                return make_boxed_func(g.forward)

            return compiler

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    torch._dynamo.reset()
    compiled = torch.compile(epicute.gemm, fullgraph=True, dynamic=True, backend=backend)
    for m in (M, 2 * M + 1):
        errors = run_case(cases(m, N, "cpu")["gelu_bias_residual"], m, N, RECOMPUTE_BELOW_K + 8, "cpu", call=compiled)
        errors.pop("differentiable outputs")
        assert all(e < TOL for e in errors.values()), errors
    ops_called = [str(node.target) for node in graphs["backward"].graph.nodes if node.op == "call_function"]
    assert ops_called.count("epicute.gemm_backward.default") == 1, ops_called  # the gradient pass, da and db
    assert "epicute.gemm.default" not in ops_called, ops_called


def test_a_training_call_finds_all_its_kernels_in_one_precompile_pass(monkeypatch, tmp_path):
    """While precompiling, a GEMM whose kernel is missing (the forward's through the op, then the backward's) is
    computed by the reference instead, so one pass finds the forward's kernel and every one of the backward's; the
    values are the reference's all along."""
    from epicute.runtime.aot import JOB_KINDS
    from epicute.runtime.compile import FAMILIES
    from epicute.runtime.precompile import missing_kernels

    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    api = sys.modules["epicute.gemm.api"]
    reference_gemm = api.gemm
    # Four distinct kernels (each of these sizes plans its own), one for each GEMM the kernel path runs.
    shapes = [[33, 40, 24], [4096, 4096, 4096], [8, 4096, 4096], [1000, 14336, 4096]]
    needed = [variant for variant, _ in JOB_KINDS["gemm"]({"shapes": shapes}, None)]
    assert len({FAMILIES["gemm"].key(v) for v in needed}) == 4
    launches = []

    def gemm(a, b, /, backend=None, **kwargs):
        if backend != "reference":  # the kernel path: a kernel of its own, missing from an empty cache
            launches.append(1)
            FAMILIES["gemm"].get(needed[len(launches) - 1])
        return reference_gemm(a, b, backend="reference", **kwargs)

    monkeypatch.setattr(api, "gemm", gemm)
    a = torch.randn(33, 24, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(24, 40, dtype=torch.bfloat16, requires_grad=True)
    grad, out = torch.randn(33, 40, dtype=torch.bfloat16), {}

    def step():
        out["d"] = epicute.gemm(a, b, epilogue=lambda acc: epicute.ops.tanh(acc))
        out["d"].backward(grad)

    # the forward, then the backward's recomputing gradient pass (K < RECOMPUTE_BELOW_K), data and weight gradients
    assert len(missing_kernels(step)) == 4 == len(launches)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    want = torch.tanh(a64 @ b64)
    want.backward(grad.double())
    for got, expected in ((out["d"], want.detach()), (a.grad, a64.grad), (b.grad, b64.grad)):
        assert got.shape == expected.shape and ((got.double() - expected).norm() / expected.norm()).item() < TOL
