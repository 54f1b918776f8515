"""Ready-made epilogues: CK Tile's ready schedules, written with the same frontend.

CK Tile's epilogue chainer ships a default schedule, a row/column-quant one and
a tensor-quant one. Here they are plain decorated functions, so they trace,
hash, schedule and run on the CPU reference exactly like a user's epilogue; the
annotations fix each operand's kind, so a square GEMM needs no pins.
Exported as ``epicute.epilogues``.
"""

from __future__ import annotations

from epicute.epilogue import ops
from epicute.epilogue.operands import ColVector, RowVector, Scalar
from epicute.epilogue.proxy import Value
from epicute.epilogue.tracer import epilogue


@epilogue
def plain(acc: Value, alpha: Scalar, beta: Scalar, C: Value) -> Value:
    """``D = alpha * acc + beta * C`` (the default schedule); ``C`` may be a tile, a row or a column vector."""
    return alpha * acc + beta * C


@epilogue
def row_col_quant(acc: Value, scale_m: ColVector, scale_n: RowVector) -> Value:
    """``D[m, n] = acc[m, n] * scale_m[m] * scale_n[n]``, rounded to D's dtype (``out_dtypes={"D": ...}``).

    ``scale_m`` has one value per row (``(M,)``/``(L, M)``), ``scale_n`` one per
    column (``(N,)``/``(L, N)``): per-token and per-channel dequantization scales.
    """
    return acc * scale_m * scale_n


@epilogue
def tensor_quant(acc: Value, scale: Scalar) -> dict[str, Value]:
    """``D = quantize(acc * scale)`` to fp8 e4m3 (saturating at ±448), and ``amax = max |acc * scale|``.

    ``amax`` (a 0-d fp32 over all batches) is what delayed scaling needs to pick the next scale.
    """
    return {"D": ops.quantize(acc, scale), "amax": ops.amax(acc * scale)}


__all__ = ["plain", "row_col_quant", "tensor_quant"]
