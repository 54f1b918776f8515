"""Quantizing an output for the next fp8 GEMM: :func:`epicute.ops.quantize_groups`.

Each row of the output is cut into groups of :data:`GROUP_N` columns (the last one
ragged); a group's scale is ``max(amax, AMAX_FLOOR) / fp8_max`` (the floor keeps an
all-zero group finite, as DeepSeek-V3's quantizer does), optionally rounded up to a
power of two (UE8M0, an 8-bit exponent: DeepSeek-V3's scale format), and the group's
values are stored as ``x * (1 / scale)`` in fp8, saturating. The scales come out
``(M, ceil(N/128))`` fp32, M-major: the layout in which ``epicute.gemm`` and
``torch._scaled_mm`` take a blockwise A scale, so the output feeds the next GEMM as
it is.

In the graph the op is two nodes: ``group_quant(x)`` (the fp8 tile, stored as D) and
``group_scales(q)`` (the scales, one per row and group). This module holds their
reference math, which the kernel's emitters reproduce operation for operation.
"""

from __future__ import annotations

import torch

from epicute.epilogue.dtypes import FP8_MAX, round_to

#: Columns per quantization group: one 128-wide block of K of the next GEMM.
GROUP_N = 128
#: The smallest amax a scale is made from (an all-zero group gets a finite scale).
AMAX_FLOOR = 1e-4
#: The graph's ops: the quantized tile and its scales.
GROUP_OPS = ("group_quant", "group_scales")


def ceil_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 ``scale`` rounded up to a power of two (exact, by its bits: a nonzero
    mantissa carries into the exponent)."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & ~0x7FFFFF).view(torch.float32)


def group_scales(x: torch.Tensor, dtype: str, ue8m0: bool) -> torch.Tensor:
    """``(L, M, N)`` -> ``(L, M, ceil(N / GROUP_N))`` fp32 scales (see the module docstring)."""
    l, m, n = x.shape
    groups = -(-n // GROUP_N)
    padded = torch.zeros(l, m, groups * GROUP_N, dtype=torch.float32, device=x.device)
    padded[..., :n] = x.abs().to(torch.float32)
    amax = padded.view(l, m, groups, GROUP_N).amax(dim=-1) if groups else padded[..., :0]
    scale = torch.clamp(amax, min=AMAX_FLOOR) / torch.tensor(FP8_MAX[dtype], dtype=torch.float32)
    return ceil_pow2(scale) if ue8m0 else scale


def group_quantize(x: torch.Tensor, dtype: str, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(L, M, N)`` quantized per row and group: (the fp8 values, in ``x``'s dtype; the scales)."""
    scales = group_scales(x, dtype, ue8m0)
    reciprocal = (1.0 / scales).repeat_interleave(GROUP_N, dim=-1)[..., : x.shape[-1]]
    q = round_to(x.to(torch.float32) * reciprocal, dtype)
    return q.to(x.dtype), scales


__all__ = ["AMAX_FLOOR", "GROUP_N", "GROUP_OPS", "ceil_pow2", "group_quantize", "group_scales"]
