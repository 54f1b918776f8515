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


@pytest.mark.parametrize(("k", "n"), [(32, 16), (264, 272)], ids=["recompute", "save"])
def test_both_collectives_train_with_their_epilogues(k, n):
    spawn(functools.partial(cases.mlp_with_epilogues_trains, rows=9, k=k, n=n), 2)


@pytest.mark.parametrize("k", [40, 264], ids=["recompute", "save"])
def test_a_gated_projection_over_the_gathered_tokens_trains(k):
    spawn(functools.partial(cases.gated_all_gather_gemm_trains, rows=7, k=k, n=24), 2)


def test_no_process_group_is_refused():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(epicute.ConfigError, match="init_process_group"):
        ED.all_gather_gemm(x, x.t())


def test_fp8_rowwise_inputs_both_ways():
    spawn(functools.partial(cases.fp8_rowwise_both_ways, rows=5, k=32, n=24), 2)


@pytest.fixture
def world_of_one():
    """An in-process gloo group of one rank (the refusals come before any collective)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with epicute.use_backend("reference"):
            yield
    finally:
        dist.destroy_process_group()


def test_bad_calls_are_refused_before_any_collective(world_of_one):
    bf16 = torch.bfloat16
    x, w = torch.randn(6, 16, dtype=bf16), torch.randn(24, 16, dtype=bf16)
    with pytest.raises(epicute.ShapeError, match=r"\(rows, K\) and \(K, N\)"):
        ED.all_gather_gemm(x, w)  # w, not w.t()
    with pytest.raises(epicute.ShapeError, match="takes tensors"):
        ED.gemm_reduce_scatter(x.tolist(), w.t())
    with pytest.raises(epicute.EpilogueError, match="without an epilogue"):
        ED.all_gather_gemm(x, w.t(), bias=torch.randn(24, dtype=bf16))
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    blockwise = torch.ones(6, 1, 1)
    with pytest.raises(epicute.ConfigError, match="tensorwise .* or rowwise"):
        ED.all_gather_gemm(x8, w8.t(), a_scale=blockwise, b_scale=torch.ones(1, 24))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    with pytest.raises(epicute.ShapeError, match="local tensors"):
        ED.all_gather_gemm(distribute_tensor(x, init_device_mesh("cpu", (1,))), w.t())
    with pytest.raises(epicute.DtypeError):  # gemm's own check, made before the first collective
        ED.gemm_reduce_scatter(x, w.t().float())


def test_a_world_of_one_is_the_gemm(world_of_one):
    x, w = torch.randn(6, 16, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16)
    want = x.double() @ w.double().T
    assert cases.rel(ED.all_gather_gemm(x, w.t()), want) < cases.TOL
    assert cases.rel(ED.gemm_reduce_scatter(x, w.t(), epilogue=lambda acc, s: acc * s, s=2.0), 2 * want) < cases.TOL


def _every_gpu_case(rank: int, world: int) -> None:
    """The GPU test's cases (tests/distributed/test_collective_gpu.py), with its sizes, one after the other."""
    from tests.distributed.test_collective_gpu import CASES

    for _, (fn, sizes) in sorted(CASES.items()):
        fn(rank, world, **sizes)


def test_the_gpu_cases_sizes_hold_in_a_world_of_eight():
    # The 8-GPU run has had no machine yet: its cases' host logic and sizes (features split eight ways into TMA-aligned
    # rows) in a gloo world of 8 ranks, so that run meets the code, not a size its GEMMs refuse.
    spawn(_every_gpu_case, 8)

