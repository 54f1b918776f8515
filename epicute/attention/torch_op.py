"""``torch.ops.epicute.attention``: the attention family's custom op (see :mod:`epicute.runtime.torch_ops`).

``torch.ops.epicute.attention(q, k, v, operands, scalars, score_mod, epilogue, spec) -> (O, LSE)``
runs :func:`epicute.attention`: ``score_mod`` and ``epilogue`` are registry keys (``""`` for
none; a score_mod is registered with its indices traced as index leaves,
:func:`~epicute.runtime.torch_ops.register_score_mod`), the hooks' operands travel by name in
``spec`` together with ``causal``, ``softmax_scale``, ``deterministic`` (the backward's) and
``config``. LSE is always computed (the kernel writes it anyway); :func:`epicute.attention` drops
it unless ``return_lse=True``. O is contiguous in q's dtype (bf16 for fp8 q), LSE fp32 ``(batch, heads_q,
seqlen_q)``, whatever the hooks are. fp8 calls' descales travel as operands named ``q_descale``,
``k_descale``, ``v_descale`` (tensors or numbers), ``v_layout`` in ``spec``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from epicute.attention.fp8 import NO_BACKWARD, stored_dtype
from epicute.attention.plan import AttentionConfig
from epicute.epilogue.dtypes import IR_TO_TORCH, TORCH_TO_IR, ir_dtype
from epicute.errors import ConfigError, EpilogueError, ShapeError
from epicute.runtime.backend import check_traced_backend, resolve_backend
from epicute.runtime.checks import config_pins as checked_pins
from epicute.runtime.torch_ops import (
    TorchOp,
    assume_constant_result,
    config_of,
    grad_slot,
    operand_values,
    parsed_spec,
    plain_fn,
    register_score_mod_traced,
    register_traced,
    registered_casts,
    registered_epilogue,
    registered_outputs,
    spec_text,
    split_operands,
)


def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    score_mod: str,
    epilogue: str,
    spec: str,
    page_table: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``epicute.attention(q, k, v, ..., return_lse=True)`` as an op: ``(O, LSE)`` (see the module docstring)."""
    from epicute.attention.api import attention

    spec = parsed_spec(spec)
    with torch.no_grad():  # autograd sees this op, whose backward is registered below, not its insides
        return attention(
            q, k, v, causal=spec["causal"], softmax_scale=spec["softmax_scale"], return_lse=True,
            score_mod=registered_epilogue(score_mod) if score_mod else None,
            epilogue=registered_epilogue(epilogue) if epilogue else None,
            config=config_of(spec), page_table=page_table, seqused_k=seqused_k,
            v_layout=spec.get("v_layout", "bshd"),
            **_packed(cu_seqlens_q, cu_seqlens_k, spec), **operand_values(operands, scalars, spec),
        )  # fmt: skip


def _packed(cu_seqlens_q, cu_seqlens_k, spec: dict) -> dict:
    """The varlen arguments of a call whose spec carries the longest lengths (none for a dense call)."""
    if cu_seqlens_q is None:
        return {}
    return {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": spec["max_seqlen_q"],
            "max_seqlen_k": spec["max_seqlen_k"]}  # fmt: skip


