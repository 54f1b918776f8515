"""Tensor-parallel layers: :mod:`epicute.nn.functional`'s ``linear``, ``gated_mlp`` and ``moe_experts`` over DTensor
weights.

torch.distributed's plans shard an ``nn.Linear`` (so an :class:`epicute.nn.Linear`) in place:
``ColwiseParallel`` splits ``weight`` and ``bias`` by output features (``Shard(0)``) and hands the layer a
replicated input; ``RowwiseParallel`` splits ``weight`` by input features (``Shard(1)``), keeps ``bias``
replicated, and hands the layer an input sharded along its last dimension. Each rank then runs its own shard as
one epicute GEMM, and the result is a DTensor the plan redistributes as it asks (``output_layouts``):

- column-parallel: ``y[:, own columns] = epilogue(x @ w_own.T + b_own)``, sharded along the last dimension. An
  epilogue is elementwise over the output, so it is fused as on one GPU; its operands are sharded like the output
  (row vectors ``Shard(0)``, tiles ``Shard(-1)``) or numbers. ``x``'s gradient on each rank is its own columns'
  part of the sum: marked ``Partial`` (the plan's backward all-reduces it).
- row-parallel: ``x_own @ w_own.T`` on each rank is a ``Partial`` sum; the replicated bias is added once the sum
  is complete. An epilogue would apply before the reduction, which changes its meaning: refused.
- a replicated weight (a layer the plan leaves whole, inside a tensor-parallel model) runs on the full tensors.

A gated MLP (:class:`epicute.nn.GatedMLP`) is split the Megatron way by :class:`GatedMLPParallel`: the interleaved
gate/up weight by rows (each rank a contiguous range of the intermediate features, whole gate/up blocks) and the
down projection by the same features, so each rank runs the whole fused MLP (one gated GEMM, one GEMM, and the
backward that fuses across them) on its features, and the outputs' partial sums are reduced once; a
:class:`epicute.nn.MoEExperts` is split the same way, every expert by its features.

Under sequence parallelism (tokens sharded among the ranks), :class:`SequenceColwiseParallel` and
:class:`SequenceRowwiseParallel` keep a column-parallel layer's input and a row-parallel layer's output sharded by
tokens, and the layer runs its collective inside its GEMMs (:mod:`epicute.distributed`: the all-gather overlapped
with the GEMM, the reduce-scatter as a ring of GEMMs adding their neighbour's partial sums in the epilogue).

FSDP2 (``fully_shard``) needs none of this: it gathers a layer's parameters into plain tensors before its forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from epicute.epilogue.operands import Pin, RowVector
from epicute.errors import ConfigError, EpilogueError

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_distributed(t: Any) -> bool:
    """Whether ``t`` is a DTensor (imported only where torch.distributed is, and only when asked)."""
    if type(t) in _PLAIN or not isinstance(t, torch.Tensor) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def parallel_linear(
    linear: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, epilogue: Callable | None,
    operands: dict[str, Any],
) -> torch.Tensor | dict[str, torch.Tensor]:  # fmt: skip
    """``linear(x, weight, bias, epilogue=..., **operands)`` (:func:`epicute.nn.functional.linear` on plain tensors)
    for a DTensor ``weight``, shard by shard (module docstring)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise ConfigError(
            f"weight is a DTensor on a {mesh.ndim}-D device mesh {tuple(mesh.shape)}; epicute's tensor-parallel "
            "linear takes the 1-D mesh of the tensor-parallel dimension (with FSDP2 on another dimension, "
            "fully_shard gathers its own before the forward)"
        )
    (placement,) = weight.placements
    if placement.is_replicate():  # every rank computes the whole layer
        x = _distributed(x, mesh).redistribute(mesh, [Replicate()])
        result = linear(x.to_local(), weight.to_local(), _local(bias), epilogue=epilogue,
                        **_local_operands(operands, sharded=False))  # fmt: skip
        return _as_distributed(result, mesh, [Replicate()])
    if placement == Shard(0):  # column-parallel
        fused = _gathered_linear(x, weight, bias, epilogue, operands)
        if fused is not None:
            return fused
        result = linear(_whole_input(x, mesh), weight.to_local(), _local(bias), epilogue=epilogue,
                        **_local_operands(operands, sharded=True))  # fmt: skip
        return _as_distributed(result, mesh, [Shard(x.dim() - 1)])
    if placement == Shard(1):  # row-parallel
        x = _distributed(x, mesh)
        if epilogue is not None or operands:
            raise EpilogueError(
                "an epilogue on a row-parallel linear (RowwiseParallel: weight Shard(1)) would apply to each rank's "
                "partial sum before the reduction; fuse it into the column-parallel layer before, or apply it to "
                "this layer's output"
            )
        x = x.redistribute(mesh, [Shard(x.dim() - 1)])
        fused = _scattered_linear(x, weight, bias)
        if fused is not None:
            return fused
        partial = DTensor.from_local(linear(x.to_local(), weight.to_local(), None), mesh, [Partial()], run_check=False)
        if bias is None:
            return partial
        if not is_distributed(bias):
            bias = DTensor.from_local(bias, mesh, [Replicate()], run_check=False)
        return partial.redistribute(mesh, [Replicate()]) + bias
    raise ConfigError(
        f"weight is sharded as {weight.placements}; epicute's tensor-parallel linear takes Shard(0) "
        "(ColwiseParallel), Shard(1) (RowwiseParallel) or Replicate()"
    )


