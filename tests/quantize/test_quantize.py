"""epicute.quantize on the reference backend (CPU): every recipe against float64 math, and the typed errors."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.quantize.api import quantize_pair
from tests.quantize.checks import FP8_MAX, REL_STEP, SUBNORMAL, check_group_quantization, check_pair


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(37, 400), (3, 5, 128), (1, 16), (301, 1040)])
def test_groups_against_float64(shape, fp8, ue8m0):
    x = (torch.randn(shape) * torch.rand(shape[-1]) * 30).to(torch.bfloat16)  # groups of different ranges
    x.view(-1)[7] = 0.0
    with epicute.use_backend("reference"):
        q, scales = epicute.quantize(x, dtype=fp8, ue8m0=ue8m0)
    check_group_quantization(x, q, scales, fp8, ue8m0)


def _check_coarse(x, q, scale, fp8):
    value = x.double() / scale.double()
    err = (q.double() - value).abs()
    assert (err <= REL_STEP[fp8] * value.abs() + SUBNORMAL[fp8] + 1e-6 * FP8_MAX[fp8]).all()


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "blocks"])
def test_coarser_recipes_against_float64(recipe):
    x = (torch.randn(300, 272) * 5).to(torch.bfloat16)
    with epicute.use_backend("reference"):
        q, scale = epicute.quantize(x, recipe=recipe)
    v = x.double().abs()
    if recipe == "rowwise":
        want = v.amax(-1, keepdim=True) / 448.0
        expanded = scale
    elif recipe == "tensorwise":
        want = v.amax() / 448.0
        expanded = scale
    else:
        want = torch.stack([torch.stack([v[i:i + 128, j:j + 128].amax() for j in range(0, 272, 128)])
                            for i in range(0, 300, 128)]) / 448.0  # fmt: skip
        expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :272]
    assert scale.shape == want.shape and ((scale.double() - want).abs() / want).max().item() < 2e-7
    _check_coarse(x, q, expanded, torch.float8_e4m3fn)


def test_the_scales_feed_a_blockwise_gemm():
    """groups for A and blocks for B: what epicute.gemm's blockwise recipe takes, as they come."""
    a, w = torch.randn(33, 256, dtype=torch.bfloat16), torch.randn(136, 256, dtype=torch.bfloat16) / 16
    with epicute.use_backend("reference"):
        qa, sa = epicute.quantize(a)
        qw, sw = epicute.quantize(w, recipe="blocks")
        d = epicute.gemm(qa, qw.t(), a_scale=sa, b_scale=sw.t())
    want = a.double() @ w.double().t()
    assert ((d.double() - want).norm() / want.norm()).item() < 0.1  # two fp8 roundings of the inputs


@pytest.mark.parametrize(("rows", "columns"), [("groups", "blocks"), ("blocks", "blocks"), ("groups", "groups"),
                                               (None, "groups"), ("blocks", None)])  # fmt: skip
@pytest.mark.parametrize("shape", [(37, 272), (300, 128), (1, 16)])
def test_rows_and_columns_against_float64(shape, rows, columns):
    """A weight gradient's operands: x along its rows and x.t() along the tokens, padded to 16 rows."""
    x = (torch.randn(shape) * torch.rand(shape[-1]) * 30).to(torch.bfloat16)
    with epicute.use_backend("reference"):
        made = quantize_pair(x, rows, columns, ue8m0=True)
    check_pair(x, rows, columns, made, torch.float8_e4m3fn, True)


