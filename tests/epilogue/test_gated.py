"""Gated epilogues on the CPU: the gate/up weight layout, tracing ``f(gate, up, ...)``, the reference
against the two projections computed apart, plans and explain, typed errors, and sm_90a compiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import epicute
from epicute import ConfigError, DtypeError, EpilogueError, OutputError, ShapeError, ops
from epicute.epilogue.gated import GatedEpilogue, gated_epilogue, split_gate_up
from epicute.epilogue.tracer import as_epilogue
from epicute.gemm import render_plan
from epicute.gemm.api import describe_call
from epicute.gemm.autograd import plan_backward
from epicute.gemm.compile import compile_gemm
from epicute.gemm.prepare import prepare
from epicute.grouped.api import describe_grouped_call
from epicute.grouped.compile import compile_grouped
from epicute.grouped.prepare import prepare as prepare_grouped
from tests.conftest import rel_err


def test_interleave_puts_gate_and_up_in_alternating_blocks_of_8():
    gate, up = torch.randn(3, 24, 5), torch.randn(3, 24, 5)
    w = epicute.interleave_gate_up(gate, up)
    assert w.shape == (3, 48, 5)
    for j in range(3):
        assert torch.equal(w[:, 16 * j : 16 * j + 8], gate[:, 8 * j : 8 * j + 8])
        assert torch.equal(w[:, 16 * j + 8 : 16 * j + 16], up[:, 8 * j : 8 * j + 8])
    # (K, N) matrices along their last dimension, and split_gate_up undoes it
    g_kn, u_kn = gate.transpose(-1, -2), up.transpose(-1, -2)
    back = split_gate_up(epicute.interleave_gate_up(g_kn, u_kn, dim=-1))
    assert torch.equal(back[0], g_kn) and torch.equal(back[1], u_kn)


@pytest.mark.parametrize("gate,up,match", [
    (torch.zeros(12, 4), torch.zeros(12, 4), "multiple of 8"),
    (torch.zeros(16, 4), torch.zeros(8, 4), "same shape"),
])  # fmt: skip
def test_interleave_refuses_what_it_cannot_pair(gate, up, match):
    with pytest.raises(ShapeError, match=match):
        epicute.interleave_gate_up(gate, up)


def test_a_gated_epilogue_traces_gate_and_up_as_two_accumulator_leaves():
    epi = gated_epilogue(lambda gate, up, score: ops.silu(gate) * up * score)
    assert isinstance(epi, GatedEpilogue) and epi.params == ("score",)
    graph = epi.trace({"score": "col"})
    assert graph.gated and [n.op for n in graph.nodes[:2]] == ["acc", "acc_up"]
    # up stays in the graph (the kernel's interface) even when unused
    assert gated_epilogue(lambda gate, up: gate).trace({}).gated
    assert not epicute.epilogue(lambda acc: acc).trace({}).gated
    with pytest.raises(EpilogueError, match="gate and up first"):
        gated_epilogue(lambda gate: gate)


def test_reference_matches_the_two_projections():
    m, n, k = 37, 24, 40
    x = torch.randn(2, m, k)
    w_gate, w_up = torch.randn(2, n, k), torch.randn(2, n, k)
    w = epicute.interleave_gate_up(w_gate, w_up)
    bias, score = torch.randn(n), torch.rand(2, m, 1)
    got = epicute.gemm(x.bfloat16(), w.transpose(-1, -2).bfloat16(), gated=True, backend="reference",
                       out_dtype=torch.float32, bias=bias, score=score,
                       epilogue=lambda gate, up, bias, score: ops.gelu(gate + bias) * up * score)  # fmt: skip
    xb, gb, ub = (t.bfloat16().double() for t in (x, w_gate, w_up))
    want = F.gelu(xb @ gb.transpose(-1, -2) + bias.double()) * (xb @ ub.transpose(-1, -2)) * score.double()
    assert got.shape == (2, m, n) and rel_err(got, want) < 1e-6


def test_grouped_reference_matches_the_two_projections():
    sizes = [3, 0, 20, 7]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(30, 16).bfloat16()
    w_gate, w_up = torch.randn(4, 8, 16).bfloat16(), torch.randn(4, 8, 16).bfloat16()
    w = epicute.interleave_gate_up(w_gate, w_up)
    got = epicute.grouped_gemm(x, w.transpose(-1, -2), offsets, gated=True, backend="reference",
                               out_dtype=torch.float32, epilogue=lambda gate, up: ops.silu(gate) * up)  # fmt: skip
    group = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    xd = x.double()
    gate = torch.einsum("mk,mnk->mn", xd, w_gate.double()[group])
    up = torch.einsum("mk,mnk->mn", xd, w_up.double()[group])
    assert got.shape == (30, 8) and rel_err(got, F.silu(gate) * up) < 1e-6


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_explain_shows_the_gated_plan():
    import io

    text = io.StringIO()
    plan = epicute.explain(meta(4096, 1024), meta(2048, 1024).t(), gated=True, file=text,
                           epilogue=lambda gate, up: ops.silu(gate) * up)  # fmt: skip
    assert plan.d_n == 1024 and plan.out_tile_n == plan.config.tile_n // 2
    assert plan.config.epi_tile[1] <= plan.out_tile_n and plan.out_tile_n % plan.config.epi_tile[1] == 0
    out = text.getvalue()
    assert "D[1x4096x1024] = gated(" in out and "slice_acc            gate, up" in out
    grouped = io.StringIO()
    epicute.explain_grouped(meta(4096, 1024), meta(8, 2048, 1024).transpose(-1, -2), meta(8, dtype=torch.int32),
                            gated=True, epilogue=lambda gate, up: ops.silu(gate) * up, file=grouped)  # fmt: skip
    assert "gated(A[4096x1024] @ B[group][1024x2048])" in grouped.getvalue()


def test_gated_and_plain_calls_of_one_function_are_planned_apart():
    def fn(first, second=2.0):  # plain: second is a scalar operand; gated: the up accumulator
        return first * second

    a, b = meta(64, 64), meta(64, 64)
    plain = describe_call(a, b, fn, None, None, None, None, None, {}, False)[2]
    gated = describe_call(a, b, fn, None, None, None, None, None, {}, False, gated=True)[2]
    assert not prepare(plain).fusion.gated and prepare(gated).fusion.gated


@pytest.mark.parametrize("call,error,match", [
    (lambda: epicute.explain(meta(8, 64), meta(64, 40), gated=True, epilogue=lambda g, u: g * u, file=None),
     ShapeError, "multiple of 8"),
    (lambda: epicute.gemm(meta(8, 64), meta(64, 32), gated=True), EpilogueError, "pass one"),
    (lambda: epicute.explain(meta(8, 64), meta(64, 32), gated=True, out=meta(8, 32), epilogue=lambda g, u: g * u,
                             file=None), OutputError, r"\(8, 16\)"),
    (lambda: epicute.explain(meta(8, 64, dtype=torch.float8_e4m3fn), meta(32, 64, dtype=torch.float8_e4m3fn).t(),
                             a_scale=1.0, b_scale=1.0, gated=True, epilogue=lambda g, u: g * u, file=None),
     DtypeError, "blockwise"),
    (lambda: epicute.explain(meta(8, 64), meta(64, 64), gated=True, config={"tile_n": 64, "epi_tile": (128, 64)},
                             epilogue=lambda g, u: g * u, file=None), ConfigError, "gated epilogue"),
    (lambda: epicute.explain_grouped(meta(8, 64), meta(2, 64, 24), meta(2, dtype=torch.int32), gated=True,
                                     epilogue=lambda g, u: g * u, file=None), ShapeError, "multiple of 8"),
])  # fmt: skip
def test_gated_misuse_gets_typed_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


GATED_DENSE = {
    "swiglu_cooperative": (lambda gate, up: ops.silu(gate) * up, {}, {}),
    "geglu_pingpong_bias": (lambda gate, up, bias: ops.gelu(gate + bias) * up, {"bias": meta(1024)},
                            {"schedule": "pingpong", "tile_m": 64}),
    "aux_reduction_one_tile": (lambda gate, up, res: {"D": ops.silu(gate) * up + res, "pre": gate,
                                                      "rs": ops.row_sum(up)},
                               {"res": meta(512, 1024)}, {"persistent": False}),
    "quantize_groups": (lambda gate, up: dict(zip(("D", "scales"), ops.quantize_groups(ops.silu(gate) * up))), {},
                        {}),
}  # fmt: skip


@pytest.mark.compile
@pytest.mark.parametrize("name", list(GATED_DENSE))
def test_gated_gemm_variants_compile_for_sm90a(name):
    fn, operands, config = GATED_DENSE[name]
    request = describe_call(meta(512, 256), meta(2048, 256).t(), fn, None, None, None, None, config, operands, False,
                            gated=True)[2]  # fmt: skip
    prepared = prepare(request)
    assert prepared.fusion.gated and prepared.plan.d_n == 1024
    assert callable(compile_gemm(prepared.variant()))


@pytest.mark.compile
def test_gated_grouped_gemm_compiles_for_sm90a():
    request = describe_grouped_call(
        meta(300, 64), meta(5, 272, 64).transpose(-2, -1), meta(5, dtype=torch.int32),
        lambda gate, up, score: ops.silu(gate) * up * score, None, None, None, {"cluster_n": 2},
        {"score": meta(300, 1, dtype=torch.float32)}, False, gated=True,
    )[2]  # fmt: skip
    assert callable(compile_grouped(prepare_grouped(request).variant()))


def test_gated_roofline_counts_the_stored_half():
    """D and the epilogue's operand tiles of a gated GEMM have N columns, not B's 2N: the roofline's bytes say so."""
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
    m, n, k = 4096, 2 * 7168, 4096
    plan = epicute.explain(meta(m, k), meta(n, k).t(), gated=True, file=None, res=meta(m, n // 2),
                           epilogue=lambda gate, up, res: epicute.ops.silu(gate) * up + res)  # fmt: skip
    stored = 2 * (m * k + k * n) + 2 * m * (n // 2) * 2  # A, B; D and the residual tile, bf16
    assert plan.roofline.min_bytes == stored


@pytest.mark.parametrize(
    ("gate", "up", "kwargs", "error", "match"),
    [
        ([1.0], torch.randn(16, 8), {}, epicute.DtypeError, r"^gate must be a torch.Tensor \(a weight\), got list"),
        (torch.randn(16, 8), torch.randn(16, 8).double(), {}, epicute.DtypeError, r"^gate is torch.float32 on cpu"),
        (torch.randn(16, 8), torch.randn(16, 8), {"dim": 5}, epicute.ShapeError, r"^dim=5: gate and up have 2 "),
        (torch.randn(16, 8), torch.randn(16, 8), {"dim": "x"}, epicute.ShapeError, r"^dim='x'"),
    ],
)  # fmt: skip
def test_interleave_gate_up_bad_arguments(gate, up, kwargs, error, match):
    # Before: AttributeError for a list; dim=5 wrapped around to dim 1 without a word; mixed dtypes promoted.
    with pytest.raises(error, match=match):
        epicute.interleave_gate_up(gate, up, **kwargs)


# ------------------------------------------------------------------ paired outputs: the gated epilogue's dual
def _paired(acc, res):
    return {"D": acc * res, "D_up": ops.silu(acc) + res, "rs": ops.row_sum(acc)}


@pytest.mark.parametrize("lead", [(), (2,)])
def test_a_paired_epilogue_returns_d_and_d_up_interleaved_in_one_d(lead):
    """An output named D_up is stored beside D in blocks of 8 columns, as a gated B holds gate and up: D comes back
    2N wide, in the order a gated GEMM's backward multiplies it; reductions and other outputs are as before."""
    m, k, n = 37, 24, 40
    a, b = torch.randn(*lead, m, k).bfloat16(), torch.randn(*lead, k, n).bfloat16()
    res = torch.randn(*lead, m, n).bfloat16()
    out = torch.full((*lead, m, 2 * n), float("nan")).bfloat16()
    got = epicute.gemm(a, b, epilogue=_paired, res=res, backend="reference", out=out)
    assert set(got) == {"D", "rs"} and got["D"].data_ptr() == out.data_ptr()
    acc = a.double() @ b.double()
    d, d_up = split_gate_up(got["D"].double())
    assert rel_err(d, acc * res.double()) < 1e-2
    assert rel_err(d_up, F.silu(acc) + res.double()) < 1e-2
    assert rel_err(got["rs"], acc.sum(-1)) < 1e-4


def test_explain_plans_a_paired_d_at_twice_the_width():
    meta = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")
    plan = epicute.explain(meta(512, 256), meta(256, 384), epilogue=lambda acc: {"D": acc, "D_up": -acc}, file=None)
    assert plan.epilogue.paired and not plan.config.swap_ab
    assert "D[1x512x768] (D and D_up interleaved in blocks of 8" in render_plan(plan)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda a, b: epicute.gemm(a, b, epilogue=lambda acc: {"D": acc, "D_up": acc}, out_dtypes={"D_up": torch.float32},
                               backend="reference"), EpilogueError, "D_up' is fp32 but D is bf16"),
    (lambda a, b: epicute.gemm(a, b, epilogue=lambda acc: {"D": acc, "D_up": ops.col_sum(acc)}, backend="reference"),
     EpilogueError, "must be a tile like D"),
    (lambda a, b: epicute.gemm(a, b, epilogue=lambda acc: {"D": acc, "D_up": acc}, backend="reference",
                               outs={"D_up": torch.empty(8, 16).bfloat16()}), OutputError, r"outs\['D_up'\]"),
    (lambda a, b: epicute.gemm(a, b, epilogue=lambda acc: {"D": acc, "D_up": acc}, backend="reference",
                               out=torch.empty(8, 16).bfloat16()), OutputError, r"writes D of shape \(8, 32\)"),
    (lambda a, b: epicute.gemm(a, b.float(), epilogue=lambda acc: {"D": acc, "D_up": acc}, backend="reference"),
     DtypeError, "b has dtype"),
])  # fmt: skip
def test_paired_misuse_gets_typed_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(8, 32).bfloat16(), torch.randn(32, 16).bfloat16())