def parallel_mlp(
    mlp: Callable, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: Any = None,
) -> torch.Tensor:  # fmt: skip
    """``mlp(x, w_gate_up, w_down)`` (:func:`epicute.nn.functional.gated_mlp` on plain tensors) for DTensor weights
    split by :class:`GatedMLPParallel`: each rank's features, the outputs' partial sums reduced. An input sharded by
    tokens (``GatedMLPParallel(input_layouts=Shard(1))``, sequence parallelism) in contiguous blocks goes through
    the two collective GEMMs instead: the gate/up projection gathers the tokens inside its GEMM, with ``activation``
    (of gate, times up) in its epilogue, and the down projection reduce-scatters its partial sums inside its own."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = w_gate_up.device_mesh
    if not is_distributed(w_down) or w_down.device_mesh != mesh or (w_gate_up.placements, w_down.placements) != (
            (Shard(0),), (Shard(1),)):  # fmt: skip
        raise ConfigError(
            "a gated MLP's weights are split together: the interleaved gate/up weight Shard(0) and the down "
            "projection Shard(1) on one 1-D mesh (epicute.nn.parallel.GatedMLPParallel does both); got "
            f"{getattr(w_gate_up, 'placements', None)} and {getattr(w_down, 'placements', None)}"
        )
    dim = _token_shard(x, mesh) if activation is not None else None
    if dim is not None:
        from epicute.distributed import all_gather_gemm, gemm_reduce_scatter

        local = x.to_local()
        group = mesh.get_group()
        h = all_gather_gemm(local.reshape(-1, local.shape[-1]), w_gate_up.to_local().t(), group, gated=True,
                            epilogue=_gated_activation(activation))  # fmt: skip
        y = gemm_reduce_scatter(h, w_down.to_local().t(), group)
        return DTensor.from_local(y.reshape(*local.shape[:-1], y.shape[-1]), mesh, [Shard(dim)], run_check=False)
    y = mlp(_whole_input(x, mesh), w_gate_up.to_local(), w_down.to_local())
    return DTensor.from_local(y, mesh, [Partial()], run_check=False)


@functools.lru_cache(maxsize=64)
def _gated_activation(activation: Any) -> Callable:
    """``act(gate) * up`` as a gated epilogue, one function per activation (so its trace is keyed once)."""
    from epicute.nn.functional import _activation  # imported here: functional imports this module

    act = _activation(activation)
    return lambda gate, up: act(gate) * up


def parallel_experts(experts: Callable, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``experts(x, gate_up, down, top_k_index, top_k_weights)`` (:func:`epicute.nn.functional.moe_experts` on plain
    tensors, ``interleaved=True``) for every expert split by features (:class:`GatedMLPParallel`): each rank routes
    all tokens through its share of every expert, the outputs' partial sums reduced."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = gate_up.device_mesh
    if not is_distributed(down) or (gate_up.placements, down.placements) != ((Shard(1),), (Shard(2),)):
        raise ConfigError(
            "the experts' weights are split together: the interleaved gate/up weight Shard(1) and down_proj "
            "Shard(2) on one 1-D mesh (epicute.nn.parallel.GatedMLPParallel does both); got "
            f"{gate_up.placements} and {getattr(down, 'placements', None)}"
        )
    index = top_k_index.full_tensor() if isinstance(top_k_index, DTensor) else top_k_index
    out = experts(_whole_input(x, mesh), gate_up.to_local(), down.to_local(), index, _whole_input(top_k_weights, mesh))
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


def _token_shard(x: torch.Tensor, mesh) -> int | None:
    """The dimension along which ``x`` (a DTensor) is sharded by tokens such that each rank's rows, flattened, are
    one contiguous block of the whole input's in rank order (every dimension before it of size 1, shards even):
    where a GEMM fused with the collective can gather or scatter it. None otherwise."""
    if not is_distributed(x) or x.dim() < 2:
        return None
    (placement,) = x.placements
    if not placement.is_shard():
        return None
    dim = placement.dim % x.dim()
    even = x.shape[dim] % mesh.size() == 0
    return dim if dim < x.dim() - 1 and even and all(size == 1 for size in x.shape[:dim]) else None


def _needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _gathered_linear(x, weight, bias, epilogue, operands) -> torch.Tensor | None:
    """A column-parallel linear whose input is sharded by tokens (:class:`SequenceColwiseParallel`), as one
    :func:`epicute.distributed.all_gather_gemm`: each rank gathers the tokens inside its GEMM, and the bias and the
    epilogue run in it (under autograd too: their derived backward runs over the gathered rows). None where that
    does not apply (the caller gathers first): tokens not in contiguous shards."""
    from torch.distributed.tensor import DTensor, Shard

    from epicute.distributed import all_gather_gemm

    mesh = weight.device_mesh
    if _token_shard(x, mesh) is None:
        return None
    local, w = x.to_local(), weight.to_local()
    rows = local.reshape(-1, local.shape[-1])
    fn, extra = _biased(epilogue, bias)
    y = all_gather_gemm(rows, w.t(), mesh.get_group(), epilogue=fn, **extra, **_local_operands(operands, True))
    shape = (*x.shape[:-1], w.shape[0])
    if isinstance(y, dict):  # aux tiles like D; a reduction holds this rank's columns' share: refused there
        y = {name: t.reshape(shape) if t.shape == y["D"].shape else t for name, t in y.items()}
        return _as_distributed(y, mesh, [Shard(x.dim() - 1)])
    return DTensor.from_local(y.reshape(shape), mesh, [Shard(x.dim() - 1)], run_check=False)


def _scattered_linear(x, weight, bias) -> torch.Tensor | None:
    """A row-parallel linear whose output goes to the ranks by tokens (:class:`SequenceRowwiseParallel`), as one
    :func:`epicute.distributed.gemm_reduce_scatter`: the partial sums reduced inside the GEMMs. None where that
    does not apply (the caller reduces after): no such output asked for, or tokens that don't split evenly into
    contiguous shards."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    from epicute.distributed import gemm_reduce_scatter

    wanted = getattr(weight, "_epicute_output_layout", None)
    mesh = weight.device_mesh
    if wanted is None or not wanted.is_shard():
        return None
    dim = wanted.dim % x.dim()
    ranks = mesh.size()
    if dim == x.dim() - 1 or x.shape[dim] % ranks or any(size != 1 for size in x.shape[:dim]):
        return None
    local, w = x.to_local(), weight.to_local()
    rows = local.reshape(-1, local.shape[-1])
    # The bias in the last GEMM of the ring, after the sum, on each rank's rows: its gradient on each rank covers
    # those rows only (Partial).
    bias = None if bias is None else _distributed(bias, mesh).to_local(grad_placements=[Partial()])
    fn, extra = _biased(None, bias)
    y = gemm_reduce_scatter(rows, w.t(), mesh.get_group(), epilogue=fn, **extra)
    shape = list(x.shape[:-1]) + [w.shape[0]]
    shape[dim] //= ranks
    return DTensor.from_local(y.reshape(shape), mesh, [Shard(dim)], run_check=False)


