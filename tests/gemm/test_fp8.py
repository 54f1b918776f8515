"""fp8 GEMM inputs on the CPU: validation, the scales as epilogue operands, the reference, plans
and sm_90a compiles (GPU correctness: tests/gemm/test_fp8_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import epicute
from epicute import ops
from epicute.gemm import GemmProblem, plan_gemm
from epicute.gemm.compile import compile_gemm
from epicute.gemm.config import promote_chunks
from epicute.gemm.launch import variant_of
from epicute.gemm.report import render_plan
from tests.conftest import rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8(*shape, dtype=E4M3, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


def dequantized(a, w, a_scale, b_scale) -> torch.Tensor:
    """float64 ``(a * a_scale) @ (w * b_scale).t()`` for (.., M, K) a and (.., N, K) w; scales a float,
    a 1-element tensor, or one per row of a / per row of w."""
    lead, m, n = a.shape[:-2], a.shape[-2], w.shape[-2]

    def as_factor(scale, shape):
        if isinstance(scale, float) or scale.numel() == 1:
            return float(scale)
        return scale.double().reshape(*lead, *shape)

    return (a.double() @ w.double().transpose(-1, -2)) * as_factor(a_scale, (m, 1)) * as_factor(b_scale, (1, n))


@pytest.mark.parametrize("recipe", ["tensorwise float", "tensorwise tensor", "rowwise", "rowwise 2-D", "mixed"])
def test_reference_applies_each_recipe(recipe):
    m, n, k = 37, 48, 96
    a, w = fp8(m, k), fp8(n, k, dtype=E5M2 if recipe == "mixed" else E4M3)
    scales = {
        "tensorwise float": (0.5, 3.0),
        "tensorwise tensor": (torch.tensor(0.25), torch.tensor([4.0])),
        "rowwise": (torch.rand(m) + 0.5, torch.rand(n) + 0.5),
        "rowwise 2-D": (torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5),
        "mixed": (torch.tensor(2.0), torch.rand(n) + 0.5),
    }[recipe]
    got = epicute.gemm(a, w.t(), a_scale=scales[0], b_scale=scales[1], backend="reference")
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel_err(got, dequantized(a, w, *scales)) < 1e-2


def test_scales_compose_with_any_epilogue_batched():
    l, m, n, k = 3, 17, 32, 64
    a, w = fp8(l, m, k), fp8(l, n, k)
    sa, sb, bias = torch.rand(l, m) + 0.5, torch.rand(l, n) + 0.5, torch.randn(n)

    def epi(acc, bias):
        return {"D": ops.gelu(acc + bias), "pre": acc, "amax": ops.amax(acc)}

    got = epicute.gemm(a, w.transpose(1, 2), epilogue=epi, bias=bias, a_scale=sa, b_scale=sb, backend="reference",
                       out_dtypes={"pre": torch.float32})  # fmt: skip
    acc = dequantized(a, w, sa, sb)
    assert rel_err(got["pre"], acc) < 1e-5  # fp32: the scaled accumulator itself
    assert rel_err(got["D"], torch.nn.functional.gelu(acc + bias.double())) < 1e-2
    assert rel_err(got["amax"], acc.abs().amax()) < 1e-5


def test_explain_shows_the_scales_in_the_chain_and_the_fp8_peak():
    a = torch.empty(8192, 8192, dtype=E4M3, device="meta")
    w = torch.empty(8192, 8192, dtype=E4M3, device="meta")
    plan = epicute.explain(a, w.t(), a_scale=torch.empty(8192, device="meta"),
                           b_scale=torch.empty(8192, device="meta"), file=None)  # fmt: skip
    text = render_plan(plan)
    assert plan.problem.ab_dtype == "fp8e4m3" and plan.problem.d_dtype == "bf16" and plan.config.tile_k == 128
    assert "at 1979 TFLOP/s" in text and "a_scale (col, fp32)" in text and "b_scale (row, fp32)" in text
    assert "A ring" in text and "x128 fp8e4m3" in text


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda a, w: epicute.gemm(a, w.t().contiguous(), a_scale=1.0, b_scale=1.0), epicute.AlignmentError,
         "K-major only"),
        (lambda a, w: epicute.gemm(a.t().contiguous().t(), w.t(), a_scale=1.0, b_scale=1.0), epicute.AlignmentError,
         "row-major a"),
        (lambda a, w: epicute.gemm(a, w.t().to(torch.bfloat16), a_scale=1.0, b_scale=1.0), epicute.DtypeError,
         "only fp8 inputs may mix"),
        (lambda a, w: epicute.gemm(a, w.t()), epicute.DtypeError, "a_scale is missing"),
        (lambda a, w: epicute.gemm(a, w.t(), a_scale=torch.ones(33, dtype=torch.float16), b_scale=1.0),
         epicute.DtypeError, "scales are fp32"),
        (lambda a, w: epicute.gemm(a, w.t(), a_scale=torch.ones(5), b_scale=1.0), epicute.ShapeError,
         r"one value per row: \(33,\), \(33, 1\)"),
        (lambda a, w: epicute.gemm(a, w.t(), a_scale=torch.ones(33, 2), b_scale=1.0), epicute.ShapeError,
         "so b_scale must be too"),
        (lambda a, w: epicute.gemm(a, w.t(), a_scale=1.0, b_scale=torch.ones(2, 2)), epicute.ShapeError,
         "so a_scale must be too"),
        (lambda a, w: epicute.gemm(a, w.t(), a_scale=torch.ones(33, 3), b_scale=torch.ones(2, 2)), epicute.ShapeError,
         r"shape \(33, 2\) fp32"),
        (lambda a, w: epicute.gemm(a, w.t(), a_scale=torch.ones(33, 2), b_scale=torch.ones(2, 2).half()),
         epicute.DtypeError, "scales are fp32"),
        (lambda a, w: epicute.gemm(a, w.t(), a_scale=torch.ones(33, 2), b_scale=torch.ones(3, 2)), epicute.ShapeError,
         r"so b_scale must be too.*\(2, 2\) or its transpose; b_scale is a torch.float32 tensor of shape \(3, 2\)"),
        (lambda a, w: epicute.gemm(a.float().bfloat16(), w.t().float().bfloat16(), a_scale=1.0),
         epicute.DtypeError, "dequantize fp8 inputs"),
        (lambda a, w: epicute.gemm(a, w.t(), a_scale=1.0, b_scale=1.0, epilogue=lambda acc, b_scale: acc * b_scale,
                                   b_scale2=1.0), epicute.EpilogueError, "'b_scale'.*own parameter b_scale=.*Rename"),
    ],
    ids=["b-not-k-major", "a-not-k-major", "fp8-with-bf16", "no-scales", "fp16-scale", "scale-shape",
         "a-blockwise-b-not", "b-blockwise-a-not", "blockwise-a-shape", "blockwise-fp16", "blockwise-b-shape",
         "scales-without-fp8", "operand-named-b_scale"],
)  # fmt: skip
def test_bad_fp8_calls_get_typed_errors(call, error, match, monkeypatch):
    a, w = fp8(33, 256), fp8(144, 256)
    real = epicute.gemm
    monkeypatch.setattr(epicute, "gemm", lambda *args, **kwargs: real(*args, backend="reference", **kwargs))
    with pytest.raises(error, match=match):
        call(a, w)


def test_k_must_be_a_multiple_of_16_bytes():
    a, w = fp8(33, 72), fp8(16, 72)
    with pytest.raises(epicute.AlignmentError, match="K=72 with fp8 inputs.*pad K to 80"):
        epicute.gemm(a, w.t(), a_scale=1.0, b_scale=1.0, backend="reference")


def test_fp8_plans_take_128_element_k_tiles():
    p = GemmProblem(4096, 4096, 4096, ab_dtype="fp8e4m3", a_major="k", b_major="k")
    assert plan_gemm(p, "h100-sxm").config.tile_k == 128
    with pytest.raises(epicute.ConfigError, match="tile_k=64 with fp8e4m3 inputs"):
        plan_gemm(p, "h100-sxm", tile_k=64)
    with pytest.raises(epicute.ConfigError, match="K-major only"):
        GemmProblem(64, 64, 64, ab_dtype="fp8e4m3", a_major="k", b_major="n")


@pytest.mark.compile
@pytest.mark.parametrize(
    ("ab", "b", "mnk", "pins"),
    [
        ("fp8e4m3", "", (8192, 8192, 8192), {}),
        ("fp8e5m2", "", (128, 7168, 2048), {}),
        ("fp8e4m3", "fp8e5m2", (4096, 14336, 4096), {"schedule": "pingpong", "tile_n": 128}),
        ("fp8e4m3", "", (1000, 4104, 1024), {"persistent": False, "cluster_m": 2}),
    ],
)
def test_fp8_variants_compile(ab, b, mnk, pins, ptxas_report):
    problem = GemmProblem(*mnk, ab_dtype=ab, b_dtype=b, a_major="k", b_major="k")
    assert callable(compile_gemm(variant_of(plan_gemm(problem, "h100-sxm", **pins))))
    spills, _ = ptxas_report()
    assert max(spills) == 0


# ------------------------------------------------------------------ blockwise
def block_dequantized(a, w, sa, sw) -> torch.Tensor:
    """float64 ``(a * sa) @ (w * sw).t()`` for a (.., M, K) with sa (.., M, KB) per 1x128 block and w
    (.., N, K) with sw (.., NB, KB) per 128x128 block, spelled out block by block."""
    m, k, n = a.shape[-2], a.shape[-1], w.shape[-2]
    out = torch.zeros(*a.shape[:-2], m, n, dtype=torch.float64)
    for kb in range(-(-k // 128)):
        ks = slice(kb * 128, (kb + 1) * 128)
        partial = a[..., ks].double() @ w[..., ks].double().transpose(-1, -2)
        per_col = sw[..., kb].double().repeat_interleave(128, dim=-1)[..., :n]
        out += partial * sa[..., kb].double()[..., :, None] * per_col[..., None, :]
    return out


@pytest.mark.parametrize("b_form", ["weight (NB, KB)", "torch (KB, NB)"])
@pytest.mark.parametrize("a_form", ["torch M-major", "row-major"])
def test_reference_applies_blockwise_scales_in_either_layout(a_form, b_form):
    m, n, k = 37, 300, 400  # ragged blocks of N and K
    a, w = fp8(m, k), fp8(n, k, dtype=E5M2)
    sa = torch.rand(4, m).t() if a_form == "torch M-major" else torch.rand(m, 4)
    sw = torch.rand(3, 4) * 4
    got = epicute.gemm(a, w.t(), a_scale=sa + 0.1, b_scale=sw if b_form.startswith("weight") else sw.t(),
                       backend="reference", out_dtype=torch.float32)  # fmt: skip
    assert rel_err(got, block_dequantized(a, w, sa + 0.1, sw)) < 1e-5


def test_square_block_grids_are_read_by_their_strides():
    """NB == KB: a tensor whose first dimension has unit stride is w_scale.t() (torch's form)."""
    m, n, k = 16, 256, 256
    a, w = fp8(m, k), fp8(n, k)
    sa, sw = torch.rand(m, 2) + 0.5, torch.tensor([[1.0, 10.0], [100.0, 1000.0]])
    want = block_dequantized(a, w, sa, sw)
    for b_scale in (sw, sw.t()):
        got = epicute.gemm(a, w.t(), a_scale=sa, b_scale=b_scale, backend="reference", out_dtype=torch.float32)
        assert rel_err(got, want) < 1e-5


def test_blockwise_scales_compose_with_epilogues_batched():
    l, m, n, k = 2, 33, 136, 272
    a, w = fp8(l, m, k), fp8(l, n, k)
    sa, sw, bias = torch.rand(l, m, 3) + 0.5, torch.rand(l, 2, 3) + 0.5, torch.randn(n)
    got = epicute.gemm(a, w.transpose(1, 2), a_scale=sa, b_scale=sw, backend="reference", bias=bias,
                       epilogue=lambda acc, bias: {"D": ops.relu(acc + bias), "row_sum": ops.row_sum(acc)})  # fmt: skip
    acc = block_dequantized(a, w, sa, sw)
    assert rel_err(got["D"], torch.relu(acc + bias.double())) < 1e-2
    assert rel_err(got["row_sum"], acc.sum(-1)) < 1e-5


def test_blockwise_plans_promote_in_128x192_or_128x128_tiles():
    """Full waves of 128x192 tiles (one partial) beat 128x128 (two partials); where 192-wide tiles quantize
    the waves worse, 128x128 stays."""

    def plan(m, n, k, **pins):
        p = GemmProblem(m, n, k, ab_dtype="fp8e4m3", a_major="k", b_major="k", block_scaled=True)
        return plan_gemm(p, "h100-sxm", **pins)

    big = plan(8192, 8192, 8192)
    assert (big.config.schedule, big.config.tile_n, big.config.tile_k) == ("cooperative", 192, 128)
    text = render_plan(big)
    assert "promoted" in text and "blockwise scales: promotion holds one k-tile's partial" in text
    assert "B block scales" in text and "a block per 64 columns per stage" in text
    for mnk in ((4096, 4096, 4096), (2048, 7168, 7168), (1024, 4096, 14336)):
        narrow = plan(*mnk)
        assert narrow.config.tile_n == 128, mnk
        assert "blockwise scales: promotion holds two k-tiles' partials" in render_plan(narrow)
    assert plan(8192, 8192, 8192, schedule="pingpong", tile_m=64, tile_n=128).config.tile_m == 64
    # 256-wide tiles promote each k-tile in two 128-column halves (128 + 64 registers), cooperative or ping-pong.
    for pins in ({"tile_n": 256}, {"schedule": "pingpong", "tile_m": 64, "tile_n": 256}):
        assert promote_chunks(plan(8192, 8192, 8192, **pins).config) == 2
    with pytest.raises(epicute.ConfigError, match="promotion holds the sum and at least one k-tile.s partial"):
        plan(8192, 8192, 8192, schedule="pingpong", tile_n=128)
    with pytest.raises(epicute.ConfigError, match="blockwise scales dequantize fp8"):
        GemmProblem(64, 64, 64, block_scaled=True)


@pytest.mark.parametrize(
    ("rows", "a_form", "kb", "b_form", "tile_n", "tma"),
    [
        (1000, "m_major", 12, "weight", None, (True, True)),  # torch._scaled_mm's layouts, M and KB multiples of 4
        (1001, "m_major", 12, "weight", None, (False, True)),  # A's row stride, 1001 floats, is no multiple of 16 B
        (1001, "m_major_padded", 9, "weight", None, (True, False)),  # B's, 9 floats, neither
        (1000, "row_major", 9, "weight_padded", None, (False, True)),
        (1000, "m_major", 12, "n_major", None, (True, False)),
        (1000, "m_major", 12, "weight", 192, (True, False)),  # a 192-wide tile's chunks straddle blocks of N
    ],
)
def test_scales_arrive_by_tma_or_bulk_copy_where_their_layout_allows(rows, a_form, kb, b_form, tile_n, tma):
    from epicute.gemm.api import describe_call
    from epicute.gemm.prepare import prepare

    k, nb = 128 * kb - 16, 4
    a = torch.empty(rows, k, dtype=E4M3, device="meta")
    w = torch.empty(128 * nb, k, dtype=E4M3, device="meta")
    sa = {
        "m_major": lambda: torch.empty(kb, rows, device="meta").t(),
        "m_major_padded": lambda: torch.empty(kb, rows + 3, device="meta")[:, :rows].t(),
        "row_major": lambda: torch.empty(rows, kb, device="meta"),
    }[a_form]()
    sw = {
        "weight": lambda: torch.empty(nb, kb, device="meta"),
        "weight_padded": lambda: torch.empty(nb, kb + 3, device="meta")[:, :kb],
        "n_major": lambda: torch.empty(kb, nb, device="meta").t(),
    }[b_form]()
    pins = {"tile_n": tile_n} if tile_n else None
    _, _, request, _ = describe_call(a, w.t(), None, None, None, None, None, pins, {}, False, (sa, sw))
    variant = prepare(request).variant()
    assert (variant.a_scales_tma, variant.b_scales_bulk) == tma
    assert request.problem.b_scales_bulk == ((b_form != "n_major" and kb % 4 == 0) or b_form == "weight_padded")
    assert ("A scales by TMA" in variant.key().label, "B scales by bulk copy" in variant.key().label) == tma
    assert ("A block scales: one TMA copy per k-tile" in render_plan(prepare(request).plan)) == tma[0]
    other = replace(request, problem=replace(request.problem, a_scales_tma=not tma[0]))
    assert variant.key() != prepare(other).variant().key()
    with pytest.raises(epicute.ConfigError, match="only blockwise scales"):
        GemmProblem(64, 64, 64, b_scales_bulk=True)


def test_kernels_refuse_scale_copies_they_cannot_make():
    """The kernel's own check behind the planner's choice: a 192-wide tile's column chunks straddle blocks of N
    (one B scale per chunk), and a grouped tile's scales follow its group's rows."""
    from epicute.gemm.compile import GemmVariant, kernel_args
    from epicute.gemm.kernel_sm90 import GemmSm90
    from epicute.grouped.kernel_sm90 import GroupedGemmSm90

    problem = GemmProblem(2048, 7168, 7168, ab_dtype="fp8e4m3", a_major="k", b_major="k", block_scaled=True)
    for tile_n, bulk, kernel, match in [
        (192, True, GemmSm90, "straddle blocks of N"),
        (128, True, GroupedGemmSm90, "only the dense GEMM"),
    ]:
        variant = GemmVariant(plan_gemm(problem, "h100-sxm", tile_n=tile_n).config, "fp8e4m3", "bf16", "k", "k",
                              "sm_90a", None, "", True, b_scales_bulk=bulk)  # fmt: skip
        with pytest.raises(epicute.ConfigError, match=match):
            kernel(*kernel_args(variant))


def test_explain_and_aot_take_blockwise_scales():
    a = torch.empty(4096, 7168, dtype=E4M3, device="meta")
    w = torch.empty(2048, 7168, dtype=E4M3, device="meta")
    plan = epicute.explain(a, w.t(), a_scale=torch.empty(56, 4096, device="meta").t(),
                           b_scale=torch.empty(16, 56, device="meta"), file=None)  # fmt: skip
    assert plan.problem.block_scaled and plan.config.tile_n <= 128
    from epicute.gemm.aot import gemm_request
    from epicute.gemm.prepare import prepare

    problem = GemmProblem(4096, 2048, 7168, ab_dtype="fp8e4m3", a_major="k", b_major="k")
    request = gemm_request(problem, None, {"a_scale": "blockwise", "b_scale": "blockwise"}, False, {}, {})
    assert prepare(request).variant().block_scaled
    from epicute.gemm.aot import gemm_variants

    # The call's scale layouts pick TMA or cp.async, so ahead of time every form is compiled.
    entry = {
        "shapes": [[4096, 2048, 7168]],
        "dtype": "fp8e4m3",
        "operands": {"a_scale": "blockwise", "b_scale": "blockwise"},
    }
    forms = sorted((v.a_scales_tma, v.b_scales_bulk) for v, _ in gemm_variants(entry, target="h100-sxm"))
    assert forms == [(False, False), (False, True), (True, False), (True, True)]
    with pytest.raises(epicute.ConfigError, match="both of them"):
        gemm_request(problem, None, {"a_scale": "blockwise"}, False, {}, {})


@pytest.mark.compile
@pytest.mark.parametrize(
    ("mnk", "epilogue", "pins", "m_major"),
    [
        ((8192, 8192, 8192), False, {}, True),
        ((8192, 8192, 8192), False, {"tile_n": 128}, False),
        ((1000, 4104, 1040), True, {"persistent": False, "cluster_m": 2}, True),
        ((128, 7168, 2048), False, {"tile_n": 64}, False),
        ((128, 7168, 2048), False, {"tile_n": 128, "split_k": 3}, True),
        ((2048, 7168, 7168), False, {"tile_n": 192}, False),
        ((1000, 4104, 1040), True, {"tile_n": 192, "cluster_m": 1}, True),
        ((8192, 8192, 8192), False, {"tile_n": 256}, True),  # a half-width partial per k-tile
    ],
)
def test_blockwise_variants_compile_without_spills(mnk, epilogue, pins, m_major, ptxas_report):
    """``m_major``: A's scales as torch._scaled_mm lays them out, TMA-loaded; else row-major, by cp.async."""
    from epicute.gemm.api import describe_call
    from epicute.gemm.prepare import prepare

    m, n, k = mnk
    a = torch.empty(m, k, dtype=E4M3, device="meta")
    w = torch.empty(n, k, dtype=E4M3, device="meta")
    kb = -(-k // 128)
    sa = torch.empty(kb, m, device="meta").t() if m_major else torch.empty(m, kb, device="meta")
    scales = (sa, torch.empty(-(-n // 128), kb, device="meta"))
    epi = (lambda acc, bias: ops.gelu(acc + bias)) if epilogue else None
    operands = {"bias": torch.empty(n, dtype=torch.bfloat16, device="meta")} if epilogue else {}
    _, _, request, _ = describe_call(a, w.t(), epi, None, None, None, None, pins, operands, False, scales)
    variant = prepare(request).variant()
    assert variant.block_scaled and (variant.fusion is not None) == epilogue and variant.a_scales_tma == m_major
    assert callable(compile_gemm(variant))
    spills, _ = ptxas_report()
    assert max(spills) == 0


def swiglu_then_quantize(gate, up):
    q, scales = ops.quantize_groups(ops.silu(gate) * up, ue8m0=True)
    return {"D": q, "scales": scales}


@pytest.mark.compile
@pytest.mark.parametrize(
    "pins", [None, {"schedule": "pingpong", "tile_m": 64, "tile_n": 256}], ids=["planned", "pingpong-64x256"]
)
def test_blockwise_gated_quantize_compiles_without_spills(pins, ptxas_report):
    """DeepSeek-V3's dense MLP (4096 tokens, 7168 -> 2 x 18432: gate/up, SwiGLU, 1x128 quantization for the down
    projection) in one blockwise GEMM: 256 accumulator columns are 128 output columns, one whole quantize group,
    and each k-tile is promoted in two 128-column halves (the sum's 128 registers and a half partial's 64), so
    the tile compiles for sm_90a without spills, beside the gated epilogue's two passes."""
    from epicute.gemm.api import describe_call
    from epicute.gemm.config import promote_partials
    from epicute.gemm.prepare import prepare

    m, n, k = 4096, 18432, 7168
    a, w = torch.empty(m, k, dtype=E4M3, device="meta"), torch.empty(2 * n, k, dtype=E4M3, device="meta")
    scales = (torch.empty(k // 128, m, device="meta").t(), torch.empty(2 * n // 128, k // 128, device="meta"))
    _, _, request, _ = describe_call(a, w.t(), swiglu_then_quantize, None, None, None, None, pins, {}, False, scales,
                                     True)  # fmt: skip
    variant = prepare(request).variant()
    cfg = variant.config
    assert variant.block_scaled and variant.fusion.gated and cfg.tile_n == 256
    assert (promote_partials(cfg), promote_chunks(cfg)) == (1, 2)
    assert cfg.schedule == ("pingpong" if pins else "cooperative")
    assert callable(compile_gemm(variant))
    spills, _ = ptxas_report()
    assert max(spills) == 0
