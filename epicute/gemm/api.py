"""epicute's public functions: :func:`gemm`, :func:`prepare_gemm`, :func:`explain` and :func:`tune`."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple, TextIO

import torch

from epicute.epilogue.dtypes import IR_TO_TORCH, TORCH_TO_IR
from epicute.epilogue.gated import check_gated_call, gated_epilogue
from epicute.epilogue.hashing import semantic_hash
from epicute.epilogue.operands import OperandSpec
from epicute.epilogue.reference import reference_gemm, round_to
from epicute.epilogue.scales import dequantize_blockwise, fp8_scaling
from epicute.epilogue.tracer import TraceMemo, as_epilogue, trace_key
from epicute.errors import (
    DeviceError,
    DtypeError,
    EpilogueError,
    OutputError,
    SignatureError,
)
from epicute.gemm import GemmPlan, render_plan
from epicute.gemm.autograd import OpCall
from epicute.gemm.config import GemmConfig
from epicute.gemm.epilogue_args import aux_outputs, check_outs, check_outs_names, kernel_inputs
from epicute.gemm.launch import GemmLaunch, bind_gemm
from epicute.gemm.prepare import GemmRequest, PreparedGemm, ir_items, prepare
from epicute.gemm.prepared import (
    FIXED_SOURCES,
    PreparedGemmCall,
    call_signature,
    source_signature,
    unwrap,
)
from epicute.gemm.torch_op import (
    GEMM_OP,
    dense_call,
    gemm_op_call,
    needs_backward,
    op_arguments,
    op_repeat,
    op_results,
)
from epicute.gemm.training import PreparedTraining
from epicute.gemm.tune import TuneResult, candidates, label, pick_fastest, store_winner, stored_entry, tune_key
from epicute.gemm.validate import D_TORCH_DTYPES, GemmCall, check_gemm_args, settle_d
from epicute.runtime.backend import resolve_backend
from epicute.runtime.checks import (
    PLAIN_TENSORS,
    TMA_ALIGN_BYTES,
    check_flags,
    check_has_values,
    check_one_device,
    check_operand_names,
    check_outputs_apart,
    check_text_file,
    config_pins,
    keyword_parameters,
    overlaps,
)
from epicute.runtime.compile import reference_device
from epicute.runtime.target import Target, current_target, resolve_target
from epicute.runtime.torch_ops import operand_values, traced


def _overrides(config: dict | None) -> tuple:
    """``config=``'s pins, checked (:func:`~epicute.runtime.checks.config_pins`)."""
    return config_pins(config, GemmConfig)


def _check_outs_apart(outs: Mapping, a, b, out, scales: tuple, operands: Mapping[str, Any]) -> None:
    """``outs``' tensors share memory with nothing the kernel reads or writes (nor have elements sharing it)."""
    inputs = (("a", a), ("b", b), ("out", out), ("a_scale", scales[0]), ("b_scale", scales[1]),
              *((f"operand {name!r}", unwrap(value)) for name, value in operands.items()))  # fmt: skip
    check_outputs_apart(_named_outs(outs), inputs)


