"""epicute's kernels as ``torch.library`` custom ops, for ``torch.compile`` and CUDA graphs.

``torch.ops.epicute.gemm(a, b, operands, scalars, epilogue, spec) -> list[Tensor]``
runs :func:`epicute.gemm`. Under ``torch.compile`` (``fullgraph=True`` included)
:func:`epicute.gemm` itself turns into one call of this op, so user code needs no
change; the op's fake implementation gives every output's shape, dtype and
strides without running anything, and its real one is the eager path. Outputs
are ``[D, *aux outputs]`` in the epilogue's output order.

Epilogues reach the op as a registry key (a string in the graph, never a Python
object): :func:`register_epilogue` traces the function once, with every operand
as a tile unless its annotation pins another kind, and keys it by the semantic
hash of that graph (``"<name>:<hash prefix>"``), so the same epilogue gets the
same key in every process. Operand kinds and dtypes are resolved inside the op,
against the actual tensors, exactly as in eager mode. Everything else the call
needs (operand names, pins, dtypes, config) travels as ``spec``, a JSON string.

CUDA graphs: capture works once the kernel is cached (call once before capturing,
or run ``epicute compile`` ahead of time); pass epilogue scalars as Python
numbers, since reading a 1-element tensor synchronizes.

``torch.ops.epicute.attention(q, k, v, operands, scalars, score_mod, epilogue, spec)
-> (O, LSE)`` runs :func:`epicute.attention` the same way: ``score_mod`` and
``epilogue`` are registry keys (``""`` for none; a score_mod is registered with
its indices traced as index leaves, :func:`register_score_mod`), the hooks'
operands travel by name in ``spec`` together with ``causal``, ``softmax_scale``
and ``config``. LSE is always computed (the kernel writes it anyway);
:func:`epicute.attention` drops it unless ``return_lse=True``. O is contiguous in
q's dtype, LSE fp32 ``(batch, heads_q, seqlen_q)``, whatever the hooks are.

Every kernel registers here in this style: a ``custom_op`` whose real
implementation is the public eager function, a ``register_fake`` giving output
metadata, a ``meta`` kernel reusing it, and a traceable ``*_op_call`` the public
function delegates to while ``torch.compiler.is_compiling()``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import torch

from epicute.epilogue.dtypes import IR_TO_TORCH, ir_dtype
from epicute.epilogue.graph import REDUCTIONS
from epicute.epilogue.hashing import semantic_hash
from epicute.epilogue.operands import PINS, Pin
from epicute.epilogue.score_mod import score_mod as as_score_mod
from epicute.epilogue.tracer import Epilogue, as_epilogue
from epicute.errors import ConfigError, EpilogueError, ShapeError
from epicute.gemm.config import GemmProblem
from epicute.gemm.prepare import GemmRequest, lower_epilogue

_EPILOGUES: dict[str, Epilogue] = {}
_OUTPUTS: dict[str, tuple[str, ...]] = {}
_LOCK = threading.Lock()


def register_epilogue(fn: Callable) -> str:
    """Register an epilogue for the custom ops; returns its key (the same in every process).

    :func:`epicute.gemm` does this by itself under ``torch.compile``; call it
    directly only to run a graph exported with ``torch.export`` in a new process.
    """
    return _register(fn)[0]


def register_score_mod(fn: Callable) -> str:
    """:func:`register_epilogue` for an attention ``score_mod``.

    :func:`epicute.attention` does this by itself under ``torch.compile``.
    """
    return _register_score_mod(fn)[0]


def registered_epilogue(key: str) -> Epilogue:
    """The epilogue (or score_mod: a ``ScoreMod``) registered under ``key``."""
    try:
        return _EPILOGUES[key]
    except KeyError:
        raise EpilogueError(
            f"no epilogue is registered under {key!r} in this process; call "
            "epicute.runtime.torch_ops.register_epilogue(fn) (register_score_mod(fn) for a score_mod) "
            "before running a graph exported elsewhere"
        ) from None


def _register(fn: Callable, hook: Callable[[Callable], Epilogue] = as_epilogue) -> tuple[str, tuple[str, ...]]:
    epi = hook(fn)
    kinds = {p: epi.pins.get(p, "tile") for p in epi.params}
    try:
        graph = epi.trace(kinds, {}, None, d_dtype="fp32")
    except EpilogueError as exc:
        raise EpilogueError(
            f"epilogue {epi.name!r} cannot be keyed for torch.compile by tracing its operands as tiles ({exc}); "
            "annotate each operand's kind (epicute.RowVector, ColVector, Scalar, Tile) in its signature"
        ) from exc
    key = f"{epi.name}:{semantic_hash(graph)[:24]}"
    with _LOCK:
        # An earlier registration under this key traced to the same graph: keep it.
        _EPILOGUES.setdefault(key, epi)
        _OUTPUTS[key] = tuple(name for name, _ in graph.outputs)
    return key, _OUTPUTS[key]


def _register_score_mod(fn: Callable) -> tuple[str, tuple[str, ...]]:
    # Its own function (not a partial): assume_constant_result wraps plain functions.
    return _register(fn, as_score_mod)


def _assume_constant_result(fn: Callable) -> Callable:
    """What ``torch._dynamo.assume_constant_result`` does (it only marks ``fn``), without importing
    dynamo: that import costs seconds, and ``import epicute`` must stay cheap for the CLI."""
    fn._dynamo_marked_constant = True
    return fn


# Under dynamo these run once, at trace time, and their results become constants of the graph.
# Dynamo folds them only over constant arguments: hand them the plain function (a
# constant to dynamo), not an Epilogue/ScoreMod object (some torch versions refuse
# user objects there); the hook rebuilds the same object from it (_plain_fn).
_register_traced = _assume_constant_result(_register)
_register_score_mod_traced = _assume_constant_result(_register_score_mod)


def _plain_fn(hook: Callable) -> Callable:
    return hook.fn if isinstance(hook, Epilogue) else hook


def _split_operands(operands: dict[str, Any]) -> tuple[list, list, list, list, list]:
    """Keyword operands as (tensor names, tensors, scalar names, scalars, pins), sorted by name."""
    tensor_names, tensors, scalar_names, scalars, pins = [], [], [], [], []
    for name in sorted(operands):
        value = operands[name]
        if isinstance(value, Pin):
            pins.append((name, value.kind))
            value = value.value
        if isinstance(value, torch.Tensor):
            tensor_names.append(name)
            tensors.append(value)
        else:
            scalar_names.append(name)
            scalars.append(float(value))
    return tensor_names, tensors, scalar_names, scalars, pins


def _operand_values(operands: list[torch.Tensor], scalars: list[float], spec: dict) -> dict[str, Any]:
    """The keyword operands :func:`_split_operands` took apart (pins re-applied)."""
    values: dict[str, Any] = dict(zip(spec["tensors"], operands))
    values.update(zip(spec["scalars"], scalars))
    for name, kind in spec["pins"].items():
        values[name] = PINS[kind](values[name])
    return values


def _config(spec: dict) -> dict | None:
    """The call's config pins; JSON turned their tuples (epi_tile, mma_atoms_mn) into lists."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items()} or None


