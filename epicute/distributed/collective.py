"""GEMMs fused with tensor parallelism's collectives, over a ``torch.distributed`` process group.

- :func:`all_gather_gemm`: ``epilogue(all_gather(a_shard) @ b)``, the column-parallel layer under sequence
  parallelism. A rank starts its GEMM on its own rows at once, while the copy engine pulls the peers' shards out of
  torch's symmetric memory; each peer's rows are multiplied as soon as they have landed, so the all-gather hides
  behind the GEMM. The fused epilogue runs unchanged on every block of rows.
- :func:`gemm_reduce_scatter`: ``epilogue(reduce_scatter(a @ b))``, the row-parallel layer. A rank first computes
  the partial sums of its peers' rows into its symmetric buffer; then its own rows, whose epilogue adds the peers'
  partials for those rows, read in place from their buffers: the reduction is part of the last GEMM, with no pass
  and no copy of its own, and the user's epilogue applies to the full sum.

Both take what :func:`epicute.gemm` takes for the GEMM and the epilogue, and are differentiable (without an epilogue:
each one's backward is the other, ``all_gather_gemm``'s input gradient a ``gemm_reduce_scatter`` and vice versa).
On a group without symmetric memory (``gloo``, CPU tensors) the same schedule runs over plain collectives
(:mod:`epicute.distributed.transport`). Every rank makes the same calls with the same shapes, as with any
collective; a call is validated in full before its first collective, so a refused call leaves no peer waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from epicute.distributed.transport import transport
from epicute.epilogue.operands import Pin, Tile
from epicute.epilogue.tracer import as_epilogue, with_leading_operands
from epicute.errors import ConfigError, EpilogueError, GradientError, ShapeError
from epicute.gemm.api import explain, gemm


def all_gather_gemm(
    a_shard: torch.Tensor,
    b: torch.Tensor,
    /,
    group=None,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    return_a: bool = False,
    **operands: Any,
) -> Any:
    """``epilogue(torch.cat(all_gather(a_shard)) @ b, **operands)``, the all-gather overlapped with the GEMM.

    Args:
        a_shard: this rank's rows of A, ``(m, K)``; every rank of the group passes the same shape, and A is the
            ranks' shards in rank order, ``(world * m, K)``.
        b: ``(K, N)``, as :func:`epicute.gemm` takes it (``w.t()`` of a column-parallel weight ``(N, K)``).
        group: the process group (default: the world).
        epilogue, operands: :func:`epicute.gemm`'s fused epilogue over the whole ``(world * m, N)`` output: tiles
            and per-row vectors span all gathered rows. It runs on each rank's block of rows as that block is
            multiplied, so its outputs are D, aux tiles and per-row reductions; one reduced over the rows (``col_*``,
            ``amax``) spans blocks and is refused.
        out_dtype: D's dtype (default: ``a_shard``'s).
        return_a: also return the gathered A (``world * m, K``), e.g. for a weight gradient.

    Returns:
        D (a dict of the epilogue's outputs when it returns more than D), and A if ``return_a``.

    Example:
        >>> y = epicute.distributed.all_gather_gemm(x_shard, w.t(), epilogue=lambda acc: epicute.ops.silu(acc))
        ... # doctest: +SKIP
    """
    group = _group(group)
    _check_pair(a_shard, b, "all_gather_gemm", "a_shard")
    if _needs_grad(a_shard, b, operands):
        _no_epilogue_under_autograd(epilogue, operands, "all_gather_gemm")
        d, gathered = _AllGatherGemm.apply(a_shard, b, group, out_dtype)
        return (d, gathered) if return_a else d
    result = _all_gather_gemm(a_shard, b, group, epilogue, out_dtype, operands)
    return result if return_a else result[0]


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    /,
    group=None,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    **operands: Any,
) -> Any:
    """``epilogue(reduce_scatter(a @ b), **operands)``: this rank's rows of the sum over ranks of ``a @ b``, the
    reduction fused into the GEMM of those rows.

    Args:
        a: ``(M, K_rank)``, this rank's share of the inner dimension (a row-parallel layer's input columns); M a
            multiple of the group's size.
        b: ``(K_rank, N)``, this rank's rows of B (``w.t()`` of a row-parallel weight shard ``(N, K_rank)``).
        group: the process group (default: the world).
        epilogue, operands: :func:`epicute.gemm`'s fused epilogue over this rank's ``(M / world, N)`` rows of the
            full sum (a bias, a residual, an activation: after the reduction, as the math says).
        out_dtype: D's dtype (default: ``a``'s). The peers' partial sums travel in ``a``'s dtype and are added to
            this rank's fp32 accumulator, the whole sum rounded once.

    Returns:
        D, rank ``r``'s rows ``r * M / world`` up to the next rank's (a dict with the epilogue's other outputs).

    Example:
        >>> y = epicute.distributed.gemm_reduce_scatter(h, w_down_shard.t(), epilogue=lambda acc, r: acc + r,
        ...                                              r=residual_rows)  # doctest: +SKIP
    """
    group = _group(group)
    _check_pair(a, b, "gemm_reduce_scatter", "a")
    if a.shape[0] % group.size():
        raise ShapeError(
            f"a has {a.shape[0]} rows; gemm_reduce_scatter gives each of the group's {group.size()} ranks an equal "
            "share of them: pad the rows to a multiple of the group's size"
        )
    if _needs_grad(a, b, operands):
        _no_epilogue_under_autograd(epilogue, operands, "gemm_reduce_scatter")
        return _GemmReduceScatter.apply(a, b, group, out_dtype)
    return _gemm_reduce_scatter(a, b, group, epilogue, out_dtype, operands)


# --- the schedules ---------------------------------------------------------------------------------------------------


def _all_gather_gemm(a_shard, b, group, epilogue, out_dtype, operands) -> tuple[Any, torch.Tensor]:
    world, rows, n = group.size(), a_shard.shape[0], b.shape[1]
    blocks = _RowBlocks(epilogue, operands, world * rows, n)
    d = new_output((world * rows, n), out_dtype or a_shard.dtype, a_shard.device)
    explain(a_shard, b, epilogue=epilogue, out=d[:rows], **blocks.rows(0, rows), file=None)  # refuse before sending
    gathered = new_output((world * rows, a_shard.shape[1]), a_shard.dtype, a_shard.device)
    others: dict[str, list] = {}
    for src in transport(group, a_shard).gather(a_shard, gathered):
        lo, hi = src * rows, (src + 1) * rows
        a_rows = a_shard if src == group.rank() else gathered[lo:hi]
        result = gemm(a_rows, b, epilogue=epilogue, out=d[lo:hi], **blocks.rows(lo, hi))
        if isinstance(result, dict):
            for name, value in result.items():
                if name != "D":
                    others.setdefault(name, [None] * world)[src] = value
    if not others:
        return d, gathered
    return {"D": d, **{name: torch.cat(parts) for name, parts in others.items()}}, gathered


def _gemm_reduce_scatter(a, b, group, epilogue, out_dtype, operands) -> Any:
    world, rank = group.size(), group.rank()
    rows, n = a.shape[0] // world, b.shape[1]
    own = a[rank * rows : (rank + 1) * rows]
    if world == 1:
        return gemm(own, b, epilogue=epilogue, out_dtype=out_dtype, **operands)
    names = tuple(f"peer_partial{i}" for i in range(1, world))
    reduce = with_leading_operands(epilogue, names, ("tile",) * len(names), _add_all, "gemm_reduce_scatter")
    partial = a.new_empty((rows, n))
    explain(own, b, out=partial, file=None)  # the peers' partials (then the own rows' call, with them as operands)
    explain(own, b, epilogue=reduce, out_dtype=out_dtype, **dict.fromkeys(names, Tile(partial)), **operands, file=None)

    def produce(dst: int, out: torch.Tensor) -> None:
        gemm(a[dst * rows : (dst + 1) * rows], b, out=out)

    partials = transport(group, a).exchange(produce, (rows, n), a.dtype)
    peers = {name: Tile(p) for name, p in zip(names, partials, strict=True)}
    return gemm(own, b, epilogue=reduce, out_dtype=out_dtype, **peers, **operands)


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output this module fills (D, the gathered A): uninitialized (tests poison it with NaN here)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _add_all(acc, *partials):
    for partial in partials:
        acc = acc + partial
    return acc


class _RowBlocks:
    """An epilogue's operands, resolved against the whole ``(M, N)`` output, cut to a block of its rows (tiles and
    per-row vectors by rows; per-column vectors and scalars whole); its outputs checked to be cut the same way."""

    def __init__(self, epilogue: Callable | None, operands: dict[str, Any], m: int, n: int) -> None:
        self.operands = operands
        self.kinds: dict[str, str] = {}
        self.views: dict[str, Any] = {}
        if epilogue is None:
            if operands:
                raise EpilogueError(f"operands {sorted(operands)} given without an epilogue to read them")
            return
        epi = as_epilogue(epilogue)
        specs = epi.operands(operands, m, n)
        self.kinds = {name: spec.kind for name, spec in specs.items()}
        self.views = {name: spec.value for name, spec in specs.items()}
        graph = epi.trace(self.kinds, {name: spec.dtype for name, spec in specs.items()})
        for name, _ in graph.outputs:
            if graph.output_node(name).kind in ("row", "scalar"):
                raise EpilogueError(
                    f"epilogue output {name!r} reduces over the output's rows, which all_gather_gemm computes a "
                    "rank's block at a time: return the tile and reduce it, or gemm the gathered input"
                )

    def rows(self, lo: int, hi: int) -> dict[str, Any]:
        """The operands for output rows ``lo:hi`` (views, never copies)."""
        cut = {}
        for name, value in self.operands.items():
            kind = self.kinds[name]
            if kind == "tile":
                cut[name] = Tile(self.views[name][0, lo:hi])
            elif kind == "col":
                cut[name] = type(value)(self.views[name][0, lo:hi]) if isinstance(value, Pin) else \
                    self.views[name][0, lo:hi, None]  # fmt: skip
            else:
                cut[name] = value
        return cut


# --- autograd: each one's input gradient is the other ----------------------------------------------------------------


class _AllGatherGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_shard, b, group, out_dtype):
        d, gathered = _all_gather_gemm(a_shard, b, group, None, out_dtype, {})
        ctx.save_for_backward(gathered, b)
        ctx.group = group
        ctx.mark_non_differentiable(gathered)
        return d, gathered

    @staticmethod
    def backward(ctx, grad_d, _):
        gathered, b = ctx.saved_tensors
        grad_d = grad_d.contiguous().to(gathered.dtype)
        grad_a = _gemm_reduce_scatter(grad_d, b.t(), ctx.group, None, None, {}) if ctx.needs_input_grad[0] else None
        grad_b = gemm(gathered.t(), grad_d) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None


class _GemmReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group, out_dtype):
        ctx.save_for_backward(a, b)
        ctx.group = group
        return _gemm_reduce_scatter(a, b, group, None, out_dtype, {})

    @staticmethod
    def backward(ctx, grad_d):
        a, b = ctx.saved_tensors
        grad_d = grad_d.contiguous().to(a.dtype)
        # The gradient of every rank's rows reaches every rank: all-gathered once, into both gradients' GEMMs.
        grad_a, grad_all = _all_gather_gemm(grad_d, b.t(), ctx.group, None, None, {})
        grad_b = gemm(a.t(), grad_all) if ctx.needs_input_grad[1] else None
        return (grad_a if ctx.needs_input_grad[0] else None), grad_b, None, None


# --- checks ----------------------------------------------------------------------------------------------------------


def _group(group):
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError("no torch.distributed process group: call torch.distributed.init_process_group first")
    return group if group is not None else torch.distributed.group.WORLD


def _check_pair(a: torch.Tensor, b: torch.Tensor, op: str, a_name: str) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ShapeError(f"{op} takes tensors {a_name} and b; got {type(a).__name__} and {type(b).__name__}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ShapeError(
            f"{op}: {a_name} {tuple(a.shape)} and b {tuple(b.shape)} must be (rows, K) and (K, N): flatten the "
            "tokens' leading dimensions first"
        )
    from epicute.nn.parallel import is_distributed

    if is_distributed(a) or is_distributed(b):
        raise ShapeError(f"{op} takes each rank's local tensors (DTensor.to_local()), not DTensors")


def _needs_grad(a: torch.Tensor, b: torch.Tensor, operands: dict[str, Any]) -> bool:
    if not torch.is_grad_enabled():
        return False
    values = (a, b, *(v.value if isinstance(v, Pin) else v for v in operands.values()))
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _no_epilogue_under_autograd(epilogue: Callable | None, operands: dict[str, Any], op: str) -> None:
    if epilogue is not None or operands:
        raise GradientError(
            f"{op} with an epilogue has no backward yet: call it without one (the plain projection, whose backward "
            "is fused with its collective) and apply the epilogue to its output, or run under torch.no_grad()"
        )