def _biased(epilogue: Callable | None, bias: torch.Tensor | None) -> tuple[Callable | None, dict]:
    """``epilogue`` after ``acc + bias`` as :func:`epicute.nn.functional.linear` composes it, and its bias operand
    (the epilogue alone without a bias)."""
    from epicute.nn.functional import _with_bias  # imported here: functional imports this module

    if bias is None:
        return epilogue, {}
    return _with_bias(epilogue), {"bias": RowVector(_local(bias))}


def _distributed(t: torch.Tensor, mesh) -> torch.Tensor:
    """``t`` as a DTensor: itself, or a plain tensor as the replicated value every rank holds."""
    from torch.distributed.tensor import DTensor, Replicate

    return t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Replicate()], run_check=False)


def _whole_input(t: torch.Tensor, mesh) -> torch.Tensor:
    """An input every rank reads whole beside its own share of a layer's features (columns, heads, an expert's
    rows): the replicated tensor, local, whose gradient on each rank covers that share only, so the full gradient
    is their sum (``Partial``: the plan's backward all-reduces it)."""
    from torch.distributed.tensor import Partial, Replicate

    return _distributed(t, mesh).redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if is_distributed(t) else t


def _local_operands(operands: dict[str, Any], sharded: bool) -> dict[str, Any]:
    """The epilogue's operands as each rank holds them: a DTensor's local shard (sharded like the output where the
    layer is column-parallel), numbers, and plain tensors where the layer is whole (beside a column-parallel layer
    one would be read whole against the rank's own columns: refused)."""
    local = {}
    for name, value in operands.items():
        inner = value.value if isinstance(value, Pin) else value
        if sharded and isinstance(inner, torch.Tensor) and not is_distributed(inner) and inner.numel() != 1:
            raise EpilogueError(
                f"operand {name!r} is a plain tensor of shape {tuple(inner.shape)} beside a column-parallel weight "
                "(ColwiseParallel: Shard(0)): each rank computes "
                "its own output columns, so pass it as a DTensor sharded like the output "
                "(distribute_tensor(t, mesh, [Shard(-1)]) for a tile, [Shard(0)] for a per-column vector)"
            )
        if is_distributed(inner):
            inner = inner.to_local()
        local[name] = type(value)(inner) if isinstance(value, Pin) else inner
    return local


