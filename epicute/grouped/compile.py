"""The grouped GEMM's compiled variants (:class:`GroupedVariant`) and their sm_90a compile, through
the family cache. Sizes, strides and the group count are symbolic: one kernel per variant serves
every routing."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from epicute.gemm.compile import GemmVariant, _fake_block_scales, _fake_epilogue_operands, _fake_operand, d_columns
from epicute.runtime.compile import KernelFamily, dsl_compile
from epicute.runtime.target import SM90A


@dataclass(frozen=True)
class GroupedVariant(GemmVariant):
    """A grouped GEMM variant: the GEMM's fields (fp8 inputs with blockwise scales only), cached under its own
    kind."""

    #: the variable-K mode (:class:`~epicute.grouped.kernel_sm90.RaggedKGemmSm90`): groups split K, not M
    ragged_k: bool = False

    kind: ClassVar[str] = "grouped_gemm"

    def key(self):
        key = super().key()
        if not self.ragged_k:
            return key
        return replace(key, parts=(*key.parts, ("ragged_k", True)), label=f"{key.label} ragged-K")


def compile_grouped_sm90(variant: GroupedVariant):
    """Compile one grouped variant for sm_90a; returns the callable
    ``f(a, b, d, offsets, epi_tensors, epi_scalars, block_scales, max_active_clusters)`` taking A
    ``(1, total_M, K)``, B ``(G, K, N)``, D ``(1, total_M, N)``, int32 ``offsets`` ``(G,)`` and ``()`` or
    fp8 blockwise scales ``(A (G, total_M, KB), B (G, NB, KB))`` (torch tensors); variable-K: A
    ``(1, M, total_K)``, B ``(1, total_K, N)``, D ``(G, M, N)``."""
    import cutlass
    from cutlass import cute

    from epicute.gemm.kernel_sm90 import CUTLASS_DTYPES
    from epicute.grouped.kernel_sm90 import GroupedGemmSm90, RaggedKGemmSm90

    ab, d = CUTLASS_DTYPES[variant.ab_dtype], CUTLASS_DTYPES[variant.d_dtype]
    b_elem = CUTLASS_DTYPES[variant.b_dtype or variant.ab_dtype]
    g, m, n, k = (cute.sym_int() for _ in range(4))
    fake_a = _fake_operand(ab, (1, m, k), contiguous=2 if variant.a_major == "k" else 1)
    fake_b = _fake_operand(b_elem, (1 if variant.ragged_k else g, k, n), contiguous=2 if variant.b_major == "n" else 1)
    d_lm = (g, m) if variant.ragged_k else (1, m)
    fake_d = _fake_operand(d, (*d_lm, d_columns(variant.fusion, n)), contiguous=2)
    fake_offsets = cute.runtime.make_fake_tensor(cutlass.Int32, (g,), stride=(1,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    epi_tensors, epi_scalars = _fake_epilogue_operands(variant.fusion)
    block_scales = _fake_block_scales() if variant.block_scaled else ()
    kernel = (RaggedKGemmSm90 if variant.ragged_k else GroupedGemmSm90)(
        variant.config, variant.ab_dtype, variant.d_dtype, variant.a_major, variant.b_major, variant.fusion,
        variant.b_dtype, variant.block_scaled,
    )  # fmt: skip
    return dsl_compile(
        variant,
        kernel,
        fake_a,
        fake_b,
        fake_d,
        fake_offsets,
        epi_tensors,
        epi_scalars,
        block_scales,
        cutlass.Int32(1),
        stream,
        constant_args=("epi_tensors", "epi_scalars", "block_scales"),
    )


GROUPED_CACHE = KernelFamily("grouped_gemm", {SM90A: compile_grouped_sm90})


def compile_grouped(variant: GroupedVariant):
    """Compile one grouped variant for ``variant.arch`` (no cache)."""
    return GROUPED_CACHE.compile(variant)


__all__ = ["GROUPED_CACHE", "GroupedVariant", "compile_grouped", "compile_grouped_sm90"]
