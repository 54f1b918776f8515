"""What a quantization must satisfy, checked against float64 math written out here (not epicute's reference)."""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: The largest rounding error of a normal fp8 value relative to it (3 and 2 mantissa bits), and the smallest
#: subnormal's magnitude: below it the error is absolute.
REL_STEP = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}


def group_scales64(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """float64 ``max(amax, 1e-4) / fp8_max`` per row and 128 columns."""
    rows = x.double().reshape(-1, x.shape[-1])
    k = rows.shape[-1]
    groups = -(-k // 128)
    amax = torch.stack([rows[:, g * 128 : (g + 1) * 128].abs().amax(-1) for g in range(groups)], -1)
    return amax.clamp(min=1e-4) / FP8_MAX[fp8]


def check_scales(got: torch.Tensor, want: torch.Tensor, ue8m0: bool) -> None:
    """``got`` (fp32) within float32 rounding of ``want`` (float64); with UE8M0 a power of two at least ``want``
    and below twice it (float32's rounding of the quotient may land on either side of a power of two)."""
    rel = 2e-7
    if not ue8m0:
        assert ((got - want).abs() / want).max().item() < rel
        return
    mantissa, _ = torch.frexp(got)
    assert (mantissa == 0.5).all()  # powers of two (frexp's mantissa is exact)
    assert (got >= want * (1 - rel)).all() and (got < 2 * want * (1 + rel)).all()


def check_group_quantization(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fp8: torch.dtype, ue8m0: bool):
    """Scales within float32 rounding of the float64 ones (exact powers of two with UE8M0); every value within one
    fp8 rounding of x / scale; layouts as the blockwise GEMM takes them."""
    k = x.shape[-1]
    assert q.dtype == fp8 and q.shape == x.shape and q.is_contiguous()
    assert scales.shape == (*x.shape[:-1], -(-k // 128)) and scales.dtype == torch.float32
    flat = scales.reshape(-1, scales.shape[-1])
    assert flat.stride(0) == 1 or flat.shape[0] <= 1  # M-major
    got, x64 = flat.double().cpu(), x.double().cpu()
    assert torch.isfinite(got).all()
    check_scales(got, group_scales64(x64, fp8), ue8m0)
    per_value = got.repeat_interleave(128, dim=-1)[:, :k]
    value = x64.reshape(-1, k) / per_value  # what q approximates, within [-fp8_max, fp8_max]
    err = (q.reshape(-1, k).double().cpu() - value).abs()
    bound = REL_STEP[fp8] * value.abs() + SUBNORMAL[fp8] + 1e-6 * FP8_MAX[fp8]
    assert (err <= bound).all(), (err - bound).max().item()