def _named_outs(outs: Any) -> tuple:
    """``outs``' tensors as ``(argument, tensor)`` pairs (none for a malformed ``outs``: refused later)."""
    return tuple((f"outs[{name!r}]", t) for name, t in outs.items()) if isinstance(outs, Mapping) else ()


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    /,
    *,
    epilogue: Callable | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    outs: dict[str, torch.Tensor] | None = None,
    a_scale: float | torch.Tensor | None = None,
    b_scale: float | torch.Tensor | None = None,
    backend: str | None = None,
    config: dict | None = None,
    tune: bool = False,
    gated: bool = False,
    **operands: Any,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """``a @ b`` on a Hopper GPU, optionally with a fused epilogue.

    Args:
        a: ``(M, K)`` or batched ``(L, M, K)``, bf16 or fp16, row- or column-major; or fp8
            (``torch.float8_e4m3fn``/``float8_e5m2``) row-major, with ``a_scale`` and ``b_scale``.
        b: ``(K, N)`` or ``(L, K, N)``, same dtype as ``a``, row- or column-major
            (``w.t()`` of a row-major ``(N, K)`` weight works without a copy). fp8: column-major,
            i.e. ``w.t()`` of a row-major ``(N, K)`` weight (WGMMA reads 8-bit operands K-major),
            e4m3 or e5m2 whatever ``a`` is; K a multiple of 16.
        epilogue: a function ``f(acc, *operands) -> {"D": ...}`` (see
            :func:`epicute.epilogue`); its operands are passed by name as keyword
            arguments (scalars, row/column vectors or full tiles).
        out: optional preallocated row-major output ``(M, N)`` / ``(L, M, N)``.
        out_dtype: D's dtype: bf16, fp16, fp32, or fp8 ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``
            (saturating at the format's largest finite value; N a multiple of 16); defaults to
            ``out.dtype``, else the dtype an epilogue's own final ``ops.cast``/``ops.quantize`` of D
            gives, else ``a.dtype``.
        out_dtypes: dtypes of the epilogue's outputs by name (``"D"`` included); an output
            without one is stored in the dtype of its own final ``cast``/``quantize``, else in D's.
            fp8 outputs saturate at the format's largest finite value.
        outs: preallocated aux tile outputs by name (D goes in ``out``).
        a_scale, b_scale: fp8 inputs' dequantization scales, as ``torch._scaled_mm`` takes them:
            tensorwise, a float or a 0-d/1-element fp32 tensor (read on the GPU: no host sync);
            rowwise, ``a_scale`` one per row of A (``(M,)``/``(M, 1)``) and ``b_scale`` one per column
            of B (``(N,)``/``(1, N)``), fp32. The epilogue sees ``acc * a_scale * b_scale``;
            blockwise, ``a_scale`` one per row and 128-wide block of K, ``(M, KB)`` (fastest M-major,
            torch's ``torch.rand(KB, M).t()``), and ``b_scale`` one per 128x128 block of the weight,
            its ``(NB, KB)`` (fastest K-major) or that tensor's ``.t()`` view ``(KB, NB)``, applied in
            the mainloop. Where NB == KB the shape cannot tell the two apart: a column-major square
            ``b_scale`` is read as the ``(KB, NB)`` view, any other as ``(NB, KB)``. fp8
            inputs give bf16 D unless ``out_dtype`` says otherwise.
        backend: ``"kernel"`` (the GPU) or ``"reference"`` (float32 on the CPU,
            any device: the oracle every GPU test compares against).
        config: optional :class:`epicute.gemm.config.GemmConfig` fields to pin
            (e.g. ``{"tile_n": 128}``); the planner chooses the rest. The reference
            backend checks the pins as the kernel would, then has no use for them.
        tune: use the fastest config measured for this problem by :func:`tune`
            (stored on disk); the first call for a new problem runs the tuning.
        gated: a SwiGLU/GeGLU projection in one kernel: ``b``'s ``2N`` columns hold the gate and up
            projections interleaved in blocks of 8 (:func:`epicute.interleave_gate_up` builds the weight
            once), and the epilogue is ``f(gate, up, *operands)``, called with each output column's
            gate and up values; D and the operands have ``N`` columns. fp8 inputs take blockwise scales
            here (a tensorwise scale can be an operand of the epilogue instead).

    A repeat call of a signature seen before takes the cached path (:mod:`epicute.gemm.prepared`); a loop
    that calls one signature many times can hold the object itself (:func:`prepare_gemm`).

    Differentiable: under autograd, a call whose ``a``, ``b`` or epilogue operands require grad records a
    backward derived from the epilogue (:mod:`epicute.gemm.autograd`: gradients to ``a``, ``b`` and every
    floating-point operand; reductions, ``quantize_groups`` and fp8 outputs carry none). fp8 inputs and scales,
    and ``out``/``outs``, take no gradient (:class:`~epicute.errors.GradientError`). ``a`` and ``b`` are
    positional-only, so epilogue operands may take those names; an operand named like one of the keyword
    parameters (``out``, ``config``, ...) is refused with :class:`~epicute.errors.EpilogueError`.

    Returns:
        D, accumulated in fp32 and rounded once to its dtype; a dict of all
        outputs when the epilogue returns more than ``"D"``: aux tiles like D,
        ``row_*`` reductions ``(M,)``/``(L, M)``, ``col_*`` ``(N,)``/``(L, N)``
        and ``amax`` a 0-d tensor, all fp32, bitwise reproducible run to run.
        Reductions propagate NaN (``*_max`` and ``amax`` included); over an empty
        extent a sum is 0, a max -inf and an amax 0. ``K = 0`` gives the epilogue
        of a zero accumulator.

    Example:
        >>> import torch, epicute                                  # doctest: +SKIP
        >>> a = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
        >>> w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
        >>> y = epicute.gemm(a, w.t())                              # (1000, 14336)
        >>> z = epicute.gemm(a, w.t(), epilogue=lambda acc, bias: epicute.ops.relu(acc + bias),
        ...                  bias=torch.randn(14336, device="cuda", dtype=torch.bfloat16))
    """
    if traced(a):
        # torch.compile sees one custom op (epicute::gemm), never this Python code.
        return gemm_op_call(
            a, b, epilogue=epilogue, out=out, out_dtype=out_dtype, out_dtypes=out_dtypes, outs=outs,
            a_scale=a_scale, b_scale=b_scale, backend=backend, config=config, operands=operands, gated=gated,
        )  # fmt: skip
    backend = resolve_backend(backend)
    # A call autograd records goes through the op, which carries the backward (needs_backward). The cached paths
    # test only their own tensors' requires_grad (a plain call's host time is counted in tenths of a
    # microsecond), and leave every other call to the whole check below.
    fast = None
    if backend == "kernel" and not tune:
        # No epilogue, out, operands or options: a plain call, or fp8 with scale tensors and nothing else.
        bare = (
            epilogue is None and out is None and not operands and outs is None and out_dtypes is None
            and config is None and not gated and type(a) in PLAIN_TENSORS and type(b) in PLAIN_TENSORS
        )  # fmt: skip
        if bare and a_scale is None and b_scale is None:
            # A plain call (the same test as _fast_call's), keyed by no more than its prepared call checks: the
            # cached path's whole cost is this key, D's allocation and the launch (bench/NOTES.md, issue 23).
            key = (a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype, b.get_device(),
                   out_dtype)  # fmt: skip
            repeat = _PREPARED_CALLS.get(key)
            if (repeat is not None and not (a.data_ptr() | b.data_ptr()) % TMA_ALIGN_BYTES
                    and not ((a.requires_grad or b.requires_grad) and torch.is_grad_enabled())):  # fmt: skip
                return repeat.plain(a, b)
            fast = _FastCall(key, (a, b, None, None, None), None, (), ())
        elif bare and type(a_scale) in PLAIN_TENSORS and type(b_scale) in PLAIN_TENSORS:
            # fp8 with scale tensors and nothing else, keyed like a plain call plus the scales' layouts. Aligned
            # pointers only (the signature's alignment class of each is then 0), and whether one tensor is both.
            key = (a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype, b.get_device(),
                   out_dtype, a_scale.shape, a_scale.stride(), a_scale.dtype, a_scale.get_device(), b_scale.shape,
                   b_scale.stride(), b_scale.dtype, b_scale.get_device(), a_scale is b_scale)  # fmt: skip
            aligned = not (a.data_ptr() | b.data_ptr() | a_scale.data_ptr() | b_scale.data_ptr()) % TMA_ALIGN_BYTES
            repeat = _PREPARED_CALLS.get(key)
            if repeat is not None and aligned and not (
                    (a.requires_grad or b.requires_grad or a_scale.requires_grad or b_scale.requires_grad)
                    and torch.is_grad_enabled()):  # fmt: skip
                return repeat.scaled(a, b, a_scale, b_scale)
            fast = _FastCall(key, (a, b, None, a_scale, b_scale), None, (), ()) if aligned else None
        else:
            fast = _fast_key(a, b, out, (a_scale, b_scale), epilogue, operands, outs, out_dtype, out_dtypes, config,
                             gated)  # fmt: skip
            if needs_backward(a, b, a_scale, b_scale, out, outs, operands):
                return _differentiable(a, b, epilogue, out_dtype, out_dtypes, a_scale, b_scale, config, gated,
                                       operands, fast)  # fmt: skip
            repeat = _PREPARED_CALLS.get(fast.key) if fast is not None else None
            apart = out is None or not (overlaps(out, a) or overlaps(out, b))
            if repeat is not None and repeat.fits(fast.sources) and apart:
                if outs:  # checked on the first call; the pointers may differ now
                    _check_outs_apart(outs, a, b, out, (a_scale, b_scale), operands)
                return repeat.replay(fast.sources)
    scales = (a_scale, b_scale)
    check_flags(tune=tune)
    if backend == "kernel" and needs_backward(a, b, a_scale, b_scale, out, outs, operands):
        if tune:  # the forward runs the tuned config too (tuning itself times inference calls)
            config = {**_tuned_overrides(a, b, epilogue, out_dtype, out_dtypes, operands, scales, gated),
                      **dict(_overrides(config))}  # fmt: skip
        return _differentiable(a, b, epilogue, out_dtype, out_dtypes, a_scale, b_scale, config, gated, operands, fast)
    if backend == "reference":
        check_has_values(("a", a), ("b", b), ("out", out), ("a_scale", a_scale), ("b_scale", b_scale),
                         *_named_outs(outs), operands=operands)  # fmt: skip
        needs_backward(a, b, a_scale, b_scale, out, outs, operands)  # the kernels' refusals, the same here
    if tune and backend == "kernel":
        tuned = _tuned_overrides(a, b, epilogue, out_dtype, out_dtypes, operands, scales, gated)
        config = {**tuned, **dict(_overrides(config))}  # the caller's pins win
    on_gpu = backend == "kernel"
    call, specs, request, operands = describe_call(
        a, b, epilogue, out, out_dtype, out_dtypes, outs, config, operands, on_gpu, scales, gated
    )
    prepared = _prepare_memo(request)
    if backend == "kernel":
        return _run_and_record(_bind(call, specs, prepared, outs, a, b, out), fast)
    if prepared.epilogue is None:
        return _deliver(call, {"D": _reference_matmul(call)})
    call = settle_d(call, prepared.d_torch_dtype, prepared.fusion.paired)
    outs = dict(outs or {})
    p = call.problem
    check_outs(prepared.fusion, outs, (p.l, p.m, call.d_n), call.batched)  # as the kernel takes them
    stored = {name: IR_TO_TORCH[dtype] for name, dtype in prepared.output_dtypes.items()}
    a_ref, b_ref = _reference_inputs(call)
    results = reference_gemm(a_ref, b_ref, request.epilogue, operands, stored, gated=call.gated,
                             device=reference_device(call.a))  # fmt: skip
    return _deliver(call, results, outs)