def test_a_paired_epilogue_has_no_backward_plan():
    """The kernel path's autograd refuses it by name (its D is no function the derivative pass knows)."""
    graph = as_epilogue(lambda acc: {"D": acc, "D_up": 2 * acc}).trace({}, {}, None, d_dtype="bf16")
    with pytest.raises(epicute.GradientError, match="D_up"):
        plan_backward(graph, 4096)


@pytest.mark.compile
@pytest.mark.parametrize("gated", [False, True])
def test_paired_gemm_variants_compile_for_sm90a(gated):
    """The dense kernel stores D and D_up through two views of one tensor (3-D TMA boxes); gated too (a gated
    epilogue's recomputed gradient pass is both)."""
    meta = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")
    if gated:
        fn = lambda gate, up, g: {"D": g * ops.sigmoid(gate) * up, "D_up": g * ops.silu(gate)}
    else:
        fn = lambda acc, g: {"D": acc * g, "D_up": ops.silu(acc) + g}
    request = describe_call(meta(1000, 256), meta(512, 256).t(), fn, None, None, None, None, None,
                            {"g": meta(1000, 256 if gated else 512)}, False, gated=gated)[2]  # fmt: skip
    prepared = prepare(request)
    assert prepared.fusion.paired
    assert callable(compile_gemm(prepared.variant()))


