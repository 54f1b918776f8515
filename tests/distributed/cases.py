"""Checks of :mod:`epicute.distributed` that every rank of a world runs (a CPU gloo world in test_collective.py, an
NCCL world of one GPU per rank in test_collective_gpu.py), against float64 of the same math on the whole, unsharded
tensors: relative error, fresh random inputs (one seed drawn by rank 0 per check), odd row counts, outputs the
module allocates poisoned with NaN. bf16 outputs: 1e-2 (one rounding); gradients 2e-2 (the partial sums travel in
bf16 before the fp32 sum, then one more rounding)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

import epicute
import epicute.distributed as ED
from epicute.distributed import collective

BF16 = torch.bfloat16
TOL, GRAD_TOL = 1e-2, 2e-2


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().cpu().double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want.detach()).norm() / want.detach().norm()).item()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _fresh_seed() -> None:
    """One new seed for every rank (rank 0 draws it): each rank builds the same whole tensors and cuts its share."""
    seed = [random.randrange(2**31) if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(seed, src=0)
    torch.manual_seed(seed[0])


def _poison_outputs() -> None:
    collective.new_output = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)


def _inputs(rows_total: int, k: int, n: int):
    a = torch.randn(rows_total, k).to(BF16)
    w = (torch.randn(n, k) / k**0.5).to(BF16)
    return a, w


def all_gather_gemm_with_epilogue(rank: int, world: int, rows: int, k: int, n: int) -> None:
    """A bias, a per-row scale and a residual tile over the gathered rows, a GELU, D and a per-row sum; the gathered
    A returned too; then a per-column reduction refused on every rank before any collective."""
    _fresh_seed()
    _poison_outputs()
    dev = _device()
    m = world * rows
    a, w = _inputs(m, k, n)
    bias, scale, residual = torch.randn(n).to(BF16), torch.rand(m, 1), torch.randn(m, n).to(BF16)

    def epilogue(acc, bias, scale, residual):
        y = epicute.ops.gelu(acc + bias) * scale + residual
        return {"D": y, "rows": epicute.ops.row_sum(y)}

    shard = a[rank * rows : (rank + 1) * rows].to(dev)
    out, gathered = ED.all_gather_gemm(shard, w.to(dev).t(), epilogue=epilogue, bias=bias.to(dev),
                                       scale=scale.to(dev), residual=residual.to(dev), return_a=True)  # fmt: skip
    want = torch.nn.functional.gelu(a.double() @ w.double().T + bias.double()) * scale.double() + residual.double()
    assert out["D"].shape == (m, n) and out["D"].dtype == BF16
    assert rel(out["D"], want) < TOL, rel(out["D"], want)
    assert rel(out["rows"], want.sum(1)) < TOL, rel(out["rows"], want.sum(1))
    assert torch.equal(gathered.cpu(), a)  # a copy of every rank's rows, bit for bit

    try:
        ED.all_gather_gemm(shard, w.to(dev).t(), epilogue=lambda acc: {"D": acc, "cols": epicute.ops.col_sum(acc)})
    except epicute.EpilogueError as exc:
        assert "reduces over the output's rows" in str(exc)
    else:
        raise AssertionError("a per-column reduction across the gathered blocks was not refused")
    dist.barrier()  # every rank refused before sending anything: the group is still in step


def gemm_reduce_scatter_with_epilogue(rank: int, world: int, rows: int, k: int, n: int) -> None:
    """Each rank's share of K; the sum's rows of this rank, with a bias and a residual after the reduction; then
    rows that don't split evenly refused."""
    _fresh_seed()
    dev = _device()
    m = world * rows
    a, w = _inputs(m, world * k, n)
    bias, residual = torch.randn(n).to(BF16), torch.randn(rows * world, n).to(BF16)
    own = slice(rank * rows, (rank + 1) * rows)
    cols = slice(rank * k, (rank + 1) * k)
    got = ED.gemm_reduce_scatter(a[:, cols].contiguous().to(dev), w[:, cols].contiguous().to(dev).t(),
                                 epilogue=lambda acc, bias, residual: epicute.ops.relu(acc + bias) + residual,
                                 bias=bias.to(dev), residual=residual[own].to(dev))  # fmt: skip
    want = torch.relu(a.double() @ w.double().T + bias.double())[own] + residual[own].double()
    assert got.shape == (rows, n) and got.dtype == BF16
    assert rel(got, want) < TOL, rel(got, want)
    # A second call: the peers' partials of the first are overwritten only once every rank is done with them.
    again = ED.gemm_reduce_scatter(a[:, cols].contiguous().to(dev), w[:, cols].contiguous().to(dev).t())
    assert rel(again, (a.double() @ w.double().T)[own]) < TOL

    try:
        ED.gemm_reduce_scatter(a[: m - 1, cols].contiguous().to(dev), w[:, cols].contiguous().to(dev).t())
    except epicute.ShapeError as exc:
        assert "multiple of the group's size" in str(exc)
    else:
        raise AssertionError("rows that don't split evenly among the ranks were not refused")
    dist.barrier()