def _as_distributed(result: Any, mesh, placements: list) -> Any:
    """``linear``'s result(s) as DTensors with ``placements``. Beside a column-parallel weight only tiles (D's shape)
    are: a reduction would hold each rank's own columns' share, refused (once the rank computed it: which outputs an
    epilogue returns is known from its trace, which the GEMM makes)."""
    from torch.distributed.tensor import DTensor

    if isinstance(result, torch.Tensor):
        return DTensor.from_local(result, mesh, placements, run_check=False)
    tile = result["D"].shape
    for name, t in result.items():
        if t.shape != tile and not placements[0].is_replicate():
            raise EpilogueError(
                f"output {name!r} is a reduction, and a column-parallel layer splits the output's columns among "
                "ranks: return the tile and reduce the DTensor, or keep this layer unsharded"
            )
    return {name: DTensor.from_local(t, mesh, placements, run_check=False) for name, t in result.items()}


def _gated_mlp_style():
    """:class:`GatedMLPParallel`, defined on first use (torch.distributed's tensor package loads only then)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    from epicute.epilogue.gated import GATE_BLOCK

    class GatedMLPParallel(ParallelStyle):
        """Shard an :class:`epicute.nn.GatedMLP` (or every expert of an :class:`epicute.nn.MoEExperts`) over a 1-D
        mesh (``parallelize_module(mlp, mesh, GatedMLPParallel())``, or under its name in a model's plan): its
        interleaved gate/up weight by rows, the down projection by columns, over the same intermediate features
        (each rank every expert's share). Its output comes back as ``output_layouts`` (``Replicate()``: one
        all-reduce) and, with ``use_local_output``, as a plain tensor. Each rank's share of the intermediate
        features must be a multiple of 8 (whole gate/up blocks). Under sequence parallelism
        (``input_layouts=Shard(1), output_layouts=Shard(1)``: each rank passes and gets back its tokens), a gated
        MLP whose tokens are one block of rows per rank runs its two projections as the collective GEMMs of
        :mod:`epicute.distributed` (the gather inside the gate/up GEMM, the reduce-scatter inside the down one)."""

        def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True) -> None:
            super().__init__()
            self.input_layouts = input_layouts
            self.output_layouts = (output_layouts or Replicate(),)
            self.use_local_output = use_local_output

        def _apply(self, module, device_mesh):
            from epicute.nn.modules import GatedMLP, MoEExperts

            if not isinstance(module, GatedMLP | MoEExperts):
                raise ConfigError("GatedMLPParallel shards an epicute.nn.GatedMLP or MoEExperts, not a "
                                  f"{type(module).__name__}")  # fmt: skip
            ranks, features = device_mesh.size(), module.intermediate_size
            if device_mesh.ndim != 1 or features % (ranks * GATE_BLOCK):
                raise ConfigError(
                    f"intermediate_size={features} over a mesh of shape {tuple(device_mesh.shape)}: each of the "
                    f"{ranks} ranks takes a contiguous share of the features, whole blocks of {GATE_BLOCK} gate and "
                    f"{GATE_BLOCK} up rows: use a 1-D mesh whose size times {GATE_BLOCK} divides intermediate_size"
                )
            # gate/up (..., 2I, H) by its rows, down (..., H, I) by its columns: one expert's or all experts'.
            owner, name = (module.down_proj, "weight") if isinstance(module, GatedMLP) else (module, "down_proj")
            for holder, attr, dim in ((module, "gate_up", -2), (owner, name, -1)):
                weight = getattr(holder, attr)
                sharded = distribute_tensor(weight.data, device_mesh, [Shard(weight.dim() + dim)])
                setattr(holder, attr, torch.nn.Parameter(sharded, weight.requires_grad))
            if self.input_layouts is not None:  # each rank's tokens, as the sharded input they are
                module.register_forward_pre_hook(functools.partial(self._input, device_mesh))
            module.register_forward_hook(self._output)
            return module

        def _input(self, device_mesh, module, inputs):
            from torch.distributed.tensor import DTensor

            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.input_layouts], run_check=False)
            return (x, *rest)

        def _output(self, module, inputs, output):
            output = output.redistribute(placements=self.output_layouts)
            return output.to_local() if self.use_local_output else output

    return GatedMLPParallel


def _sequence_styles() -> dict[str, type]:
    """:class:`SequenceColwiseParallel` and :class:`SequenceRowwiseParallel`, defined on first use."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class SequenceColwiseParallel(ColwiseParallel):
        """``ColwiseParallel`` for an :class:`epicute.nn.Linear` under sequence parallelism: the input comes sharded
        by tokens (``input_layouts``, default ``Shard(1)``) and stays so into the layer, whose GEMM gathers it
        (:func:`epicute.distributed.all_gather_gemm`: the peers' tokens pulled while the own ones are multiplied)
        instead of an all-gather before it. Tokens sharded another way than in contiguous blocks (``Shard(1)`` of a
        batch of several sequences) are gathered first, as ``ColwiseParallel`` does."""

        def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True) -> None:
            super().__init__(input_layouts=input_layouts or Shard(1), output_layouts=output_layouts,
                             use_local_output=use_local_output)  # fmt: skip
            self.desired_input_layouts = self.input_layouts

    class SequenceRowwiseParallel(RowwiseParallel):
        """``RowwiseParallel`` for an :class:`epicute.nn.Linear` under sequence parallelism: the output goes back
        sharded by tokens (``output_layouts``, default ``Shard(1)``), reduce-scattered inside the layer's GEMMs
        (:func:`epicute.distributed.gemm_reduce_scatter`) instead of after them. Where the tokens don't split into
        contiguous blocks the partial sums are reduced after, as ``RowwiseParallel`` does."""

        def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True) -> None:
            super().__init__(input_layouts=input_layouts, output_layouts=output_layouts or Shard(1),
                             use_local_output=use_local_output)  # fmt: skip

        def _apply(self, module, device_mesh):
            module = super()._apply(module, device_mesh)
            module.weight._epicute_output_layout = self.output_layouts[0]  # read by the layer (_scattered_linear)
            return module

    return {"SequenceColwiseParallel": SequenceColwiseParallel, "SequenceRowwiseParallel": SequenceRowwiseParallel}


def __getattr__(name: str) -> Any:
    if name == "GatedMLPParallel":
        style = globals()["GatedMLPParallel"] = _gated_mlp_style()
        return style
    if name in ("SequenceColwiseParallel", "SequenceRowwiseParallel"):
        globals().update(_sequence_styles())
        return globals()[name]
    raise AttributeError(name)


__all__ = [  # noqa: F822 - the styles: __getattr__
    "GatedMLPParallel", "SequenceColwiseParallel", "SequenceRowwiseParallel", "is_distributed", "parallel_experts",
    "parallel_linear", "parallel_mlp",
]  # fmt: skip