@pytest.mark.compile
@pytest.mark.parametrize("gated", [False, True])
def test_paired_grouped_gemm_compiles_for_sm90a(gated):
    """The grouped kernel's ragged store view keeps a paired half's column blocks (an MoE backward's d gate, d up)."""
    n = 272 if gated else 136
    fn = (lambda gate, up, g: {"D": g * gate, "D_up": g * up}) if gated else (lambda acc, g: {"D": g, "D_up": acc})
    request = describe_grouped_call(
        meta(300, 64), meta(5, n, 64).transpose(-2, -1), meta(5, dtype=torch.int32), fn, None, None, None, None,
        {"g": meta(300, 136)}, False, gated=gated,
    )[2]  # fmt: skip
    prepared = prepare_grouped(request)
    assert prepared.epilogue.fusion.paired
    assert callable(compile_grouped(prepared.variant()))


def test_a_paired_grouped_call_refuses_out_and_returns_the_wide_d():
    """grouped_gemm stores a paired D new, (total_M, 2N); an ``out=`` of either width is refused by name."""
    a, b = torch.randn(12, 16).bfloat16(), torch.randn(3, 16, 24).bfloat16()
    offsets = torch.tensor([5, 5, 12], dtype=torch.int32)
    fn = lambda acc: {"D": acc, "D_up": 2 * acc}
    d = epicute.grouped_gemm(a, b, offsets, epilogue=fn, backend="reference")
    assert d.shape == (12, 48)
    gate, up = split_gate_up(d.double())
    acc = torch.cat([a[:5].double() @ b[0].double(), a[5:].double() @ b[2].double()])
    assert rel_err(gate, acc) < 1e-2 and rel_err(up, 2 * acc) < 1e-2
    with pytest.raises(OutputError, match="leave out= out"):
        epicute.grouped_gemm(a, b, offsets, epilogue=fn, backend="reference", out=torch.empty(12, 24).bfloat16())


def test_a_paired_d_needs_whole_blocks_of_columns():
    from epicute.epilogue.gated import stored_columns

    assert stored_columns(24, True) == 48 and stored_columns(12, False) == 12
    with pytest.raises(ShapeError, match="N=12 must be a multiple of 8"):
        stored_columns(12, True)
