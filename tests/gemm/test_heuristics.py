"""The planner's choices: every plan fits and validates, and each decision follows its rule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from epicute import ConfigError
from epicute.gemm import GemmProblem, plan_gemm, render_plan
from epicute.gemm.heuristics import (
    MAX_AB_STAGES,
    MIN_EPI_STAGES,
    choose_config,
    choose_raster,
    raster_window,
    reread_rows_and_columns,
)
from epicute.gemm.smem import smem_total
from epicute.runtime.target import H100_SXM, TARGETS, current_target
from epicute.sm90.tile_grid import ceil_div

BUDGET = H100_SXM.smem_per_cta_bytes
BIG = GemmProblem(8192, 8192, 8192)
TINY = GemmProblem(1, 8, 8)
PROBLEMS = {
    "8192^3": BIG,
    "4096^3": GemmProblem(4096, 4096, 4096),
    "1x8x8": TINY,
    "1000x4104x1000": GemmProblem(1000, 4104, 1000),
    "256x4096x4096": GemmProblem(256, 4096, 4096),
    "batched-L3": GemmProblem(1024, 1024, 1024, l=3),
    "N64-fp32-out": GemmProblem(4096, 64, 4096, d_dtype="fp32"),
    "colmajor-fp16": GemmProblem(2048, 2048, 2048, ab_dtype="fp16", a_major="m", b_major="k"),
}


@pytest.fixture(params=list(PROBLEMS), ids=list(PROBLEMS))
def problem(request):
    return PROBLEMS[request.param]


def test_plan_fits_validates_and_explains(problem):
    cfg = choose_config(problem, H100_SXM)
    cfg.validate()
    assert smem_total(cfg, problem.ab_dtype, problem.d_dtype) <= BUDGET
    assert len(cfg.reasons) >= 5
    assert all(isinstance(reason, str) and reason for reason in cfg.reasons)


def test_ab_stages_are_maximal(problem):
    cfg = choose_config(problem, H100_SXM)
    if cfg.ab_stages < MAX_AB_STAGES:
        deeper = replace(cfg, ab_stages=cfg.ab_stages + 1, num_epi_stages=MIN_EPI_STAGES)
        assert smem_total(deeper, problem.ab_dtype, problem.d_dtype) > BUDGET


def test_big_problems_get_persistent_2x1_clusters_of_wide_tiles():
    cfg = choose_config(PROBLEMS["4096^3"], H100_SXM)
    assert (cfg.schedule, cfg.tile_n, cfg.cluster_m, cfg.cluster_n) == ("cooperative", 256, 2, 1)
    assert cfg.persistent and not cfg.epi_reuses_ab_smem
    assert any(reason.startswith("persistent grid of 132 CTAs") for reason in cfg.reasons)


@pytest.mark.parametrize(
    ("m", "n", "cluster", "why"),
    [
        # 99 x 4 tiles of 128x256 (ViT's 12608 tokens): 3 waves alone, 50 x 4 pairs of them 4 waves, 99 x 2 three
        (12608, 1024, (1, 2), ("cluster 1x2: A tiles multicast to 2 CTAs, halving A's L2->SM traffic (pairs along M "
                               "would pad 99 rows of tiles to 100: 4 waves of clusters against 3 unpaired)")),
        # 23 x 16 tiles: 3 waves alone, 12 x 16 pairs 3 waves too: the odd row of tiles costs no wave
        (2944, 4096, (2, 1), "cluster 2x1: B tiles multicast to 2 CTAs"),
        # 161 x 9 tiles: 11 waves alone, 12 paired along M, 12 along N (161 x 5 pairs)
        (20608, 2304, (1, 1), ("cluster 1x1: pairs along M would pad 161 rows of tiles to 162: 12 waves of clusters "
                               "against 11 unpaired, and pairs along N too")),
    ],
)  # fmt: skip
def test_pairs_of_tiles_cost_no_wave_of_their_own(m, n, cluster, why):
    cfg = choose_config(GemmProblem(m, n, 4096, b_major="k"), H100_SXM)
    assert (cfg.schedule, cfg.tile_m, cfg.tile_n) == ("cooperative", 128, 256)
    assert (cfg.cluster_m, cfg.cluster_n) == cluster
    assert any(reason.startswith(why) for reason in cfg.reasons), cfg.reasons


def test_the_roofline_counts_the_padded_tiles_of_a_ragged_last_cluster():
    """99 x 4 tiles of 128x256 in 2x1 clusters are 50 x 4 clusters, 400 CTAs' worth: a fourth wave (the plan's 1x2
    pairs run 396 in three)."""
    problem = GemmProblem(12608, 1024, 4096, b_major="k")
    planned = plan_gemm(problem, H100_SXM).roofline
    paired = plan_gemm(problem, H100_SXM, cluster_m=2, cluster_n=1).roofline
    assert planned.waves == pytest.approx(396 / 132) and paired.waves == pytest.approx(400 / 132)
    assert paired.predicted_s == pytest.approx(planned.predicted_s * 4 / 3)


def test_8192_cubed_takes_ping_pong_tiles_in_bands_down_m():
    # 2752 tiles of 128x192 fill 20.85 of 21 waves, 2048 of 128x256 15.5 of 16; with two tiles
    # per SM in flight, bands of 8 clusters down M cover 2048x3264 instead of 4352x1536.
    cfg = choose_config(PROBLEMS["8192^3"], H100_SXM)
    assert (cfg.schedule, cfg.tile_n, cfg.cluster_m, cfg.cluster_n) == ("pingpong", 192, 2, 1)
    assert not cfg.raster_along_m
    assert "2048x3264 instead of 4352x1536" in cfg.reasons[-1]


@pytest.mark.parametrize(("m", "n", "along_m"), [(8192, 4096, True), (4096, 14336, False), (256, 4096, False)])
def test_raster_sweeps_the_longer_output_dimension(m, n, along_m):
    cfg = choose_config(GemmProblem(m=m, n=n, k=4096), H100_SXM)
    assert cfg.raster_along_m is along_m


def test_raster_re_reads_the_operand_that_costs_less():
    """Square tiles in 2x1 clusters: at 16384x4096 bands of 8 clusters across N are 1024 columns wide (A re-read
    4 times), bands across M 2048 rows tall (B re-read 8 times, a quarter of A's size): across M wins although
    M is the longer dimension. 128x256 tiles in the same clusters are square and sweep down M."""
    problem = GemmProblem(m=16384, n=4096, k=4096)
    assert reread_rows_and_columns(problem, (128, 128), (2, 1), 8) == {True: 16384 * 4 + 4096, False: 16384 + 4096 * 8}
    along_m, why = choose_raster(problem, (128, 128), (2, 1), 8, 66)
    assert not along_m and "B is re-read per band: 49152" in why
    assert choose_raster(problem, (128, 256), (2, 1), 8, 66)[0]
    blockwise = GemmProblem(16384, 4096, 4096, ab_dtype="fp8e4m3", a_major="k", b_major="k", block_scaled=True)
    cfg = choose_config(blockwise, H100_SXM)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.raster_along_m) == (128, 128, 2, 1, False)


def test_raster_window_and_square_tie():
    problem = GemmProblem(m=8192, n=8192, k=8192)
    # Cooperative 128x256 tiles in 2x1 clusters: 66 clusters in flight, 256x256 each.
    assert raster_window(problem, (128, 256), (2, 1), 8, 66, along_m=True) == (9 * 256, 8 * 256)
    assert raster_window(problem, (128, 256), (2, 1), 8, 66, along_m=False) == (8 * 256, 9 * 256)
    along_m, why = choose_raster(problem, (128, 256), (2, 1), 8, 66)
    assert along_m and "either walk" in why
    # A band never covers more clusters than the problem has.
    small = GemmProblem(m=512, n=512, k=64)
    assert raster_window(small, (128, 128), (2, 1), 8, 132, along_m=True) == (512, 512)


@pytest.mark.parametrize("name", ["1x8x8", "256x4096x4096", "batched-L3"])
def test_single_wave_problems_reuse_the_a_ring(name):
    cfg = choose_config(PROBLEMS[name], H100_SXM)
    assert not cfg.persistent and cfg.epi_reuses_ab_smem
    problem = PROBLEMS[name]
    tiles_m = -(-problem.m // 128)
    tiles = tiles_m * -(-problem.n // cfg.tile_n) * problem.l
    # 2x1 clusters (B multicast) once there are two rows of tiles and half a wave of them.
    expected = (2, 1) if tiles_m >= 2 and 2 * tiles >= 132 else (1, 1)
    assert (cfg.cluster_m, cfg.cluster_n) == expected


def test_tiny_problem_gets_narrow_tile_and_deepest_ring():
    cfg = choose_config(TINY, H100_SXM)
    assert cfg.tile_n == 64
    assert cfg.epi_tile == (128, 32)
    assert cfg.ab_stages == MAX_AB_STAGES
    assert cfg.reasons[:2] == ("schedule cooperative: plain GEMM: two warpgroups on one 128-row tile",
                               "tile 128x64x64: N=8 fits one 64-wide tile")  # fmt: skip


@pytest.mark.parametrize(("n", "tile_n"), [(1, 64), (64, 64), (65, 128), (128, 128)])
def test_narrow_n_picks_the_smallest_covering_tile(n, tile_n):
    assert choose_config(GemmProblem(4096, n, 4096), H100_SXM).tile_n == tile_n


def test_wave_quantization_prefers_128_wide_tiles():
    # 128x256 tiles: 8 x 17 = 136 tiles, just over one wave of 132 SMs.
    cfg = choose_config(PROBLEMS["1000x4104x1000"], H100_SXM)
    assert cfg.tile_n == 128
    assert "wave quantization" in cfg.reasons[1]


def test_plain_gemm_takes_pingpong_where_its_tile_fills_the_waves_best():
    # 8192^3: 2048 tiles of 128x256 are 15.5 waves, ping-pong's 2752 of 128x192 20.8 with the store under the
    # other warpgroup's mainloop (bench/results/configs_pingpong.json; bench/NOTES.md, 'Ping-pong 128x192 for
    # plain GEMMs').
    cfg = choose_config(GemmProblem(8192, 8192, 8192), H100_SXM)
    assert (cfg.schedule, cfg.tile_n) == ("pingpong", 192)
    assert "ping-pong 128x192 tiles estimated" in cfg.reasons[0]
    for m, n, k in ((4096, 4096, 4096), (1024, 4096, 4096), (512, 14336, 4096), (16384, 4096, 4096)):
        assert choose_config(GemmProblem(m, n, k), H100_SXM).schedule == "cooperative", (m, n, k)
    # A pinned tile keeps the cooperative default (its epi_tile may not suit ping-pong).
    pinned = choose_config(GemmProblem(1024, 14336, 4096), H100_SXM, tile_n=128, epi_tile=(128, 128))
    assert pinned.schedule == "cooperative" and "pinned tile" in pinned.reasons[0]
    pinned.validate()


def test_224_wide_tiles_where_they_tile_n_exactly():
    # 1024x14336: 448 tiles of 128x256 are 3.4 waves (four waves' time), 600 of ping-pong's 128x192 4.5; 512 of
    # 128x224 (N in 64 whole tiles) 3.9: measured 750 TFLOPS against 728 (ping-pong 128x192, planned before) and 679
    # (128x256; bench/results/configs_wide224.json).
    for target in (H100_SXM, TARGETS["h200"]):
        cfg = choose_config(GemmProblem(1024, 14336, 4096), target)
        assert (cfg.schedule, cfg.tile_n) == ("cooperative", 224)
        assert cfg.reasons[1].startswith("tile 128x224x64: 128x224 tiles estimated")
        assert "N in whole 224-wide tiles" in cfg.reasons[1]
    # Not where 224 leaves a partial tile (12288 = 54.9 x 224), nor for fp8 inputs (not measured).
    assert choose_config(GemmProblem(1024, 12288, 4096), H100_SXM).tile_n == 256
    assert choose_config(GemmProblem(2048, 7168, 7168, ab_dtype="fp8e4m3", b_major="k"), TARGETS["h200"]).tile_n != 224


@pytest.mark.parametrize("k", [4096, 14336])
def test_under_filled_problem_takes_narrow_tiles(k):
    # 256 x 4096: 64 tiles of 128x128 leave half the SMs idle; 128 tiles of 128x64 do not
    # (bench/results/configs.json; bench/NOTES.md, 'Narrow tiles for under-filled problems').
    cfg = choose_config(GemmProblem(256, 4096, k), H100_SXM)
    assert (cfg.tile_n, cfg.cluster_m, cfg.cluster_n) == (64, 2, 1)
    assert "too few wider tiles to fill the SMs" in cfg.reasons[1]


def test_fused_epilogue_schedule_follows_the_wave_count():
    from epicute.gemm.smem import EpilogueBuffers

    epi = EpilogueBuffers(tile_inputs=("bf16",), vectors=("row",), chain=("tile load_vectors",))
    # Up to 4 tiles of 128x128 per SM: cooperative (measured faster: bench/NOTES.md, 'Fused epilogue
    # at few tiles per SM'); above: ping-pong.
    for m, n in ((512, 4096), (1024, 4096), (1024, 8192)):
        cfg = choose_config(GemmProblem(m, n, 4096), H100_SXM, epi)
        assert cfg.schedule == "cooperative" and "too few for ping-pong's overlap to pay" in cfg.reasons[0]
    assert choose_config(GemmProblem(1024, 9216, 4096), H100_SXM, epi).schedule == "pingpong"


@pytest.mark.parametrize(
    ("m", "n", "k", "schedule"),
    [
        # plain GEMMs at 7, 14 and 55 waves of 128x256 tiles (bench/NOTES.md, 'The cooperative store's exposed time')
        (2048, 14336, 4096, "cooperative"),
        (4096, 14336, 4096, "cooperative"),
        (16384, 14336, 4096, "pingpong"),
    ],
)
def test_plain_schedule_counts_the_cooperative_store(m, n, k, schedule):
    """On the H200 a cooperative tile's store runs with no WGMMA in flight: at many waves ping-pong 128x192, whose
    store runs under the other warpgroup's mainloop, is estimated (and measured) ahead; at few, the wider tile stays
    ahead. The H100, not measured so, keeps cooperative at 55 waves."""
    h200 = TARGETS["h200"]
    plan = plan_gemm(GemmProblem(m, n, k), h200)
    assert plan.config.schedule == schedule
    assert plan_gemm(GemmProblem(m, n, k), H100_SXM).config.schedule == "cooperative"
    coop = plan_gemm(GemmProblem(m, n, k), h200, schedule="cooperative", tile_n=256)
    tiles = ceil_div(m, 128) * ceil_div(n, 256)
    store = 128 * 256 * h200.cooperative_store_cycles / h200.tensor_clock_hz
    mainloop = 2 * 128 * 256 * k / (h200.peak_tflops_16bit * 1e12 / h200.num_sms * 0.82)
    assert coop.roofline.predicted_s == pytest.approx(ceil_div(tiles, h200.num_sms) * (mainloop + store))


@pytest.mark.parametrize(
    ("m", "n", "k", "schedule", "tile_n"),
    [
        # the schedule measured faster with gelu(0.5 acc + bias) + residual (bench/NOTES.md,
        # 'Fused epilogues: the schedule by estimate'; the ping-pong shapes also 'gelu through erfc')
        (4096, 4096, 4096, "cooperative", 256),
        (2048, 8192, 8192, "cooperative", 256),
        (16384, 4096, 4096, "cooperative", 256),
        (4096, 14336, 4096, "pingpong", 192),
        (8192, 8192, 8192, "pingpong", 192),
        (1024, 9216, 4096, "pingpong", 192),
        # 64 whole tiles of 224 along N: 694 TFLOPS fused against 686 for ping-pong 128x192 (configs_epilogue_wide224)
        (1024, 14336, 4096, "cooperative", 224),
    ],
)
def test_fused_epilogue_schedule_by_estimate(m, n, k, schedule, tile_n):
    from epicute.gemm.smem import EpilogueBuffers

    ffn = EpilogueBuffers(tile_inputs=("bf16",), vectors=("row",), chain=("x",), instructions_per_element=24)
    cfg = choose_config(GemmProblem(m, n, k), H100_SXM, ffn)
    assert (cfg.schedule, cfg.tile_n) == (schedule, tile_n)
    assert cfg.reasons[0].startswith(f"schedule {schedule}: fused epilogue: {schedule} 128x{tile_n} estimated")


def test_batch_counts_towards_waves():
    # One 1024^3 GEMM is 32 tiles of 128x256; 8 of them are 256 tiles, two waves.
    cfg = choose_config(GemmProblem(1024, 1024, 1024, l=8), H100_SXM)
    assert cfg.persistent and (cfg.cluster_m, cfg.cluster_n) == (2, 1)


def test_override_tile_n():
    cfg = choose_config(BIG, H100_SXM, tile_n=128)
    assert cfg.tile_n == 128
    assert cfg.reasons[1] == "tile 128x128x64: requested"
    assert smem_total(cfg, "bf16", "bf16") <= BUDGET


def test_override_persistent_false_reuses_the_a_ring():
    cfg = choose_config(BIG, H100_SXM, persistent=False)
    assert not cfg.persistent and cfg.epi_reuses_ab_smem
    assert "one tile per CTA: requested" in cfg.reasons


def test_override_stages():
    cfg = choose_config(BIG, H100_SXM, ab_stages=3)
    assert cfg.ab_stages == 3
    assert "stages: requested" in cfg.reasons


def test_register_overrides_pass_through():
    cfg = choose_config(BIG, H100_SXM, producer_regs=48, consumer_regs=224)
    assert (cfg.producer_regs, cfg.consumer_regs) == (48, 224)
    assert cfg.tile_n == choose_config(BIG, H100_SXM).tile_n


def test_unknown_override_is_rejected():
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['tile_x'\]"):
        choose_config(BIG, H100_SXM, tile_x=128)


def test_override_that_cannot_fit_names_shared_memory():
    with pytest.raises(ConfigError, match=r"needs \d+ B of shared memory, over the 232448 B"):
        choose_config(BIG, H100_SXM, tile_n=256, ab_stages=8)


def test_invalid_override_is_rejected_by_validate():
    with pytest.raises(ConfigError, match=r"tile_n=96"):
        choose_config(BIG, H100_SXM, tile_n=96)


def test_plan_gemm_uses_given_target():
    small = replace(H100_SXM, num_sms=66)
    plan = plan_gemm(BIG, small)
    assert plan.target is small
    assert plan.grid == (2, 1, 33)


def test_current_target_without_gpu_is_h100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    current_target.cache_clear()
    try:
        hw = current_target()
    finally:
        current_target.cache_clear()
    assert replace(hw, origin="named") == H100_SXM and hw.origin.startswith("assumed")
    assert (hw.num_sms, hw.smem_per_cta_bytes, hw.arch, hw.detected) == (132, 227 * 1024, "sm_90a", False)


def test_reused_d_staging_must_fit_in_the_a_ring():
    # fp32 D: 4 x 128x32x4 B = 64 KiB would alias a 2-stage A ring of 32 KiB.
    with pytest.raises(ConfigError, match="do not fit in the A ring"):
        choose_config(GemmProblem(1, 8, 8, d_dtype="fp32"), H100_SXM, ab_stages=2)


def test_fused_epilogue_shrinks_the_ab_ring_and_shows_in_the_roofline():
    from epicute.gemm.smem import EpilogueBuffers

    problem = GemmProblem(8192, 8192, 8192)
    epi = EpilogueBuffers(
        tile_inputs=("bf16",), aux_outputs=("bf16",), vectors=("row",), chain=("tile load_vectors",),
        instructions_per_element=24,
    )  # fmt: skip
    fused = plan_gemm(problem, H100_SXM, epilogue=epi)
    # A fused epilogue gets the ping-pong schedule; against a plain GEMM of the same tiles:
    assert (fused.config.schedule, fused.config.tile_n) == ("pingpong", 192)
    plain = plan_gemm(problem, H100_SXM, schedule="pingpong", tile_n=192)
    stages = lambda plan: (plan.config.ab_stages, plan.config.num_epi_stages)
    assert stages(fused) < stages(plain)  # the A/B ring or the D staging gave way
    assert fused.smem_bytes <= BUDGET
    assert fused.roofline.epilogue_bytes == 8192 * 8192 * 4
    # The epilogue's bytes arrive under the mainloop in both schedules; of its arithmetic
    # (128x192 elements x 24 instructions at 128 per cycle) ping-pong's other mainloop loses
    # half, in each of 21 waves, while cooperative pays all of it, in each of 16.
    alu = fused.roofline.epilogue_alu_s
    assert alu == pytest.approx(128 * 192 * 24 / (128 * H100_SXM.tensor_clock_hz))
    assert not fused.roofline.epilogue_exposed
    assert fused.roofline.predicted_s == pytest.approx(plain.roofline.predicted_s + 21 * alu / 2)
    coop = plan_gemm(problem, H100_SXM, epilogue=epi, schedule="cooperative", tile_n=256)
    coop_plain = plan_gemm(problem, H100_SXM, schedule="cooperative", tile_n=256)
    assert coop.roofline.predicted_s == pytest.approx(coop_plain.roofline.predicted_s + 16 * alu * 256 / 192)
    assert "exposed (the cooperative epilogue" in render_plan(coop)
    text = render_plan(fused)
    assert "under the other warpgroup's mainloop (ping-pong)" in text and "takes turns with warpgroup 2" in text
    assert "epilogue chain" in text and "tile load_vectors" in text and "epilogue        +268.44 MB" in text


def test_epilogue_code_over_budget_moves_to_cooperative_tiles():
    from epicute.gemm.heuristics import EPILOGUE_CODE_BUDGET, epilogue_code
    from epicute.gemm.smem import EpilogueBuffers

    problem = GemmProblem(4096, 14336, 4096)

    def plan(per_element):
        epi = EpilogueBuffers(
            tile_inputs=("bf16",), vectors=("row",), chain=("x",), instructions_per_element=per_element
        )
        return choose_config(problem, H100_SXM, epi), epi

    # One or two gelus (24 / 40 per element): ping-pong 128x192, 192 elements per thread, within budget.
    for per_element in (24, 40):
        cfg, epi = plan(per_element)
        assert (cfg.schedule, cfg.tile_n) == ("pingpong", 192)
        assert epilogue_code(epi, "pingpong", 128, 192) <= EPILOGUE_CODE_BUDGET
        assert any("within the 8192 budget" in r for r in cfg.reasons)
    # Three gelus (56): 10752 unrolled on ping-pong 128x192 -> cooperative 128x256 (128 per thread).
    cfg, _ = plan(56)
    assert (cfg.schedule, cfg.tile_n) == ("cooperative", 256)
    assert any("cooperative 128x256 (7168) instead of pingpong 128x192" in r for r in cfg.reasons)
    # Four (72): 128x256 would still be 9216 -> 128x128.
    cfg, _ = plan(72)
    assert (cfg.schedule, cfg.tile_n) == ("cooperative", 128)
    # What the caller pins is kept, with the estimate reported.
    cfg = choose_config(problem, H100_SXM, plan(72)[1], schedule="pingpong", tile_n=192)
    assert (cfg.schedule, cfg.tile_n) == ("pingpong", 192)
    assert any("13824 instructions per thread" in r and "requested" in r for r in cfg.reasons)


def test_plans_of_different_epilogues_with_equal_buffers_are_not_shared():
    import epicute
    from epicute import ops

    a = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    b = torch.empty(256, 512, dtype=torch.bfloat16, device="meta")
    bias = epicute.RowVector(torch.empty(512, dtype=torch.bfloat16, device="meta"))
    relu = epicute.explain(a, b, epilogue=lambda acc, bias: ops.relu(acc + bias), bias=bias)
    gelu = epicute.explain(a, b, epilogue=lambda acc, bias: ops.gelu(acc + bias), bias=bias)
    assert "relu" in " ".join(relu.epilogue.chain) and "gelu_erf" in " ".join(gelu.epilogue.chain)
    assert gelu.epilogue.instructions_per_element > relu.epilogue.instructions_per_element


def test_the_store_is_delayed_where_the_chain_allows_it():
    """The planner delays each subtile's TMA store (CUTLASS's DelayTmaStore) for a fused epilogue without operand
    tiles, not for a plain GEMM (measured the same) nor one that streams operand tiles through the TMA ring; a pin
    that cannot run is refused; explain prints the chain the kernel runs."""
    import epicute
    from epicute import ops

    a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    b = torch.empty(4096, 14336, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(14336, dtype=torch.bfloat16, device="meta")
    residual = torch.empty(4096, 14336, dtype=torch.bfloat16, device="meta")
    plain = epicute.explain(a, b, file=None)
    with_vector = epicute.explain(a, b, epilogue=lambda acc, bias: ops.gelu(acc + bias), bias=bias, file=None)
    with_tile = epicute.explain(a, b, epilogue=lambda acc, residual: acc + residual, residual=residual, file=None)
    assert with_vector.config.delay_tma_store and not plain.config.delay_tma_store
    assert not with_tile.config.delay_tma_store
    assert any("TMA store delayed one subtile" in why for why in with_vector.config.reasons)
    assert epicute.explain(a, b, config={"delay_tma_store": True}, file=None).config.delay_tma_store
    assert any("loads operand tiles" in why for why in with_tile.config.reasons)
    chain = [line.split()[1] for line in render_plan(with_vector).split("epilogue chain")[1].splitlines()[1:]
             if line.startswith("  ") and len(line.split()) > 1 and line.split()[0] in ("tile", "subtile")]  # fmt: skip
    assert chain[-2:] == ["delayed_store", "store_smem"] and "fence_barrier" not in chain
    with pytest.raises(ConfigError, match="loads operand tiles through the TMA ring"):
        epicute.explain(a, b, epilogue=lambda acc, residual: acc + residual, residual=residual,
                        config={"delay_tma_store": True}, file=None)  # fmt: skip


def test_d_is_staged_in_the_operand_ring_where_that_buys_a_stage():
    """ReuseSmemC: chosen where freeing D's staging buys an A/B stage (cooperative 128x192 with a residual),
    explained; refused where D cannot live in the ring."""
    import epicute
    from epicute import ops

    a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    b = torch.empty(4096, 14336, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(14336, dtype=torch.bfloat16, device="meta")
    residual = torch.empty(4096, 14336, dtype=torch.bfloat16, device="meta")

    def ffn(acc, bias, residual):
        return ops.gelu(acc + bias) + residual

    coop = {"schedule": "cooperative", "tile_n": 192}
    reused = epicute.explain(a, b, epilogue=ffn, bias=bias, residual=residual, config=coop, file=None)
    own = epicute.explain(a, b, epilogue=ffn, bias=bias, residual=residual, config={**coop, "reuse_smem_c": False},
                          file=None)  # fmt: skip
    assert reused.config.reuse_smem_c and not own.config.reuse_smem_c
    assert reused.config.ab_stages == own.config.ab_stages + 1
    assert reused.config.num_c_stages > reused.config.num_epi_stages and not reused.config.delay_tma_store
    text = render_plan(reused)
    assert "ReuseSmemC: D staged in operand tile 0's ring" in text and "in operand tile 0's ring (ReuseSmemC)" in text
    assert "D staging                     0 B" in text  # an alias: its bytes are the ring's
    wide = epicute.explain(a, b, epilogue=ffn, bias=bias, residual=residual,
                           config={"schedule": "cooperative", "tile_n": 256}, file=None)  # fmt: skip
    assert not wide.config.reuse_smem_c and any("buys no A/B stage" in why for why in wide.config.reasons)
    for config, match in [
        ({"schedule": "pingpong", "tile_n": 192, "reuse_smem_c": True}, "ping-pong"),
        ({**coop, "reuse_smem_c": True, "num_c_stages": 2, "num_epi_stages": 2}, "num_c_stages=2"),
    ]:
        with pytest.raises(ConfigError, match=match):
            epicute.explain(a, b, epilogue=ffn, bias=bias, residual=residual, config=config, file=None)
    with pytest.raises(ConfigError, match="aux tiles"):
        epicute.explain(a, b, epilogue=lambda acc, residual: {"D": acc + residual, "pre": acc}, residual=residual,
                        config={**coop, "reuse_smem_c": True}, file=None)  # fmt: skip
    with pytest.raises(ConfigError, match="loads no operand tile"):
        epicute.explain(a, b, config={**coop, "reuse_smem_c": True}, file=None)


def test_many_operand_tiles_keep_d_staged_apart_rather_than_refuse_the_call():
    """Seven operand tiles (a reduce-scatter's partials at TP8) fill shared memory: ReuseSmemC's deeper ring would
    leave no second A/B stage, so D keeps its own staging and the call is planned (it was refused)."""
    import epicute

    a = torch.empty(1024, 1024, dtype=torch.bfloat16, device="meta")
    b = torch.empty(1024, 8192, dtype=torch.bfloat16, device="meta")
    tiles = {f"p{i}": torch.empty(1024, 8192, dtype=torch.bfloat16, device="meta") for i in range(7)}

    def add_all(acc, p0, p1, p2, p3, p4, p5, p6):
        return acc + p0 + p1 + p2 + p3 + p4 + p5 + p6

    plan = epicute.explain(a, b, epilogue=add_all, **tiles, file=None)
    assert not plan.config.reuse_smem_c and plan.config.ab_stages >= 2
    assert any("leaves no room for 2 A/B stages" in why for why in plan.config.reasons)
