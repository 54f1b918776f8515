"""Compiling kernel variants, with or without a GPU, and the in-process cache.

Kernels are compiled against *fake* tensors: symbolic sizes and strides, fixed
dtypes, majors and 16-byte alignment. The result therefore serves every
problem size, and compiling needs no GPU (``CUTE_DSL_ARCH=sm_90a`` is set when
none is present), which is how CI proves every variant builds.

Compiled functions use the DSL's TVM-FFI calling convention: they take torch
tensors directly and launch on torch's current stream.
"""

from __future__ import annotations

import threading
import warnings
import time
from dataclasses import dataclass

from epicute.errors import CompileError
from epicute.plan.config import DTYPE_BYTES, GemmConfig

TARGET_ARCH = "sm_90a"


@dataclass(frozen=True)
class GemmVariant:
    """Everything that changes the generated GEMM code (and nothing else)."""

    config: GemmConfig
    ab_dtype: str
    d_dtype: str
    a_major: str
    b_major: str
    max_active_clusters: int
    arch: str = TARGET_ARCH
    #: the fused epilogue (an ``epicute.kernels.epilogue_emit.EpilogueFusion``), if any
    fusion: object = None

    def key(self) -> tuple:
        return (
            "gemm", self.config.key(), self.ab_dtype, self.d_dtype, self.a_major,
            self.b_major, self.max_active_clusters, self.arch,
            None if self.fusion is None else self.fusion.key(),
        )  # fmt: skip


def _fake_operand(dtype, dims: tuple, contiguous: int):
    """A fake (L, X, Y) tensor whose mode ``contiguous`` has stride 1.

    The other strides are symbolic but declared divisible by 16 bytes (TMA's
    rule, checked on the host before every launch).
    """
    import cutlass.cute as cute

    div = 16 * 8 // dtype.width
    stride = tuple(1 if i == contiguous else cute.sym_int64(divisibility=div) for i in range(3))
    return cute.runtime.make_fake_tensor(dtype, dims, stride=stride, assumed_align=16)


def _fake_epilogue_operands(fusion) -> tuple[tuple, tuple]:
    """Fake operand tensors (batch-first, fully dynamic strides: they are read
    element by element, so any layout works) and fp32 scalar placeholders."""
    from epicute.kernels.epilogue_emit import DSL_DTYPES  # first: sets the target arch

    import cutlass
    import cutlass.cute as cute

    if fusion is None:
        return (), ()
    rank = {"row": 2, "col": 2, "tile": 3}
    tensors = tuple(
        cute.runtime.make_fake_tensor(
            DSL_DTYPES[dtype],
            tuple(cute.sym_int() for _ in range(rank[kind])),
            stride=tuple(cute.sym_int64() for _ in range(rank[kind])),
            assumed_align=DSL_DTYPES[dtype].width // 8,
        )
        for _, kind, dtype in fusion.tensor_operands
    )
    return tensors, tuple(cutlass.Float32(0.0) for _ in fusion.scalar_operands)


def compile_gemm(variant: GemmVariant):
    """Compile one GEMM variant for ``variant.arch``; returns the callable ``f(a, b, d)``.

    ``a`` is ``(L, M, K)``, ``b`` ``(L, K, N)``, ``d`` ``(L, M, N)`` torch tensors.
    """
    from epicute.kernels.gemm_sm90 import CUTLASS_DTYPES, GemmSm90  # first: sets the target arch

    import cutlass.cute as cute

    ab = CUTLASS_DTYPES[variant.ab_dtype]
    d = CUTLASS_DTYPES[variant.d_dtype]
    l, m, n, k = (cute.sym_int() for _ in range(4))
    fake_a = _fake_operand(ab, (l, m, k), contiguous=2 if variant.a_major == "k" else 1)
    fake_b = _fake_operand(ab, (l, k, n), contiguous=2 if variant.b_major == "n" else 1)
    fake_d = _fake_operand(d, (l, m, n), contiguous=2)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    epi_tensors, epi_scalars = _fake_epilogue_operands(variant.fusion)
    kernel = GemmSm90(
        variant.config, variant.ab_dtype, variant.d_dtype, variant.a_major, variant.b_major,
        variant.max_active_clusters, variant.fusion,
    )  # fmt: skip
    try:
        with warnings.catch_warnings():
            # Empty operand tuples (no fused epilogue) become compile-time constants,
            # which is what we want; the DSL warns about it on every compile.
            warnings.filterwarnings("ignore", message=r"Argument epi_(tensors|scalars) .*cannot be converted")
            return cute.compile(
                kernel, fake_a, fake_b, fake_d, epi_tensors, epi_scalars, stream, options="--enable-tvm-ffi"
            )
    except Exception as exc:  # the DSL raises many types; report one
        raise CompileError(f"CuTe DSL failed to compile {variant}: {exc}") from exc


class CompileCache:
    """In-process cache of compiled variants; safe to use from several threads."""

    def __init__(self) -> None:
        self._fns: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.compile_seconds: dict[tuple, float] = {}

    def get(self, variant: GemmVariant):
        key = variant.key()
        fn = self._fns.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._fns.get(key)
            if fn is None:
                start = time.perf_counter()
                fn = compile_gemm(variant)
                self.compile_seconds[key] = time.perf_counter() - start
                self._fns[key] = fn
        return fn

    def __len__(self) -> int:
        return len(self._fns)

    def clear(self) -> None:
        with self._lock:
            self._fns.clear()


GEMM_CACHE = CompileCache()

__all__ = ["GemmVariant", "compile_gemm", "CompileCache", "GEMM_CACHE", "DTYPE_BYTES", "TARGET_ARCH"]