def _differentiable(a, b, epilogue, out_dtype, out_dtypes, a_scale, b_scale, config, gated, operands, fast=None):
    """A call autograd records: through the op, whose backward (:mod:`epicute.gemm.autograd`) is derived from the
    epilogue; eager and ``torch.compile`` then train through the same code. An eager call of a signature met before
    (``fast``: its key) repeats through the :class:`~epicute.gemm.training.PreparedTraining` its first call left."""
    if fast is not None:
        repeat = _TRAINING_CALLS.get(fast.key)
        if repeat is not None:
            return repeat(a, b, operands)
    args = op_arguments(
        a, b, epilogue=epilogue, out=None, out_dtype=out_dtype, out_dtypes=out_dtypes, outs=None, a_scale=a_scale,
        b_scale=b_scale, backend="kernel", config=config, operands=operands, gated=gated,
    )  # fmt: skip
    results = dict(zip(args.outputs, GEMM_OP(a, b, args.tensors, args.scalars, args.epilogue, args.spec)))
    if fast is not None and a_scale is None and b_scale is None:
        _remember_training(fast.key, a, b, args)
    return op_results(args.outputs, results)


#: Eager training calls by :func:`gemm`'s key of their signature (fp8 calls aside: their scales travel among the op's
#: operands, out of the order a prepared forward takes them).
_TRAINING_CALLS: dict[tuple, PreparedTraining] = {}


