"""Differentiable layer functions with ``torch.nn.functional``'s conventions, on epicute's GEMMs.

- :func:`linear`: ``F.linear`` (any leading dimensions, weight ``(out, in)``, optional bias) with an optional fused
  epilogue after the bias. Its backward is :func:`epicute.gemm`'s, derived from the epilogue.
- :func:`moe_experts`: a mixture-of-experts layer's experts (routed rows gathered once, gate/up/activation/routing
  weight in one gated grouped GEMM, the down projection, a deterministic sum of each token's rows).
- :func:`mlp`: ``w2 act(w1 x + b1) + b2``, and :func:`gated_mlp`: ``w_down (act(gate) * up)`` over a gate/up
  weight interleaved once (:func:`epicute.interleave_gate_up`). Their backward fuses across the two GEMMs: the
  down projection's data-gradient GEMM (``dh = dy w_down``) applies the activation's derivative in its epilogue,
  from the pre-activation the forward stored beside ``h``, and reduces ``b1``'s gradient there too (cuBLASLt's
  ``DGELU_BGRAD``, for any activation: the derivative comes from the activation's traced graph,
  :func:`epicute.epilogue.backward.read_from_accumulator`). Five GEMMs and no elementwise pass per step;
  :func:`explain_mlp` prints them.

Activations are named (``"gelu"`` (erf), ``"gelu_tanh"``, ``"relu"``, ``"silu"``) or any function of one traced value
written with :mod:`epicute.ops` (eager only: under ``torch.compile`` name one).

Example:
    >>> import torch                                                           # doctest: +SKIP
    >>> from epicute.nn import functional as EF
    >>> x = torch.randn(8, 512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> w, b = torch.randn(11008, 4096, device="cuda", dtype=torch.bfloat16), None
    >>> y = EF.linear(x, w, b, epilogue=lambda acc: epicute.ops.silu(acc))   # (8, 512, 11008)
"""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from epicute.epilogue import ops
from epicute.epilogue.backward import DACC, DACC_UP, SAVED, gradient_graph, read_from_accumulator, replay_epilogue
from epicute.epilogue.gated import gated_epilogue, interleave_gate_up
from epicute.epilogue.operands import ColVector, RowVector
from epicute.epilogue.tracer import as_epilogue, with_leading_operands
from epicute.errors import ConfigError, DtypeError, EpilogueError, ShapeError
from epicute.gemm.api import gemm
from epicute.grouped.api import grouped_gemm
from epicute.nn.parallel import is_distributed, parallel_experts, parallel_linear, parallel_mlp
from epicute.runtime.torch_ops import assume_constant_result

#: Named activations: one traced value in, one out.
ACTIVATIONS: dict[str, Callable] = {
    "gelu": ops.gelu,
    "gelu_tanh": functools.partial(ops.gelu, approximate="tanh"),
    "relu": ops.relu,
    "silu": ops.silu,
}


def _activation(activation: str | Callable) -> Callable:
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise EpilogueError(f"activation={activation!r}: use one of {sorted(ACTIVATIONS)} or a function of one value")
    return ACTIVATIONS[activation]


