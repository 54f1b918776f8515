"""What a quantization must satisfy, checked against float64 math written out here (not epicute's reference)."""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: The largest rounding error of a normal fp8 value relative to it (3 and 2 mantissa bits), and the smallest
#: subnormal's magnitude: below it the error is absolute.
REL_STEP = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}


def group_scales64(x: torch.Tensor, fp8: torch.dtype, group: int = 128) -> torch.Tensor:
    """float64 ``max(amax, 1e-4) / fp8_max`` per row and ``group`` columns."""
    rows = x.double().reshape(-1, x.shape[-1])
    k = rows.shape[-1]
    groups = -(-k // group)
    amax = torch.stack([rows[:, g * group : (g + 1) * group].abs().amax(-1) for g in range(groups)], -1)
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


def check_group_quantization(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fp8: torch.dtype, ue8m0: bool,
                             group: int = 128):  # fmt: skip
    """Scales (one per ``group`` values of a row: 128, or a whole row) within float32 rounding of the float64 ones
    (exact powers of two with UE8M0); every value within one fp8 rounding of x / scale; layouts as the blockwise GEMM
    takes them."""
    k = x.shape[-1]
    assert q.dtype == fp8 and q.shape == x.shape and q.is_contiguous()
    assert scales.shape == (*x.shape[:-1], -(-k // group)) and scales.dtype == torch.float32
    flat = scales.reshape(-1, scales.shape[-1])
    assert flat.stride(0) == 1 or flat.shape[0] <= 1  # M-major
    got, x64 = flat.double().cpu(), x.double().cpu()
    assert torch.isfinite(got).all()
    check_scales(got, group_scales64(x64, fp8, group), ue8m0)
    per_value = got.repeat_interleave(group, dim=-1)[:, :k]
    value = x64.reshape(-1, k) / per_value  # what q approximates, within [-fp8_max, fp8_max]
    err = (q.reshape(-1, k).double().cpu() - value).abs()
    bound = REL_STEP[fp8] * value.abs() + SUBNORMAL[fp8] + 1e-6 * FP8_MAX[fp8]
    assert (err <= bound).all(), (err - bound).max().item()


def check_block_quantization(w: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fp8: torch.dtype, ue8m0: bool):
    """A 2-D ``w`` in 128 x 128 blocks: scales ``(ceil(N / 128), ceil(K / 128))`` within float32 rounding of the
    float64 ones, every value within one fp8 rounding of ``w / scale``."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    assert q.dtype == fp8 and q.shape == w.shape and q.is_contiguous()
    assert scales.shape == (nb, kb) and scales.dtype == torch.float32
    w64, got = w.double().cpu(), scales.double().cpu()
    amax = torch.tensor([[w64[i:i + 128, j:j + 128].abs().max().item() for j in range(0, k, 128)]
                         for i in range(0, n, 128)], dtype=torch.float64)  # fmt: skip
    check_scales(got, amax.clamp(min=1e-4) / FP8_MAX[fp8], ue8m0)
    value = w64 / got.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    err = (q.double().cpu() - value).abs()
    bound = REL_STEP[fp8] * value.abs() + SUBNORMAL[fp8] + 1e-6 * FP8_MAX[fp8]
    assert (err <= bound).all(), (err - bound).max().item()


def check_pair(x: torch.Tensor, rows, columns, made, fp8: torch.dtype, ue8m0: bool):
    """``quantize_pair``'s outputs: rows of ``x`` and ``x.t()`` padded with zero rows to a multiple of 16 (the
    padding's fp8 values exactly zero), each by its recipe, or absent where not asked."""
    check = {"groups": check_group_quantization, "blocks": check_block_quantization}
    made_rows, made_columns = made
    assert (made_rows is None) == (rows is None) and (made_columns is None) == (columns is None)
    if rows:
        check[rows](x, *made_rows, fp8, ue8m0)
    if columns:
        pad = -x.shape[0] % 16
        x_t = torch.nn.functional.pad(x.t().float(), (0, pad))
        check[columns](x_t, *made_columns, fp8, ue8m0)
        assert (made_columns[0][:, x.shape[0]:].float().cpu() == 0).all()
