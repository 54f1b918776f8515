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


#: test id -> (the case of cases.py, its sizes): each run at every world size
CASES = {
    "all_gather_gemm_with_an_epilogue_over_the_gathered_rows": (
        cases.all_gather_gemm_with_epilogue, {"rows": 333, "k": 264, "n": 200}),
    "gemm_reduce_scatter_adds_the_peers_partials_before_the_epilogue": (
        cases.gemm_reduce_scatter_with_epilogue, {"rows": 277, "k": 136, "n": 296}),
    "column_then_row_parallel_projections_train": (
        cases.column_then_row_parallel_trains, {"rows": 301, "k": 200, "n": 168}),
    "fp8_rowwise_inputs_both_ways": (cases.fp8_rowwise_both_ways, {"rows": 259, "k": 128, "n": 176}),
    "both_collectives_train_with_their_epilogues": (
        cases.mlp_with_epilogues_trains, {"rows": 301, "k": 264, "n": 296}),
    "a_gated_projection_over_the_gathered_tokens_trains": (
        cases.gated_all_gather_gemm_trains, {"rows": 301, "k": 264, "n": 200}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_collective_gemms_on_gpus(world, case):
    fn, sizes = CASES[case]
    _spawn(fn, world, **sizes)