def _rows(x: torch.Tensor, name: str, features: int) -> torch.Tensor:
    """``x`` as ``(tokens, features)``: its leading dimensions flattened (a view where they can be)."""
    if x.dim() < 1 or x.shape[-1] != features:
        raise ShapeError(f"{name} has shape {tuple(x.shape)}; its last dimension must be {features} (the weight's in)")
    return x if x.dim() == 2 else x.reshape(-1, features)  # no view of a 2-D x: one node less in autograd's graph


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    **operands: Any,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """``epilogue(x @ weight.T + bias, **operands)``, as ``F.linear`` takes ``x``, ``weight`` and ``bias``.

    ``x`` ``(..., in)``; ``weight`` ``(out, in)``; ``bias`` ``(out,)``. The epilogue's operands are shaped against the
    flattened ``(tokens, out)`` problem (a residual ``(..., out)`` may be passed as ``residual.reshape(-1, out)``).
    Tile outputs come back ``(..., out)``; per-row reductions ``(...)``; per-column ones ``(out,)``. ``out_dtype``:
    the output's dtype, as :func:`epicute.gemm` takes it (default: the inputs').
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ShapeError(f"weight is {got}; linear takes a 2-D (out, in) weight tensor")
    if is_distributed(weight):  # sharded by a tensor-parallel plan: each rank runs its shard (epicute.nn.parallel)
        if out_dtype is not None:
            raise ConfigError("out_dtype with a tensor-parallel (DTensor) weight: not supported; cast the result")
        return parallel_linear(linear, x, weight, bias, epilogue, operands)
    lead, out_features = x.shape[:-1], weight.shape[0]
    x2 = _rows(x, "x", weight.shape[1])
    if bias is not None:
        # Under torch.compile the composite is built while tracing and read back from _BIASED_TRACED (a function
        # returned by a folded call cannot be guarded; one read from a module-level table can).
        fn = _BIASED_TRACED[_biased_traced(epilogue)] if torch.compiler.is_compiling() else _with_bias(epilogue)
    else:
        fn = epilogue
    extra = {"bias": RowVector(bias)} if bias is not None else {}
    result = gemm(x2, weight.t(), epilogue=fn, out_dtype=out_dtype, **extra, **operands)
    if isinstance(result, torch.Tensor):
        # A 2-D x's result as it is, not a view of it (FSDP2 warns of a module returning a view).
        return result if x.dim() == 2 else result.reshape(*lead, out_features)
    return {name: _unflatten(t, lead, x2.shape[0], out_features) for name, t in result.items()}


def _unflatten(t: torch.Tensor, lead: tuple, rows: int, cols: int) -> torch.Tensor:
    if t.dim() == 2 and t.shape == (rows, cols):
        return t.reshape(*lead, cols)
    if t.dim() == 1 and t.shape[0] == rows and rows != cols:
        return t.reshape(*lead)
    return t


def _with_bias(epilogue: Callable | None) -> Callable:
    """``f(acc, bias, *operands) = epilogue(acc + bias, *operands)`` (or ``acc + bias``)."""
    if epilogue is None:
        return _add_bias
    return with_leading_operands(epilogue, ("bias",), ("row",), operator.add, "linear's bias=")


_BIASED_TRACED: dict[str, Callable] = {}


@assume_constant_result
def _biased_traced(epilogue: Callable | None) -> str:
    """:func:`_with_bias` of ``epilogue``, filed in ``_BIASED_TRACED`` under the name returned (a constant of the
    traced graph)."""
    composite = _with_bias(epilogue)
    key = f"{getattr(composite, '__name__', 'biased')}:{id(composite)}"
    _BIASED_TRACED[key] = composite
    return key


def _add_bias(acc, bias: RowVector):
    return acc + bias


# --- MLPs with a backward fused across their two GEMMs ------------------------------------------------------------


def _programs(activation: str | Callable, gated: bool, has_bias: bool) -> tuple[Callable, Callable]:
    """:func:`_mlp_programs` of an activation, by name or function. The named ones' are built when this module is
    imported, so a call under ``torch.compile`` only looks them up (dynamo does not trace the tracer)."""
    key = (activation, gated, has_bias)
    programs = _PROGRAMS.get(key)
    if programs is None:
        programs = _PROGRAMS[key] = _mlp_programs(_activation(activation), gated, has_bias)
    return programs


def _mlp_programs(activation: Callable, gated: bool, has_bias: bool) -> tuple[Callable, Callable]:
    """(forward epilogue of the up projection, backward epilogue of the down projection's data gradient).

    Forward: ``h = act(acc + b1)`` (gated: ``act(gate) * up``), storing what the derivative reads (the
    pre-activation; gated: gate and up) as the aux outputs named in :data:`SAVED`. Backward: the derivative's graph
    with ``dh`` read from the accumulator of ``dy @ w_down`` (:func:`read_from_accumulator`), the bias gradient a
    ``col_sum`` of the same kernel; gated, ``D`` and ``D_up`` are d gate and d up."""
    if gated:
        graph = gated_epilogue(lambda gate, up: activation(gate) * up).trace({})
    else:
        graph = as_epilogue(lambda acc: activation(acc)).trace({})
    backward = read_from_accumulator(gradient_graph(graph, {"D": "bf16"}, saved_acc=True), "D",
                                     "d_bias" if has_bias else None)  # fmt: skip
    if gated:

        def forward(gate, up):
            return {"D": activation(gate) * up, SAVED["acc"]: gate, SAVED["acc_up"]: up}

    elif has_bias:

        def forward(acc, bias: RowVector):
            pre = acc + bias
            return {"D": activation(pre), SAVED["acc"]: pre}

    else:

        def forward(acc):
            return {"D": activation(acc), SAVED["acc"]: acc}

    return forward, replay_epilogue(backward, "mlp_backward")


class _MLP(torch.autograd.Function):
    """``y = act(x w1^T + b1) w2^T + b2`` (``gated``: ``w_down (act(gate) * up)``, ``w1`` the interleaved gate/up
    weight, no biases), with the down projection's data gradient carrying the activation's derivative."""

    @staticmethod
    def forward(ctx, activation, gated: bool, x, w1, b1, w2, b2):
        forward_epi, backward_epi = _programs(activation, gated, b1 is not None)
        bias = {"bias": RowVector(b1)} if b1 is not None else {}
        up = gemm(x, w1.t(), gated=gated, epilogue=forward_epi, **bias)
        h = up["D"]
        y = gemm(h, w2.t(), epilogue=_add_bias, bias=RowVector(b2)) if b2 is not None else gemm(h, w2.t())
        saved = [up[SAVED["acc"]], *((up[SAVED["acc_up"]],) if gated else ())]
        ctx.save_for_backward(x, w1, w2, h, *saved)
        ctx.program = (backward_epi, gated, b1 is not None, b2 is not None)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w1, w2, h, *saved = ctx.saved_tensors
        backward_epi, gated, has_b1, has_b2 = ctx.program
        dy = dy if dy.is_contiguous() else dy.contiguous()
        needs = ctx.needs_input_grad
        tiles = {SAVED["acc"]: saved[0], **({SAVED["acc_up"]: saved[1]} if gated else {})}
        # dh = dy @ w2, and in its epilogue the activation's derivative (and b1's gradient): dacc in one kernel.
        grads = gemm(dy, w2, epilogue=backward_epi, out_dtypes={DACC: x.dtype, **({DACC_UP: x.dtype} if gated else {})},
                     **tiles)  # fmt: skip
        grads = grads if isinstance(grads, dict) else {DACC: grads}
        dacc = grads[DACC]  # gated: d gate and d up interleaved as w1's rows are (a paired D, Graph.paired)
        dx = gemm(dacc, w1) if needs[2] else None
        dw1 = gemm(dacc.t(), x) if needs[3] else None
        db1 = grads["d_bias"].to(w1.dtype) if has_b1 and needs[4] else None
        dw2 = gemm(dy.t(), h) if needs[5] else None
        db2 = dy.sum(0, dtype=torch.float32).to(dy.dtype) if has_b2 and needs[6] else None
        return None, None, dx, dw1, db1, dw2, db2


def mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    activation: str | Callable = "gelu",
) -> torch.Tensor:
    """``F.linear(act(F.linear(x, w1, b1)), w2, b2)``: ``x`` ``(..., d)``, ``w1`` ``(hidden, d)``, ``w2``
    ``(d_out, hidden)``. The backward fuses the activation's derivative and ``b1``'s gradient into the GEMM of
    ``dy @ w2`` (see the module docstring)."""
    _check_weights(w1, w2, x.shape[-1])
    x2 = _rows(x, "x", w1.shape[1])
    y = _MLP.apply(activation, False, x2, w1, b1, w2, b2)
    return y.reshape(*x.shape[:-1], w2.shape[0])


def gated_mlp(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str | Callable = "silu"
) -> torch.Tensor:
    """``F.linear(act(x w_gate^T) * (x w_up^T), w_down)`` (SwiGLU with ``"silu"``, GeGLU with ``"gelu"``), with
    ``w_gate_up = epicute.interleave_gate_up(w_gate, w_up)`` ``(2 * hidden, d)`` built once. One GEMM computes gate,
    up and ``h``; the backward's ``dy @ w_down`` GEMM gives d gate and d up from the stored gate and up."""
    _check_weights(w_gate_up, w_down, x.shape[-1], gated=True)
    if is_distributed(w_gate_up):  # split by GatedMLPParallel: each rank its features (epicute.nn.parallel)
        return parallel_mlp(functools.partial(gated_mlp, activation=activation), x, w_gate_up, w_down, activation)
    x2 = _rows(x, "x", w_gate_up.shape[1])
    y = _MLP.apply(activation, True, x2, w_gate_up, None, w_down, None)
    return y.reshape(*x.shape[:-1], w_down.shape[0])


def explain_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "gelu",
    *,
    gated: bool = False,
    file: Any = "stdout",
) -> dict[str, Any]:
    """The GEMMs :func:`mlp` (``gated=True``: :func:`gated_mlp`, ``w1`` the interleaved gate/up weight, no biases)
    runs for a training step, each planned as :func:`epicute.explain` plans it: ``up`` (``x w1^T``, the activation
    in its epilogue, storing what the derivative reads), ``down``, then the backward's ``dh`` (``dy w2``: the
    activation's derivative in its epilogue, and ``b1``'s gradient as its column sum), ``dx``, ``dw1`` and ``dw2``
    (``b2``'s gradient is a torch column sum of ``dy``). Printed in that order under a heading each (``file`` as for
    :func:`epicute.explain`); returns the plans by name. Tensors may be on any device, ``"meta"`` included: nothing
    is read or launched.

    Example:
        >>> import torch
        >>> from epicute.nn.functional import explain_mlp
        >>> meta = dict(device="meta", dtype=torch.bfloat16)
        >>> x, w1, b1 = torch.empty(8192, 4096, **meta), torch.empty(16384, 4096, **meta), torch.empty(16384, **meta)
        >>> w2, b2 = torch.empty(4096, 16384, **meta), torch.empty(4096, **meta)
        >>> plans = explain_mlp(x, w1, w2, b1, b2, file=None)
        >>> list(plans)
        ['up', 'down', 'dh', 'dx', 'dw1', 'dw2']
    """
    from epicute.gemm import render_plan
    from epicute.gemm.api import explain
    from epicute.runtime.checks import check_text_file

    check_text_file(file)
    if gated and (b1 is not None or b2 is not None):
        raise ShapeError("gated=True: the gated MLP has no biases; pass b1=None and b2=None")
    _check_weights(w1, w2, x.shape[-1], gated=gated)
    forward_epi, backward_epi = _programs(activation, gated, b1 is not None)
    x2 = _rows(x, "x", w1.shape[1])
    hidden, tokens = w2.shape[1], x2.shape[0]
    h = x2.new_empty((tokens, hidden))
    dy = x2.new_empty((tokens, w2.shape[0]))
    dacc = x2.new_empty((tokens, w1.shape[0]))  # gated: d gate and d up interleaved, as w1's rows are
    saved = {SAVED["acc"]: h, **({SAVED["acc_up"]: h} if gated else {})}
    grads = {DACC: x2.dtype, **({DACC_UP: x2.dtype} if gated else {})}
    up_bias = {"bias": RowVector(b1)} if b1 is not None else {}
    calls = {
        "up": ((x2, w1.t()), dict(gated=gated, epilogue=forward_epi, **up_bias)),
        "down": ((h, w2.t()), dict(epilogue=_add_bias, bias=RowVector(b2)) if b2 is not None else {}),
        "dh": ((dy, w2), dict(epilogue=backward_epi, out_dtypes=grads, **saved)),
        "dx": ((dacc, w1), {}),
        "dw1": ((dacc.t(), x2), {}),
        "dw2": ((dy.t(), h), {}),
    }  # fmt: skip
    out = sys.stdout if file == "stdout" else file
    plans = {name: explain(*args, file=None, **kwargs) for name, (args, kwargs) in calls.items()}
    if out is not None:  # each plan's own text (the GEMMs run inside the MLP's backward: none has its own)
        for name, plan in plans.items():
            print(f"=== {name}: {_MLP_STEPS[name]} ===\n{render_plan(plan)}\n", file=out)
    return plans


