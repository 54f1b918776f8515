"""The grouped GEMM's compiled variants (:class:`GroupedVariant`) and their sm_90a compile, through
the family cache. Sizes, strides and the group count are symbolic: one kernel per variant serves
every routing."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from epicute.gemm.compile import GEMM_CONSTANT_ARGS, GemmVariant, fake_gemm_inputs, kernel_args
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

    from epicute.grouped.kernel_sm90 import GroupedGemmSm90, RaggedKGemmSm90

    g, m, n, k = (cute.sym_int() for _ in range(4))
    if variant.ragged_k:
        operands, tail = fake_gemm_inputs(variant, (1, m), 1, (g, m), n, k)
    else:
        operands, tail = fake_gemm_inputs(variant, (1, m), g, (1, m), n, k)
    fake_offsets = cute.runtime.make_fake_tensor(cutlass.Int32, (g,), stride=(1,), assumed_align=4)
    kernel = (RaggedKGemmSm90 if variant.ragged_k else GroupedGemmSm90)(*kernel_args(variant))
    return dsl_compile(variant, kernel, *operands, fake_offsets, *tail, constant_args=GEMM_CONSTANT_ARGS)


GROUPED_CACHE = KernelFamily("grouped_gemm", {SM90A: compile_grouped_sm90})


def compile_grouped(variant: GroupedVariant):
    """Compile one grouped variant for ``variant.arch`` (no cache)."""
    return GROUPED_CACHE.compile(variant)


__all__ = ["GROUPED_CACHE", "GroupedVariant", "compile_grouped", "compile_grouped_sm90"]