def _dtype_name(dtype: torch.dtype | str | None) -> str | None:
    return None if dtype is None else ir_dtype(dtype, "dtype")


@_assume_constant_result
def _spec_text(tensor_names: tuple, scalar_names: tuple, pins: tuple, config: tuple, fields: tuple) -> str:
    """An op's static arguments as JSON: operand names and pins, config pins, and the
    kernel's own ``fields`` (``(name, value)`` pairs; see :func:`_plain`)."""
    spec = {
        "tensors": list(tensor_names),
        "scalars": list(scalar_names),
        "pins": dict(pins),
        "config": dict(config),
        **{name: _plain(value) for name, value in fields},
    }
    return json.dumps(spec, sort_keys=True)


def _plain(value: Any) -> Any:
    """A JSON value: torch dtypes by IR name, ``((name, value), ...)`` tuples as dicts."""
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    if isinstance(value, tuple):
        return {name: _plain(v) for name, v in value}
    return value


def _gemm_kwargs(operands: list[torch.Tensor], scalars: list[float], epilogue: str, spec: dict) -> dict:
    """The keyword arguments of the :func:`epicute.gemm` call the op stands for."""
    return {
        "epilogue": registered_epilogue(epilogue) if epilogue else None,
        "out_dtype": IR_TO_TORCH[spec["out_dtype"]] if spec["out_dtype"] else None,
        "out_dtypes": {k: IR_TO_TORCH[v] for k, v in spec["out_dtypes"].items()} or None,
        "config": _config(spec),
        **_operand_values(operands, scalars, spec),
    }


