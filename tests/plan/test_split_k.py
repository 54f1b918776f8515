"""Split-K planning: which problems split, into how many slices, and what explain says."""

from __future__ import annotations

import pytest

from epicute import ConfigError
from epicute.plan import GemmProblem, plan_gemm
from epicute.plan.hardware import H100_SXM
from epicute.plan.report import render_plan
from epicute.plan.smem import EpilogueBuffers
from epicute.plan.split_k import choose_split_k, feasible, sliced


def test_a_problem_under_half_a_wave_splits_k_into_a_batch():
    problem = GemmProblem(256, 4096, 4096)
    plan = plan_gemm(problem, H100_SXM)
    assert plan.split_k == 2 and plan.split_reason.startswith("split-K 2: 64 128x128 tiles")
    assert plan.kernel_problem == GemmProblem(256, 4096, 2048, l=2, d_dtype="fp32")
    assert plan.num_tiles == 2 * 2 * 4096 // plan.config.tile_n
    assert plan.config.reasons[0] == plan.split_reason
    assert "split-K         2 slices of K=2048" in render_plan(plan)


@pytest.mark.parametrize(
    "problem",
    [
        GemmProblem(8192, 8192, 8192),  # many waves already
        GemmProblem(256, 4096, 4096, l=2),  # batched: slices would need a second batch stride
        GemmProblem(256, 4096, 1000),  # K not a multiple of 16
        GemmProblem(256, 4096, 1024),  # slices shorter than 1024
        GemmProblem(1, 8, 8),
    ],
    ids=["large", "batched", "ragged-k", "short-k", "tiny"],
)
def test_problems_that_do_not_split(problem):
    assert choose_split_k(problem, H100_SXM) == (1, None)
    assert plan_gemm(problem, H100_SXM).split_k == 1


def test_a_fused_epilogue_never_splits():
    epi = EpilogueBuffers(vectors=("row",), chain=("tile load_vectors",))
    assert plan_gemm(GemmProblem(256, 4096, 4096), H100_SXM, epilogue=epi).split_k == 1
    with pytest.raises(ConfigError, match="split_k=2: needs a plain GEMM"):
        plan_gemm(GemmProblem(256, 4096, 4096), H100_SXM, epilogue=epi, split_k=2)


def test_split_k_overrides():
    problem = GemmProblem(256, 4096, 4096)
    assert plan_gemm(problem, H100_SXM, split_k=1).split_k == 1
    forced = plan_gemm(problem, H100_SXM, split_k=4, tile_n=128)
    assert forced.split_k == 4 and forced.split_reason is None and forced.kernel_problem.k == 1024
    with pytest.raises(ConfigError, match="split_k=3"):
        plan_gemm(problem, H100_SXM, split_k=3)


def test_slices_keep_tma_alignment():
    assert feasible(GemmProblem(17, 1000, 4096), 4)
    assert not feasible(GemmProblem(17, 1000, 4104), 2)  # 4104 / 2 = 2052: not a multiple of 8
    assert sliced(GemmProblem(17, 1000, 4096, a_major="m", b_major="k"), 4) == GemmProblem(
        17, 1000, 1024, l=4, d_dtype="fp32", a_major="m", b_major="k"
    )
