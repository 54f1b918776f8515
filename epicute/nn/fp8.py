"""fp8 training of a linear layer: the forward, the data gradient and the weight gradient as fp8 GEMMs.

Each GEMM quantizes its two inputs along its own K, as the fp8 GEMMs take them (:func:`epicute.quantize`):

- forward ``y = x @ w.T``: x per row and 128 columns of ``in``, w in 128 x 128 blocks;
- data gradient ``dx = dy @ w``: dy per row and 128 columns of ``out``, w's transpose in 128 x 128 blocks (the
  same blocks as the forward's, transposed: the same fp8 values and scales);
- weight gradient ``dw = dy.T @ x``: dy's transpose per row and 128 tokens, x's transpose in 128 x 128 blocks
  (the blockwise GEMM takes a per-block B scale; the tokens are padded with zeros to a multiple of 16, which add
  nothing to ``dw``).

``recipe="rowwise"`` takes one scale per row of each operand instead (``torch._scaled_mm``'s rowwise recipe).
Master weights stay in their own dtype; activations are saved in theirs and quantized again in the backward
(the forward's fp8 copies are per-row along ``in``, the weight gradient needs them along the tokens).
"""

from __future__ import annotations

import torch

from epicute.errors import ConfigError, ShapeError

#: recipe -> (the activations' and gradients' quantization, the weights')
RECIPES = {"blockwise": ("groups", "blocks"), "rowwise": ("rowwise", "rowwise")}


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               recipe: str = "blockwise") -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` with its three GEMMs in fp8 e4m3 (see the module docstring), output and
    gradients in ``x``'s dtype. ``in`` and ``out`` must be multiples of 16 (the fp8 rows' alignment)."""
    if recipe not in RECIPES:
        raise ConfigError(f"recipe={recipe!r}; fp8 training takes one of {sorted(RECIPES)}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: F.linear takes x (..., in) and a "
                         "2-D (out, in) weight")  # fmt: skip
    out_features, in_features = weight.shape
    if in_features % 16 or out_features % 16:
        raise ShapeError(f"weight has shape {tuple(weight.shape)}; fp8 training needs in and out multiples of 16 "
                         "(fp8 rows are 16-byte aligned for TMA)")  # fmt: skip
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ShapeError(f"bias has shape {tuple(bias.shape)}; it must be ({out_features},)")
    y = _Fp8Linear.apply(x.reshape(-1, in_features), weight, bias, recipe)
    return y.reshape(*x.shape[:-1], out_features)


def _gemm_fp8(a: torch.Tensor, b_weight: torch.Tensor, recipe: str, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b_weight.T`` with both quantized along their last dimension (this GEMM's K): ``b_weight`` is the
    ``(N, K)`` "weight" of the product, read K-major as the fp8 GEMM takes it."""
    from epicute import gemm, quantize

    a_recipe, b_recipe = RECIPES[recipe]
    qa, sa = quantize(a, recipe=a_recipe)
    qb, sb = quantize(b_weight, recipe=b_recipe)
    return gemm(qa, qb.t(), a_scale=sa, b_scale=sb.t() if b_recipe == "rowwise" else sb, out_dtype=dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: str):
        y = _gemm_fp8(x, weight, recipe, x.dtype)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _gemm_fp8(dy, weight.t().contiguous(), ctx.recipe, x.dtype)
        if ctx.needs_input_grad[1]:
            pad = -x.shape[0] % 16  # the tokens are this GEMM's K: zero rows add nothing
            dy_t = torch.nn.functional.pad(dy.t(), (0, pad)).contiguous()
            x_t = torch.nn.functional.pad(x.t(), (0, pad)).contiguous()
            dw = _gemm_fp8(dy_t, x_t, ctx.recipe, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(dy.dtype)
        return dx, dw, db, None


__all__ = ["RECIPES", "fp8_linear"]
