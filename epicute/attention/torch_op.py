"""``torch.ops.epicute.attention``: the attention family's custom op (see :mod:`epicute.runtime.torch_ops`).

``torch.ops.epicute.attention(q, k, v, operands, scalars, score_mod, epilogue, spec) -> (O, LSE)``
runs :func:`epicute.attention`: ``score_mod`` and ``epilogue`` are registry keys (``""`` for
none; a score_mod is registered with its indices traced as index leaves,
:func:`~epicute.runtime.torch_ops.register_score_mod`), the hooks' operands travel by name in
``spec`` together with ``causal``, ``softmax_scale`` and ``config``. LSE is always computed (the
kernel writes it anyway); :func:`epicute.attention` drops it unless ``return_lse=True``. O is
contiguous in q's dtype, LSE fp32 ``(batch, heads_q, seqlen_q)``, whatever the hooks are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from epicute.epilogue.dtypes import ir_dtype
from epicute.errors import ConfigError, EpilogueError, ShapeError
from epicute.runtime.torch_ops import (
    assume_constant_result,
    config_of,
    operand_values,
    plain_fn,
    register_meta,
    register_score_mod_traced,
    register_traced,
    registered_casts,
    registered_epilogue,
    registered_outputs,
    spec_text,
    split_operands,
)


@torch.library.custom_op("epicute::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    score_mod: str,
    epilogue: str,
    spec: str,
    page_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``epicute.attention(q, k, v, ..., return_lse=True)`` as an op: ``(O, LSE)`` (see the module docstring)."""
    from epicute.attention.api import attention

    spec = json.loads(spec)
    return attention(
        q, k, v, causal=spec["causal"], softmax_scale=spec["softmax_scale"], return_lse=True,
        score_mod=registered_epilogue(score_mod) if score_mod else None,
        epilogue=registered_epilogue(epilogue) if epilogue else None,
        config=config_of(spec), page_table=page_table, seqused_k=seqused_k, **operand_values(operands, scalars, spec),
    )  # fmt: skip


@attention_op.register_fake
def _attention_fake(
    q, k, v, operands, scalars, score_mod, epilogue, spec, page_table=None, seqused_k=None
) -> tuple[torch.Tensor, torch.Tensor]:
    # Output metadata never depends on the hooks: O is stored in q's dtype (the kernel's
    # O tile is q's type), contiguous like eager's torch.empty_like(q, contiguous_format).
    if q.dim() != 4:
        raise ShapeError(f"q has shape {tuple(q.shape)}; attention takes 4-D (batch, seqlen, heads, head_dim) tensors")
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


register_meta(attention_op, _attention_fake)


@assume_constant_result
def _uncompilable(epi_key: str, q_dtype: torch.dtype, has_out_dtypes: bool) -> str:
    """Why the op cannot stand for this epilogue ("" if it can): its outputs are O in q's dtype and LSE."""
    outputs, o_dtype = registered_outputs(epi_key), registered_casts(epi_key).get("D", ir_dtype(q_dtype, "q"))
    if outputs == ("D",) and not has_out_dtypes and o_dtype == ir_dtype(q_dtype, "q"):
        return ""
    return (
        "under torch.compile, epicute.attention's epilogue may only rewrite O, stored in q's dtype "
        f"(this one returns {list(outputs)}{' with out_dtypes' if has_out_dtypes else ''}, O as {o_dtype}); "
        "call it outside the compiled region (torch.compiler.disable) for aux outputs, reductions or fp8 O"
    )


def attention_op_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    return_lse: bool,
    score_mod: Callable | None,
    epilogue: Callable | None,
    out: torch.Tensor | None,
    out_dtypes: dict | None,
    backend: str,
    config: dict | None,
    operands: dict[str, Any],
    page_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`epicute.attention` while ``torch.compile`` traces it: one ``epicute::attention`` op.

    The op's outputs are O in q's dtype and LSE: an epilogue with more outputs (aux tiles,
    reductions) or one that stores O in another dtype runs eagerly only, and is refused here."""
    if backend != "kernel":
        raise ConfigError(f"backend={backend!r} cannot be compiled with torch.compile; use backend='kernel'")
    score_key = register_score_mod_traced(plain_fn(score_mod))[0] if score_mod is not None else ""
    epi_key = ""
    if epilogue is not None:
        epi_key = register_traced(plain_fn(epilogue))[0]
        refusal = _uncompilable(epi_key, q.dtype, bool(out_dtypes))
        if refusal:
            raise EpilogueError(refusal)
    tensor_names, tensors, scalar_names, scalars, pins = split_operands(operands)
    spec = spec_text(
        tuple(tensor_names), tuple(scalar_names), tuple(pins), tuple(sorted((config or {}).items())),
        (("causal", bool(causal)), ("softmax_scale", None if softmax_scale is None else float(softmax_scale))),
    )  # fmt: skip
    o, lse = torch.ops.epicute.attention(q, k, v, tensors, scalars, score_key, epi_key, spec, page_table, seqused_k)
    if out is not None:  # the op returns a fresh O, copied in (eager writes out directly)
        o = out.copy_(o)
    return (o, lse) if return_lse else o


__all__ = ["attention_op", "attention_op_call"]
