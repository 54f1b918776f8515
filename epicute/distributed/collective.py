"""GEMMs fused with tensor parallelism's collectives, over a ``torch.distributed`` process group.

- :func:`all_gather_gemm`: ``epilogue(all_gather(a_shard) @ b)``, the column-parallel layer under sequence
  parallelism. A rank starts its GEMM on its own rows at once, while the copy engine pulls the peers' shards out of
  torch's symmetric memory; each peer's rows are multiplied as soon as they have landed, so the all-gather hides
  behind the GEMM. The fused epilogue runs unchanged on every block of rows.
- :func:`gemm_reduce_scatter`: ``epilogue(reduce_scatter(a @ b))``, the row-parallel layer. A rank first multiplies
  the other ranks' rows, one rank a step, and hands each partial sum to the rank that owns those rows (the copy
  engine pushes it into the owner's symmetric buffer while the next GEMM runs; the last one is read in place);
  then it multiplies its own rows, and that GEMM's epilogue adds the partials it was handed. The reduction is part
  of the last GEMM, with no pass of its own, and the user's epilogue applies to the full sum.

Both take what :func:`epicute.gemm` takes for the GEMM and the epilogue, and are differentiable: each one's input
gradient is the other (``all_gather_gemm``'s a ``gemm_reduce_scatter`` of ``dacc`` and vice versa), and an
epilogue's backward is the one :func:`epicute.gemm` derives for it (the gradient epilogue over the gathered rows, or
over the owner's rows of the sum; the accumulator saved by the forward or recomputed, as the plan says).
On a group without symmetric memory (``gloo``, CPU tensors) the same schedule runs over plain collectives
(:mod:`epicute.distributed.transport`). Every rank makes the same calls with the same shapes, as with any
collective; a call is validated in full before its first collective, so a refused call leaves no peer waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from epicute.distributed.transport import transport
from epicute.epilogue.backward import differentiable_outputs
from epicute.epilogue.gated import check_gated_call, gated_epilogue, output_columns
from epicute.epilogue.operands import Pin, Tile
from epicute.epilogue.tracer import as_epilogue, trace_key, with_leading_operands
from epicute.errors import ConfigError, EpilogueError, GradientError, ShapeError
from epicute.gemm.api import describe_call, explain, gemm
from epicute.gemm.autograd import BackwardPlan, backward_of, plan_backward, saved_dtype, saving_call, to_operand_shape
from epicute.gemm.prepare import lower_epilogue
from epicute.gemm.torch_op import DenseKernels


def all_gather_gemm(
    a_shard: torch.Tensor,
    b: torch.Tensor,
    /,
    group=None,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    a_scale: float | torch.Tensor | None = None,
    b_scale: float | torch.Tensor | None = None,
    return_a: bool = False,
    gated: bool = False,
    **operands: Any,
) -> Any:
    """``epilogue(torch.cat(all_gather(a_shard)) @ b, **operands)``, the all-gather overlapped with the GEMM.

    Args:
        a_shard: this rank's rows of A, ``(m, K)``; every rank of the group passes the same shape, and A is the
            ranks' shards in rank order, ``(world * m, K)``.
        b: ``(K, N)``, as :func:`epicute.gemm` takes it (``w.t()`` of a column-parallel weight ``(N, K)``).
        group: the process group (default: the world).
        epilogue, operands: :func:`epicute.gemm`'s fused epilogue over the whole ``(world * m, N)`` output: tiles
            and per-row vectors span all gathered rows. It runs on each rank's block of rows as that block is
            multiplied, so its outputs are D, aux tiles and per-row reductions; one reduced over the rows (``col_*``,
            ``amax``) spans blocks and is refused.
        out_dtype: D's dtype (default: ``a_shard``'s; bf16 for fp8 inputs).
        a_scale, b_scale: fp8 inputs' scales, as :func:`epicute.gemm` takes them, ``a_scale`` for this rank's rows:
            rowwise (``(m,)``/``(m, 1)``, gathered with the rows) or tensorwise (one value per rank).
        return_a: also return the gathered A (``world * m, K``), e.g. for a weight gradient.
        gated: B holds gate and up columns interleaved and the epilogue is ``f(gate, up, **operands)``, as
            :func:`epicute.gemm`'s ``gated=True`` (a SwiGLU MLP's column-parallel gate/up projection): D has half of
            B's columns.

    Returns:
        D (a dict of the epilogue's outputs when it returns more than D), and A if ``return_a``.

    Example:
        >>> y = epicute.distributed.all_gather_gemm(x_shard, w.t(), epilogue=lambda acc: epicute.ops.silu(acc))
        ... # doctest: +SKIP
    """
    group = _group(group)
    _check_pair(a_shard, b, "all_gather_gemm", "a_shard")
    check_gated_call(gated, epilogue)
    scales = (_row_scales(a_scale, a_shard), b_scale)
    if _needs_grad(a_shard, b, operands):
        _no_scales_under_autograd(scales, "all_gather_gemm")
        if epilogue is None and not operands:
            d, gathered = _AllGatherGemm.apply(a_shard, b, group, out_dtype)
        else:
            lowered = _Lowered.of(group.size() * a_shard.shape[0], a_shard, b, epilogue, out_dtype, operands, gated)
            d, gathered = lowered.apply(_AllGatherGemmEpilogue, a_shard, b, group)
        return (d, gathered) if return_a else d
    result = _all_gather_gemm(a_shard, b, group, epilogue, out_dtype, operands, scales, gated=gated)
    return result if return_a else result[0]


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    /,
    group=None,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    a_scale: float | torch.Tensor | None = None,
    b_scale: float | torch.Tensor | None = None,
    **operands: Any,
) -> Any:
    """``epilogue(reduce_scatter(a @ b), **operands)``: this rank's rows of the sum over ranks of ``a @ b``, the
    reduction fused into the GEMM of those rows.

    Args:
        a: ``(M, K_rank)``, this rank's share of the inner dimension (a row-parallel layer's input columns); M a
            multiple of the group's size.
        b: ``(K_rank, N)``, this rank's rows of B (``w.t()`` of a row-parallel weight shard ``(N, K_rank)``).
        group: the process group (default: the world).
        epilogue, operands: :func:`epicute.gemm`'s fused epilogue over this rank's ``(M / world, N)`` rows of the
            full sum (a bias, a residual, an activation: after the reduction, as the math says).
        out_dtype: D's dtype (default: ``a``'s; bf16 for fp8 inputs). The partial sums travel in ``a``'s dtype
            (bf16 for fp8 inputs), each rounded once and added to the owner's fp32 accumulator, as torch's
            async-TP reduces them.
        a_scale, b_scale: fp8 inputs' scales, as :func:`epicute.gemm` takes them: ``a_scale`` rowwise over all M
            rows or tensorwise.

    Returns:
        D, rank ``r``'s rows ``r * M / world`` up to the next rank's (a dict with the epilogue's other outputs).

    Example:
        >>> y = epicute.distributed.gemm_reduce_scatter(h, w_down_shard.t(), epilogue=lambda acc, r: acc + r,
        ...                                              r=residual_rows)  # doctest: +SKIP
    """
    group = _group(group)
    _check_pair(a, b, "gemm_reduce_scatter", "a")
    if a.shape[0] % group.size():
        raise ShapeError(
            f"a has {a.shape[0]} rows; gemm_reduce_scatter gives each of the group's {group.size()} ranks an equal "
            "share of them: pad the rows to a multiple of the group's size"
        )
    scales = (_row_scales(a_scale, a), b_scale)
    if _needs_grad(a, b, operands):
        _no_scales_under_autograd(scales, "gemm_reduce_scatter")
        if epilogue is None and not operands:
            return _GemmReduceScatter.apply(a, b, group, out_dtype)
        lowered = _Lowered.of(a.shape[0] // group.size(), a, b, epilogue, out_dtype, operands)
        return lowered.apply(_GemmReduceScatterEpilogue, a, b, group)[0]
    return _gemm_reduce_scatter(a, b, group, epilogue, out_dtype, operands, scales)


# --- the schedules ---------------------------------------------------------------------------------------------------


def _all_gather_gemm(a_shard, b, group, epilogue, out_dtype, operands, scales=(None, None),
                     out_dtypes=None, gated: bool = False) -> tuple[Any, Any]:  # fmt: skip
    world, rows, n = group.size(), a_shard.shape[0], output_columns(b.shape[1], gated)
    a_scale, b_scale = scales
    blocks = _RowBlocks(epilogue, operands, world * rows, n, gated)
    d = new_output((world * rows, n), out_dtype or _wide(a_shard.dtype), a_shard.device)
    gathered = new_output((world * rows, a_shard.shape[1]), a_shard.dtype, a_shard.device)
    shards, outs = [a_shard], [gathered]
    if a_scale is not None:
        shards.append(a_scale)
        outs.append(new_output((world * rows, 1), a_scale.dtype, a_scale.device))

    def call(src: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """Block ``src``'s GEMM: its rows (the own ones read from the shard itself), their scales, D's rows."""
        lo, hi = src * rows, (src + 1) * rows
        own = src == group.rank()
        a_rows = shards if own else [out[lo:hi] for out in outs]
        scale = {"a_scale": a_rows[1]} if a_scale is not None else {}
        aux = {"out_dtypes": out_dtypes} if out_dtypes else {}
        aux |= {"gated": True} if gated else {}
        return a_rows[0], {"epilogue": epilogue, "out": d[lo:hi], "b_scale": b_scale, **scale, **aux,
                           **blocks.rows(lo, hi)}  # fmt: skip

    calls = [call(src) for src in range(world)]
    for a_rows, arguments in calls:
        _check_before_sending(a_rows, b, **arguments)
    others: dict[str, list] = {}
    # A block's aux outputs may be made on a side stream: they are read (concatenated) on the caller's.
    caller = torch.cuda.current_stream(a_shard.device) if a_shard.is_cuda else None
    for src in transport(group, a_shard).gather(shards, outs):
        a_rows, arguments = calls[src]
        result = gemm(a_rows, b, **arguments)
        if isinstance(result, dict):
            for name, value in result.items():
                if name != "D":
                    if caller is not None:
                        value.record_stream(caller)
                    others.setdefault(name, [None] * world)[src] = value
    if not others:
        return d, gathered
    return {"D": d, **{name: torch.cat(parts) for name, parts in others.items()}}, gathered


def _gemm_reduce_scatter(a, b, group, epilogue, out_dtype, operands, scales=(None, None), out_dtypes=None) -> Any:
    """Rank ``r`` multiplies the other ranks' rows first, one owner a step (``r + 1``, ``r + 2``, ...: the
    transport's order), handing each partial to its owner, then its own rows, whose GEMM adds the ``world - 1``
    partials it was handed in its epilogue, before the user's epilogue."""
    world, rank = group.size(), group.rank()
    rows, n = a.shape[0] // world, b.shape[1]
    a_scale, b_scale = scales

    def rows_of(owner: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """Rank ``owner``'s rows of A, and their scales as :func:`gemm`'s arguments."""
        cut = slice(owner * rows, (owner + 1) * rows)
        return a[cut], {"a_scale": None if a_scale is None else a_scale[cut], "b_scale": b_scale}

    aux = {"out_dtypes": out_dtypes} if out_dtypes else {}
    own_rows, own_scales = rows_of(rank)
    if world == 1:
        return gemm(own_rows, b, epilogue=epilogue, out_dtype=out_dtype, **own_scales, **aux, **operands)
    names = tuple(f"partial_{i}" for i in range(1, world))
    final = with_leading_operands(epilogue, names, ("tile",) * len(names), _add_partials, "gemm_reduce_scatter")
    steps = [rows_of((rank + 1 + step) % world) for step in range(world - 1)]
    # Every GEMM checked before the first signal, a stand-in for the partials (their shape and dtype).
    stand_in = new_output((rows, n), _wide(a.dtype), a.device)
    for a_rows, scaled in steps:
        _check_before_sending(a_rows, b, out=stand_in, **scaled)
    _check_before_sending(own_rows, b, epilogue=final, out_dtype=out_dtype, **own_scales, **aux, **operands,
                          **dict.fromkeys(names, Tile(stand_in)))  # fmt: skip

    exchange = transport(group, a).partials((rows, n), stand_in.dtype, a.device)
    for step, (a_rows, scaled) in enumerate(steps):
        gemm(a_rows, b, out=exchange.out(step), **scaled)
        exchange.send(step)
    partials = {name: Tile(part) for name, part in zip(names, exchange.received(), strict=True)}
    return gemm(own_rows, b, epilogue=final, out_dtype=out_dtype, **own_scales, **aux, **operands, **partials)


def _add_partials(acc, *partials):
    """The own rows' accumulator plus the partials the other ranks sent, in the order they were computed."""
    for part in partials:
        acc = acc + part
    return acc


def _check_before_sending(a: torch.Tensor, b: torch.Tensor, **arguments: Any) -> None:
    """Refuse a GEMM call of the schedule before its first collective (a refusal after it would leave the peers
    waiting): :func:`epicute.explain` goes :func:`epicute.gemm`'s way without launching. Once per signature (the
    shapes, strides, dtypes, devices and 16-byte alignment of its tensors, its epilogue's trace): a plan costs
    hundreds of microseconds, as much as an fp8 block's GEMM."""
    key = _signature((a, b, *sorted(arguments.items())))
    if key is None or key not in _CHECKED:
        explain(a, b, **arguments, file=None)
        if key is not None:
            if len(_CHECKED) >= 4096:
                _CHECKED.clear()
            _CHECKED.add(key)


_CHECKED: set[tuple] = set()


def _signature(value: Any) -> Any:
    """What :func:`_check_before_sending`'s verdict on ``value`` depends on, hashable; None where unknown."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device, value.data_ptr() % 16 == 0)
    if isinstance(value, Pin):
        inner = _signature(value.value)
        return None if inner is None else (type(value).__name__, inner)
    if isinstance(value, tuple):
        parts = tuple(_signature(v) for v in value)
        return None if any(p is None and v is not None for p, v in zip(parts, value, strict=True)) else parts
    if value is None or isinstance(value, int | float | str | torch.dtype):
        return value
    if callable(value):
        return trace_key(value)
    return None


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a GEMM of ``dtype`` inputs gives by default: its own, bf16 for fp8."""
    return torch.bfloat16 if dtype.itemsize == 1 else dtype


def _row_scales(a_scale: float | torch.Tensor | None, a: torch.Tensor) -> torch.Tensor | None:
    """An fp8 A's scale as one fp32 value per row of ``a``, ``(rows, 1)``: rowwise as given, tensorwise spread over
    the rows (each rank's shard may have its own); blockwise refused."""
    if a_scale is None:
        return None
    rows = a.shape[0]
    scale = torch.as_tensor(a_scale, dtype=torch.float32, device=a.device)
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    if scale.shape in ((rows,), (rows, 1)):
        return scale.reshape(rows, 1)
    raise ConfigError(
        f"a_scale has shape {tuple(scale.shape)}; the collective GEMMs take an fp8 A's scale tensorwise (one value) "
        f"or rowwise ((rows,) or (rows, 1) = ({rows}, 1)): quantize A per row (epicute.quantize) for blockwise data"
    )


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output this module fills (D, the gathered A): uninitialized (tests poison it with NaN here)."""
    return torch.empty(shape, dtype=dtype, device=device)


#: Epilogue signatures whose outputs were found computable block by block (:class:`_RowBlocks`).
_BLOCKWISE: set[tuple] = set()


class _RowBlocks:
    """An epilogue's operands, resolved against the whole ``(M, N)`` output, cut to a block of its rows (tiles and
    per-row vectors by rows; per-column vectors and scalars whole); its outputs checked to be cut the same way."""

    def __init__(self, epilogue: Callable | None, operands: dict[str, Any], m: int, n: int, gated: bool = False):
        self.operands = operands
        self.kinds: dict[str, str] = {}
        self.views: dict[str, Any] = {}
        if epilogue is None:
            if operands:
                raise EpilogueError(f"operands {sorted(operands)} given without an epilogue to read them")
            return
        epi = gated_epilogue(epilogue) if gated else as_epilogue(epilogue)
        specs = epi.operands(operands, m, n)
        self.kinds = {name: spec.kind for name, spec in specs.items()}
        self.views = {name: spec.value for name, spec in specs.items()}
        dtypes = {name: spec.dtype for name, spec in specs.items()}
        key = trace_key(epilogue)
        signature = None if key is None else (key, gated, tuple(self.kinds.items()), tuple(dtypes.items()))
        if signature not in _BLOCKWISE:  # traced once per epilogue and operand signature, not per call
            graph = epi.trace(self.kinds, dtypes)
            for name, _ in graph.outputs:
                if graph.output_node(name).kind in ("row", "scalar"):
                    raise EpilogueError(
                        f"epilogue output {name!r} reduces over the output's rows, which all_gather_gemm computes a "
                        "rank's block at a time: return the tile and reduce it, or gemm the gathered input"
                    )
            if signature is not None:
                if len(_BLOCKWISE) >= 1024:
                    _BLOCKWISE.clear()
                _BLOCKWISE.add(signature)

    def rows(self, lo: int, hi: int) -> dict[str, Any]:
        """The operands for output rows ``lo:hi`` (views, never copies)."""
        cut = {}
        for name, value in self.operands.items():
            kind = self.kinds[name]
            if kind == "tile":
                cut[name] = Tile(self.views[name][0, lo:hi])
            elif kind == "col":
                cut[name] = type(value)(self.views[name][0, lo:hi]) if isinstance(value, Pin) else \
                    self.views[name][0, lo:hi, None]  # fmt: skip
            else:
                cut[name] = value
        return cut


# --- autograd: each one's input gradient is the other ----------------------------------------------------------------


class _AllGatherGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_shard, b, group, out_dtype):
        d, gathered = _all_gather_gemm(a_shard, b, group, None, out_dtype, {})
        ctx.save_for_backward(gathered, b)
        ctx.group = group
        ctx.mark_non_differentiable(gathered)
        return d, gathered

    @staticmethod
    def backward(ctx, grad_d, _):
        gathered, b = ctx.saved_tensors
        grad_d = grad_d.contiguous().to(gathered.dtype)
        grad_a = _gemm_reduce_scatter(grad_d, b.t(), ctx.group, None, None, {}) if ctx.needs_input_grad[0] else None
        grad_b = gemm(gathered.t(), grad_d) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None


class _GemmReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group, out_dtype):
        ctx.save_for_backward(a, b)
        ctx.group = group
        return _gemm_reduce_scatter(a, b, group, None, out_dtype, {})

    @staticmethod
    def backward(ctx, grad_d):
        a, b = ctx.saved_tensors
        grad_d = grad_d.contiguous().to(a.dtype)
        # The gradient of every rank's rows reaches every rank: all-gathered once, into both gradients' GEMMs.
        grad_a, grad_all = _all_gather_gemm(grad_d, b.t(), ctx.group, None, None, {})
        grad_b = gemm(a.t(), grad_all) if ctx.needs_input_grad[1] else None
        return (grad_a if ctx.needs_input_grad[0] else None), grad_b, None, None


# --- autograd with an epilogue: the GEMM's own derived backward, its data gradient the other collective ------------


@dataclass(frozen=True)
class _Lowered:
    """A collective GEMM's epilogue as autograd takes it: lowered over the rows one rank's fused call covers (its
    backward plan, :func:`epicute.gemm.autograd.plan_backward`), and its operands split into the tensors autograd
    tracks (``tensors``) and how each operand is rebuilt around them (``templates``: a Pin's type, None for a plain
    tensor, or the value itself)."""

    plan: BackwardPlan
    names: tuple[str, ...]
    epilogue: Callable
    out_dtype: torch.dtype | None
    operand_names: tuple[str, ...]
    templates: tuple
    tensors: tuple
    gated: bool = False

    @classmethod
    def of(cls, rows: int, a: torch.Tensor, b: torch.Tensor, epilogue, out_dtype, operands: dict,
           gated: bool = False) -> _Lowered:  # fmt: skip
        templates, tensors = [], []
        for value in operands.values():
            inner = value.value if isinstance(value, Pin) else value
            if isinstance(inner, torch.Tensor):
                templates.append(type(value) if isinstance(value, Pin) else None)
                tensors.append(inner)
            else:
                templates.append(("value", value))
        # Lowered once per signature (shapes, dtypes, the epilogue's trace), as the checks before sending are.
        key = _signature((rows, a, b, epilogue, out_dtype, gated, *sorted(operands.items())))
        plan = _LOWERED.get(key) if key is not None else None
        if plan is None:
            meta = torch.empty((rows, a.shape[1]), dtype=a.dtype, device="meta")
            request = describe_call(meta, _on_meta(b), epilogue, None, out_dtype, None, None, None,
                                    {n: _on_meta(v) for n, v in operands.items()}, False, gated=gated)[2]  # fmt: skip
            plan = plan_backward(lower_epilogue(request).graph, a.shape[1])
            if key is not None:
                if len(_LOWERED) >= 1024:
                    _LOWERED.clear()
                _LOWERED[key] = plan
        names = tuple(name for name, _ in plan.graph.outputs)
        return cls(plan, names, epilogue, out_dtype, tuple(operands), tuple(templates), tuple(tensors), gated)

    def operands(self, tensors) -> dict[str, Any]:
        """The operands by name around ``tensors`` (the forward's, or the backward's saved ones)."""
        found, values = iter(tensors), {}
        for name, template in zip(self.operand_names, self.templates):
            if isinstance(template, tuple):
                values[name] = template[1]
            else:
                tensor = next(found)
                values[name] = tensor if template is None else template(tensor)
        return values

    def forward_call(self, a_dtype: torch.dtype) -> tuple[Callable, dict | None]:
        """The forward's epilogue and ``out_dtypes``: under a ``save`` plan it also stores the accumulator."""
        if not self.plan.saved:
            return self.epilogue, None
        options, _ = saving_call(self.plan, self.names, a_dtype)
        return options["epilogue"], {name: d for name, d in options["out_dtypes"].items() if name != "D"}

    def apply(self, fn, a: torch.Tensor, b: torch.Tensor, group) -> tuple[Any, torch.Tensor]:
        """``fn.apply``'s results by name (D alone where the epilogue returns nothing else), and its last output."""
        *outputs, last = fn.apply(a, b, group, self, *self.tensors)
        result = dict(zip(self.names, outputs))
        return (result["D"] if len(result) == 1 else result), last

    def setup(self, ctx, group, outputs: dict, saved_inputs: tuple, tensors: tuple, extra: torch.Tensor) -> tuple:
        """Save what the backward reads (``saved_inputs``, the operands' ``tensors``, a ``save`` plan's
        accumulator); the outputs in order, then ``extra`` (the gathered A, or nothing), those with no gradient
        marked so."""
        saved = tuple(outputs.pop(name) for name in self.plan.saved)
        ordered = tuple(outputs[name] for name in self.names)
        differentiable = differentiable_outputs(self.plan.graph)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(t for name, t in zip(self.names, ordered) if name not in differentiable), extra)
        ctx.save_for_backward(*saved_inputs, *tensors, *saved)
        ctx.lowered, ctx.group, ctx.differentiable, ctx.inputs = self, group, differentiable, len(saved_inputs)
        return (*ordered, extra)

    @staticmethod
    def backward(ctx, grads, kernels_of) -> tuple:
        """``(da, db, *operand gradients)`` of an autograd Function whose forward went through :meth:`setup`."""
        lowered: _Lowered = ctx.lowered
        saved_tensors = ctx.saved_tensors
        inputs, rest = saved_tensors[: ctx.inputs], saved_tensors[ctx.inputs :]
        count = len(lowered.tensors)
        tensors, saved = rest[:count], rest[count:]
        by_name = {name: g.contiguous() for name, g in zip(lowered.names, grads)
                   if g is not None and name in ctx.differentiable}  # fmt: skip
        if not by_name:
            return (None, None, *(None,) * count)
        values = lowered.operands(tensors)
        tracked = [n for n, t in zip(lowered.operand_names, lowered.templates) if not isinstance(t, tuple)]
        needing = tuple(n for n, needs in zip(tracked, ctx.needs_input_grad[4:]) if needs)
        saved_by_name = dict(zip(lowered.plan.saved, saved))
        needs = tuple(ctx.needs_input_grad[:2])
        da, db, by_operand = backward_of(lowered.plan, kernels_of(*inputs), values, saved_by_name, by_name, needs,
                                         needing, saved_dtype(inputs[0].dtype))  # fmt: skip
        graph = lowered.plan.graph
        operand_grads = [to_operand_shape(by_operand[n], t, graph.input_node(n).kind) if n in by_operand else None
                         for n, t in zip(tracked, tensors)]  # fmt: skip
        return (da, db, *operand_grads)


