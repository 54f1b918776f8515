"""``torch.ops.epicute.quantize``: the quantizers' custom op (see :mod:`epicute.runtime.torch_ops`).

``torch.ops.epicute.quantize(x, rows, columns, dtype, ue8m0) -> list[Tensor]`` runs :func:`epicute.quantize`
(``columns`` empty: recipe ``rows``) or :func:`~epicute.quantize.api.quantize_pair` (``x``'s rows by recipe
``rows``, if any, and ``x.t()`` by ``columns``), its outputs ``(q, scales)`` for each side made, rows first.
Under ``torch.compile`` both functions turn into one call of it: fp8 training compiles without a graph break at
each quantization, and Inductor never generates code for the reference recipes (on the CPU, torch 2.13's made
NaN values of a product cut to a partial group). The fake implementation runs the reference recipes on the fake
tensors, so its shapes and strides are theirs, which the kernels match.
"""

from __future__ import annotations

import torch

from epicute.epilogue.dtypes import IR_TO_TORCH
from epicute.runtime.torch_ops import TorchOp


def quantize_op(x: torch.Tensor, rows: str, columns: str, dtype: str, ue8m0: bool) -> list[torch.Tensor]:
    """``epicute.quantize`` or ``quantize_pair`` as an op (see the module docstring)."""
    from epicute.quantize.api import quantize, quantize_pair

    fp8 = IR_TO_TORCH[dtype]
    if not columns:
        return list(quantize(x, recipe=rows, dtype=fp8, ue8m0=ue8m0))
    made = quantize_pair(x, rows or None, columns, dtype=fp8, ue8m0=ue8m0)
    return [t for side in made if side is not None for t in side]


def _quantize_fake(x: torch.Tensor, rows: str, columns: str, dtype: str, ue8m0: bool) -> list[torch.Tensor]:
    from epicute.quantize.api import reference_pair

    made = reference_pair(x, rows or None, columns or None, dtype, ue8m0)
    return [t for side in made if side is not None for t in side]


QUANTIZE_OP = TorchOp("epicute::quantize", quantize_op, _quantize_fake)


def quantize_op_call(x: torch.Tensor, rows: str | None, columns: str | None, dtype: torch.dtype, ue8m0: bool):
    """``((q, scales) or None, (q_t, scales_t) or None)`` from one call of the op (dynamo-traceable); the
    arguments are checked by the caller."""
    from epicute.quantize.api import FP8_DTYPES

    made = QUANTIZE_OP(x, rows or "", columns or "", FP8_DTYPES[dtype], ue8m0)
    sides, i = [], 0
    for recipe in (rows, columns):
        sides.append((made[i], made[i + 1]) if recipe else None)
        i += 2 if recipe else 0
    return tuple(sides)


__all__ = ["QUANTIZE_OP", "quantize_op", "quantize_op_call"]