def _remember_training(key: tuple, a, b, args) -> None:
    """File the training call just made under ``key``, with the forward launch its op implementation recorded."""
    call = dense_call(a, b, args.tensors, args.scalars, args.epilogue, args.spec)
    # The op implementation recorded it in gemm's cached path, or replayed the forward it had kept before.
    forward = prepared_forward(a, b, call, operand_values(args.tensors, args.scalars, call.spec)) or op_repeat(
        a, b, args.tensors, args.scalars, args.epilogue, args.spec)  # fmt: skip
    if forward is not None:
        if len(_TRAINING_CALLS) >= 1024:
            _TRAINING_CALLS.clear()
        _TRAINING_CALLS[key] = PreparedTraining(a, b, args, call, forward)


def prepared_forward(a: torch.Tensor, b: torch.Tensor, call: OpCall, values: dict) -> PreparedGemmCall | None:
    """The prepared call that the op implementation's :func:`gemm` call of ``a``, ``b`` and the operand ``values``
    (``call``: its :class:`~epicute.gemm.autograd.OpCall`) left, or None where it left none."""
    opts = call.options
    return recorded_call(a, b, values, epilogue=opts["epilogue"], out_dtype=opts["out_dtype"],
                         out_dtypes=opts["out_dtypes"], config=opts["config"], gated=opts["gated"])  # fmt: skip


def recorded_call(
    a: torch.Tensor, b: torch.Tensor, operands: dict, *, epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None, out_dtypes: dict | None = None, config: dict | None = None,
    gated: bool = False,
) -> PreparedGemmCall | None:  # fmt: skip
    """The prepared call :func:`gemm`'s cached path keeps for a call of these arguments (no ``out``, ``outs`` or
    scales), or None where it keeps none."""
    fast = _fast_call(a, b, None, (None, None), epilogue, operands, None, out_dtype, out_dtypes, config, gated)
    return _PREPARED_CALLS.get(fast.key) if fast is not None else None


def prepare_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    /,
    *,
    epilogue: Callable | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    outs: dict[str, torch.Tensor] | None = None,
    a_scale: float | torch.Tensor | None = None,
    b_scale: float | torch.Tensor | None = None,
    config: dict | None = None,
    gated: bool = False,
    **operands: Any,
) -> PreparedGemmCall:
    """:func:`gemm` prepared once for arguments like these, to call many times with new ones at little host cost.

    Takes :func:`gemm`'s arguments (example tensors on the GPU: their values are not read) and goes
    the same way, validation, tracing and planning included (:func:`epicute.gemm.prepare.prepare`),
    up to the launch, which it records without running. The returned
    :class:`~epicute.gemm.prepared.PreparedGemmCall` is then called like ``gemm`` without the options
    fixed here (``epilogue``, ``out_dtype``, ``out_dtypes``, ``config``, ``gated``): with tensors of the
    same shapes, strides, dtypes and device (``out``, ``outs`` and the scales where they were given
    here), and numbers where numbers were, whose values may change. It checks only that, raising
    :class:`~epicute.errors.SignatureError` naming the argument on a mismatch, before any launch;
    then it launches the recorded kernel: no tracing, planning or validation. A plain GEMM's call
    hands the kernel the caller's tensors as they are, with one allocation for D. ``gemm``
    itself repeats calls through the same objects, one per signature, and finds this one too.

    A prepared call captures in a CUDA graph like any launch (D of a captured call comes from the
    graph's memory pool; a scalar operand's value is captured with the launch). It is no torch custom
    op: inside ``torch.compile``, call :func:`gemm`, which is one.

    Example:
        >>> import torch, epicute                                  # doctest: +SKIP
        >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        >>> x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
        >>> proj = epicute.prepare_gemm(x, w.t())                 # plans and loads the kernel once
        >>> y = proj(torch.randn_like(x), w.t())                   # (16, 4096): checks and launches
        >>> bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        >>> act = epicute.prepare_gemm(x, w.t(), epilogue=lambda acc, bias: epicute.ops.silu(acc + bias), bias=bias)
        >>> z = act(x, w.t(), bias=bias)
        >>> proj(x[:8], w.t())                                     # another shape: prepare another
        Traceback (most recent call last):
        epicute.errors.SignatureError: a has shape (8, 4096); this call was prepared for (16, 4096): ...
    """
    call, specs, request, _ = describe_call(
        a, b, epilogue, out, out_dtype, out_dtypes, outs, config, operands, True, (a_scale, b_scale), gated
    )
    values = (a, b, out, a_scale, b_scale, *operands.values(), *(outs or {}).values())
    names, outs_names = tuple(operands), tuple(outs or ())
    parts = call_signature(values)
    if parts is None:
        labels = (*FIXED_SOURCES, *names, *(f"outs[{n!r}]" for n in outs_names))
        i = next(i for i, v in enumerate(values) if source_signature(v) is False)
        raise SignatureError(f"{labels[i]} is a {type(values[i]).__name__}; a prepared call takes tensors, Python "
                             "numbers and operand pins (epicute.RowVector(t), ...)")  # fmt: skip
    launch = _bind(call, specs, _prepare_memo(request), outs, a, b, out)
    prepared = _record(launch, values, parts, names, outs_names)
    if prepared is None:  # a launch that copies a tensor (see epicute.gemm.prepared): the whole path, every call
        whole = functools.partial(gemm, epilogue=epilogue, out_dtype=out_dtype, out_dtypes=out_dtypes, config=config,
                                  gated=gated)  # fmt: skip
        return PreparedGemmCall(parts, names, outs_names, whole=whole)
    fast = _fast_call(a, b, out, (a_scale, b_scale), epilogue, operands, outs, out_dtype, out_dtypes, config, gated)
    if fast is not None:
        _remember(fast.key, prepared)
    return prepared


