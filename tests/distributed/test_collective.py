"""epicute.distributed's host logic in a CPU ``gloo`` world (the GEMMs by the reference backend): the schedules'
blocks, operands cut by rows, the reduction added in the epilogue, autograd, refusals (cases.py)."""

from __future__ import annotations

import functools

import pytest
import torch

import epicute
import epicute.distributed as ED
from tests.distributed import cases
from tests.nn.gloo_world import AVAILABLE, spawn

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs torch.distributed with gloo")


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_gemm_with_an_epilogue_over_the_gathered_rows(world):
    spawn(functools.partial(cases.all_gather_gemm_with_epilogue, rows=7, k=40, n=24), world)


@pytest.mark.parametrize("world", [2, 3])
def test_gemm_reduce_scatter_adds_the_peers_partials_before_the_epilogue(world):
    spawn(functools.partial(cases.gemm_reduce_scatter_with_epilogue, rows=5, k=24, n=40), world)


def test_column_then_row_parallel_projections_train():
    spawn(functools.partial(cases.column_then_row_parallel_trains, rows=9, k=32, n=16), 2)


def test_no_process_group_is_refused():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(epicute.ConfigError, match="init_process_group"):
        ED.all_gather_gemm(x, x.t())


def test_fp8_rowwise_inputs_both_ways():
    spawn(functools.partial(cases.fp8_rowwise_both_ways, rows=5, k=32, n=24), 2)
