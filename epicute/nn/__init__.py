"""Layers on epicute's kernels. :mod:`epicute.nn.functional` holds the differentiable functions (``linear``, ``mlp``,
``gated_mlp``) with ``torch.nn.functional``'s conventions; they call the families' public entry points only."""

from epicute.nn import functional

__all__ = ["functional"]
