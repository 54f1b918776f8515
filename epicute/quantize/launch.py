"""The group quantizer's variants, their compile (against fake tensors: one kernel serves every size) and launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epicute.runtime.cache import CacheKey
from epicute.runtime.compile import FAMILIES, OPERAND_ALIGN_BYTES, dsl_compile
from epicute.runtime.target import DEFAULT_ARCH

#: Groups a thread of the kernel quantizes (their loads issued together) and values a lane takes of each: 8 (one
#: 16-byte load, an 8-byte store) or 16 (two loads, one 16-byte store). One group of 16 values a lane measured
#: fastest on the H200 (bench/NOTES.md, issue 59: the sweep).
GROUPS_PER_LANE = 1
VALUES_PER_LANE = 16


@dataclass(frozen=True)
class QuantizeVariant:
    """The group quantizer (:mod:`epicute.quantize.kernel_sm90`) for one input dtype, fp8 dtype and scale format."""

    in_dtype: str  # "bf16" | "fp16"
    out_dtype: str  # "fp8e4m3" | "fp8e5m2"
    ue8m0: bool
    groups_per_lane: int = GROUPS_PER_LANE
    values_per_lane: int = VALUES_PER_LANE
    arch: str = DEFAULT_ARCH

    def key(self) -> CacheKey:
        label = f"quantize 1x128 {self.in_dtype} -> {self.out_dtype}" + (" ue8m0" if self.ue8m0 else "")
        fields = (self.in_dtype, self.out_dtype, self.ue8m0, self.groups_per_lane, self.values_per_lane)
        lanes = f"{self.groups_per_lane} groups x {self.values_per_lane} values a lane"
        return CacheKey("quantize", fields, self.arch, f"{label}, {lanes}")


def compile_quantize(variant: QuantizeVariant):
    """Compile the kernel; returns ``f(x, q, scales)`` taking torch tensors (see ``GroupQuantizeSm90.__call__``)."""
    import cutlass
    from cutlass import cute

    from epicute.quantize.kernel_sm90 import GroupQuantizeSm90
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    def rows(dtype):  # (M, K) row-major, rows 16-byte aligned (K a multiple of 16, checked per call)
        return cute.runtime.make_fake_tensor(
            dtype, (cute.sym_int(), cute.sym_int(divisibility=16)), stride=(cute.sym_int64(divisibility=16), 1),
            assumed_align=OPERAND_ALIGN_BYTES,
        )  # fmt: skip

    x, q = rows(DSL_DTYPES[variant.in_dtype]), rows(DSL_DTYPES[variant.out_dtype])
    scales = cute.runtime.make_fake_tensor(
        cutlass.Float32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = GroupQuantizeSm90(
        DSL_DTYPES[variant.out_dtype],
        variant.out_dtype,
        variant.ue8m0,
        variant.groups_per_lane,
        variant.values_per_lane,
    )
    return dsl_compile(variant, kernel, x, q, scales, stream)


QUANTIZE_CACHE = FAMILIES["quantize"]


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer the kernel fills (a seam for tests, which poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def launch_group_quantize(x: torch.Tensor, variant: QuantizeVariant, out_dtype: torch.dtype):
    """``(q, scales)`` of a validated ``(M, K)`` row-major ``x``: q ``(M, K)``, scales ``(M, K / 128)`` M-major."""
    m, k = x.shape
    q, scales = new_output((m, k), out_dtype, x.device), new_output((-(-k // 128), m), torch.float32, x.device)
    if m and k:
        QUANTIZE_CACHE.get(variant)(x, q, scales)
    return q, scales.t()


__all__ = ["QUANTIZE_CACHE", "QuantizeVariant", "compile_quantize", "launch_group_quantize"]
