"""Compile every GEMM kernel path for sm_90a with fake tensors (no GPU needed).

A failure here is a kernel that would not build on the device. The matrix
covers each tile width, cluster shape, persistence/smem-reuse mode, epilogue
tile and stage count, every output dtype and all four operand majors.
"""

from __future__ import annotations

import pytest

from epicute.gemm import GemmConfig, GemmProblem, plan_gemm
from epicute.gemm.compile import GemmVariant, compile_gemm
from epicute.gemm.launch import variant_of

pytestmark = pytest.mark.compile

VARIANTS = [
    # (config, ab, d, a_major, b_major)
    (GemmConfig(tile_n=256, cluster_m=2, ab_stages=4, num_epi_stages=4), "bf16", "bf16", "k", "n"),
    (GemmConfig(tile_n=256, cluster_n=2, ab_stages=4, num_epi_stages=2), "fp16", "fp16", "m", "k"),
    (GemmConfig(tile_n=128, ab_stages=6, epi_tile=(128, 64)), "bf16", "fp32", "m", "n"),
    (GemmConfig(tile_n=128, persistent=False, epi_reuses_ab_smem=True, ab_stages=7), "fp16", "bf16", "k", "k"),
    (GemmConfig(tile_n=64, cluster_m=2, persistent=False, epi_tile=(128, 16), num_epi_stages=1),
     "bf16", "fp32", "k", "k"),
    (GemmConfig(tile_n=256, epi_tile=(128, 128), num_epi_stages=1, raster_along_m=False, swizzle=1),
     "bf16", "fp16", "m", "k"),
    (GemmConfig(tile_n=192, cluster_m=2, ab_stages=5, num_epi_stages=2), "bf16", "bf16", "k", "n"),
    (GemmConfig(tile_n=224, cluster_m=2, ab_stages=4, num_epi_stages=4), "bf16", "bf16", "k", "k"),
    # 256 rows: each consumer warpgroup two 64-row WGMMA blocks, the epilogue two 128-row subtiles tall
    (GemmConfig(tile_m=256, tile_n=128, cluster_m=2, ab_stages=4), "bf16", "bf16", "k", "n"),
    (GemmConfig(schedule="pingpong", tile_n=128, epi_tile=(64, 32), cluster_m=2, ab_stages=6),
     "bf16", "bf16", "k", "n"),
    (GemmConfig(schedule="pingpong", tile_n=192, epi_tile=(64, 64), ab_stages=5), "fp16", "fp32", "m", "k"),
    (GemmConfig(schedule="pingpong", tile_m=64, tile_n=256, epi_tile=(64, 32), cluster_n=2),
     "bf16", "fp8e4m3", "k", "k"),
]  # fmt: skip


def _variant_id(v) -> str:
    cfg, ab, d, a_major, b_major = v
    return f"{cfg.schedule}-{cfg.tile_m}x{cfg.tile_n}-c{cfg.cluster_m}x{cfg.cluster_n}-{ab}{d}-{a_major}{b_major}"


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_variant_compiles(variant, ptxas_report):
    cfg, ab, d, a_major, b_major = variant
    fn = compile_gemm(GemmVariant(cfg, ab, d, a_major, b_major))
    assert callable(fn)
    spills, _ = ptxas_report()
    assert max(spills) == 0, f"{cfg}: ptxas spilled {spills} bytes"


@pytest.mark.parametrize(
    "mnk", [(8192, 8192, 8192), (1, 8, 8), (1000, 4104, 136), (256, 4096, 4096), (256, 14336, 4096)]
)
def test_planned_variants_compile(mnk, ptxas_report):
    plan = plan_gemm(GemmProblem(*mnk))
    assert callable(compile_gemm(variant_of(plan)))
    spills, _ = ptxas_report()
    assert max(spills) == 0, f"{plan.config}: ptxas spilled {spills} bytes"
