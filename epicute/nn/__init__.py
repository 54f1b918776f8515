"""Layers on epicute's kernels, with ``torch.nn``'s conventions and state dicts (:mod:`epicute.nn.modules`:
``Linear``, ``GatedMLP``), and the differentiable functions they call (:mod:`epicute.nn.functional`: ``linear``,
``mlp``, ``gated_mlp``). They use the families' public entry points only."""

from epicute.nn import functional
from epicute.nn.modules import GatedMLP, Linear

__all__ = ["GatedMLP", "Linear", "functional"]
