"""The standalone fp8 quantizer: :func:`quantize` (the group recipe on the GPU: :mod:`epicute.quantize.kernel_sm90`)."""

from epicute.quantize.api import RECIPES, quantize

__all__ = ["RECIPES", "quantize"]