class _FastCall(NamedTuple):
    """A call as the cached path sees it: its key in :data:`_PREPARED_CALLS`, its sources (pins unwrapped; see
    :data:`~epicute.gemm.prepared.FIXED_SOURCES`) and their values as given, their signatures (None: not yet
    computed), the epilogue's operand names and the ``outs`` names."""

    key: tuple
    sources: tuple
    parts: tuple | None
    names: tuple
    outs_names: tuple
    values: tuple = ()


#: Prepared calls by call signature: the cached path of :func:`gemm` (see epicute.gemm.prepared). A plain call's
#: key is :func:`gemm`'s short one, an fp8 call's with only scales that one plus the scales', any other's
#: :func:`_fast_key`'s (three lengths: they never meet).
_PREPARED_CALLS: dict[tuple, PreparedGemmCall] = {}


def _fast_call(a, b, out, scales, epilogue, operands, outs, out_dtype, out_dtypes, config, gated) -> _FastCall | None:
    """What :func:`gemm`'s cached path keys a call by (its plain test and key, else :func:`_fast_key`)."""
    plain = (
        epilogue is None and out is None and not operands and scales == (None, None) and outs is None
        and out_dtypes is None and config is None and not gated and type(a) in PLAIN_TENSORS
        and type(b) in PLAIN_TENSORS
    )  # fmt: skip
    if plain:
        key = (a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype, b.get_device(), out_dtype)
        return _FastCall(key, (a, b, None, None, None), None, (), ())
    return _fast_key(a, b, out, scales, epilogue, operands, outs, out_dtype, out_dtypes, config, gated)


def _fast_key(a, b, out, scales, epilogue, operands, outs, out_dtype, out_dtypes, config, gated) -> _FastCall | None:
    """A call's :class:`_FastCall`, or None when it has no signature (something unhashable)."""
    capture = None
    if config is not None and not isinstance(config, dict):
        return None  # a malformed config: the whole path refuses it
    if epilogue is not None:
        capture = trace_key(epilogue)
        if capture is None:
            return None
    values = (a, b, out, *scales, *operands.values(), *(outs.values() if outs else ()))
    parts = call_signature(values)
    if parts is None:
        return None
    names, outs_names = tuple(operands), tuple(outs) if outs else ()
    key = (
        capture, gated, out_dtype, names, outs_names or None,
        tuple(out_dtypes.items()) if out_dtypes else None, tuple(config.items()) if config else None, *parts,
    )  # fmt: skip
    if config:
        try:
            hash(key)
        except TypeError:  # an unhashable config value (the rest is hashable by construction)
            return None
    sources = (a, b, out, *scales, *map(unwrap, operands.values()), *(outs.values() if outs else ()))
    return _FastCall(key, sources, parts, names, outs_names, values)


def _record(launch: GemmLaunch, values: tuple, parts: tuple | None, names: tuple, outs_names: tuple):
    """``launch``'s :class:`PreparedGemmCall` for arguments like ``values`` (signatures ``parts``), or None."""
    parts = parts if parts is not None else call_signature(values)
    index = {"a_scale": 3, "b_scale": 4, **{name: 5 + i for i, name in enumerate(names)}}
    scalar_names = () if launch.fusion is None else launch.fusion.scalar_inputs
    if parts is None or not all(name in index for name in scalar_names):  # a scalar from the epilogue's defaults
        return None
    scalar_sources = tuple(index[name] for name in scalar_names)
    return PreparedGemmCall.record(launch, values, parts, scalar_sources, names, outs_names)


def _remember(key: tuple, prepared: PreparedGemmCall) -> None:
    if len(_PREPARED_CALLS) >= 1024:
        _PREPARED_CALLS.clear()
    _PREPARED_CALLS[key] = prepared


