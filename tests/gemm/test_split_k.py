"""Split-K planning on the CPU: when the planner splits, what explain says, and typed errors."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.gemm import GemmProblem, plan_gemm


def meta(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("m", [1, 16, 48])
def test_decode_shapes_with_few_tiles_split_k_and_explain_says_why(m):
    plan = epicute.explain(meta(m, 14336), meta(4096, 14336).t(), file=None)
    assert plan.config.split_k > 1
    assert plan.grid[2] == min(plan.clusters * plan.config.split_k, plan.max_active_clusters)
    text = "\n".join(plan.config.reasons)
    assert f"split_k {plan.config.split_k}" in text and "deterministic" in text


@pytest.mark.parametrize(
    "shape",
    [(128, 4096, 14336), (256, 4096, 14336), (4096, 4096, 4096), (16, 14336, 4096), (16, 4096, 512), (0, 32, 64)],
)
def test_no_split_with_enough_tiles_or_short_k_or_two_rows_of_tiles(shape):
    # The unswapped plan's split (a swapped one splits by its own rule: tests/gemm/test_swap_ab.py).
    m, n, k = shape
    assert plan_gemm(GemmProblem(m, n, k, b_major="k"), swap_ab=False).config.split_k == 1


def test_a_weight_gradient_of_few_tiles_and_a_long_k_splits_128_wide_tiles_in_two():
    """ViT's 1024 x 1024 x 12608 (tokens as K): 64 tiles of 128x128 over 197 k-tiles run as 128 CTAs in 2x1 clusters;
    fewer k-tiles, or rows and columns under 512 (128 x 4096 x 14336 above), stay unsplit."""
    plan = epicute.explain(meta(12608, 1024).t(), meta(12608, 1024), file=None)
    c = plan.config
    assert (c.tile_m, c.tile_n, c.split_k, c.cluster_m, c.cluster_n) == (128, 128, 2, 2, 1)
    assert any(r.startswith("split_k 2: M = 1024: 64 tiles of 128x128 fill 48% of the SMs") for r in c.reasons)
    for unsplit in ((1024, 1024, 8128), (384, 1024, 12608), (1024, 384, 12608)):
        assert plan_gemm(GemmProblem(*unsplit)).config.split_k == 1, unsplit


def test_pinned_split_k_is_planned_around_and_validated():
    assert plan_gemm(GemmProblem(16, 4096, 4096), split_k=3).config.split_k == 3
    with pytest.raises(epicute.EpicuteError, match="split_k=9"):
        plan_gemm(GemmProblem(16, 4096, 4096), split_k=9)
    with pytest.raises(epicute.EpicuteError, match="cooperative"):
        plan_gemm(GemmProblem(16, 4096, 4096), split_k=2, schedule="pingpong")


def test_split_k_is_refused_where_it_cannot_run():
    from epicute.gemm.compile import compile_gemm

    x, w, res = meta(16, 4096), meta(4096, 4096), meta(16, 4096)
    plan = epicute.explain(x, w.t(), epilogue=lambda acc, res: acc + res, res=res, file=None)
    assert plan.config.split_k == 1  # a tile operand streams in before the splits meet
    from epicute.epilogue.tracer import as_epilogue
    from epicute.gemm.prepare import GemmRequest, prepare

    request = GemmRequest(GemmProblem(16, 4096, 4096, b_major="k"), as_epilogue(lambda acc, res: acc + res),
                          (("res", "tile", "bf16"),), overrides=(("split_k", 2),))  # fmt: skip
    with pytest.raises(epicute.EpicuteError, match="full-tile operands"):
        compile_gemm(prepare(request).variant())


def test_a_split_variant_compiles_for_sm90a():
    from epicute.gemm.compile import compile_gemm
    from epicute.gemm.launch import variant_of

    compile_gemm(variant_of(plan_gemm(GemmProblem(16, 4096, 14336, b_major="k"))))


def test_grouped_kernels_refuse_split_k():
    """A grouped kernel schedules its own tiles: a pinned split_k is a typed error, not a silently wrong walk."""
    from dataclasses import replace

    from epicute.grouped.kernel_sm90 import GroupedGemmSm90

    cfg = replace(plan_gemm(GemmProblem(16, 4096, 14336, b_major="k")).config, split_k=2)
    with pytest.raises(epicute.EpicuteError, match="does not split K"):
        GroupedGemmSm90(cfg, "bf16", "bf16", "k", "k")


def test_a_split_plans_roofline_runs_each_split_as_a_cta():
    """explain's prediction of a split plan: every split of a tile is a CTA in the waves, running its share of the
    k-tiles, plus its fp32 partial stored and read back (a weight gradient's 1024 x 1024 x 12608)."""
    from epicute.gemm.roofline import MAINLOOP_EFFICIENCY
    from epicute.runtime.target import TARGETS

    h200 = TARGETS["h200"]
    problem = GemmProblem(1024, 1024, 12608, a_major="m")
    whole = plan_gemm(problem, h200, tile_n=128, split_k=1).roofline
    split = plan_gemm(problem, h200, tile_n=128, split_k=2).roofline
    assert whole.waves == pytest.approx(64 / h200.num_sms) and split.waves == pytest.approx(128 / h200.num_sms)
    per_sm_flops = h200.peak_tflops("bf16") * 1e12 / h200.num_sms * MAINLOOP_EFFICIENCY[128]

    def mainloop_s(k_tiles: int) -> float:
        return 2 * 128 * 128 * 64 * k_tiles / per_sm_flops

    partial_s = 2 * 128 * 128 * 4 / (h200.hbm_tb_per_s * 1e12 / h200.num_sms)
    k_tiles = -(-12608 // 64)  # 197: splits of 99
    assert split.predicted_s - whole.predicted_s == pytest.approx(mainloop_s(99) + partial_s - mainloop_s(k_tiles))
