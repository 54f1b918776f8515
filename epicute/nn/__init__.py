"""Layers on epicute's kernels, with ``torch.nn``'s conventions and state dicts (:mod:`epicute.nn.modules`:
``Linear``, ``GatedMLP``, ``MoEExperts``), and the differentiable functions they call (:mod:`epicute.nn.functional`:
``linear``, ``mlp``, ``gated_mlp``, ``moe_experts``), fp8 training of a linear layer (:mod:`epicute.nn.fp8`:
``fp8_linear``, ``fp8_gated_mlp``, ``fp8_moe_experts``), and a paged KV cache that appends (:mod:`epicute.nn.kv_cache`).
They use the families' public entry points only."""

from epicute.nn import functional
from epicute.nn.fp8 import fp8_gated_mlp, fp8_linear, fp8_moe_experts
from epicute.nn.kv_cache import PagedKVCache, attention_with_kvcache
from epicute.nn.modules import Attention, GatedMLP, Linear, MoEExperts, rotary, top_k_routing

__all__ = [
    "Attention", "GatedMLP", "Linear", "MoEExperts", "PagedKVCache", "attention_with_kvcache", "fp8_gated_mlp",
    "fp8_linear", "fp8_moe_experts", "functional", "rotary", "top_k_routing",
]  # fmt: skip
