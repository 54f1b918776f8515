"""Dequantization scales of an fp8 GEMM, as operands of the epilogue language.

With tensorwise and rowwise scaling (the recipes of ``torch._scaled_mm``), the
scales factor out of the K sum: ``sum_k (a[m,k] sa[m]) (b[k,n] sb[n]) = sa[m] sb[n]
sum_k a[m,k] b[k,n]``. So they are applied to the fp32 accumulator, in front of
the user's epilogue: :func:`scaled_epilogue` composes ``epilogue(acc * a_scale *
b_scale, ...)``, and the scales are operands like any other -- traced, hashed,
scheduled, shown by ``explain`` and emitted by the same chain -- so every
epilogue composes with every recipe.

:func:`fp8_scaling` turns what the caller passed into those operands:

- tensorwise: a Python float (a kernel scalar), or a 0-d / 1-element fp32 tensor,
  read by the kernel from GPU memory (no host sync, CUDA-graph safe) as a row
  vector of one value repeated by a zero stride;
- rowwise: A's per row, ``(M,)`` or ``(M, 1)`` (``(L, M)``, ``(L, M, 1)`` batched)
  -> a column vector; B's per column, ``(N,)`` or ``(1, N)`` (``(L, N)``,
  ``(L, 1, N)``) -> a row vector. fp32, as ``torch._scaled_mm`` takes them.

Blockwise scales (DeepSeek-V3's recipe: A per 1x128, B per 128x128 block of K)
do not factor out of the K sum: the GEMM's mainloop applies them, one k-tile of
128 at a time, as it promotes each tile's WGMMA partial into its fp32
accumulator. :func:`fp8_scaling` recognizes them and returns them as
:class:`BlockScales` for the kernel, leaving the epilogue as the user wrote it:

- ``a_scale`` ``(M, ceil(K/128))`` (``(L, M, KB)`` batched), any strides:
  ``torch._scaled_mm``'s M-major ``torch.rand(KB, M).t()`` and a row-major
  ``(M, KB)`` both work;
- ``b_scale`` per 128x128 block of the ``(N, K)`` weight: ``(ceil(N/128), KB)``
  as the weight's scales are stored, or its transpose ``(KB, ceil(N/128))``, the
  orientation of ``b = w.t()`` that ``torch._scaled_mm`` takes. When the two
  shapes coincide (NB == KB), a tensor whose first dimension has unit stride is
  read as the transpose (``w_scale.t()``, as torch takes it), any other as
  ``(NB, KB)``.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from epicute.epilogue.operands import ColVector, RowVector, Scalar
from epicute.epilogue.tracer import Epilogue, as_epilogue
from epicute.errors import DeviceError, DtypeError, EpilogueError, ShapeError

#: The operand names the scales take in a scaled epilogue (an epilogue's own operands must differ).
SCALE_NAMES = ("a_scale", "b_scale")
#: K extent of a block of blockwise scaling (DeepSeek-V3's recipe).
BLOCK_K = 128
#: The operand kinds :func:`fp8_scaling` makes of tensorwise and rowwise scales: a float is a scalar, a 1-element
#: tensor a row (one value, zero stride); rowwise, A's one per row is a col and B's one per column a row.
SCALE_KINDS = {"a_scale": ("scalar", "row", "col"), "b_scale": ("scalar", "row")}


class ScaledEpilogue(Epilogue):
    """``inner(acc * a_scale * b_scale, *operands)``: the operands are ``a_scale``, ``b_scale``, then
    ``inner``'s (``inner`` None: D is the scaled accumulator)."""

    def __init__(self, inner: Epilogue | None):
        clash = sorted(set(SCALE_NAMES) & set(inner.params if inner else ()))
        if clash:
            raise EpilogueError(
                f"epilogue {inner.name!r} has operands named {clash}, which an fp8 GEMM's a_scale/b_scale take; "
                "rename them"
            )

        def scaled(acc, a_scale, b_scale, *args, **kwargs):
            acc = acc * a_scale * b_scale
            return acc if inner is None else inner.fn(acc, *args, **kwargs)

        # Not Epilogue.__init__: the signature is inner's with the scales in front, not scaled's.
        self.fn, self.inner = scaled, inner
        self.name = "scaled" if inner is None else f"scaled_{inner.name}"
        self.params = SCALE_NAMES + (inner.params if inner else ())
        self.pins = dict(inner.pins) if inner else {}
        self.defaults = dict(inner.defaults) if inner else {}
        self._keyword_only = inner._keyword_only if inner else frozenset()


