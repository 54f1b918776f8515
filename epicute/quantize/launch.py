"""The quantizers' variants, their compile (against fake tensors: one kernel serves every size) and launch: the
group quantizer (:mod:`epicute.quantize.kernel_sm90`) and the tile quantizer (:mod:`epicute.quantize.tile_sm90`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epicute.epilogue.group_quant import GROUP_N
from epicute.runtime.cache import CacheKey
from epicute.runtime.compile import FAMILIES, OPERAND_ALIGN_BYTES, dsl_compile, launch_or_skip
from epicute.runtime.target import DEFAULT_ARCH

#: Groups a thread of the kernel quantizes (their loads issued together) and values a lane takes of each: 8 (one
#: 16-byte load, an 8-byte store) or 16 (two loads, one 16-byte store). One group of 16 values a lane measured
#: fastest on the H200 (bench/NOTES.md, issue 59: the sweep).
GROUPS_PER_LANE = 1
VALUES_PER_LANE = 16
#: Rows the group kernel quantizes whole (``rowwise``): a group's lanes are one warp's at most, 16 or 32 values each.
ROWWISE_KERNEL_K = (GROUP_N, 2 * GROUP_N, 4 * GROUP_N, 8 * GROUP_N)


@dataclass(frozen=True)
class QuantizeVariant:
    """The group quantizer (:mod:`epicute.quantize.kernel_sm90`) for one input dtype, fp8 dtype and scale format."""

    in_dtype: str  # "bf16" | "fp16"
    out_dtype: str  # "fp8e4m3" | "fp8e5m2"
    ue8m0: bool
    groups_per_lane: int = GROUPS_PER_LANE
    values_per_lane: int = VALUES_PER_LANE
    #: values per scale along a row: 128, or one of ROWWISE_KERNEL_K for whole rows
    group_n: int = GROUP_N
    arch: str = DEFAULT_ARCH

    @classmethod
    def rowwise(cls, in_dtype: str, out_dtype: str, ue8m0: bool, k: int) -> QuantizeVariant:
        """The variant that quantizes rows of ``k`` (one of ROWWISE_KERNEL_K) values whole, one scale each."""
        return cls(in_dtype, out_dtype, ue8m0, values_per_lane=max(VALUES_PER_LANE, k // 32), group_n=k)

    def key(self) -> CacheKey:
        label = f"quantize 1x{self.group_n} {self.in_dtype} -> {self.out_dtype}" + (" ue8m0" if self.ue8m0 else "")
        fields = (self.in_dtype, self.out_dtype, self.ue8m0, self.groups_per_lane, self.values_per_lane, self.group_n)
        lanes = f"{self.groups_per_lane} groups x {self.values_per_lane} values a lane"
        return CacheKey("quantize", fields, self.arch, f"{label}, {lanes}")


def compile_quantize(variant: QuantizeVariant):
    """Compile the kernel; returns ``f(x, q, scales)`` taking torch tensors (see ``GroupQuantizeSm90.__call__``)."""
    from cutlass import cute

    from epicute.quantize.kernel_sm90 import GroupQuantizeSm90
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    x, q = _rows(DSL_DTYPES[variant.in_dtype]), _rows(DSL_DTYPES[variant.out_dtype])
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = GroupQuantizeSm90(variant.out_dtype, variant.ue8m0, variant.groups_per_lane, variant.values_per_lane,
                               variant.group_n)  # fmt: skip
    return dsl_compile(variant, kernel, x, q, _scales(), stream)


def _rows(dtype):
    """A fake ``(M, K)`` row-major tensor, rows 16-byte aligned (K a multiple of 16, checked per call)."""
    from cutlass import cute

    return cute.runtime.make_fake_tensor(
        dtype, (cute.sym_int(), cute.sym_int(divisibility=16)), stride=(cute.sym_int64(divisibility=16), 1),
        assumed_align=OPERAND_ALIGN_BYTES,
    )  # fmt: skip


def _scales():
    """A fake row-major fp32 scale table."""
    import cutlass
    from cutlass import cute

    return cute.runtime.make_fake_tensor(
        cutlass.Float32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4
    )


@dataclass(frozen=True)
class TileQuantizeVariant:
    """The tile quantizer (:mod:`epicute.quantize.tile_sm90`): a 2-D input quantized along its rows, its columns
    (written transposed), or both, each by ``"groups"`` (1 x 128) or ``"blocks"`` (128 x 128), or not (``None``)."""

    in_dtype: str  # "bf16" | "fp16"
    out_dtype: str  # "fp8e4m3" | "fp8e5m2"
    ue8m0: bool
    rows: str | None
    columns: str | None
    arch: str = DEFAULT_ARCH

    def key(self) -> CacheKey:
        outputs = [f"{side} {recipe}" for side, recipe in (("rows", self.rows), ("columns", self.columns)) if recipe]
        label = f"quantize 128x128 tiles {self.in_dtype} -> {self.out_dtype}" + (" ue8m0" if self.ue8m0 else "")
        fields = (self.in_dtype, self.out_dtype, self.ue8m0, self.rows, self.columns)
        return CacheKey("quantize_tiles", fields, self.arch, f"{label}: {', '.join(outputs)}")


def compile_tile_quantize(variant: TileQuantizeVariant):
    """Compile the kernel; returns ``f(x, q, scales, q_t, scales_t)`` taking torch tensors (see
    ``TileQuantizeSm90.__call__``; an output not written is any tensor of its dtype)."""
    from cutlass import cute

    from epicute.quantize.tile_sm90 import TileQuantizeSm90
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    in_dtype, out_dtype = DSL_DTYPES[variant.in_dtype], DSL_DTYPES[variant.out_dtype]
    x, q, q_t = _rows(in_dtype), _rows(out_dtype), _rows(out_dtype)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = TileQuantizeSm90(in_dtype, variant.out_dtype, variant.ue8m0, variant.rows, variant.columns)
    return dsl_compile(variant, kernel, x, q, _scales(), q_t, _scales(), stream)


QUANTIZE_CACHE = FAMILIES["quantize"]
TILE_QUANTIZE_CACHE = FAMILIES["quantize_tiles"]


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer the kernel fills (a seam for tests, which poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def launch_group_quantize(x: torch.Tensor, variant: QuantizeVariant, out_dtype: torch.dtype):
    """``(q, scales)`` of a validated ``(M, K)`` row-major ``x``: q ``(M, K)``, scales ``(M, K / group_n)``
    M-major."""
    m, k = x.shape
    groups = -(-k // variant.group_n)
    q, scales = new_output((m, k), out_dtype, x.device), new_output((groups, m), torch.float32, x.device)
    if m and k:
        launch_or_skip(QUANTIZE_CACHE, variant, x, q, scales)  # skipped where missing while precompiling
    return q, scales.t()


def launch_tile_quantize(x: torch.Tensor, variant: TileQuantizeVariant, out_dtype: torch.dtype):
    """``((q, scales) or None, (q_t, scales_t) or None)`` of a validated ``(R, C)`` row-major ``x``, in the
    layouts the fp8 GEMMs take: rows ``q`` ``(R, C)``, groups ``(R, C / 128)`` M-major or blocks
    ``(R / 128, C / 128)``; columns ``q_t`` ``(C, pad16(R))`` (zeros past ``R``), groups ``(C, pad16(R) / 128)``
    M-major or blocks ``(C / 128, pad16(R) / 128)``."""
    r, c = x.shape
    padded, device = -(-r // 16) * 16, x.device
    tiles_r, tiles_c = -(-r // 128), -(-c // 128)
    unused_q, unused_scales = new_output((0, 16), out_dtype, device), new_output((0, 1), torch.float32, device)
    q = new_output((r, c), out_dtype, device) if variant.rows else unused_q
    scales = {"groups": (tiles_c, r), "blocks": (tiles_r, tiles_c), None: None}[variant.rows]
    scales = new_output(scales, torch.float32, device) if scales else unused_scales
    q_t = new_output((c, padded), out_dtype, device) if variant.columns else unused_q
    scales_t = {"groups": (tiles_r, c), "blocks": (tiles_c, tiles_r), None: None}[variant.columns]
    scales_t = new_output(scales_t, torch.float32, device) if scales_t else unused_scales
    if r and c:
        launch_or_skip(TILE_QUANTIZE_CACHE, variant, x, q, scales, q_t, scales_t)
    rows = (q, scales.t() if variant.rows == "groups" else scales) if variant.rows else None
    columns = (q_t, scales_t.t() if variant.columns == "groups" else scales_t) if variant.columns else None
    return rows, columns


__all__ = [
    "QUANTIZE_CACHE", "ROWWISE_KERNEL_K", "TILE_QUANTIZE_CACHE", "QuantizeVariant", "TileQuantizeVariant",
    "compile_quantize", "compile_tile_quantize", "launch_group_quantize", "launch_tile_quantize",
]  # fmt: skip
