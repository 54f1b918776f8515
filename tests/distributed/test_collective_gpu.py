"""epicute.distributed on GPUs: an NCCL world of one GPU per rank, torch's symmetric memory, the kernels (cases.py).
World sizes 2, 4 and 8, each skipped on a machine with fewer GPUs."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed import cases
from tests.nn.gloo_world import spawn

pytestmark = pytest.mark.gpu
WORLDS = [2, 4, 8]


def _spawn(case, world: int, **sizes) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"a world of {world} ranks needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    spawn(functools.partial(case, **sizes), world, backend="nccl")


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_gemm_with_an_epilogue_over_the_gathered_rows(world):
    _spawn(cases.all_gather_gemm_with_epilogue, world, rows=333, k=264, n=200)


@pytest.mark.parametrize("world", WORLDS)
def test_gemm_reduce_scatter_adds_the_peers_partials_before_the_epilogue(world):
    _spawn(cases.gemm_reduce_scatter_with_epilogue, world, rows=277, k=136, n=296)


@pytest.mark.parametrize("world", WORLDS)
def test_column_then_row_parallel_projections_train(world):
    _spawn(cases.column_then_row_parallel_trains, world, rows=301, k=200, n=168)


@pytest.mark.parametrize("world", WORLDS)
def test_fp8_rowwise_inputs_both_ways(world):
    _spawn(cases.fp8_rowwise_both_ways, world, rows=259, k=128, n=176)


@pytest.mark.parametrize("world", WORLDS)
def test_both_collectives_train_with_their_epilogues(world):
    _spawn(cases.mlp_with_epilogues_trains, world, rows=301, k=264, n=296)


@pytest.mark.parametrize("world", WORLDS)
def test_a_gated_projection_over_the_gathered_tokens_trains(world):
    _spawn(cases.gated_all_gather_gemm_trains, world, rows=301, k=264, n=200)