@functools.lru_cache(maxsize=256)
def scaled_epilogue(epilogue) -> ScaledEpilogue:
    """The scaled form of ``epilogue`` (a function of ``acc``, or None), one object per epilogue so
    that a repeat call finds its prepared kernel."""
    return ScaledEpilogue(None if epilogue is None else as_epilogue(epilogue))


def _describe(value: Any) -> str:
    if value is None:
        return "not given"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class BlockScales:
    """Blockwise scales as the GEMM's mainloop reads them (views of the caller's tensors, never copies):
    ``a`` ``(L, M, KB)`` one per row and 128-wide block of K, ``b`` ``(L, NB, KB)`` one per 128x128
    block of the ``(N, K)`` weight, fp32."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def a_tma(self) -> bool:
        """Whether the kernel can fetch A's scales of a k-tile with one TMA copy: they are M-major (unit stride
        along rows: ``torch._scaled_mm``'s ``torch.rand(KB, M).t()``) with 16-byte aligned strides and base, as
        TMA requires (M a multiple of 4). Other layouts are read a word per row (``cp.async``)."""
        return _aligned_for_copies(self.a, contiguous=1, other=2)

    @property
    def b_bulk(self) -> bool:
        """Whether the kernel can fetch B's scale of a k-tile with one 16-byte bulk copy (the aligned group of four
        blocks of K holding it): they are K-major (the weight's ``(NB, KB)`` row-major, or its ``(KB, NB)`` view
        ``.t()`` that ``torch._scaled_mm`` takes with ``w.t()``) with 16-byte aligned strides and base (KB a
        multiple of 4 when contiguous). Other layouts are read by one ``cp.async``."""
        return _aligned_for_copies(self.b, contiguous=2, other=1)


def _aligned_for_copies(t: torch.Tensor, contiguous: int, other: int) -> bool:
    """Whether ``(L, X, Y)`` scales have unit stride along dim ``contiguous`` and 16-byte aligned base and other
    strides, as TMA and bulk copies need (a single batch's stride is not the layout's: none is stepped along, and
    a TMA tensor gets an aligned one at launch, ``with_aligned_unit_dims``)."""
    words = 4  # fp32 values per 16 bytes
    return (
        t.stride(contiguous) == 1 and t.stride(other) > 0 and t.stride(other) % words == 0
        and (t.shape[0] == 1 or t.stride(0) % words == 0) and t.data_ptr() % 16 == 0 and t.shape[contiguous] > 0
    )  # fmt: skip


@dataclass(frozen=True)
class Fp8Scaling:
    """How an fp8 call's scales are applied: ``operands``, the scaled epilogue's ``a_scale``/``b_scale``
    (tensorwise and rowwise), or ``block``, the mainloop's scales (blockwise)."""

    operands: dict
    block: BlockScales | None = None

    def apply(self, epilogue, operands: dict) -> tuple[Any, dict]:
        """The epilogue and operands the call runs: the scaled epilogue with the scales in front, or,
        blockwise, the caller's own (the mainloop applied the scales)."""
        if self.block is not None:
            return epilogue, operands
        return scaled_epilogue(epilogue), {**self.operands, **operands}