#: What each GEMM of :func:`explain_mlp` is for.
_MLP_STEPS = {
    "up": "forward, x w1^T with the activation (its inputs stored for the backward)",
    "down": "forward, h w2^T",
    "dh": "backward, dy w2 with the activation's derivative (and b1's gradient) in its epilogue",
    "dx": "backward, dh w1",
    "dw1": "backward, dh^T x",
    "dw2": "backward, dy^T h",
}


_PROGRAMS: dict[tuple, tuple[Callable, Callable]] = {}
for _name in ACTIVATIONS:
    for _gated, _bias in ((False, True), (False, False), (True, False)):
        _programs(_name, _gated, _bias)


def moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str = "silu",
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """A mixture-of-experts layer's experts: ``out[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with
    ``e = top_k_index[t, j]`` and ``w = top_k_weights``, differentiable in ``x``, the weights and ``top_k_weights``.

    ``x`` ``(T, H)``; ``gate_up_proj`` ``(E, 2I, H)`` holding ``[gate; up]`` (transformers' layout); ``down_proj``
    ``(E, H, I)``; ``top_k_index`` ``(T, k)``, ``top_k_weights`` ``(T, k)``. The ``(token, slot)`` pairs are sorted
    by expert and their rows gathered (one copy: the grouped GEMM then loads them by TMA, multicast across a cluster,
    which measured faster than reading them in place through ``a_index``, bench/NOTES.md); gate, up, the activation
    and the routing weight are one gated grouped GEMM (the down projection is linear: weighting its input weights its
    output), the down projection a second; each token then sums its ``k`` rows in slot order. The gather and the sum
    are each other's gradient (:class:`_Dispatch`, :class:`_Combine`): deterministic, no atomics, no sort in the
    backward. The gated GEMM reads gate and up interleaved: built here from ``gate_up_proj`` (a differentiable copy,
    so the weights train in their own layout), or, with ``interleaved=True``, ``gate_up_proj`` is already
    ``epicute.interleave_gate_up(gate, up)`` ``(E, 2I, H)``, built once by a layer that owns and trains it (no copy
    per call, none of its gradient).
    """
    check_routing(x, top_k_index, top_k_weights, gate_up_proj.shape[0], activation)
    if is_distributed(gate_up_proj):  # every expert split by features (epicute.nn.parallel.GatedMLPParallel)
        if not interleaved:
            raise ConfigError("gate_up_proj is a DTensor with interleaved=False: its [gate; up] halves split by rows "
                              "would give each rank gate or up rows only; shard the interleaved weight "
                              "(epicute.nn.MoEExperts holds it)")  # fmt: skip
        run = functools.partial(moe_experts, activation=activation, interleaved=True)
        return parallel_experts(run, x, gate_up_proj, down_proj, top_k_index, top_k_weights)
    route = Routing.of(top_k_index, top_k_weights, gate_up_proj.shape[0])
    gate_up = gate_up_proj if interleaved else interleave_gate_up(*gate_up_proj.chunk(2, dim=-2))
    rows = _Dispatch.apply(x, *route.pairs)
    h = grouped_gemm(rows, gate_up.transpose(-2, -1), route.offsets, gated=True, epilogue=_WEIGHTED_GATED[activation],
                     weight=route.weight)  # fmt: skip
    down = grouped_gemm(h, down_proj.transpose(-2, -1), route.offsets)
    return _Combine.apply(down, *route.pairs)