def column_then_row_parallel_trains(rank: int, world: int, rows: int, k: int, n: int) -> None:
    """A sequence-parallel MLP's two projections, ``reduce_scatter(all_gather(x) @ w1_r.T @ w2_r.T)``, through
    autograd: the output and the gradients of x's rows, w1's and w2's shares against float64 autograd of the whole;
    fp8 inputs under autograd refused."""
    _fresh_seed()
    dev = _device()
    m, inner = world * rows, world * n
    x, w1 = _inputs(m, k, inner)
    w2 = (torch.randn(k, inner) / inner**0.5).to(BF16)
    grad = torch.randn(m, k).to(BF16)
    own, feats = slice(rank * rows, (rank + 1) * rows), slice(rank * n, (rank + 1) * n)
    x_r = x[own].to(dev).requires_grad_()
    w1_r = w1[feats].to(dev).requires_grad_()
    w2_r = w2[:, feats].contiguous().to(dev).requires_grad_()
    h = ED.all_gather_gemm(x_r, w1_r.t())
    y = ED.gemm_reduce_scatter(h, w2_r.t())
    y.backward(grad[own].to(dev))

    x64, w1_64, w2_64 = (t.double().requires_grad_() for t in (x, w1, w2))
    want = x64 @ w1_64.T @ w2_64.T
    want.backward(grad.double())
    assert rel(y, want[own]) < TOL, rel(y, want[own])
    for name, got, ref in (("x", x_r.grad, x64.grad[own]), ("w1", w1_r.grad, w1_64.grad[feats]),
                           ("w2", w2_r.grad, w2_64.grad[:, feats])):  # fmt: skip
        assert got is not None and rel(got, ref) < GRAD_TOL, (name, rel(got, ref) if got is not None else None)

    try:
        ED.all_gather_gemm(x_r, w1_r.t(), a_scale=1.0)
    except epicute.GradientError as exc:
        assert "fp8 inputs has no backward" in str(exc)
    else:
        raise AssertionError("fp8 scales under autograd were not refused")
    dist.barrier()


def mlp_with_epilogues_trains(rank: int, world: int, rows: int, k: int, n: int) -> None:
    """Both collectives with epilogues under autograd, ``gemm_reduce_scatter(gelu(all_gather(x) @ w1_r.T + b1_r)
    @ w2_r.T) + b2 + residual``: each one's gradient epilogue derived from its forward's (``recompute`` where K is
    small, ``save`` where it is large), its data gradient the other collective. The output and every gradient against
    float64 autograd of the whole: x's rows, w1's and b1's features, w2's columns, the residual's rows, and b2's
    (replicated: each rank's gradient is its rows' share, summed over the ranks here as a data-parallel step does)."""
    _fresh_seed()
    _poison_outputs()
    dev = _device()
    m, inner = world * rows, world * n
    x, w1 = _inputs(m, k, inner)
    w2 = (torch.randn(k, inner) / inner**0.5).to(BF16)
    b1, b2, residual = torch.randn(inner).to(BF16), torch.randn(k).to(BF16), torch.randn(m, k).to(BF16)
    grad = torch.randn(m, k).to(BF16)
    own, feats = slice(rank * rows, (rank + 1) * rows), slice(rank * n, (rank + 1) * n)
    leaves = {"x": x[own], "w1": w1[feats], "b1": b1[feats], "w2": w2[:, feats].contiguous(), "b2": b2,
              "residual": residual[own]}  # fmt: skip
    local = {name: t.to(dev, copy=True).requires_grad_() for name, t in leaves.items()}
    h = ED.all_gather_gemm(local["x"], local["w1"].t(), b1=epicute.RowVector(local["b1"]),
                           epilogue=lambda acc, b1: epicute.ops.gelu(acc + b1))  # fmt: skip
    y = ED.gemm_reduce_scatter(h, local["w2"].t(), b2=epicute.RowVector(local["b2"]), residual=local["residual"],
                               epilogue=lambda acc, b2, residual: acc + b2 + residual)  # fmt: skip
    y.backward(grad[own].to(dev))

    whole = {name: t.double().requires_grad_() for name, t in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2),
                                                                 ("b2", b2), ("residual", residual))}  # fmt: skip
    hidden = torch.nn.functional.gelu(whole["x"] @ whole["w1"].T + whole["b1"])
    want = hidden @ whole["w2"].T + whole["b2"] + whole["residual"]
    want.backward(grad.double())
    assert rel(y, want[own]) < TOL, rel(y, want[own])
    b2_grad = local["b2"].grad.float()
    dist.all_reduce(b2_grad)
    expected = {"x": whole["x"].grad[own], "w1": whole["w1"].grad[feats], "b1": whole["b1"].grad[feats],
                "w2": whole["w2"].grad[:, feats], "residual": whole["residual"].grad[own]}  # fmt: skip
    for name, ref in expected.items():
        got = local[name].grad
        assert got is not None and rel(got, ref) < GRAD_TOL, (name, rel(got, ref) if got is not None else None)
    assert rel(b2_grad, whole["b2"].grad) < GRAD_TOL, rel(b2_grad, whole["b2"].grad)
    dist.barrier()