def check_scale_kind(name: str, text: str) -> None:
    """A scale of an fp8 GEMM described in text (``--operand a_scale=col``, a spec's ``operands``) as
    ``kind[:dtype]``: a kind some recipe takes (:data:`SCALE_KINDS`; ``blockwise`` is the mainloop's, taken
    before), in fp32, as :func:`fp8_scaling` checks a call's scales."""
    kind, _, dtype = str(text).partition(":")
    legal = SCALE_KINDS[name]
    if kind not in legal:
        rowwise = {"a_scale": "a_scale=col, one per row of A, (M, 1)", "b_scale": "b_scale=row, one per column "
                   "of B, (1, N)"}[name]  # fmt: skip
        raise ShapeError(
            f"{name}={text}: no fp8 recipe takes a {kind!r} scale; give {name} as {', '.join(legal)} or blockwise: "
            f"tensorwise ({name}=scalar, a float; {name}=row, a 1-element fp32 tensor), rowwise ({rowwise}), or "
            "blockwise (a_scale=blockwise and b_scale=blockwise, one per 128-wide block of K)"
        )
    if dtype not in ("", "fp32"):
        raise DtypeError(f"{name}={text}: scales are fp32; give {name}={kind}" + (":fp32" if kind != "scalar" else ""))


def fp8_scaling(
    a_scale: Any, b_scale: Any, m: int, n: int, k: int, l: int, batched: bool, device: torch.device | None = None
) -> Fp8Scaling:
    """Recognize the recipe of ``a_scale``/``b_scale`` for an ``(L, M, N, K)`` fp8 problem (``batched``: the
    call's tensors are 3-D; ``device``: where blockwise scales must live, the kernel reads them there)."""
    lead = (l,) if batched else ()
    blocks_n, blocks_k = -(-n // BLOCK_K), -(-k // BLOCK_K)
    b_block = _block_b(b_scale, lead, n, blocks_n, blocks_k)
    if b_block is not None:
        a_block = _block_a(a_scale, lead, m, blocks_k)
        _check_block_devices(a_block, b_block, device)
        l3 = lambda t: t if batched else t.unsqueeze(0)  # noqa: E731
        return Fp8Scaling({}, BlockScales(l3(a_block), l3(b_block)))
    return Fp8Scaling({
        "a_scale": _scale("a_scale", a_scale, m, n, k, l, batched, per="row", other=b_scale),
        "b_scale": _scale("b_scale", b_scale, m, n, k, l, batched, per="column"),
    })  # fmt: skip


def grouped_block_scales(
    a_scale: Any, b_scale: Any, rows: int, n: int, k: int, groups: int, device: torch.device | None = None
) -> BlockScales:
    """A grouped fp8 GEMM's blockwise scales: ``a_scale`` ``(total_M, KB)`` over every group's rows (any
    strides), ``b_scale`` one per 128x128 block of each group's ``(N, K)`` weight, ``(G, NB, KB)`` (or its
    per-group transpose ``(G, KB, NB)``, as for :func:`fp8_scaling`). As the mainloop reads them: A's
    ``(1, total_M, KB)``, B's ``(G, NB, KB)``."""
    for name, value in (("a_scale", a_scale), ("b_scale", b_scale)):
        if value is None:
            raise DtypeError(f"{name} is missing: a grouped GEMM of fp8 inputs needs blockwise a_scale and b_scale "
                             "(fp32, one per 128-wide block of K; see epicute.grouped_gemm)")  # fmt: skip
    blocks_n, blocks_k = -(-n // BLOCK_K), -(-k // BLOCK_K)
    b_block = _block_b(b_scale, (groups,), n, blocks_n, blocks_k)
    if b_block is None:
        got = _describe(b_scale) if not isinstance(b_scale, torch.Tensor) else f"shape {tuple(b_scale.shape)}"
        raise ShapeError(
            f"b_scale has {got}; a grouped fp8 GEMM takes blockwise scales, one per 128x128 block of each group's "
            f"(N, K) weight: ({groups}, {blocks_n}, {blocks_k}) fp32 (tensorwise or rowwise scales are epilogue "
            "operands there: epilogue=lambda acc, sa, sb: acc * sa * sb with sa (total_M, 1) and sb (G, N))"
        )
    a_block = _block_a(a_scale, (), rows, blocks_k)
    _check_block_devices(a_block, b_block, device)
    return BlockScales(a_block.unsqueeze(0), b_block)


def ragged_k_block_scales(a_scale: Any, b_scale: Any, m: int, n: int, total_k: int,
                          device: torch.device | None = None) -> BlockScales:  # fmt: skip
    """A variable-K grouped fp8 GEMM's blockwise scales, over the whole K (each group's k-tiles are whole blocks
    of it): ``a_scale`` ``(M, KB)`` one per row and 128-wide block of K, ``b_scale`` one per 128x128 block of the
    ``(N, total_K)`` B, ``(NB, KB)`` (or ``(KB, NB)``). As the mainloop reads them: ``(1, M, KB)`` and
    ``(1, NB, KB)``."""
    for name, value in (("a_scale", a_scale), ("b_scale", b_scale)):
        if value is None:
            raise DtypeError(f"{name} is missing: a variable-K grouped GEMM of fp8 inputs needs blockwise a_scale and "
                             "b_scale (fp32, one per 128-wide block of K; see epicute.grouped_gemm)")  # fmt: skip
    blocks_n, blocks_k = -(-n // BLOCK_K), -(-total_k // BLOCK_K)
    b_block = _block_b(b_scale, (), n, blocks_n, blocks_k)
    if b_block is None:
        got = _describe(b_scale) if not isinstance(b_scale, torch.Tensor) else f"shape {tuple(b_scale.shape)}"
        raise ShapeError(
            f"b_scale has {got}; a variable-K grouped fp8 GEMM takes one scale per 128x128 block of the (N, total_K) "
            f"B: ({blocks_n}, {blocks_k}) fp32"
        )
    a_block = _block_a(a_scale, (), m, blocks_k)
    _check_block_devices(a_block, b_block, device)
    return BlockScales(a_block.unsqueeze(0), b_block.unsqueeze(0))


def _check_block_devices(a_block: torch.Tensor, b_block: torch.Tensor, device: torch.device | None) -> None:
    for name, t in (("a_scale", a_block), ("b_scale", b_block)):
        if device is not None and t.device != device:
            raise DeviceError(f"{name} is on {t.device} but a is on {device}; blockwise scales are read by the "
                              f"kernel: pass {name}.to({str(device)!r})")  # fmt: skip


def dequantize_blockwise(a: torch.Tensor, b: torch.Tensor, scales: BlockScales) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` ``(L, M, K)`` and ``b`` ``(L, K, N)`` times their blockwise scales, in float32 on the CPU: the
    reference's inputs."""
    cpu = torch.device("cpu")
    k = a.shape[-1]

    def per_k(s: torch.Tensor) -> torch.Tensor:  # (..., KB) -> (..., K)
        return s.to(cpu).repeat_interleave(BLOCK_K, dim=-1)[..., :k]

    a_deq = a.to(cpu, torch.float32) * per_k(scales.a)
    sb = per_k(scales.b).repeat_interleave(BLOCK_K, dim=-2)[..., : b.shape[-1], :]  # (L, N, K)
    return a_deq, b.to(cpu, torch.float32) * sb.transpose(-2, -1)


def _fp32_tensor(name: str, value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    if value.dtype != torch.float32:
        raise DtypeError(f"{name} has dtype {value.dtype}; scales are fp32 (pass {name}.float())")
    return True


def _block_b(value: Any, lead: tuple, n: int, blocks_n: int, blocks_k: int) -> torch.Tensor | None:
    """B's blockwise scales as ``(..., NB, KB)``, or None when ``value`` is no blockwise B scale (a rowwise
    form wins where the shapes coincide: N == 1 and K <= 128, the same math)."""
    if not _fp32_tensor("b_scale", value) or value.dim() < len(lead) + 2:  # 0-d or 1-D: tensorwise or rowwise
        return None
    shape = tuple(value.shape)
    if shape in (lead + (n,), lead + (1, n)):
        return None
    weight, transposed = lead + (blocks_n, blocks_k), lead + (blocks_k, blocks_n)
    if shape == weight and (shape != transposed or not (value.stride(-2) == 1 and value.stride(-1) != 1)):
        return value
    if shape == transposed:
        return value.transpose(-2, -1)
    return None


def _block_a(value: Any, lead: tuple, m: int, blocks_k: int) -> torch.Tensor:
    expected = lead + (m, blocks_k)
    if not _fp32_tensor("a_scale", value) or tuple(value.shape) != expected:
        got = _describe(value) if not isinstance(value, torch.Tensor) else f"shape {tuple(value.shape)}"
        raise ShapeError(
            f"b_scale is blockwise (one per 128x128 block), so a_scale must be too: one per row and 128-wide block "
            f"of K, shape {expected} fp32 (torch._scaled_mm's torch.rand(KB, M).t() works); got {got}"
        )
    return value


def _scale(name: str, value: Any, m: int, n: int, k: int, l: int, batched: bool, per: str, other: Any = None):
    if value is None:
        raise DtypeError(f"{name} is missing: fp8 inputs need both a_scale and b_scale (pass {name}=1.0 for none)")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return Scalar(float(value))
    if not isinstance(value, torch.Tensor):
        raise DtypeError(f"{name} is {_describe(value)}; pass a float or an fp32 tensor")
    _fp32_tensor(name, value)
    extent = m if per == "row" else n
    lead = (l,) if batched else ()
    if value.numel() == 1 and value.dim() <= 1:
        # Tensorwise, read on the GPU: one value repeated along N by a zero stride.
        return RowVector(value.reshape((1,) * (len(lead) + 1)).expand(*lead, n))
    # A tuple, not a set: traced with dynamic shapes the sizes are SymInts, which do not hash.
    rowwise = (lead + (extent,), lead + ((extent, 1) if per == "row" else (1, extent)))
    if tuple(value.shape) in rowwise:
        t = value.reshape(*lead, extent)
        return ColVector(t) if per == "row" else RowVector(t)
    blocks_k = -(-k // BLOCK_K)
    if per == "row" and tuple(value.shape) == lead + (m, blocks_k):
        raise ShapeError(
            f"a_scale has shape {tuple(value.shape)}: blockwise (one per row and 128-wide block of K), so b_scale "
            f"must be too: one per 128x128 block of the (N, K) weight, {lead + (-(-n // BLOCK_K), blocks_k)} or "
            f"its transpose; b_scale is {_describe(other)}"
        )
    forms = f"{lead + (extent,)}, {lead + ((extent, 1) if per == 'row' else (1, extent))}"
    blockwise = (
        f"; or blockwise, {lead + (m, blocks_k)}" if per == "row"
        else f"; or blockwise, {lead + (-(-n // BLOCK_K), blocks_k)} or its transpose"
    )  # fmt: skip
    raise ShapeError(
        f"{name} has shape {tuple(value.shape)}; give a float or a 1-element tensor (tensorwise), one value "
        f"per {per}: {forms} (rowwise){blockwise} (per 128-wide block of K)"
    )


__all__ = [
    "BLOCK_K",
    "SCALE_KINDS",
    "SCALE_NAMES",
    "BlockScales",
    "Fp8Scaling",
    "ScaledEpilogue",
    "check_scale_kind",
    "dequantize_blockwise",
    "fp8_scaling",
    "grouped_block_scales",
    "scaled_epilogue",
]