def check_routing(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int,
                  activation: str) -> None:  # fmt: skip
    """The experts' tokens and routing: ``x`` ``(T, H)``, ``top_k_index`` (integer expert ids) and ``top_k_weights``
    (floating) ``(T, k)``, and a named ``activation``. Ids in ``[0, experts)`` are checked where they are on the CPU
    (eagerly); on the GPU that would read them back (a sync no CUDA graph can capture), and an id out of range
    there stops at torch's device-side index assert, as ``torch.topk``'s ids never are."""
    if x.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2 or \
            top_k_index.shape[0] != x.shape[0]:  # fmt: skip
        raise ShapeError(f"x {tuple(x.shape)}, top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)}: need (T, H), (T, k) and (T, k)")  # fmt: skip
    if top_k_index.dtype == torch.bool or top_k_index.is_floating_point() or top_k_index.is_complex():
        raise DtypeError(f"top_k_index has dtype {top_k_index.dtype}: pass the integer expert ids torch.topk returns "
                         "(top_k_index.long())")  # fmt: skip
    if not top_k_weights.is_floating_point():
        raise DtypeError(f"top_k_weights has dtype {top_k_weights.dtype}: pass floating routing weights (the softmax "
                         "of the router's logits)")  # fmt: skip
    if activation not in _WEIGHTED_GATED:
        raise EpilogueError(f"activation={activation!r}: the experts take one of {sorted(_WEIGHTED_GATED)}")
    if top_k_index.device.type == "cpu" and top_k_index.numel() and not torch.compiler.is_compiling():
        low, high = int(top_k_index.min()), int(top_k_index.max())
        if low < 0 or high >= experts:
            raise ShapeError(f"top_k_index holds expert ids {low}..{high}: the layer has {experts} experts "
                             f"(ids 0..{experts - 1})")  # fmt: skip