def _rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` quantized to e4m3 per row, and the per-row fp32 scales that dequantize it."""
    scale = t.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-6) / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_rowwise_both_ways(rank: int, world: int, rows: int, k: int, n: int) -> None:
    """fp8 e4m3 inputs with rowwise scales (A's gathered with its rows; cut by rows in the reduce-scatter) through
    both collective GEMMs, bf16 out, against float64 of the dequantized inputs."""
    _fresh_seed()
    dev = _device()
    m = world * rows
    a, w = _inputs(m, world * k, n)
    a8, a_scale = _rowwise_fp8(a)
    w8, w_scale = _rowwise_fp8(w)
    want = (a8.double() * a_scale.double()) @ (w8.double() * w_scale.double()).T
    own, cols = slice(rank * rows, (rank + 1) * rows), slice(rank * k, (rank + 1) * k)

    got = ED.all_gather_gemm(a8[own].to(dev), w8.to(dev).t(), a_scale=a_scale[own].to(dev),
                             b_scale=w_scale.reshape(1, n).to(dev))  # fmt: skip
    assert got.shape == (m, n) and got.dtype == BF16
    assert rel(got, want) < TOL, rel(got, want)

    # The reduce-scatter's shares of K: A's columns and W's, each share's product dequantized by the same row scales.
    a8_k, w8_k = a8[:, cols].contiguous(), w8[:, cols].contiguous()
    got = ED.gemm_reduce_scatter(a8_k.to(dev), w8_k.to(dev).t(), a_scale=a_scale.to(dev),
                                 b_scale=w_scale.reshape(1, n).to(dev))  # fmt: skip
    assert got.shape == (rows, n) and got.dtype == BF16
    assert rel(got, want[own]) < TOL, rel(got, want[own])  # the shares' products summed: the whole product
    dist.barrier()


def gated_all_gather_gemm_trains(rank: int, world: int, rows: int, k: int, n: int) -> None:
    """A SwiGLU gate/up projection under sequence parallelism: ``silu(gate) * up`` over the gathered tokens, B
    interleaving this rank's ``n`` features of the two projections (``gated=True``), trained: the output and the
    gradients of x's rows (every rank's features' share, summed by the backward's reduce-scatter) and of this rank's
    interleaved weight rows, against float64 autograd of the two whole projections apart."""
    _fresh_seed()
    _poison_outputs()
    dev = _device()
    m, own, feats = world * rows, slice(rank * rows, (rank + 1) * rows), slice(rank * n, (rank + 1) * n)
    x = torch.randn(m, k).to(BF16)
    w_gate, w_up = ((torch.randn(world * n, k) / k**0.5).to(BF16) for _ in range(2))
    grad = torch.randn(m, world * n).to(BF16)
    x_r = x[own].to(dev, copy=True).requires_grad_()
    w_r = epicute.interleave_gate_up(w_gate[feats], w_up[feats]).to(dev).requires_grad_()
    y = ED.all_gather_gemm(x_r, w_r.t(), gated=True, epilogue=lambda gate, up: epicute.ops.silu(gate) * up)
    y.backward(grad[:, feats].to(dev))

    x64, g64, u64 = (t.double().requires_grad_() for t in (x, w_gate, w_up))
    want = torch.nn.functional.silu(x64 @ g64.T) * (x64 @ u64.T)
    want.backward(grad.double())
    assert y.shape == (m, n) and rel(y, want[:, feats]) < TOL, rel(y, want[:, feats])
    assert rel(x_r.grad, x64.grad[own]) < GRAD_TOL, rel(x_r.grad, x64.grad[own])
    w_want = epicute.interleave_gate_up(g64.grad[feats], u64.grad[feats])
    assert rel(w_r.grad, w_want) < GRAD_TOL, rel(w_r.grad, w_want)
    dist.barrier()
