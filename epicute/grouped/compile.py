"""The grouped GEMM's compiled variants (:class:`GroupedVariant`) and their sm_90a compile, through
the family cache. Sizes, strides and the group count are symbolic: one kernel per variant serves
every routing."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from epicute.gemm.compile import GEMM_CONSTANT_ARGS, GemmVariant, fake_gemm_inputs, kernel_args
from epicute.runtime.compile import FAMILIES, dsl_compile


@dataclass(frozen=True)
class GroupedVariant(GemmVariant):
    """A grouped GEMM variant: the GEMM's fields (fp8 inputs with blockwise scales only), cached under its own
    kind."""

    #: the variable-K mode (:class:`~epicute.grouped.kernel_sm90.RaggedKGemmSm90`): groups split K, not M
    ragged_k: bool = False
    #: A's rows read through an index (:class:`~epicute.grouped.kernel_sm90.GatheredGemmSm90`)
    gathered: bool = False

    kind: ClassVar[str] = "grouped_gemm"

    def key(self):
        key = super().key()
        for mode, label in (("ragged_k", "ragged-K"), ("gathered", "gathered")):
            if getattr(self, mode):
                key = replace(key, parts=(*key.parts, (mode, True)), label=f"{key.label} {label}")
        return key

    def kernel_class(self):
        from epicute.grouped.kernel_sm90 import GatheredGemmSm90, GroupedGemmSm90, RaggedKGemmSm90

        return RaggedKGemmSm90 if self.ragged_k else GatheredGemmSm90 if self.gathered else GroupedGemmSm90


def compile_grouped_sm90(variant: GroupedVariant):
    """Compile one grouped variant for sm_90a; returns the callable
    ``f(a, b, d, offsets, epi_tensors, epi_scalars, block_scales, max_active_clusters)`` taking A
    ``(1, total_M, K)``, B ``(G, K, N)``, D ``(1, total_M, N)``, int32 ``offsets`` ``(G,)`` and ``()`` or
    fp8 blockwise scales ``(A (G, total_M, KB), B (G, NB, KB))`` (torch tensors); variable-K: A
    ``(1, M, total_K)``, B ``(1, total_K, N)``, D ``(G, M, N)``; gathered rows: A ``(1, T, K)``, the rows
    gathered from, and after the offsets an int32 ``a_index`` ``(total_M,)``."""
    import cutlass
    from cutlass import cute

    g, m, n, k = (cute.sym_int() for _ in range(4))
    if variant.ragged_k:
        operands, tail = fake_gemm_inputs(variant, (1, m), 1, (g, m), n, k)
    else:
        a_rows = cute.sym_int() if variant.gathered else m
        operands, tail = fake_gemm_inputs(variant, (1, a_rows), g, (1, m), n, k)
    index_args = (cute.runtime.make_fake_tensor(cutlass.Int32, (g,), stride=(1,), assumed_align=4),)  # offsets
    if variant.gathered:
        index_args += (cute.runtime.make_fake_tensor(cutlass.Int32, (m,), stride=(1,), assumed_align=4),)
    kernel = variant.kernel_class()(*kernel_args(variant))
    return dsl_compile(variant, kernel, *operands, *index_args, *tail, constant_args=GEMM_CONSTANT_ARGS)


GROUPED_CACHE = FAMILIES["grouped_gemm"]


def compile_grouped(variant: GroupedVariant):
    """Compile one grouped variant for ``variant.arch`` (no cache)."""
    return GROUPED_CACHE.compile(variant)


__all__ = ["GROUPED_CACHE", "GroupedVariant", "compile_grouped", "compile_grouped_sm90"]
