"""Layers on epicute's kernels, with ``torch.nn``'s conventions and state dicts (:mod:`epicute.nn.modules`:
``Linear``, ``GatedMLP``, ``MoEExperts``), and the differentiable functions they call (:mod:`epicute.nn.functional`:
``linear``, ``mlp``, ``gated_mlp``, ``moe_experts``). They use the families' public entry points only."""

from epicute.nn import functional
from epicute.nn.modules import GatedMLP, Linear, MoEExperts, top_k_routing

__all__ = ["GatedMLP", "Linear", "MoEExperts", "functional", "top_k_routing"]