@torch.library.custom_op("epicute::gemm", mutates_args=())
def gemm_op(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], scalars: list[float], epilogue: str, spec: str
) -> list[torch.Tensor]:
    """``epicute.gemm(a, b, ...)`` as an op: ``[D, *aux outputs]`` (see the module docstring)."""
    from epicute.gemm.api import gemm

    result = gemm(a, b, **_gemm_kwargs(operands, scalars, epilogue, json.loads(spec)))
    if isinstance(result, torch.Tensor):
        return [result]
    return [result[name] for name in _OUTPUTS[epilogue]]


@gemm_op.register_fake
def _gemm_fake(a, b, operands, scalars, epilogue, spec) -> list[torch.Tensor]:
    spec = json.loads(spec)
    l_dims = (a.shape[0],) if a.dim() == 3 else ()
    m, n = a.shape[-2], b.shape[-1]
    d_dtype = IR_TO_TORCH[spec["out_dtype"] or spec["out_dtypes"].get("D") or ir_dtype(a.dtype, "a")]
    if not epilogue:
        return [a.new_empty((*l_dims, m, n), dtype=d_dtype)]
    epi = registered_epilogue(epilogue)
    values: dict[str, Any] = dict(zip(spec["scalars"], scalars))
    for name, t in zip(spec["tensors"], operands):
        # A 1-element tensor read as a scalar: its value is irrelevant to shapes (and unreadable here).
        is_scalar = t.numel() == 1 and spec["pins"].get(name, "scalar") == "scalar"
        values[name] = 0.0 if is_scalar else t
    for name, kind in spec["pins"].items():
        values[name] = PINS[kind](values[name])
    l = a.shape[0] if a.dim() == 3 else 1
    specs = epi.operands(values, m, n, l)
    # D's dtype follows epicute.gemm's rule (prepare's first half); out_dtypes already holds outs' dtypes.
    # Sizes are symbolic here and never planned, so the request's problem carries only the dtypes.
    request = GemmRequest(
        GemmProblem(0, 0, 0, 1, ir_dtype(a.dtype, "a"), ir_dtype(d_dtype, "out_dtype")), epi,
        tuple((s.name, s.kind, s.dtype) for s in specs.values()),
        d_explicit=bool(spec["out_dtype"] or "D" in spec["out_dtypes"]),
        out_dtypes=tuple(sorted(spec["out_dtypes"].items())),
    )  # fmt: skip
    graph = lower_epilogue(request).graph
    stored = dict(graph.output_dtypes)
    shapes = {"col": (*l_dims, m), "row": (*l_dims, n), "scalar": ()}
    outputs = []
    for name, node_id in graph.outputs:
        op = graph.node(node_id).op
        if op in REDUCTIONS:
            outputs.append(a.new_empty(shapes[REDUCTIONS[op][0]], dtype=torch.float32))
        else:
            outputs.append(a.new_empty((*l_dims, m, n), dtype=IR_TO_TORCH[stored[name]]))
    return outputs


# The meta device runs the fake implementation, so shapes can be checked with no GPU.
# Some torch versions already route Meta to the fake implementation (and refuse a second kernel).
if not torch._C._dispatch_has_kernel_for_dispatch_key(gemm_op._qualname, "Meta"):
    gemm_op.register_kernel("meta")(_gemm_fake)