def _attention_fake(
    q, k, v, operands, scalars, score_mod, epilogue, spec, page_table, seqused_k, cu_seqlens_q, cu_seqlens_k
) -> tuple[torch.Tensor, torch.Tensor]:
    # Output metadata never depends on the hooks: O is stored in q's dtype (the kernel's O tile is q's type; bf16
    # for fp8 q), contiguous like eager's torch.empty_like(q, contiguous_format).
    o_dtype = IR_TO_TORCH[stored_dtype(TORCH_TO_IR.get(q.dtype, "bf16"))]
    if cu_seqlens_q is not None and q.dim() == 3:  # packed: LSE (heads_q, total_q)
        return q.new_empty(q.shape, dtype=o_dtype), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)
    if q.dim() != 4:
        raise ShapeError(f"q has shape {tuple(q.shape)}; attention takes 4-D (batch, seqlen, heads, head_dim) tensors")
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape, dtype=o_dtype), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def attention_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    operands: list[torch.Tensor],
    scalars: list[float],
    score_mod: str,
    spec: str,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    operand_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dQ, dK, dV, dOperands)`` of ``epicute::attention``'s ``(O, LSE)`` for their gradients ``do`` and
    ``dlse``. ``dOperands``: with ``operand_grads``, fp32 ``(len(operands), heads_q)``, row ``i`` the gradient
    of ``operands[i]`` (a per-head vector; zeros for one the score_mod does not read); else ``(0, heads_q)``."""
    from epicute.attention.api import remembered_plain_call
    from epicute.attention.backward import attention_backward
    from epicute.attention.prepare import prepare
    from epicute.attention.validate import check_attention_args

    spec = parsed_spec(spec)
    if resolve_backend(None) == "reference":  # a compiled graph run inside use_backend("reference")
        raise ConfigError("attention's backward under torch.compile runs on the kernels only; on the reference "
                          "backend, train without torch.compile (eager autograd differentiates it)")  # fmt: skip
    packed = _packed(cu_seqlens_q, cu_seqlens_k, spec)
    remembered = None
    if not (score_mod or operands or scalars or spec["config"]):  # a plain call: the forward's validation holds
        remembered = remembered_plain_call(q, k, v, cu_seqlens_q, cu_seqlens_k, spec["causal"], spec["softmax_scale"],
                                           packed.get("max_seqlen_q"), packed.get("max_seqlen_k"))  # fmt: skip
    if remembered is not None:
        call, prepared = remembered
    else:
        call = check_attention_args(q, k, v, causal=spec["causal"], softmax_scale=spec["softmax_scale"], **packed)
        prepared = prepare(
            call, registered_epilogue(score_mod) if score_mod else None, None, operand_values(operands, scalars, spec),
            None, config_of(spec),
        )  # fmt: skip
    score = prepared.score
    score_operands = score.kernel_operands(q.device) if score else ((), ())
    variant = prepared.backward_variant(spec.get("deterministic", False), operand_grads)
    dq, dk, dv, by_name = attention_backward(call, o, lse, _tma_ready(do), variant, score_operands, dlse)
    rows = len(operands) if operand_grads else 0
    d_operands = torch.zeros(rows, q.size(-2), dtype=torch.float32, device=q.device)
    for i, name in enumerate(spec["tensors"][:rows]):
        if name in by_name:
            d_operands[i] = by_name[name]
    return dq, dk, dv, d_operands


def _attention_backward_fake(q, k, v, o, lse, do, dlse, operands, scalars, score_mod, spec, cu_q, cu_k, operand_grads):
    rows = len(operands) if operand_grads else 0
    d_operands = q.new_empty((rows, q.size(-2)), dtype=torch.float32)
    # Contiguous, as the kernels write them whatever the layout of q, k and v (views of (batch, heads, ...) too).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_operands


#: The op (defined by ``import epicute`` from the family's declaration, :mod:`epicute.families`).
ATTENTION_BACKWARD_OP = TorchOp("epicute::attention_backward", attention_backward_op, _attention_backward_fake)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where TMA could not read it (the forward's operand rules): autograd
    hands over expanded or strided gradients (``o.sum().backward()`` gives stride 0, which those rules
    let through on dimensions a broadcast made, so it is refused here too)."""
    from epicute.attention.validate import TMA_ALIGN_BYTES, tma_layout_problem

    if 0 in t.stride():
        return t.contiguous()
    if t.is_contiguous() and t.data_ptr() % TMA_ALIGN_BYTES == 0:  # the common case, without the full check
        return t
    return t.contiguous() if tma_layout_problem(t, "dO") else t


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, operands, scalars, score_mod, _epilogue, spec, _page_table, _seqused_k, cu_q, cu_k = inputs
    o, lse = output
    # An output the loss does not use gets None, not zeros: an unused LSE costs the backward no fill
    # and no dLSE read in the preprocess.
    ctx.set_materialize_grads(False)
    ctx.packed = cu_q is not None
    ctx.save_for_backward(q, k, v, o, lse, *((cu_q, cu_k) if ctx.packed else ()), *operands)
    ctx.hooks = (scalars, score_mod, spec)
    ctx.list_slots = tuple(grad_slot(x) for x in (operands, scalars))
    ctx.operand_needs_grad = tuple(t.requires_grad for t in operands)


def _backward(ctx, grad_o, grad_lse):
    q, k, v, o, lse, *rest = ctx.saved_tensors
    cu_q, cu_k, operands = (*rest[:2], rest[2:]) if ctx.packed else (None, None, rest)
    scalars, score_mod, spec = ctx.hooks
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    needs = ctx.operand_needs_grad
    dq, dk, dv, d_operands = torch.ops.epicute.attention_backward(
        q, k, v, o, lse, grad_o, grad_lse, operands, scalars, score_mod, spec, cu_q, cu_k, any(needs)
    )  # fmt: skip
    # Gradients for the score_mod's per-head vectors that require one (in their dtype); none for the
    # scalars, the page table, seqused_k or the offsets. The tensor list gets a list, as autograd checks.
    operand_grads, scalar_grads = ctx.list_slots
    if any(needs):
        operand_grads = [row.to(t.dtype) if need else None for row, t, need in zip(d_operands, operands, needs)]
    return dq, dk, dv, operand_grads, scalar_grads, None, None, None, None, None, None, None


#: The op (defined by ``import epicute`` from the family's declaration, :mod:`epicute.families`), differentiable
#: through ``torch.ops.epicute.attention_backward``.
ATTENTION_OP = TorchOp("epicute::attention", attention_op, _attention_fake, _backward, _setup_context)