@dataclass(frozen=True)
class Routing:
    """Top-k routing as the experts' grouped GEMMs take it: the ``(token, slot)`` pairs sorted by expert (routed
    rows), every tensor on the GPU (no sync, CUDA-graph safe)."""

    #: routed row -> its token
    token_of_row: torch.Tensor
    #: ``(token, slot)`` pair ``i * k + j`` -> its routed row
    slot_of: torch.Tensor
    top_k: int
    #: rows per expert ``(E,)`` int64, and their ends, int32 (the grouped GEMMs' offsets)
    counts: torch.Tensor
    offsets: torch.Tensor
    #: each routed row's routing weight, fp32 ``(rows, 1)`` (differentiable in ``top_k_weights``)
    weight: torch.Tensor

    @staticmethod
    def of(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int) -> Routing:
        top_k = top_k_index.shape[1]
        expert_ids = top_k_index.reshape(-1).long()
        order = torch.argsort(expert_ids, stable=True)  # routed row -> its (token, slot), rows sorted by expert
        slot_of = torch.empty_like(order).index_put_((order,), torch.arange(order.numel(), device=order.device))
        # A scatter-add count, not bincount: bincount reads its maximum back (a sync no CUDA graph can capture).
        counts = expert_ids.new_zeros(experts).scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        weight = top_k_weights.reshape(-1)[order].to(torch.float32).unsqueeze(-1)
        return Routing(order // top_k, slot_of, top_k, counts, torch.cumsum(counts, 0, dtype=torch.int32), weight)

    @property
    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What the gather and the sum of the routed rows take (:class:`_Dispatch`, :class:`_Combine`)."""
        return self.token_of_row, self.slot_of, self.top_k

    def padded(self, align: int) -> Routing:
        """The same routing with each expert's rows starting on a multiple of ``align`` (zero-weight padding rows of
        token 0 between experts; ``counts`` and ``offsets`` the padded ones), in ``capacity`` rows, which hold any
        routing of as many rows (``rows + (align - 1) E``, rounded up): the sizes stay on the GPU. Rows past the
        last expert's end belong to no group. ``weight`` stays differentiable in the unpadded one's."""
        rows, experts = self.token_of_row.numel(), self.counts.numel()
        device = self.counts.device
        counts = (self.counts + align - 1) // align * align
        ends = torch.cumsum(counts, 0)
        shift = (ends - counts) - (self.offsets.long() - self.counts)  # each expert's rows move by its padding so far
        expert_of_row = torch.repeat_interleave(torch.arange(experts, device=device), self.counts, output_size=rows)
        padded_row = torch.arange(rows, device=device) + shift[expert_of_row]
        capacity = -(-(rows + (align - 1) * experts) // align) * align if rows else 0
        token = self.token_of_row.new_zeros(capacity).index_copy_(0, padded_row, self.token_of_row)
        weight = self.weight.new_zeros(capacity, 1).index_copy(0, padded_row, self.weight)
        return Routing(token, padded_row[self.slot_of], self.top_k, counts, ends.to(torch.int32), weight)


def _gather_tokens(t: torch.Tensor, token_of_row: torch.Tensor) -> torch.Tensor:
    """Routed row ``r`` is its token's row: ``t[token_of_row]``."""
    return t[token_of_row]