def _run_and_record(launch: GemmLaunch, fast: _FastCall | None):
    """Run ``launch``; remember how to repeat it for the call's signature, if it has one."""
    if fast is not None:
        recorded = _record(launch, fast.values or fast.sources, fast.parts, fast.names, fast.outs_names)
        if recorded is not None:
            _remember(fast.key, recorded)
    return launch.run()


def _bind(call: GemmCall, specs, prepared: PreparedGemm, outs, a, b, out) -> GemmLaunch:
    """The launch of a validated kernel call (``describe_call``'s ``call`` and ``specs``) as ``prepared`` says."""
    if prepared.epilogue is None:
        return bind_gemm(call, prepared.plan)
    call = settle_d(call, prepared.d_torch_dtype, prepared.fusion.paired)
    p, device = call.problem, call.a.device
    tensors, scalars = kernel_inputs(prepared.fusion, specs, device)
    aux = aux_outputs(prepared.fusion, dict(outs or {}), (p.l, p.m, call.d_n), call.batched, device)
    fresh_aux = frozenset(id(t) for name, t in aux.items() if name not in (outs or {}))
    return bind_gemm(call, prepared.plan, prepared.fusion, tensors, scalars, aux, fresh_aux)


def describe_call(
    a, b, epilogue, out, out_dtype, out_dtypes, outs, config, operands, require_cuda: bool, scales=(None, None),
    gated: bool = False,
) -> tuple[GemmCall, dict[str, OperandSpec], GemmRequest, dict[str, Any]]:  # fmt: skip
    """Validate a call's tensors and describe it: the call, its resolved operands, its :class:`GemmRequest`
    and the operands by name (an fp8 call's ``scales`` among them, in front of its epilogue's)."""
    for name, value in (("out_dtypes", out_dtypes), ("outs", outs)):
        if value is not None and not isinstance(value, Mapping):
            raise OutputError(
                f"{name} is a {type(value).__name__}; pass a dict by output name, e.g. "
                f"{name}={{'pre': {'torch.float32' if name == 'out_dtypes' else 'torch.empty_like(d)'}}}"
            )
    for name, t in (outs or {}).items():
        if not isinstance(t, torch.Tensor):
            raise OutputError(f"outs[{name!r}] is a {type(t).__name__}; pass a preallocated tensor (or leave it out)")
    if outs:  # each its own memory, apart from the inputs and D (out's own is checked with a and b)
        _check_outs_apart(outs, a, b, out, scales, operands)
    if epilogue is None and (operands or out_dtypes or outs):
        given = sorted(operands) or list(out_dtypes or outs)
        raise EpilogueError(f"operands/outputs {given} were given without an epilogue")
    check_flags(gated=gated)
    check_gated_call(gated, epilogue)
    user_epilogue, hook = epilogue, None
    if epilogue is not None:
        # Before any argument is checked: an operand named like gemm's own parameter never reached the epilogue.
        hook = gated_epilogue(epilogue) if gated else as_epilogue(epilogue)
        check_operand_names("epilogue", hook.name, hook.params, GEMM_KEYWORDS, "epicute.gemm")
    if out_dtypes and "D" in out_dtypes:
        d_dtype = out_dtypes["D"]
        if d_dtype not in D_TORCH_DTYPES:
            raise DtypeError(f"out_dtypes['D']={d_dtype!r}; D's dtype is one of {', '.join(map(str, D_TORCH_DTYPES))}")
        if out_dtype is not None and out_dtype != d_dtype:
            raise OutputError(f"out_dtype={out_dtype} but out_dtypes['D']={d_dtype}; D has one dtype: drop one")
        out_dtype = out_dtype or d_dtype
    call = check_gemm_args(a, b, out, out_dtype, require_cuda=require_cuda, gated=gated, d_settled=epilogue is None)
    p = call.problem
    if gated:
        epilogue = gated_epilogue(epilogue)
    if p.fp8:
        # Tensorwise and rowwise scales are epilogue operands (the epilogue sees acc * a_scale * b_scale);
        # blockwise ones are the mainloop's.
        scaling = fp8_scaling(*scales, p.m, p.n, p.k, p.l, call.batched, call.a.device)
        if gated and scaling.block is None:
            raise DtypeError(
                "gated=True with fp8 inputs takes blockwise scales (applied in the mainloop to gate and up alike); "
                "for a tensorwise scale pass it as an operand of the epilogue: "
                "lambda gate, up, s: ops.silu(gate * s) * (up * s)"
            )
        epilogue, operands = scaling.apply(epilogue, operands)
        if scaling.block is not None:
            p = replace(p, block_scaled=True, a_scales_tma=scaling.block.a_tma, b_scales_bulk=scaling.block.b_bulk)
            call = replace(call, problem=p, block_scales=scaling.block)
    elif scales != (None, None):
        raise DtypeError(f"a_scale/b_scale dequantize fp8 inputs; a is {a.dtype}: drop them or pass fp8 tensors")
    if epilogue is None:
        return call, {}, GemmRequest(p, overrides=_overrides(config)), operands
    epi = hook if epilogue is user_epilogue else as_epilogue(epilogue)
    specs = epi.operands(operands, p.m, call.d_n, p.l)
    request = GemmRequest(
        p, epi, tuple((s.name, s.kind, s.dtype) for s in specs.values()),
        d_explicit=out is not None or out_dtype is not None,
        out_dtypes=ir_items(out_dtypes, "out_dtypes"),
        outs_dtypes=ir_items({name: t.dtype for name, t in (outs or {}).items()}, "outs"),
        overrides=_overrides(config),
    )  # fmt: skip
    return call, specs, request, operands