class EagerAttention(torch.autograd.Function):
    """A training call outside ``torch.compile``: the kernels the op's autograd runs (the same forward launch,
    :func:`~epicute.attention.backward.attention_backward`), without the op's dispatch, and the backward takes
    the forward's validated call and plan instead of rebuilding them from the spec. Those were 65 % of a
    training forward's host time and half of its backward's (bench/NOTES.md).

    ``apply(call, prepared, deterministic, names, q, k, v, *tensors)``: ``call`` and ``prepared`` as
    :func:`epicute.attention` made them, ``tensors`` the hooks' tensor operands named ``names``; returns
    ``(O, LSE)``."""

    @staticmethod
    def forward(ctx, call, prepared, deterministic: bool, names: tuple, q, k, v, *tensors):
        from epicute.attention.launch import launch_attention

        score = prepared.score
        results, lse = launch_attention(
            call, prepared.variant(), score.kernel_operands(q.device) if score else ((), ()), ((), ()),
            prepared.plan.max_ctas,
        )  # fmt: skip
        o = results["D"]
        ctx.set_materialize_grads(False)  # as the op's: an unused LSE costs no fill and no dLSE read
        ctx.save_for_backward(q, k, v, o, lse, *tensors)
        ctx.call, ctx.prepared, ctx.deterministic, ctx.names = call, prepared, deterministic, names
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_o, grad_lse):
        from epicute.attention.backward import attention_backward

        q, _, _, o, lse, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[7:]  # the operand tensors' (after call, prepared, deterministic, names, q, k, v)
        if grad_o is None:
            grad_o = torch.zeros_like(o)
        variant = ctx.prepared.backward_variant(ctx.deterministic, any(needs))
        score = ctx.prepared.score
        dq, dk, dv, by_name = attention_backward(
            ctx.call, o, lse, _tma_ready(grad_o), variant, score.kernel_operands(q.device) if score else ((), ()),
            grad_lse,
        )  # fmt: skip
        grads = [by_name[name].to(t.dtype) if need else None for name, t, need in zip(ctx.names, tensors, needs)]
        return None, None, None, None, dq, dk, dv, *grads


@assume_constant_result
def _check_names_traced(score_mod: Callable | None, epilogue: Callable | None) -> bool:
    """The eager call's check of the hooks' operand names (``epicute.attention.api._named_hooks``), run once while
    dynamo traces."""
    from epicute.attention.api import _named_hooks

    _named_hooks(score_mod, epilogue)
    return True


@assume_constant_result
def _uncompilable(epi_key: str, q_dtype: torch.dtype, has_out_dtypes: bool) -> str:
    """Why the op cannot stand for this epilogue ("" if it can): its outputs are O in q's dtype (bf16 for fp8 q)
    and LSE."""
    stored = stored_dtype(ir_dtype(q_dtype, "q"))
    outputs, o_dtype = registered_outputs(epi_key), registered_casts(epi_key).get("D", stored)
    if outputs == ("D",) and not has_out_dtypes and o_dtype == stored:
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
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
    descales: dict[str, Any] | None = None,
    v_layout: str = "bshd",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`epicute.attention` while ``torch.compile`` traces it: one ``epicute::attention`` op.

    The op's outputs are O in q's dtype and LSE: an epilogue with more outputs (aux tiles,
    reductions) or one that stores O in another dtype runs eagerly only, and is refused here."""
    check_traced_backend(backend)
    _check_names_traced(None if score_mod is None else plain_fn(score_mod), None if epilogue is None else
                        plain_fn(epilogue))  # fmt: skip
    score_key = register_score_mod_traced(plain_fn(score_mod))[0] if score_mod is not None else ""
    epi_key = ""
    if epilogue is not None:
        epi_key = register_traced(plain_fn(epilogue))[0]
        refusal = _uncompilable(epi_key, q.dtype, bool(out_dtypes))
        if refusal:
            raise EpilogueError(refusal)
    given = {name: x for name, x in (descales or {}).items() if x is not None}  # fp8's, as operands of their name
    if q.dtype == torch.float8_e4m3fn and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ConfigError(f"attention backward: {NO_BACKWARD}; call it under torch.no_grad() or detach them")
    tensor_names, tensors, scalar_names, scalars, pins = split_operands({**operands, **given})
    extra = (("causal", bool(causal)), ("softmax_scale", None if softmax_scale is None else float(softmax_scale)))
    if v_layout != "bshd":
        extra += (("v_layout", v_layout),)
    if deterministic:
        extra += (("deterministic", True),)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ConfigError("under torch.compile, cu_seqlens need max_seqlen_q and max_seqlen_k (ints): the "
                              "graph cannot read them from the offsets")  # fmt: skip
        extra += (("max_seqlen_q", int(max_seqlen_q)), ("max_seqlen_k", int(max_seqlen_k)))
    config_pins = checked_pins(config, AttentionConfig)
    spec = spec_text(tuple(tensor_names), tuple(scalar_names), tuple(pins), config_pins, extra)
    o, lse = torch.ops.epicute.attention(
        q, k, v, tensors, scalars, score_key, epi_key, spec, page_table, seqused_k, cu_seqlens_q, cu_seqlens_k
    )
    if out is not None:  # the op returns a fresh O, copied in (eager writes out directly)
        o = out.copy_(o)
    return (o, lse) if return_lse else o


__all__ = [
    "ATTENTION_BACKWARD_OP", "ATTENTION_OP", "EagerAttention", "attention_backward_op", "attention_op",
    "attention_op_call",
]  # fmt: skip