def test_torch_compile_sees_one_op_per_call_without_a_graph_break():
    """Under torch.compile (fullgraph, dynamic sizes) each quantization is one ``epicute::quantize`` call whose
    fake gives the eager call's shapes and strides; its values still meet the float64 checks."""
    from torch.utils._pytree import tree_leaves

    from tests.quantize.checks import check_block_quantization

    x = (torch.randn(2, 37, 144) * torch.rand(144) * 30).to(torch.bfloat16)
    w = (torch.randn(300, 272) * 30).to(torch.bfloat16)

    def step(x, w):
        return epicute.quantize(x), quantize_pair(w, "groups", "blocks"), epicute.quantize(w, recipe="blocks")

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    with epicute.use_backend("reference"):
        got = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)(x, w)
        eager = step(x, w)
    calls = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and calls.count(torch.ops.epicute.quantize) == 3, calls
    got_leaves, eager_leaves = tree_leaves(got), tree_leaves(eager)
    assert len(got_leaves) == len(eager_leaves) == 8
    for g, e in zip(got_leaves, eager_leaves):
        assert (g.shape, g.stride(), g.dtype) == (e.shape, e.stride(), e.dtype)
    (q, scales), made, (qw, sw) = got
    check_group_quantization(x, q, scales, torch.float8_e4m3fn, False)
    check_pair(w, "groups", "blocks", made, torch.float8_e4m3fn, False)
    check_block_quantization(w, qw, sw, torch.float8_e4m3fn, False)


def test_transpose_quantizes_x_t():
    x = torch.randn(48, 272, dtype=torch.bfloat16)
    with epicute.use_backend("reference"):
        q, scales = epicute.quantize(x, recipe="blocks", transpose=True)
        q_t, scales_t = epicute.quantize(x.t().contiguous(), recipe="blocks")
    assert torch.equal(q.view(torch.uint8), q_t.view(torch.uint8)) and torch.equal(scales, scales_t)


def test_nan_propagates_to_its_group_only():
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    with epicute.use_backend("reference"):
        _, scales = epicute.quantize(x)
    assert torch.isnan(scales[0, 0]) and torch.isfinite(scales[0, 1]) and torch.isfinite(scales[1]).all()


def test_empty_inputs():
    with epicute.use_backend("reference"):
        q, scales = epicute.quantize(torch.empty(0, 256, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and scales.shape == (0, 2)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: epicute.quantize([1.0]), epicute.DtypeError, "x must be a torch.Tensor"),
        (lambda: epicute.quantize(torch.ones(4, 32), recipe="1x128"), epicute.ConfigError, "recipe='1x128'"),
        (lambda: epicute.quantize(torch.ones(4, 32), dtype=torch.int8), epicute.DtypeError, "float8_e4m3fn"),
        (lambda: epicute.quantize(torch.ones(4, 32, dtype=torch.int32)), epicute.DtypeError, "x has dtype"),
        (lambda: epicute.quantize(torch.ones(4, 40)), epicute.AlignmentError, "pad K to 48"),
        (lambda: epicute.quantize(torch.ones(3, 4, 32), recipe="blocks"), epicute.ShapeError, "2-D"),
        (lambda: epicute.quantize(torch.ones(32, 4).t()), epicute.AlignmentError, "x.contiguous"),
        (lambda: epicute.quantize(torch.ones(4, 32), ue8m0=1), epicute.ConfigError, "ue8m0"),
        (lambda: epicute.quantize(torch.ones(())), epicute.ShapeError, "at least one dimension"),
        (lambda: epicute.quantize(torch.ones(4, 32, requires_grad=True)), epicute.GradientError, "x.detach"),
        (lambda: epicute.quantize(torch.ones(40, 32), transpose=True), epicute.AlignmentError, "pad x's rows to 48"),
        (lambda: epicute.quantize(torch.ones(2, 16, 32), transpose=True), epicute.ShapeError, "2-D x"),
        (lambda: epicute.quantize(torch.ones(16, 32), recipe="rowwise", transpose=True), epicute.ConfigError,
         "recipe='rowwise' with transpose=True"),
        (lambda: quantize_pair(torch.ones(4, 32), "rowwise", None), epicute.ConfigError, "rows='rowwise'"),
        (lambda: quantize_pair(torch.ones(4, 32), None, None), epicute.ConfigError, "one at least"),
        (lambda: quantize_pair(torch.ones(4, 40), "groups", "groups"), epicute.AlignmentError, "pad K to 48"),
    ],
)
def test_bad_arguments_are_refused(call, error, match):
    with epicute.use_backend("reference"), pytest.raises(error, match=match):
        call()


def test_the_kernel_backend_needs_a_gpu():
    with pytest.raises(epicute.DeviceError, match="CUDA device"):
        epicute.quantize(torch.ones(4, 32, dtype=torch.bfloat16), backend="kernel")
