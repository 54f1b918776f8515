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

from torch import nn

from epicute.errors import ConfigError
from epicute.nn.modules import GatedMLP, Linear

#: transformers versions this integration is tested with (the modules' attribute names it reads).
SUPPORTED = ((5, 0), (6, 0))
#: transformers' ``hidden_act`` names -> epicute's activations
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu"}  # fmt: skip


def patch(model: nn.Module, *, mlps: bool = True, linears: bool = False) -> dict[str, int]:
    """Swap ``model``'s gated MLPs (and, with ``linears``, its other ``nn.Linear`` layers) for epicute's, in place.

    Returns how many modules of each kind were swapped. A gated MLP with biases or an activation epicute lacks is
    left as it is (and not counted). Raises :class:`~epicute.errors.ConfigError` for a transformers version outside
    :data:`SUPPORTED`.
    """
    _check_version()
    swapped = {"GatedMLP": 0, "Linear": 0}
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


__all__ = ["ACTIVATIONS", "SUPPORTED", "patch"]
