"""epicute in Hugging Face transformers models: :func:`patch` swaps a model's MLPs (and optionally its linear layers)
for epicute's layers in place, for training and for ``generate()``.

A gated MLP (``gate_proj``, ``up_proj``, ``down_proj`` without biases: Llama, Qwen2/Qwen3, Mistral, and the dense
layers of their MoE siblings) becomes a :class:`epicute.nn.GatedMLP` (one gated GEMM for gate, up and the
activation; a backward fused across its two GEMMs); ``linears=True`` also puts every other ``nn.Linear``
(attention projections, ``lm_head``) on :class:`epicute.nn.Linear`, sharing its parameters. The patched model's
``state_dict()`` keeps the checkpoint's keys and layout, so ``save_pretrained``/``load_state_dict`` work as before.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM          # doctest: +SKIP
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=14336)).cuda().bfloat16()
    >>> report = epicute.integrations.transformers.patch(model)         # {'GatedMLP': 32}
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epicute.epilogue.gated import interleave_gate_up
from epicute.errors import ConfigError
from epicute.grouped.api import grouped_gemm
from epicute.nn import functional as EF
from epicute.nn.modules import GatedMLP, Linear

#: The name epicute's experts forward is registered under in transformers' ``ExpertsInterface``.
EXPERTS = "epicute"

#: transformers versions this integration is tested with (the modules' attribute names it reads).
SUPPORTED = ((5, 0), (6, 0))
#: transformers' ``hidden_act`` names -> epicute's activations
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu"}  # fmt: skip


def patch(model: nn.Module, *, mlps: bool = True, linears: bool = False, experts: bool = True) -> dict[str, int]:
    """Swap ``model``'s gated MLPs (and, with ``linears``, its other ``nn.Linear`` layers) for epicute's, in place,
    and (``experts``) run its MoE experts (Mixtral, Qwen3-MoE: transformers' experts interface) on epicute's grouped
    GEMMs (:func:`experts_forward`).

    Returns how many modules of each kind were swapped or switched. A gated MLP with biases or an activation epicute
    lacks is left as it is (and not counted). Raises :class:`~epicute.errors.ConfigError` for a transformers version
    outside :data:`SUPPORTED`.
    """
    _check_version()
    swapped = {"GatedMLP": 0, "Linear": 0, "experts": 0}
    if experts:
        swapped["experts"] = _use_epicute_experts(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = _replacement(child, mlps, linears)
            if replacement is not None:
                setattr(parent, name, replacement)
                swapped[type(replacement).__name__] += 1
    return swapped


def _replacement(module: nn.Module, mlps: bool, linears: bool) -> nn.Module | None:
    if mlps and _is_gated_mlp(module):
        activation = ACTIVATIONS.get(_hidden_act(module))
        if activation is not None:
            return GatedMLP.from_projections(module.gate_proj, module.up_proj, module.down_proj, activation)
    if linears and type(module) is nn.Linear:
        return Linear.from_linear(module)
    return None


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward (``ExpertsInterface``) on epicute: the routed rows sorted by expert and read
    in place through ``a_index`` (no gathered copy), gate/up as one gated grouped GEMM whose epilogue applies the
    activation and the router weight (``act(gate) * up * weight``: the down projection is linear, so weighting its
    input weights its output), the down projection a grouped GEMM, and each routed row summed back into its token.

    ``self.gate_up_proj`` ``(E, 2I, H)`` holds ``[gate; up]`` (transformers' concatenated layout); the gated GEMM
    reads them interleaved, built here from the parameter (a differentiable copy: the weights train as stored).
    """
    num_tokens, top_k = top_k_index.shape
    experts = self.gate_up_proj.shape[0]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    rows = (order // top_k).to(torch.int32)  # the token each routed row reads
    offsets = torch.cumsum(torch.bincount(expert_ids, minlength=experts), 0, dtype=torch.int32)
    weight = top_k_weights.reshape(-1)[order].to(torch.float32).unsqueeze(-1)
    gate, up = self.gate_up_proj.chunk(2, dim=-2)
    h = grouped_gemm(hidden_states, interleave_gate_up(gate, up).transpose(-2, -1), offsets, a_index=rows,
                     gated=True, epilogue=_WEIGHTED[ACTIVATIONS[self.config.hidden_act]], weight=weight)  # fmt: skip
    down = grouped_gemm(h, self.down_proj.transpose(-2, -1), offsets)
    out = torch.zeros(num_tokens, down.shape[-1], device=down.device, dtype=torch.float32)
    return out.index_add(0, rows.long(), down.float()).to(hidden_states.dtype)


def _weighted_gated(act):
    def weighted(gate, up, weight):
        return act(gate) * up * weight

    return weighted


#: The experts' gate/up epilogue per activation: one function each, so the call's trace is remembered.
_WEIGHTED = {name: _weighted_gated(act) for name, act in EF.ACTIVATIONS.items()}


def _use_epicute_experts(model: nn.Module) -> int:
    """Register :func:`experts_forward` with transformers and select it for every experts module: their count."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, experts_forward)
    count = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "gate_up_proj") and hasattr(config, "_experts_implementation"):
            if getattr(module, "has_bias", False) or ACTIVATIONS.get(getattr(config, "hidden_act", None)) is None:
                continue
            config._experts_implementation = EXPERTS
            count += 1
    return count


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


__all__ = ["ACTIVATIONS", "EXPERTS", "SUPPORTED", "experts_forward", "patch"]
