"""Split-K on the GPU: decode-shaped GEMMs whose K runs as several CTAs per output tile.

Odd M, N and K, every split count (K short enough that some splits get no k-tile), clusters, a fused
epilogue with reductions, and the reduction's determinism; D NaN-poisoned, against a float32 reference.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from tests.conftest import decode_operands, rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.fixture(autouse=True)
def _exact_reference():
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("split_k", [2, 3, 5, 8])
@pytest.mark.parametrize("m,n,k", [(1, 1000, 4104), (17, 264, 2056), (128, 136, 8200), (5, 72, 72)])
def test_every_split_matches_the_reference(m, n, k, split_k):
    x, w = decode_operands(m, n, k)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    epicute.gemm(x, w.t(), out=out, config={"split_k": split_k})
    assert rel_err(out, x.float() @ w.float().t()) <= TOL, (m, n, k, split_k)


@pytest.mark.parametrize("cluster", [(1, 2), (2, 1)], ids=["1x2", "2x1"])
def test_split_k_under_clusters_and_batches(cluster):
    a = torch.randn(3, 33, 3000, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, 3000, 392, device="cuda", dtype=torch.bfloat16)
    out = torch.full((3, 33, 392), float("nan"), device="cuda", dtype=torch.bfloat16)
    epicute.gemm(a, b, out=out, config={"split_k": 4, "cluster_m": cluster[0], "cluster_n": cluster[1]})
    assert rel_err(out, a.float() @ b.float()) <= TOL


def test_the_planner_splits_decode_shapes_and_the_epilogue_runs_once_on_the_sum():
    x, w = decode_operands(16, 4096, 14336)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)

    def epi(acc, bias):
        return {"D": ops.gelu(acc + bias), "rows": ops.row_sum(acc), "cols": ops.col_max(acc), "amax": ops.amax(acc)}

    assert epicute.explain(x, w.t(), epilogue=epi, bias=bias, file=None).config.split_k > 1
    got = epicute.gemm(x, w.t(), epilogue=epi, bias=bias)
    acc = x.float() @ w.float().t()
    assert rel_err(got["D"], torch.nn.functional.gelu(acc + bias.float())) <= TOL
    assert rel_err(got["rows"], acc.sum(-1)) <= TOL
    assert rel_err(got["cols"], acc.amax(0)) <= TOL
    assert rel_err(got["amax"], acc.abs().amax()) <= TOL


def test_the_split_sum_is_deterministic():
    """The last split adds the partials in split order whichever split finished last: repeated launches
    agree bit for bit (the kernel against itself; no torch op's rounding is involved)."""
    x, w = decode_operands(7, 2048, 16384)
    first = epicute.gemm(x, w.t(), out_dtype=torch.float32, config={"split_k": 8})
    for _ in range(20):
        assert torch.equal(epicute.gemm(x, w.t(), out_dtype=torch.float32, config={"split_k": 8}), first)
    assert rel_err(first, x.float() @ w.float().t()) <= 1e-3


def test_split_k_inside_a_cuda_graph():
    """Captured on a fresh stream (its workspace is the graph's own) and replayed over new inputs: the counters
    each launch leaves at zero serve the next replay."""
    x, w = decode_operands(3, 1024, 8192)
    out = torch.full((3, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
    epicute.gemm(x, w.t(), out=out, config={"split_k": 4})  # compiled outside the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        epicute.gemm(x, w.t(), out=out, config={"split_k": 4})
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x.float() @ w.float().t()) <= TOL


def test_a_planned_long_k_weight_gradient_split_in_2x1_clusters():
    """A weight gradient over 12600 tokens (ragged 1000 x 1000 output, 64 tiles of 128x128): the planner splits
    each tile's 197 k-tiles in two, in 2x1 clusters; dy^T and x read M- and N-major as autograd hands them."""
    dy = torch.randn(12600, 1000, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(12600, 1000, device="cuda", dtype=torch.bfloat16)
    c = epicute.explain(dy.t(), x, file=None).config
    assert (c.tile_n, c.split_k, c.cluster_m, c.cluster_n) == (128, 2, 2, 1)
    out = torch.full((1000, 1000), float("nan"), device="cuda", dtype=torch.bfloat16)
    epicute.gemm(dy.t(), x, out=out)
    assert rel_err(out, dy.float().t() @ x.float()) <= TOL