def _sum_slots(t: torch.Tensor, slot_of: torch.Tensor, top_k: int) -> torch.Tensor:
    """Token ``i``'s row is the sum of its ``k`` routed rows ``t[slot_of[i * k + j]]``, in slot order, in fp32."""
    return t[slot_of].view(-1, top_k, t.shape[-1]).sum(dim=1, dtype=torch.float32).to(t.dtype)


class _Dispatch(torch.autograd.Function):
    """Tokens to routed rows (a gather); its gradient sums each token's rows (:func:`_sum_slots`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of_row: torch.Tensor, slot_of: torch.Tensor, top_k: int):
        ctx.save_for_backward(slot_of)
        ctx.top_k = top_k
        return _gather_tokens(x, token_of_row)

    @staticmethod
    def backward(ctx, d_rows: torch.Tensor):
        (slot_of,) = ctx.saved_tensors
        return _sum_slots(d_rows, slot_of, ctx.top_k), None, None, None


class _Combine(torch.autograd.Function):
    """Routed rows back to tokens (each token's rows summed); its gradient gathers (:func:`_gather_tokens`)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, token_of_row: torch.Tensor, slot_of: torch.Tensor, top_k: int):
        ctx.save_for_backward(token_of_row)
        return _sum_slots(rows, slot_of, top_k)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        (token_of_row,) = ctx.saved_tensors
        return _gather_tokens(d_out, token_of_row), None, None, None


def _weighted_gated(act: Callable) -> Callable:
    def weighted(gate, up, weight):
        return act(gate) * up * weight

    return weighted


#: The experts' gate/up epilogue per named activation: one function each, so a call's trace is remembered.
_WEIGHTED_GATED = {name: _weighted_gated(act) for name, act in ACTIVATIONS.items()}


def _expert_programs(activation: str, weight_grad: bool = True) -> tuple[Callable, Callable]:
    """The experts' :func:`_programs`: (the gate/up projection's forward epilogue ``act(gate) * up * weight``
    storing gate and up, the backward epilogue of ``dh = d_rows @ w_down``: d gate and d up, and with
    ``weight_grad`` the routing weight's gradient as a row sum, ``d_weight``)."""
    key = ("experts", activation, weight_grad)
    programs = _PROGRAMS.get(key)
    if programs is None:
        weighted = _WEIGHTED_GATED[activation]
        graph = gated_epilogue(weighted).trace({"weight": "col"})
        operands = ("weight",) if weight_grad else ()
        backward = read_from_accumulator(gradient_graph(graph, {"D": "bf16"}, operands, saved_acc=True), "D")

        def forward(gate, up, weight: ColVector):
            return {"D": weighted(gate, up, weight), SAVED["acc"]: gate, SAVED["acc_up"]: up}

        programs = _PROGRAMS[key] = (forward, replay_epilogue(backward, "experts_backward"))
    return programs


def _check_weights(w1: torch.Tensor, w2: torch.Tensor, d: int, gated: bool = False) -> None:
    if w1.dim() != 2 or w2.dim() != 2:
        raise ShapeError(f"weights of shapes {tuple(w1.shape)} and {tuple(w2.shape)}: pass 2-D (out, in) weights")
    hidden = w1.shape[0] // 2 if gated else w1.shape[0]
    if w1.shape[1] != d or w2.shape[1] != hidden:
        what = "w_gate_up (2 * hidden, d)" if gated else "w1 (hidden, d)"
        raise ShapeError(f"x's features {d}, {what} {tuple(w1.shape)} and the down weight {tuple(w2.shape)} do not "
                         f"chain: need the down weight (d_out, {hidden})")  # fmt: skip


__all__ = ["ACTIVATIONS", "explain_mlp", "gated_mlp", "linear", "mlp", "moe_experts"]
