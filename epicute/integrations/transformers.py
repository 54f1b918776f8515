"""epicute in Hugging Face transformers models: :func:`patch` swaps a model's MLPs (and optionally its linear layers)
for epicute's layers in place, for training and for ``generate()``.

A gated MLP (``gate_proj``, ``up_proj``, ``down_proj`` without biases: Llama, Qwen2/Qwen3, Mistral, and the dense
layers of their MoE siblings) becomes a :class:`epicute.nn.GatedMLP` (one gated GEMM for gate, up and the
activation; a backward fused across its two GEMMs); the 3-D experts of Mixtral and Qwen3-MoE become
:class:`epicute.nn.MoEExperts` (two grouped GEMMs, the gate/up weight interleaved once); ``linears=True`` also puts
every other ``nn.Linear`` (attention projections, ``lm_head``) on :class:`epicute.nn.Linear`, sharing its
parameters. The patched model's ``state_dict()`` keeps the checkpoint's keys and layout, so
``save_pretrained``/``load_state_dict`` work as before.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM          # doctest: +SKIP
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=14336)).cuda().bfloat16()
    >>> report = epicute.integrations.transformers.patch(model)         # {'GatedMLP': 32}
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from epicute.attention.api import attention
from epicute.epilogue import ops
from epicute.errors import ConfigError
from epicute.nn.modules import GatedMLP, Linear, MoEExperts

#: The name epicute's attention is registered under in transformers' ``AttentionInterface``
#: (``attn_implementation="epicute"``).
ATTENTION = "epicute"

#: transformers versions this integration is tested with (the modules' attribute names it reads).
SUPPORTED = ((5, 0), (6, 0))
#: transformers' ``hidden_act`` names -> epicute's activations
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu"}  # fmt: skip


def patch(
    model: nn.Module, *, mlps: bool = True, linears: bool = False, experts: bool = True, attention: bool = True,
    fp8: str | None = None,
) -> dict[str, int]:  # fmt: skip
    """Swap ``model``'s gated MLPs (and, with ``linears``, its other ``nn.Linear`` layers) and its MoE experts
    (Mixtral, Qwen3-MoE) for epicute's layers, in place, and run its attention on :func:`epicute.attention`
    (:func:`attention_forward`, ``attn_implementation="epicute"``). Patch before building the optimizer: the
    experts' gate/up weight becomes a new (interleaved) parameter.

    ``fp8="blockwise"`` trains every swapped layer in fp8 (DeepSeek-V3's recipe: :mod:`epicute.nn.fp8`) but the
    output embedding (``lm_head``: its logits stay in the model's dtype, as fp8 training recipes keep them); the
    master weights stay in their dtype. A layer fp8 cannot take (sizes: multiples of 16; experts' hidden size of
    128 and intermediate size of 64) raises the layer's :class:`~epicute.errors.ShapeError`.

    Returns how many modules of each kind were swapped or switched (``"fp8"``: how many of them train in fp8). A
    gated MLP with biases or an activation epicute lacks is left as it is (and not counted). Raises
    :class:`~epicute.errors.ConfigError` for a transformers version outside :data:`SUPPORTED`, or an ``fp8``
    recipe other than ``"blockwise"``.
    """
    _check_version()
    if not isinstance(model, nn.Module) or (attention and not hasattr(model, "set_attn_implementation")):
        raise ConfigError(f"model is a {type(model).__name__}: patch takes a transformers model (a PreTrainedModel); "
                          "for a plain torch module use epicute.nn's layers, or pass attention=False to swap its "
                          "MLPs and linears only")  # fmt: skip
    if fp8 not in (None, "blockwise"):
        raise ConfigError(f"fp8={fp8!r}: patch trains in fp8 with 'blockwise' scales, the recipe every epicute layer "
                          "takes (or None: the model's dtype)")  # fmt: skip
    swapped = {"GatedMLP": 0, "Linear": 0, "MoEExperts": 0, "attention": 0, "fp8": 0}
    if attention:
        swapped["attention"] = _use_epicute_attention(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def swap_children(parent: nn.Module) -> None:  # a swapped module's own children stay as they were
        for name, child in list(parent.named_children()):
            replacement = _replacement(child, mlps, linears, experts, None if child is head else fp8)
            if replacement is None:
                swap_children(child)
                continue
            setattr(parent, name, replacement)
            swapped[type(replacement).__name__] += 1
            swapped["fp8"] += replacement.fp8 is not None

    swap_children(model)
    return swapped


def _replacement(module: nn.Module, mlps: bool, linears: bool, experts: bool, fp8: str | None) -> nn.Module | None:
    if experts and _is_experts(module):
        activation = ACTIVATIONS.get(_hidden_act(module))
        if activation is not None:
            return MoEExperts.from_experts(module, activation, fp8=fp8)
    if mlps and _is_gated_mlp(module):
        activation = ACTIVATIONS.get(_hidden_act(module))
        if activation is not None:
            return GatedMLP.from_projections(module.gate_proj, module.up_proj, module.down_proj, activation, fp8=fp8)
    if linears and type(module) is nn.Linear:
        return Linear.from_linear(module, fp8=fp8)
    return None


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention forward (``AttentionInterface``) on :func:`epicute.attention`: q, k, v arrive
    ``(batch, heads, seqlen, head_dim)`` and leave ``(batch, seqlen, heads, head_dim)``, as flash-attn's do; causal
    bottom-right aligned (a decode step's queries see the whole cache, up to their own positions: a static cache's
    empty slots are never read); GQA at any ratio. What epicute's attention
    lacks is refused with :class:`~epicute.errors.ConfigError` rather than computed differently: attention dropout,
    a sliding window shorter than the keys, padded batches (a mask with zeros: pass unpadded sequences; under
    torch.compile, where reading the mask would stop the graph, a device-side assertion fails instead)."""
    if dropout:
        raise ConfigError(f"attention dropout {dropout}: epicute's attention has none; set attention_dropout=0.0")
    kv_len = key.shape[2]
    if sliding_window is not None and sliding_window < kv_len:
        raise ConfigError(f"sliding_window={sliding_window} < {kv_len} keys: epicute's attention has no sliding "
                          "window; use a window of at least the sequence length")  # fmt: skip
    if attention_mask is not None:
        if torch.compiler.is_compiling():  # no host sync in a graph (and no graph break): checked on the device
            torch._assert_async(attention_mask.all(), "epicute attention: a padding mask with zeros")
        elif not bool(attention_mask.all()):
            raise ConfigError("a padding mask with zeros: epicute's attention takes unpadded batches (equal lengths, "
                              "no attention_mask), or packed sequences")  # fmt: skip
    used = None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and query.shape[2] < kv_len:
        # A cache may hold more slots than keys (a static cache has its full length from the start, the unused
        # slots zero): each sequence attends over the keys up to its last query's position, never past them.
        used = (position_ids[..., -1] + 1).to(torch.int32).expand(query.shape[0]).contiguous()
    causal = bool(module.is_causal if is_causal is None else is_causal) and query.shape[2] > 1
    score_mod = _softcapped(float(softcap)) if softcap else None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = attention(q, k, v, causal=causal, softmax_scale=scaling, score_mod=score_mod, seqused_k=used)
    return out, None


@functools.lru_cache(maxsize=64)
def _softcapped(cap: float):
    """Gemma-2-style logit softcapping as a score_mod, one function per cap (its trace is remembered)."""

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * ops.tanh(score / cap)

    return softcap


def _use_epicute_attention(model: nn.Module) -> int:
    """Register :func:`attention_forward` (and flash-attn's mask convention: no mask without padding) and select it
    for ``model``: the number of attention modules that will run it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(ATTENTION, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, flash_attention_mask)
    model.set_attn_implementation(ATTENTION)
    return sum(1 for module in model.modules() if hasattr(module, "is_causal") and hasattr(module, "q_proj"))


#: The attention projections a tensor-parallel plan splits by heads (column-parallel), and the one it reduces.
ATTENTION_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), "o_proj")
#: Norms inside an attention block over each head's features (Qwen3), by attribute name.
PER_HEAD_NORMS = ("q_norm", "k_norm")
#: The norms of a transformers decoder layer, and the stack's final one (by attribute name).
LAYER_NORMS, FINAL_NORM = ("input_layernorm", "post_attention_layernorm"), "norm"


def tensor_parallel_plan(model: nn.Module, world_size: int, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """A ``parallelize_module`` plan for a model :func:`patch` switched to epicute (``linears=True``) over a 1-D mesh
    of ``world_size`` ranks, the Megatron split: each attention's ``q_proj``/``k_proj``/``v_proj`` column-parallel
    (each rank its own heads, which epicute's attention runs as on one GPU) and ``o_proj`` row-parallel, each
    :class:`~epicute.nn.GatedMLP` and every expert of each :class:`~epicute.nn.MoEExperts` by their features
    (:class:`~epicute.nn.parallel.GatedMLPParallel`). Embeddings, norms, routers and the LM head stay replicated.

    ``sequence_parallel``: the residual stream between the layers is sharded by tokens too (each rank keeps its
    ``seqlen / world_size`` tokens of every sequence), so the norms run on a rank's own tokens
    (``SequenceParallel``) and each layer's collectives sit inside its GEMMs (:mod:`epicute.distributed`): a
    gated MLP gathers its tokens inside the gate/up GEMM and reduce-scatters inside the down GEMM, and ``o_proj``
    reduce-scatters inside its GEMM. An attention block's input is gathered before its q/k/v projections
    (transformers reshapes them by the token count the block received). The first layer takes its tokens from
    the replicated embeddings, and the LM head gathers them back. An MoE block runs on the gathered tokens (a
    router on one rank's tokens would get that share of its gradient), its experts split by features as without
    sequence parallelism, and hands each rank its tokens back by reduce-scattering the experts' partial sums.
    For training and prefill: a call whose sequence length does not split evenly over the ranks (a decode step's
    one token) raises :class:`~epicute.errors.ConfigError` on every rank.

    Raises :class:`~epicute.errors.ConfigError` where the heads (query or key/value) do not split evenly (and
    ``parallelize_module`` does where a gated MLP's features do not). Per-head norms inside the attention
    (``q_norm``/``k_norm``, Qwen3) run on each rank's heads, their weights' gradients summed over the ranks.

    Example:
        >>> plan = tensor_parallel_plan(model, mesh.size(), sequence_parallel=True)   # doctest: +SKIP
        >>> parallelize_module(model, mesh, plan)
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from epicute.nn.parallel import GatedMLPParallel, SequenceRowwiseParallel

    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tokens = Shard(1)  # (batch, seqlen, hidden): the residual stream's tokens
    plan: dict[str, Any] = {}
    (columns, rows) = ATTENTION_PROJECTIONS
    moe_blocks = [name.rpartition(".")[0] for name, module in model.named_modules() if isinstance(module, MoEExperts)]
    for name, module in model.named_modules():
        if all(isinstance(getattr(module, p, None), Linear) for p in (*columns, rows)):
            if heads is None or heads % world_size or kv_heads % world_size:
                raise ConfigError(f"{name}: {heads} query and {kv_heads} key/value heads do not split over "
                                  f"{world_size} ranks; use a tensor-parallel size that divides both")  # fmt: skip
            plan |= {f"{name}.{p}": ColwiseParallel() for p in columns}
            # Per-head norms (Qwen3's q_norm/k_norm) share one weight over the heads the split scatters: run on each
            # rank's heads as a shard along them (dim 2 of (batch, seqlen, heads, head_dim)), so the weight's
            # gradient is summed over the ranks.
            plan |= {f"{name}.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for n in PER_HEAD_NORMS if isinstance(getattr(module, n, None), nn.Module)}  # fmt: skip
            plan[f"{name}.{rows}"] = SequenceRowwiseParallel() if sequence_parallel else RowwiseParallel()
            if sequence_parallel:
                plan[name] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": tokens},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                use_local_output=True)  # fmt: skip
        elif isinstance(module, MoEExperts) and sequence_parallel:
            # The MoE block (router, experts, any shared expert) runs on the gathered tokens as without sequence
            # parallelism (a router on one rank's tokens would get that share of its gradient), and hands each rank
            # its tokens back: the experts' partial sums (each rank its share of the features) reduce-scattered by
            # tokens, half an all-reduce's traffic, with no cut after it.
            block = name.rpartition(".")[0]
            plan[block] = PrepareModuleInputOutput(input_layouts=(tokens,), desired_input_layouts=(Replicate(),),
                                                   use_local_input=True, output_layouts=(Partial(),),
                                                   desired_output_layouts=(tokens,), use_local_output=True)  # fmt: skip
            plan[name] = GatedMLPParallel(output_layouts=Partial())
        elif isinstance(module, GatedMLP | MoEExperts):  # GatedMLPParallel checks that the features split
            # A shared expert inside a sequence-parallel MoE block sees the block's gathered tokens and leaves its
            # partial sum to the block's reduce-scatter (a gate on it, a per-token factor, keeps it a partial sum).
            in_moe_block = sequence_parallel and any(name.startswith(f"{block}.") for block in moe_blocks)
            if in_moe_block:
                plan[name] = GatedMLPParallel(output_layouts=Partial())
            elif sequence_parallel:
                plan[name] = GatedMLPParallel(input_layouts=tokens, output_layouts=tokens)
            else:
                plan[name] = GatedMLPParallel()
    if not plan:
        raise ConfigError("no attention or GatedMLP to split: patch(model, linears=True) first")
    if sequence_parallel:
        plan |= _sequence_parallel_edges(model)
    return plan


def _sequence_parallel_edges(model: nn.Module) -> dict[str, Any]:
    """The sequence-parallel plan's entries outside the attention blocks and MLPs: the layer stack takes its
    first layer's input (the embeddings, replicated) as each rank's tokens, every norm runs on a rank's tokens
    (its weight's gradient summed over the ranks), and the LM head gathers the tokens back."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    plan: dict[str, Any] = {}
    stacks = [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)]
    if len(stacks) != 1 or not len(stacks[0][1].layers):
        raise ConfigError("sequence_parallel=True: the model has no single stack of decoder layers (a `layers` "
                          "ModuleList) to shard the tokens of")  # fmt: skip
    stack_name, stack = stacks[0]
    prefix = f"{stack_name}." if stack_name else ""
    plan[f"{prefix}layers.0"] = _token_shards()()
    for i, layer in enumerate(stack.layers):
        for norm in LAYER_NORMS:
            if not isinstance(getattr(layer, norm, None), nn.Module):
                raise ConfigError(f"sequence_parallel=True: {prefix}layers.{i} has no {norm}; only decoder layers "
                                  f"with {' and '.join(LAYER_NORMS)} (Llama, Qwen, Mistral, Mixtral) are "
                                  "planned")  # fmt: skip
            plan[f"{prefix}layers.{i}.{norm}"] = SequenceParallel(use_local_output=True)
    if isinstance(getattr(stack, FINAL_NORM, None), nn.Module):
        plan[f"{prefix}{FINAL_NORM}"] = SequenceParallel(use_local_output=True)
    if isinstance(getattr(model, "lm_head", None), nn.Module):
        plan["lm_head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                             use_local_output=True)  # fmt: skip
    return plan


@functools.cache
def _token_shards() -> type:
    """The style that hands the first decoder layer each rank's share of the tokens, defined on first use (torch's
    tensor-parallel package loads only then)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ParallelStyle

    class TokenShards(ParallelStyle):
        """A layer's first input, ``(batch, seqlen, hidden)`` and the same on every rank, cut to this rank's
        ``seqlen / ranks`` tokens (its gradient gathered back). torch's styles wrap a rank's tokens as even shards,
        so an uneven split is refused here, on every rank alike, before any collective could disagree on sizes."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            module.register_forward_pre_hook(functools.partial(self._shard, device_mesh))
            return module

        @staticmethod
        def _shard(device_mesh, module, inputs):
            x, *rest = inputs
            ranks = device_mesh.size()
            if x.shape[1] % ranks:
                raise ConfigError(f"sequence_parallel=True over {ranks} ranks: a sequence of {x.shape[1]} tokens does "
                                  f"not split evenly; pad the sequences to a multiple of {ranks} tokens (or plan "
                                  "with sequence_parallel=False)")  # fmt: skip
            whole = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return (whole.redistribute(device_mesh, [Shard(1)]).to_local(), *rest)

    return TokenShards


def _is_experts(module: nn.Module) -> bool:
    """transformers' 3-D experts (``gate_up_proj`` ``(E, 2I, H)`` ``[gate; up]``, ``down_proj``, no biases)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and not getattr(module, "has_bias", False) and gate_up.shape[1] % 16 == 0)  # fmt: skip


def _is_gated_mlp(module: nn.Module) -> bool:
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return all(type(p) is nn.Linear and p.bias is None for p in projections) and hasattr(module, "act_fn")


def _hidden_act(module: nn.Module) -> str | None:
    config: Any = getattr(module, "config", None)
    return getattr(config, "hidden_act", None)


def _check_version() -> None:
    import transformers

    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    low, high = SUPPORTED
    if not low <= version < high:
        raise ConfigError(
            f"transformers {transformers.__version__} is not supported by epicute.integrations.transformers "
            f"(tested: >= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))})"
        )


__all__ = [
    "ACTIVATIONS", "ATTENTION", "ATTENTION_PROJECTIONS", "FINAL_NORM", "LAYER_NORMS", "PER_HEAD_NORMS", "SUPPORTED",
    "attention_forward", "patch", "tensor_parallel_plan",
]  # fmt: skip