class _AllGatherGemmEpilogue(torch.autograd.Function):
    """:func:`all_gather_gemm` with an epilogue: the gradient epilogue runs over the gathered rows (each rank has
    all of D's rows, its columns), ``da`` is a :func:`gemm_reduce_scatter` of ``dacc``, ``db`` the gathered A's."""

    @staticmethod
    def forward(ctx, a_shard, b, group, lowered: _Lowered, *tensors):
        epilogue, out_dtypes = lowered.forward_call(a_shard.dtype)
        result, gathered = _all_gather_gemm(a_shard, b, group, epilogue, lowered.out_dtype, lowered.operands(tensors),
                                            out_dtypes=out_dtypes, gated=lowered.gated)  # fmt: skip
        outputs = dict(result) if isinstance(result, dict) else {"D": result}
        return lowered.setup(ctx, group, outputs, (gathered, b), tensors, gathered)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        group, gated = ctx.group, ctx.lowered.gated
        da, db, *operand_grads = _Lowered.backward(ctx, grads[:-1], lambda g, b: _GatheredKernels(g, b, group, gated))
        return (da, db, None, None, *operand_grads)


class _GemmReduceScatterEpilogue(torch.autograd.Function):
    """:func:`gemm_reduce_scatter` with an epilogue: the gradient epilogue runs over the rank's rows of the sum,
    ``da`` is an :func:`all_gather_gemm` of ``dacc``, whose gathered rows give ``db`` too."""

    @staticmethod
    def forward(ctx, a, b, group, lowered: _Lowered, *tensors):
        epilogue, out_dtypes = lowered.forward_call(a.dtype)
        result = _gemm_reduce_scatter(a, b, group, epilogue, lowered.out_dtype, lowered.operands(tensors),
                                      out_dtypes=out_dtypes)  # fmt: skip
        outputs = dict(result) if isinstance(result, dict) else {"D": result}
        return lowered.setup(ctx, group, outputs, (a, b), tensors, a.new_empty(0))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        group = ctx.group
        da, db, *operand_grads = _Lowered.backward(ctx, grads[:-1], lambda a, b: _ReduceScatterKernels(a, b, group))
        return (da, db, None, None, *operand_grads)


