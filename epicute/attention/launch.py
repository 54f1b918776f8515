"""Compiling and launching the attention kernel.

An :class:`AttentionVariant` is everything that changes the generated code
(config, dtype, causal, the fused score_mod and epilogue graphs). It compiles
against fake tensors -- sizes, batch/seq/head strides and head counts symbolic,
head_dim static and contiguous, 16-byte aligned -- so one compile serves every
problem shape, on machines without a GPU too. Compiled variants live in the
process-wide kernel cache under the ``"attention"`` family.

Dynamically scheduled variants (``AttentionConfig.dynamic_tiles``) claim work
tiles from an int32 counter in global memory (:func:`tile_counter`): one per
(device, stream), zero between launches because each launch's last claim
resets it, so a launch needs no memset and concurrent streams never share one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from epicute.attention.plan import AttentionConfig
from epicute.errors import CompileError
from epicute.runtime import compile as compile_module
from epicute.runtime.cache import CacheKey
from epicute.runtime.compile import OPERAND_ALIGN_BYTES, KernelFamily
from epicute.runtime.target import DEFAULT_ARCH, SM90A, current_target


@dataclass(frozen=True)
class AttentionVariant:
    config: AttentionConfig
    dtype: str
    causal: bool
    #: ``epicute.attention.kernel_sm90.AttentionFusion`` of the score_mod / output epilogue, if any
    score_mod: object = None
    epilogue: object = None
    #: the target's arch; nothing else of the target (the persistent CTA count is a launch argument)
    arch: str = DEFAULT_ARCH

    def key(self) -> CacheKey:
        """The compile cache's key (see :mod:`epicute.runtime.cache`)."""
        parts = (
            self.config.key(), self.dtype, self.causal,
            None if self.score_mod is None else self.score_mod.key(),
            None if self.epilogue is None else self.epilogue.key(),
            ("align", OPERAND_ALIGN_BYTES),
        )  # fmt: skip
        c = self.config
        label = (
            f"attention d{c.head_dim} {c.tile_m}x{c.tile_n} {self.dtype}" + (" causal" if self.causal else "")
            + ("" if self.score_mod is None else " +score_mod") + ("" if self.epilogue is None else " +epilogue")
        )  # fmt: skip
        return CacheKey("attention", parts, self.arch, label)


def _fake_bshd(dtype, head_dim: int):
    """A fake (batch, seqlen, heads, head_dim) tensor: head_dim static and contiguous, other strides 16 B aligned."""
    from cutlass import cute

    div = 16 * 8 // dtype.width
    shape = (cute.sym_int(), cute.sym_int(), cute.sym_int(), head_dim)
    stride = (cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div), 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=OPERAND_ALIGN_BYTES)


def _fake_operands(fusion) -> tuple[tuple, tuple]:
    """Fake operand tensors (read element by element: any strides) and fp32 scalar placeholders."""
    import cutlass
    from cutlass import cute

    from epicute.sm90.epilogue_emit import DSL_DTYPES

    if fusion is None:
        return (), ()
    rank = {"head": 1, "row": 1, "tile": 4}
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


def compile_attention(variant: AttentionVariant):
    """Compile one variant for sm_90a; returns ``f(q, k, v, o, lse, softmax_scale, score_tensors, score_scalars,
    epi_tensors, epi_scalars, max_ctas, tile_counter)`` taking torch tensors (layout ``(batch, seqlen,
    heads, head_dim)``, LSE ``(batch, heads, seqlen_q)`` fp32 contiguous); a persistent variant launches
    at most ``max_ctas`` CTAs (one per SM); a dynamically scheduled one claims tiles from
    ``tile_counter`` (int32, one element, zero at launch), which the others never read."""
    import cutlass
    from cutlass import cute

    from epicute.attention.kernel_sm90 import AttentionSm90
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    dtype = DSL_DTYPES[variant.dtype]
    d = variant.config.head_dim
    q, k, v, o = (_fake_bshd(dtype, d) for _ in range(4))
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32,
        (cute.sym_int(), cute.sym_int(), cute.sym_int()),
        stride=(cute.sym_int64(), cute.sym_int64(), 1),
        assumed_align=4,
    )
    counter = cute.runtime.make_fake_tensor(cutlass.Int32, (1,), stride=(1,), assumed_align=4)
    score_tensors, score_scalars = _fake_operands(variant.score_mod)
    epi_tensors, epi_scalars = _fake_operands(variant.epilogue)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = AttentionSm90(variant.config, variant.dtype, variant.causal, variant.score_mod, variant.epilogue)
    try:
        with warnings.catch_warnings():
            # Empty operand tuples become compile-time constants, which is what we want.
            warnings.filterwarnings("ignore", message=r"Argument (score|epi)_(tensors|scalars) .*cannot be converted")
            return cute.compile(
                kernel, q, k, v, o, lse, cutlass.Float32(1.0), score_tensors, score_scalars,
                epi_tensors, epi_scalars, cutlass.Int32(1), counter, stream, options=compile_module.DSL_COMPILE_OPTIONS,
            )  # fmt: skip
    except Exception as exc:  # the DSL raises many types; report one
        raise CompileError(f"CuTe DSL failed to compile {variant}: {exc}") from exc


ATTENTION_CACHE = KernelFamily("attention", {SM90A: compile_attention})


_TILE_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def tile_counter(device: torch.device, dynamic: bool = True) -> torch.Tensor:
    """The work counter of dynamically scheduled launches on ``device``'s current stream
    (see the module docstring): allocated zeroed on first use, then left at zero by every launch.
    With ``dynamic=False``, one placeholder per device that the kernel never reads (no stream query)."""
    if dynamic:
        stream = torch.cuda.current_stream(device)
        key = (stream.device_index, stream.cuda_stream)
    else:
        key = (device.index, None)
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = _TILE_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def new_lse(shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """The LSE buffer of one call (a seam for tests, which poison it with NaN)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def launch_attention(
    call,
    variant: AttentionVariant,
    score_operands: tuple = ((), ()),
    epi_operands: tuple = ((), ()),
    max_ctas: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on a validated ``call``; returns O ``(B, Sq, Hq, D)`` (``call.out`` if given)
    and LSE ``(B, Hq, Sq)`` fp32. ``max_ctas`` bounds a persistent grid (the plan's
    :attr:`~epicute.attention.plan.AttentionPlan.max_ctas`; default: one CTA per SM of the current GPU)."""
    p = call.problem
    out = call.out if call.out is not None else torch.empty_like(call.q, memory_format=torch.contiguous_format)
    lse = new_lse((p.batch, p.heads_q, p.seqlen_q), call.q.device)
    if out.numel():
        kernel = ATTENTION_CACHE.get(variant)
        if max_ctas is None:
            max_ctas = current_target().num_sms
        kernel(
            call.q, call.k, call.v, out, lse, call.softmax_scale, *score_operands, *epi_operands, max_ctas,
            tile_counter(call.q.device, variant.config.dynamic_tiles),
        )  # fmt: skip
    return out, lse