def gemm_op_call(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue: Callable | None,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    out_dtypes: dict | None,
    outs: dict[str, torch.Tensor] | None,
    backend: str,
    config: dict | None,
    operands: dict[str, Any],
) -> torch.Tensor | dict[str, torch.Tensor]:
    """:func:`epicute.gemm` while ``torch.compile`` traces it: one ``epicute::gemm`` op (dynamo-traceable)."""
    if backend != "kernel":
        raise ConfigError(f"backend={backend!r} cannot be compiled with torch.compile; use backend='kernel'")
    if epilogue is None and (operands or out_dtypes or outs):
        given = sorted(operands) or list(out_dtypes or outs)
        raise EpilogueError(f"operands/outputs {given} were given without an epilogue")
    # Preallocated outputs: the op returns fresh ones in their dtypes, copied in below.
    if out is not None and out_dtype is None:
        out_dtype = out.dtype
    out_dtypes = {**{name: t.dtype for name, t in (outs or {}).items()}, **(out_dtypes or {})}
    key, outputs = _register_traced(_plain_fn(epilogue)) if epilogue is not None else ("", ("D",))
    tensor_names, tensors, scalar_names, scalars, pins = _split_operands(operands)
    spec = _spec_text(
        tuple(tensor_names), tuple(scalar_names), tuple(pins), tuple(sorted((config or {}).items())),
        (("out_dtype", out_dtype), ("out_dtypes", tuple(sorted(out_dtypes.items())))),
    )  # fmt: skip
    results = torch.ops.epicute.gemm(a, b, tensors, scalars, key, spec)
    results = dict(zip(outputs, results))
    for name, target in {**(outs or {}), **({"D": out} if out is not None else {})}.items():
        target.copy_(results[name])
        results[name] = target
    return results["D"] if len(outputs) == 1 else results


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``epicute.attention(q, k, v, ..., return_lse=True)`` as an op: ``(O, LSE)`` (see the module docstring)."""
    from epicute.attention.api import attention

    spec = json.loads(spec)
    return attention(
        q, k, v, causal=spec["causal"], softmax_scale=spec["softmax_scale"], return_lse=True,
        score_mod=registered_epilogue(score_mod) if score_mod else None,
        epilogue=registered_epilogue(epilogue) if epilogue else None,
        config=_config(spec), **_operand_values(operands, scalars, spec),
    )  # fmt: skip


@attention_op.register_fake
def _attention_fake(q, k, v, operands, scalars, score_mod, epilogue, spec) -> tuple[torch.Tensor, torch.Tensor]:
    # Output metadata never depends on the hooks: O is stored in q's dtype (the kernel's
    # O tile is q's type), contiguous like eager's torch.empty_like(q, contiguous_format).
    if q.dim() != 4:
        raise ShapeError(f"q has shape {tuple(q.shape)}; attention takes 4-D (batch, seqlen, heads, head_dim) tensors")
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


if not torch._C._dispatch_has_kernel_for_dispatch_key(attention_op._qualname, "Meta"):
    attention_op.register_kernel("meta")(_attention_fake)


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
    backend: str,
    config: dict | None,
    operands: dict[str, Any],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`epicute.attention` while ``torch.compile`` traces it: one ``epicute::attention`` op."""
    if backend != "kernel":
        raise ConfigError(f"backend={backend!r} cannot be compiled with torch.compile; use backend='kernel'")
    score_key = _register_score_mod_traced(_plain_fn(score_mod))[0] if score_mod is not None else ""
    epi_key = _register_traced(_plain_fn(epilogue))[0] if epilogue is not None else ""
    tensor_names, tensors, scalar_names, scalars, pins = _split_operands(operands)
    spec = _spec_text(
        tuple(tensor_names), tuple(scalar_names), tuple(pins), tuple(sorted((config or {}).items())),
        (("causal", bool(causal)), ("softmax_scale", None if softmax_scale is None else float(softmax_scale))),
    )  # fmt: skip
    o, lse = torch.ops.epicute.attention(q, k, v, tensors, scalars, score_key, epi_key, spec)
    if out is not None:  # the op returns a fresh O, copied in (eager writes out directly)
        o = out.copy_(o)
    return (o, lse) if return_lse else o


__all__ = [
    "attention_op",
    "attention_op_call",
    "gemm_op",
    "gemm_op_call",
    "register_epilogue",
    "register_score_mod",
    "registered_epilogue",
]  # fmt: skip