#: Prepared epilogue calls, by what tracing depends on (see trace_key) and the rest of the request.
_PREPARED = TraceMemo()


def _prepare_memo(request: GemmRequest) -> PreparedGemm:
    """:func:`prepare`, remembered per epilogue capture: a repeat call neither traces nor plans."""
    if request.epilogue is None:
        return prepare(request)  # a plan-cache hit
    # The request's epilogue is what is traced: the user's, or its scaled or gated form.
    return _PREPARED.get(request.epilogue, request.signature(), lambda: prepare(request))


def tune(
    a: torch.Tensor,
    b: torch.Tensor,
    /,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    a_scale: float | torch.Tensor | None = None,
    b_scale: float | torch.Tensor | None = None,
    iters: int = 20,
    warmup: int = 5,
    progress: bool = True,
    gated: bool = False,
    **operands: Any,
) -> TuneResult:
    """Time every config the planner accepts for ``a @ b`` (with ``epilogue``) on the GPU; store the fastest.

    Later ``gemm(..., tune=True)`` calls for the same problem (and epilogue, GPU
    and epicute version), in any process, use the stored winner.

    Example:
        >>> result = epicute.tune(x, w.t(), iters=10)                 # doctest: +SKIP
        >>> result.best, result.speedup_over_planner                  # doctest: +SKIP
        ({'cluster_m': 2, 'cluster_n': 1, 'persistent': True, 'tile_n': 256}, 1.0)
    """
    from epicute.benchmark import time_cuda

    if not torch.cuda.is_available():
        raise DeviceError("tune() times candidate kernels on a CUDA GPU; none is visible")
    key, prepared = _tune_identity(a, b, epilogue, out_dtype, out_dtypes, operands, (a_scale, b_scale), gated)
    options = candidates(prepared.plan.problem, prepared.plan.target, prepared.plan.epilogue)

    def measure(overrides: dict) -> float:
        run = functools.partial(gemm, a, b, epilogue=epilogue, out_dtype=out_dtype, out_dtypes=out_dtypes,
                                a_scale=a_scale, b_scale=b_scale, config=overrides, gated=gated,
                                **operands)  # fmt: skip
        return time_cuda(run, warmup=warmup, iters=iters)

    # Timing needs no gradient: inputs that require grad (a model's weights) are run as inference.
    from rich.progress import Progress  # tune() alone draws a bar: rich stays out of `import epicute`

    with Progress(transient=True, disable=not progress) as bar, torch.no_grad():
        task = bar.add_task("tuning", total=len(options))

        def advance(name: str) -> None:
            bar.update(task, advance=1, description=f"tuning {name}")

        result = pick_fastest(options, measure, advance)
    store_winner(key, result)
    _TUNED[key] = result.best
    return result


#: Stored winners already read in this process, by tune key.
_TUNED: dict[str, dict] = {}


def _tune_identity(
    a, b, epilogue, out_dtype, out_dtypes, operands, scales=(None, None), gated=False
) -> tuple[str, PreparedGemm]:
    """The tune key of one call and its preparation (the problem with D's dtype settled, the epilogue's buffers)."""
    _, _, request, _ = describe_call(a, b, epilogue, None, out_dtype, out_dtypes, None, None, operands, False, scales,
                                     gated)  # fmt: skip
    prepared = _prepare_memo(request)  # gemm(..., tune=True) asks on every call: trace once
    epi_hash = None if prepared.epilogue is None else semantic_hash(prepared.epilogue.graph)
    return tune_key(prepared.plan.problem, epi_hash, current_target().device), prepared


def _tuned_overrides(a, b, epilogue, out_dtype, out_dtypes, operands, scales=(None, None), gated=False) -> dict:
    key, _ = _tune_identity(a, b, epilogue, out_dtype, out_dtypes, operands, scales, gated)
    if key not in _TUNED:
        stored = stored_entry(key)
        _TUNED[key] = stored["best"] if stored is not None else tune(
            a, b, epilogue=epilogue, out_dtype=out_dtype, out_dtypes=out_dtypes, a_scale=scales[0],
            b_scale=scales[1], gated=gated, **operands,
        ).best  # fmt: skip
    return _TUNED[key]


