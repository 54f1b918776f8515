"""Gated epilogues: ``f(gate, up, *operands)`` over a GEMM whose B holds two projections.

SwiGLU and GeGLU MLPs multiply the input by two weights, gate and up, and combine
the products column by column (``silu(x @ w_gate.T) * (x @ w_up.T)``). A gated
GEMM computes both in one pass: B has ``2 * N`` columns, gate and up interleaved
in blocks of :data:`GATE_BLOCK` (= 8) columns -- gate columns 0-7, up columns
0-7, gate 8-15, up 8-15, ... -- and the epilogue receives, for each output
column, the gate value and the up value. D has ``N`` columns.

Why blocks of 8: a WGMMA accumulator gives each thread 2 adjacent columns of
every 8-column block, so with this layout a thread holds the gate and the up
value of each of its output columns in its own registers: no shuffle, and the
output tile has the accumulator's layout at half the width.
:func:`interleave_gate_up` builds such a weight once from the two projections.

Example:
    >>> import torch, epicute
    >>> w_gate, w_up = torch.randn(64, 32), torch.randn(64, 32)   # (N, K) each
    >>> w = epicute.interleave_gate_up(w_gate, w_up)              # (2N, K)
    >>> x = torch.randn(5, 32)
    >>> y = epicute.gemm(x.bfloat16(), w.t().bfloat16(), gated=True, backend="reference",
    ...                  epilogue=lambda gate, up: epicute.ops.silu(gate) * up)
    >>> y.shape
    torch.Size([5, 64])
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from epicute.epilogue.proxy import Recorder, Value
from epicute.epilogue.tracer import Epilogue
from epicute.errors import DtypeError, EpilogueError, ShapeError

#: Gate and up columns alternate in blocks of this many (see the module docstring).
GATE_BLOCK = 8


def output_columns(n: int, gated: bool) -> int:
    """Output columns of ``n`` accumulator columns (a whole B, or one tile): half of them when gated."""
    return n // 2 if gated else n


def stored_columns(n: int, paired: bool) -> int:
    """Columns D is stored with for ``n`` output columns: twice as many when it holds a paired ``D_up``
    (:attr:`epicute.epilogue.graph.Graph.paired`), gate and up blocks interleaved as in a gated B, which needs whole
    blocks of ``GATE_BLOCK`` (:class:`~epicute.errors.ShapeError` otherwise)."""
    if paired and n % GATE_BLOCK:
        raise ShapeError(f"the epilogue returns D_up, stored beside D in blocks of {GATE_BLOCK} columns: N={n} must "
                         f"be a multiple of {GATE_BLOCK}")  # fmt: skip
    return 2 * n if paired else n


class GatedEpilogue(Epilogue):
    """A gated epilogue ``f(gate, up, *operands)``: ``gate`` is the accumulator, ``up`` its partner column."""

    LEAF_PARAMS = ("up",)
    #: ``up`` is the kernel's interface: it stays in the graph even when the function ignores it.
    KEEP_LEAVES = True

    def _leaf_params_error(self) -> str:
        return f"gated epilogue {self.name!r}: takes gate and up first, then its operands, e.g. f(gate, up, score)"

    def _leaf_values(self, rec: Recorder) -> list[Value]:
        return [rec.add("acc_up")]

    def __repr__(self) -> str:
        return f"<gated epilogue {self.name}(gate, up{''.join(', ' + p for p in self.params)})>"


@functools.lru_cache(maxsize=256)
def gated_epilogue(fn: Callable) -> GatedEpilogue:
    """``fn(gate, up, *operands)`` (a plain function or an :class:`Epilogue`) as a gated epilogue, one object per
    function (as ``epicute.epilogue.scales.scaled_epilogue``): a repeat call does not re-read its signature."""
    if isinstance(fn, GatedEpilogue):
        return fn
    return GatedEpilogue(fn.fn if isinstance(fn, Epilogue) else fn)


def check_gated_call(gated: bool, epilogue) -> None:
    """``gated=True`` needs an epilogue: it is what combines the gate and up columns."""
    if gated and epilogue is None:
        raise EpilogueError(
            "gated=True pairs gate and up columns for an epilogue to combine: pass one, e.g. "
            "epilogue=lambda gate, up: epicute.ops.silu(gate) * up"
        )


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """One weight holding ``gate`` and ``up`` interleaved in blocks of :data:`GATE_BLOCK` along ``dim``.

    For ``(N, K)`` weights (``nn.Linear``'s layout; per expert ``(G, N, K)``) the result is ``(2N, K)``, used
    as ``w.t()`` (``w.transpose(-2, -1)``) like any weight. ``dim=-1`` interleaves ``(K, N)`` matrices instead.
    N must be a multiple of 8. A copy: build it once, where the weights are loaded.
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise DtypeError(f"{name} must be a torch.Tensor (a weight), got {type(t).__name__}")
    if gate.shape != up.shape:
        raise ShapeError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dtype != up.dtype or gate.device != up.device:
        raise DtypeError(f"gate is {gate.dtype} on {gate.device} but up is {up.dtype} on {up.device}; pass one dtype "
                         "and device (torch.cat would promote one silently)")  # fmt: skip
    if isinstance(dim, bool) or not isinstance(dim, int) or not -gate.dim() <= dim < gate.dim():
        rank = gate.dim()
        raise ShapeError(f"dim={dim!r}: gate and up have {rank} dimensions {tuple(gate.shape)}; pass a dimension "
                         f"in [-{rank}, {rank}) (default -2: the N of (N, K) weights)")  # fmt: skip
    dim = dim % gate.dim()
    n = gate.shape[dim]
    if n % GATE_BLOCK:
        raise ShapeError(f"gate and up have {n} columns along dim {dim}; interleaving needs a multiple of {GATE_BLOCK}")
    blocks = (n // GATE_BLOCK, 1, GATE_BLOCK)
    pair = torch.cat([gate.unflatten(dim, blocks), up.unflatten(dim, blocks)], dim=dim + 1)
    return pair.flatten(dim, dim + 2)


def check_gated_columns(n: int, name: str, gated: bool) -> int:
    """D's columns for a B of ``n`` columns; when gated, ``2 * GATE_BLOCK`` must divide ``n`` (B holds gate and up
    interleaved in blocks of ``GATE_BLOCK`` columns)."""
    if gated and n % (2 * GATE_BLOCK):
        raise ShapeError(
            f"{name} has N={n} columns; gated=True takes gate and up interleaved in blocks of {GATE_BLOCK} "
            f"(epicute.interleave_gate_up(w_gate, w_up)), so N = 2 x a multiple of {GATE_BLOCK}"
        )
    return output_columns(n, gated)


def split_gate_up(acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a gated GEMM's accumulator ``(..., 2N)``: views ``(..., N)`` each."""
    n2 = acc.shape[-1]
    if n2 % (2 * GATE_BLOCK):
        raise ShapeError(f"a gated accumulator has 2N columns, N a multiple of {GATE_BLOCK}; got {n2}")
    blocks = acc.unflatten(-1, (n2 // (2 * GATE_BLOCK), 2, GATE_BLOCK))
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


__all__ = [
    "GATE_BLOCK",
    "GatedEpilogue",
    "check_gated_call",
    "check_gated_columns",
    "gated_epilogue",
    "interleave_gate_up",
    "output_columns",
    "split_gate_up",
    "stored_columns",
]
