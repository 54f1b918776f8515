"""The GEMM's compiled variants: what changes its code (:class:`GemmVariant`), and compiling one
against fake tensors for its arch (sm_90a: :func:`compile_gemm_sm90`), through the family cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from epicute.epilogue.dtypes import DTYPE_BYTES
from epicute.gemm.config import GemmConfig
from epicute.runtime.cache import CacheKey
from epicute.runtime.compile import FAMILIES, OPERAND_ALIGN_BYTES, dsl_compile
from epicute.runtime.target import DEFAULT_ARCH


@dataclass(frozen=True)
class GemmVariant:
    """Everything that changes the generated GEMM code (and nothing else: the persistent
    cluster budget, which depends on the GPU's SM count, is an argument of each launch)."""

    config: GemmConfig
    ab_dtype: str
    d_dtype: str
    a_major: str
    b_major: str
    arch: str = DEFAULT_ARCH
    #: the fused epilogue (an ``epicute.epilogue.fusion.EpilogueFusion``), if any
    fusion: object = None
    #: B's dtype where it is not ``ab_dtype`` (fp8 e4m3 x e5m2)
    b_dtype: str = ""
    #: fp8 with blockwise scales applied in the mainloop (``GemmProblem.block_scaled``)
    block_scaled: bool = False
    #: its A scales are TMA-loaded (``GemmProblem.a_scales_tma``: M-major, 16-byte aligned strides)
    a_scales_tma: bool = False
    #: its B scales arrive by bulk copy (``GemmProblem.b_scales_bulk``, and its tiles lie in one block of N)
    b_scales_bulk: bool = False
    #: A, B and D arrive ``(L, ., .)``; False: one batch, 2-D ``(., .)``, so that an unbatched call hands the
    #: kernel its own tensors (a 3-D view per call costs more host time than the launch; NOTES, issue 23)
    batched: bool = True
    #: the kernel family whose cache holds it (a subclass's kernel takes these fields too)
    kind: ClassVar[str] = "gemm"

    def key(self) -> CacheKey:
        """The compile cache's key (see :mod:`epicute.runtime.cache`)."""
        parts = (
            self.config.key(), self.ab_dtype, self.b_dtype or self.ab_dtype, self.d_dtype, self.a_major, self.b_major,
            None if self.fusion is None else self.fusion.key(),
            ("align", OPERAND_ALIGN_BYTES),
        ) + ((("block_scaled", True),) if self.block_scaled else ())  # fmt: skip
        parts += (("a_scales", "tma"),) if self.a_scales_tma else ()
        parts += (("b_scales", "bulk"),) if self.b_scales_bulk else ()
        parts += () if self.batched else (("batched", False),)
        c = self.config
        label = (
            ("" if self.kind == "gemm" else f"{self.kind} ")
            + f"{c.tile_m}x{c.tile_n}x{c.tile_k} cluster {c.cluster_m}x{c.cluster_n} "
            f"{'persistent' if c.persistent else 'one tile/CTA'} {self.ab_dtype}"
            + (f"x{self.b_dtype}" if self.b_dtype and self.b_dtype != self.ab_dtype else "")
            + f"->{self.d_dtype} "
            f"A:{self.a_major} B:{self.b_major}"
            + (" blockwise" if self.block_scaled else "")
            + (" (A scales by TMA)" if self.a_scales_tma else "")
            + (" (B scales by bulk copy)" if self.b_scales_bulk else "")
            + (" swap-AB" if c.swap_ab else "")
            + (f" L2:evict-first {c.evict_first.upper()}" if c.evict_first else "")
            + ("" if self.batched else " 2-D")
            + ("" if self.fusion is None else " +epilogue")
        )
        return CacheKey(self.kind, parts, self.arch, label)


def _fake_operand(dtype, dims: tuple, contiguous: int):
    """A fake (L, X, Y) or (X, Y) tensor whose mode ``contiguous`` (counted from the end: -1 or -2) has stride 1.

    The other strides are symbolic but declared divisible by 16 bytes (TMA's
    rule, checked on the host before every launch).
    """
    from cutlass import cute

    div = 16 * 8 // dtype.width
    stride = tuple(1 if i == len(dims) + contiguous else cute.sym_int64(divisibility=div) for i in range(len(dims)))
    return cute.runtime.make_fake_tensor(dtype, dims, stride=stride, assumed_align=OPERAND_ALIGN_BYTES)


def _fake_epilogue_operands(fusion) -> tuple[tuple, tuple]:
    """Fake epilogue tensors (batch-first, in ``fusion.tensor_args`` order) and fp32 scalar placeholders.

    Operand and aux tiles go through TMA, so they are row-major with 16-byte
    aligned strides like D; vectors and workspaces are indexed element by
    element, so any strides work.
    """
    import cutlass
    from cutlass import cute

    from epicute.sm90.epilogue_emit import DSL_DTYPES

    if fusion is None:
        return (), ()
    tensors = []
    for role, _, dtype in fusion.tensor_args:
        dsl = DSL_DTYPES[dtype]
        if role in ("tile", "aux"):
            tensors.append(_fake_operand(dsl, tuple(cute.sym_int() for _ in range(3)), contiguous=-1))
        else:
            rank = 3 if role in ("workspace", "group_scales") else 2
            stride = tuple(cute.sym_int64() for _ in range(rank))
            if role == "workspace":  # allocated contiguous by the launch: a unit column stride, static
                stride = (*stride[:-1], 1)
            tensors.append(cute.runtime.make_fake_tensor(
                dsl, tuple(cute.sym_int() for _ in range(rank)), stride=stride, assumed_align=max(dsl.width // 8, 1),
            ))  # fmt: skip
    return tuple(tensors), tuple(cutlass.Float32(0.0) for _ in fusion.scalar_inputs)


def d_columns(fusion, n):
    """D's symbolic N: B's, or its own under a gated epilogue (half of B's, which the DSL cannot state) or a paired
    one (twice the output's)."""
    from cutlass import cute

    return cute.sym_int() if fusion is not None and (fusion.gated or fusion.paired) else n


def _fake_block_scales(a_tma: bool, b_bulk: bool) -> tuple:
    """Blockwise fp8 scales as the kernel takes them, fp32 ``(L, M, KB)`` and ``(L, NB, KB)``, read element by
    element, so of any strides; a TMA-loaded one (``a_tma``: A's M-major, ``b_bulk``: B's K-major) has unit stride
    along that dim and 16-byte aligned others."""
    import cutlass
    from cutlass import cute

    def fake(unit_stride: int | None):
        if unit_stride is None:
            stride, align = tuple(cute.sym_int64() for _ in range(3)), 4
        else:
            stride = tuple(1 if i == unit_stride else cute.sym_int64(divisibility=4) for i in range(3))
            align = 16
        return cute.runtime.make_fake_tensor(cutlass.Float32, tuple(cute.sym_int() for _ in range(3)), stride=stride,
                                             assumed_align=align)  # fmt: skip

    return fake(1 if a_tma else None), fake(2 if b_bulk else None)


def fake_gemm_inputs(variant: GemmVariant, a_lm: tuple, b_l, d_lm: tuple, n, k) -> tuple:
    """What every GEMM-family kernel is compiled against, from ``variant``: fake A ``(*a_lm, K)``, B
    ``(b_l, K, N)`` (``(K, N)`` where ``b_l`` is None) and D ``(*d_lm, D's columns)`` in the variant's dtypes
    and majors (``n``, ``k``: the shared sym ints), then the launch tail ``(epi_tensors, epi_scalars,
    block_scales, max_active_clusters, stream)``: the fused epilogue's operands, blockwise scales or ``()``, a
    runtime Int32 (its value here is a placeholder: the cluster budget is given per launch) and the stream."""
    import cutlass
    from cutlass import cute

    from epicute.gemm.kernel_sm90 import CUTLASS_DTYPES

    b_dtype = CUTLASS_DTYPES[variant.b_dtype or variant.ab_dtype]
    a_dims, b_dims = (*a_lm, k), (k, n) if b_l is None else (b_l, k, n)
    fake_a = _fake_operand(CUTLASS_DTYPES[variant.ab_dtype], a_dims, contiguous=-1 if variant.a_major == "k" else -2)
    fake_b = _fake_operand(b_dtype, b_dims, contiguous=-1 if variant.b_major == "n" else -2)
    fake_d = _fake_operand(CUTLASS_DTYPES[variant.d_dtype], (*d_lm, d_columns(variant.fusion, n)), contiguous=-1)
    epi_tensors, epi_scalars = _fake_epilogue_operands(variant.fusion)
    block_scales = _fake_block_scales(variant.a_scales_tma, variant.b_scales_bulk) if variant.block_scaled else ()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (fake_a, fake_b, fake_d), (epi_tensors, epi_scalars, block_scales, cutlass.Int32(1), stream)


#: The launch arguments that may be empty tuples (see :func:`~epicute.runtime.compile.dsl_compile`).
GEMM_CONSTANT_ARGS = ("epi_tensors", "epi_scalars", "block_scales")


def kernel_args(variant: GemmVariant) -> tuple:
    """The arguments every GEMM-family kernel class is built from (:class:`~epicute.gemm.kernel_sm90.GemmSm90`)."""
    return (
        variant.config, variant.ab_dtype, variant.d_dtype, variant.a_major, variant.b_major, variant.fusion,
        variant.b_dtype, variant.block_scaled, variant.a_scales_tma, variant.b_scales_bulk,
    )  # fmt: skip


def compile_gemm_sm90(variant: GemmVariant):
    """Compile one GEMM variant for sm_90a; returns the callable
    ``f(a, b, d, epi_tensors, epi_scalars, block_scales, split_workspace, max_active_clusters)``.

    ``a`` is ``(L, M, K)``, ``b`` ``(L, K, N)``, ``d`` ``(L, M, N)`` torch tensors (2-D ``(M, K)``, ``(K, N)``,
    ``(M, N)`` where ``variant.batched`` is False); ``block_scales`` is
    ``()``, or for a block-scaled variant fp32 ``(A (L, M, KB), B (L, NB, KB))`` of any strides;
    ``split_workspace`` is ``()``, or for a split-K variant ``(partials, counters)`` (``split_workspace`` in
    :mod:`epicute.gemm.launch`);
    ``max_active_clusters`` (an int, :attr:`epicute.gemm.plan.GemmPlan.max_active_clusters`)
    bounds a persistent variant's grid, and is ignored by the others.
    """
    from cutlass import cute

    from epicute.gemm.kernel_sm90 import GemmSm90

    l, m, n, k = (cute.sym_int() for _ in range(4))
    lm, b_l = ((l, m), l) if variant.batched else ((m,), None)
    operands, tail = fake_gemm_inputs(variant, lm, b_l, lm, n, k)
    split_workspace = _fake_split_workspace() if variant.config.split_k > 1 else ()
    tail = (*tail[:3], split_workspace, *tail[3:])
    return dsl_compile(variant, GemmSm90(*kernel_args(variant)), *operands, *tail,
                       constant_args=(*GEMM_CONSTANT_ARGS, "split_workspace"))  # fmt: skip


def _fake_split_workspace() -> tuple:
    """Split-K's fp32 partial tiles and int32 per-tile arrival counters, flat (see ``GemmSm90._reduce_splits``)."""
    import cutlass
    from cutlass import cute

    return tuple(
        cute.runtime.make_fake_tensor(dtype, (cute.sym_int(),), stride=(1,), assumed_align=16)
        for dtype in (cutlass.Float32, cutlass.Int32)
    )


GEMM_CACHE = FAMILIES["gemm"]


def compile_gemm(variant: GemmVariant):
    """Compile one GEMM variant for ``variant.arch`` (no cache); see :func:`compile_gemm_sm90`."""
    return GEMM_CACHE.compile(variant)


__all__ = ["DTYPE_BYTES", "GEMM_CACHE", "GemmVariant", "compile_gemm", "compile_gemm_sm90"]