def _reference_inputs(call) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B as the reference multiplies them: as given, or dequantized by their blockwise scales (fp32, CPU)."""
    if call.block_scales is None:
        return call.a, call.b
    return dequantize_blockwise(call.a, call.b, call.block_scales)


def _reference_matmul(call) -> torch.Tensor:
    """The plain GEMM in float32 on the CPU (:func:`~epicute.runtime.compile.reference_device`), stored like the
    kernel stores D (fp8 saturates)."""
    a, b = _reference_inputs(call)
    device = reference_device(call.a)
    return round_to(torch.matmul(a.to(device, torch.float32), b.to(device, torch.float32)),
                    TORCH_TO_IR[call.out_dtype])  # fmt: skip


def _deliver(call, results: dict[str, torch.Tensor], outs: dict | None = None):
    """Reference results in the caller's rank, copied into ``out``/``outs`` when given."""
    if not call.batched:
        results = {k: v[0] if v.dim() else v for k, v in results.items()}
    targets = dict(outs or {})
    for name, target in targets.items():
        if name in results and tuple(target.shape) != tuple(results[name].shape):
            raise OutputError(f"outs[{name!r}] has shape {tuple(target.shape)}; the epilogue writes "
                              f"{tuple(results[name].shape)}")  # fmt: skip
    if call.out is not None:
        targets["D"] = call.out if call.batched else call.out[0]
    for name, target in targets.items():
        target.copy_(results[name].reshape(target.shape))
        results[name] = target
    return results["D"] if set(results) == {"D"} else results


def explain(
    a: torch.Tensor,
    b: torch.Tensor,
    /,
    *,
    epilogue: Callable | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    outs: dict[str, torch.Tensor] | None = None,
    a_scale: float | torch.Tensor | None = None,
    b_scale: float | torch.Tensor | None = None,
    config: dict | None = None,
    gated: bool = False,
    target: Target | str | None = None,
    file: TextIO | str | None = "stdout",
    **operands: Any,
) -> GemmPlan:
    """Print (to ``file``, default stdout; ``None`` to stay quiet) and return the plan for ``a @ b``.

    Takes :func:`gemm`'s arguments and goes the same way (:func:`epicute.gemm.prepare.prepare`),
    so the plan is the one ``gemm`` launches: with ``epilogue`` (and its operands) it
    budgets the epilogue's shared memory, D's dtype is the one stored, and the text
    ends with the stage chain the kernel runs.
    Works without a GPU: tensors may live on any device, ``"meta"`` included
    (``a`` and ``b`` on the same one), and the plan then targets an H100 SXM, or ``target``: a name of
    :data:`epicute.runtime.target.TARGETS` (``"h100-pcie"``, ``"h20"``...) or a
    :class:`~epicute.runtime.target.Target` (default: the visible GPU).

    Example:
        >>> import torch, epicute
        >>> a = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
        >>> plan = epicute.explain(a, a, file=None)
        >>> plan.config.tile_m, plan.config.tile_n
        (128, 192)
        >>> bias = torch.empty(8192, dtype=torch.bfloat16, device="meta")
        >>> plan = epicute.explain(a, a, epilogue=lambda acc, bias, residual: epicute.ops.gelu(acc + bias) + residual,
        ...                        bias=epicute.RowVector(bias), residual=a, file=None)
        >>> [item.name for item in plan.smem][-2:]
        ['operand tile 0', 'row vector 0']
    """
    check_text_file(file)
    check_one_device(("a", a), ("b", b))
    scales = (a_scale, b_scale)
    call, _, request, _ = describe_call(a, b, epilogue, out, out_dtype, out_dtypes, outs, config, operands, False,
                                        scales, gated)  # fmt: skip
    resolved = resolve_target(target)
    prepared = prepare(replace(request, target=resolved))
    plan = prepared.plan
    if prepared.epilogue is not None:  # D's rows and the preallocated outputs, as gemm would take them
        settle_d(call, prepared.d_torch_dtype, prepared.fusion.paired)
        check_outs(prepared.fusion, dict(outs or {}), (call.problem.l, call.problem.m, call.d_n), call.batched)
    elif outs:
        check_outs_names(outs, ())
    if file is not None:
        text = render_plan(plan) + "\n\n" + _backward_line(request, call.problem)
        # Tuned winners are stored per GPU: only the current one's apply to its own plan.
        tuned = None
        if resolved == current_target():
            tuned = stored_entry(_tune_identity(a, b, epilogue, out_dtype, out_dtypes, operands, scales, gated)[0])
        if tuned is not None:
            times, best, planner = tuned["times_ms"], label(tuned["best"]), label(tuned["planner"])
            text += (
                f"\n\ntuned (epicute.tune, stored): {best} at {times[best]:.3f} ms vs the "
                f"planner's {planner} at {times[planner]:.3f} ms; "
                "gemm(..., tune=True) uses it"
            )
        # Resolved per call so redirect_stdout, capsys and notebooks see the text.
        print(text, file=sys.stdout if file == "stdout" else file)
    return plan


def _backward_line(request, problem) -> str:
    """What a training call's backward would do (:func:`epicute.gemm.autograd.explain_backward`)."""
    from epicute.gemm.autograd import explain_backward
    from epicute.gemm.prepare import lower_epilogue

    graph = lower_epilogue(request).graph if request.epilogue is not None else None
    return explain_backward(graph, problem.m, problem.n, problem.k)


#: Keyword parameters of the GEMM's entry points: an epilogue operand of one of these names would bind to the
#: parameter (refused by describe_call); ``a`` and ``b`` are positional-only, so operands may take those names.
GEMM_KEYWORDS = keyword_parameters(gemm, prepare_gemm, explain, tune)