class _GatheredKernels(DenseKernels):
    """The dense GEMM's backward kernels over the gathered rows, but for the data gradient: each rank's rows of
    ``dacc @ b^T`` summed over the ranks, a :func:`gemm_reduce_scatter`."""

    def __init__(self, gathered: torch.Tensor, b: torch.Tensor, group, gated: bool) -> None:
        super().__init__(gathered, b, gated, {})
        self.group = group

    def data_grad(self, dacc):
        return _gemm_reduce_scatter(dacc, self.b.t(), self.group, None, None, {})


class _ReduceScatterKernels(DenseKernels):
    """The backward of a rank's rows of a reduce-scatter (``(M / world, N)`` of D): the gradient epilogue over them
    (a ``recompute`` plan runs the reduce-scatter again with it), and ``dacc`` all-gathered once into both ``da``
    and ``db``."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, group) -> None:
        super().__init__(a, b, False, {})
        self.group, self.gathered = group, None

    def gradient_pass(self, epilogue, recompute, out_dtypes, operands):
        if recompute:
            result = _gemm_reduce_scatter(self.a, self.b, self.group, epilogue, None, operands, out_dtypes=out_dtypes)
            return result if isinstance(result, dict) else {"D": result}
        rows = self.a.shape[0] // self.group.size()
        return DenseKernels(self.a[:rows], self.b, False, {}).gradient_pass(epilogue, False, out_dtypes, operands)

    def _gather(self, dacc) -> torch.Tensor:
        if self.gathered is None:
            self.da, self.gathered = _all_gather_gemm(dacc, self.b.t(), self.group, None, None, {})
        return self.gathered

    def data_grad(self, dacc):
        self._gather(dacc)
        return self.da

    def weight_grad(self, dacc):
        return DenseKernels(self.a, self.b, False, {}).weight_grad(self._gather(dacc))


#: Backward plans of the collective GEMMs' epilogues by call signature (:meth:`_Lowered.of`).
_LOWERED: dict[tuple, BackwardPlan] = {}


def _on_meta(value: Any) -> Any:
    """``value`` with its tensor on the meta device (what lowering an epilogue reads: shapes and dtypes)."""
    if isinstance(value, Pin):
        return type(value)(_on_meta(value.value))
    return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value


# --- checks ----------------------------------------------------------------------------------------------------------


def _group(group):
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError("no torch.distributed process group: call torch.distributed.init_process_group first")
    return group if group is not None else torch.distributed.group.WORLD


def _check_pair(a: torch.Tensor, b: torch.Tensor, op: str, a_name: str) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ShapeError(f"{op} takes tensors {a_name} and b; got {type(a).__name__} and {type(b).__name__}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ShapeError(
            f"{op}: {a_name} {tuple(a.shape)} and b {tuple(b.shape)} must be (rows, K) and (K, N): flatten the "
            "tokens' leading dimensions first"
        )
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):
        raise ShapeError(f"{op} takes each rank's local tensors (DTensor.to_local()), not DTensors")


def _needs_grad(a: torch.Tensor, b: torch.Tensor, operands: dict[str, Any]) -> bool:
    if not torch.is_grad_enabled():
        return False
    values = (a, b, *(v.value if isinstance(v, Pin) else v for v in operands.values()))
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _no_scales_under_autograd(scales: tuple, op: str) -> None:
    if any(scale is not None for scale in scales):
        raise GradientError(
            f"{op} with fp8 inputs has no backward (fp8 tensors take no gradient): run it under torch.no_grad(), or "
            "train in bf16"
        )
