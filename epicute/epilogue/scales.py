"""Dequantization scales of an fp8 GEMM, as operands of the epilogue language.

With tensorwise and rowwise scaling (the recipes of ``torch._scaled_mm``), the
scales factor out of the K sum: ``sum_k (a[m,k] sa[m]) (b[k,n] sb[n]) = sa[m] sb[n]
sum_k a[m,k] b[k,n]``. So they are applied to the fp32 accumulator, in front of
the user's epilogue: :func:`scaled_epilogue` composes ``epilogue(acc * a_scale *
b_scale, ...)``, and the scales are operands like any other -- traced, hashed,
scheduled, shown by ``explain`` and emitted by the same chain -- so every
epilogue composes with every recipe.

:func:`scale_operands` turns what the caller passed into those operands:

- tensorwise: a Python float (a kernel scalar), or a 0-d / 1-element fp32 tensor,
  read by the kernel from GPU memory (no host sync, CUDA-graph safe) as a row
  vector of one value repeated by a zero stride;
- rowwise: A's per row, ``(M,)`` or ``(M, 1)`` (``(L, M)``, ``(L, M, 1)`` batched)
  -> a column vector; B's per column, ``(N,)`` or ``(1, N)`` (``(L, N)``,
  ``(L, 1, N)``) -> a row vector. fp32, as ``torch._scaled_mm`` takes them.

Blockwise scales (A per 1x128, B per 128x128 block of K) do not factor out of
the K sum; they are recognized and refused with a typed error.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import torch

from epicute.epilogue.operands import ColVector, RowVector, Scalar
from epicute.epilogue.tracer import Epilogue, as_epilogue
from epicute.errors import DtypeError, EpilogueError, ShapeError

#: The operand names the scales take in a scaled epilogue (an epilogue's own operands must differ).
SCALE_NAMES = ("a_scale", "b_scale")
#: K extent of a block of blockwise scaling (DeepSeek-V3's recipe).
BLOCK_K = 128


class ScaledEpilogue(Epilogue):
    """``inner(acc * a_scale * b_scale, *operands)``: the operands are ``a_scale``, ``b_scale``, then
    ``inner``'s (``inner`` None: D is the scaled accumulator)."""

    def __init__(self, inner: Epilogue | None):
        clash = sorted(set(SCALE_NAMES) & set(inner.params if inner else ()))
        if clash:
            raise EpilogueError(
                f"epilogue {inner.name!r} has operands named {clash}, which an fp8 GEMM's a_scale/b_scale take; "
                "rename them"
            )

        def scaled(acc, a_scale, b_scale, *args, **kwargs):
            acc = acc * a_scale * b_scale
            return acc if inner is None else inner.fn(acc, *args, **kwargs)

        # Not Epilogue.__init__: the signature is inner's with the scales in front, not scaled's.
        self.fn, self.inner = scaled, inner
        self.name = "scaled" if inner is None else f"scaled_{inner.name}"
        self.params = SCALE_NAMES + (inner.params if inner else ())
        self.pins = dict(inner.pins) if inner else {}
        self.defaults = dict(inner.defaults) if inner else {}
        self._keyword_only = inner._keyword_only if inner else frozenset()


@functools.lru_cache(maxsize=256)
def scaled_epilogue(epilogue) -> ScaledEpilogue:
    """The scaled form of ``epilogue`` (a function of ``acc``, or None), one object per epilogue so
    that a repeat call finds its prepared kernel."""
    return ScaledEpilogue(None if epilogue is None else as_epilogue(epilogue))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def scale_operands(a_scale: Any, b_scale: Any, m: int, n: int, k: int, l: int, batched: bool) -> dict[str, Any]:
    """The ``a_scale`` and ``b_scale`` operands of a scaled epilogue (see the module docstring), pinned
    to their kinds, for an ``(L, M, N, K)`` problem (``batched``: the call's tensors are 3-D)."""
    return {
        "a_scale": _scale("a_scale", a_scale, m, n, k, l, batched, per="row"),
        "b_scale": _scale("b_scale", b_scale, m, n, k, l, batched, per="column"),
    }


def _scale(name: str, value: Any, m: int, n: int, k: int, l: int, batched: bool, per: str):
    if value is None:
        raise EpilogueError(f"{name} is missing: fp8 inputs need both a_scale and b_scale (1.0 for none)")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return Scalar(float(value))
    if not isinstance(value, torch.Tensor):
        raise DtypeError(f"{name} is {_describe(value)}; pass a float or an fp32 tensor")
    if value.dtype != torch.float32:
        raise DtypeError(f"{name} has dtype {value.dtype}; scales are fp32 (pass {name}.float())")
    extent = m if per == "row" else n
    lead = (l,) if batched else ()
    if value.numel() == 1 and value.dim() <= 1:
        # Tensorwise, read on the GPU: one value repeated along N by a zero stride.
        return RowVector(value.reshape((1,) * (len(lead) + 1)).expand(*lead, n))
    rowwise = {lead + (extent,), lead + ((extent, 1) if per == "row" else (1, extent))}
    if tuple(value.shape) in rowwise:
        t = value.reshape(*lead, extent)
        return ColVector(t) if per == "row" else RowVector(t)
    blocks_k = -(-k // BLOCK_K)
    blockwise = lead + ((m, blocks_k) if per == "row" else (-(-n // BLOCK_K), blocks_k))
    if tuple(value.shape) == blockwise:
        raise EpilogueError(
            f"{name} has shape {tuple(value.shape)}: a blockwise scale (per {'1x128' if per == 'row' else '128x128'} "
            "block of K), which does not factor out of the K sum; epicute's fp8 GEMM takes tensorwise and rowwise "
            "scales (blockwise needs fp32 promotion in the mainloop, not built yet)"
        )
    forms = f"{lead + (extent,)}, {lead + ((extent, 1) if per == 'row' else (1, extent))}"
    raise ShapeError(
        f"{name} has shape {tuple(value.shape)}; give a float or a 1-element tensor (tensorwise), or one value "
        f"per {per}: {forms} (rowwise)"
    )


__all__ = ["SCALE_NAMES", "ScaledEpilogue", "scale_operands", "scaled_epilogue"]
