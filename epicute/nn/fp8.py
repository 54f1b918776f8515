"""fp8 training of a linear layer and a gated MLP: the forward, the data gradients and the weight gradients as fp8
GEMMs.

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

:func:`fp8_gated_mlp` is :func:`epicute.nn.functional.gated_mlp` with its six GEMMs so: the gated up projection
runs the activation in its epilogue (storing gate and up, as in bf16), and the down projection's data gradient
runs the activation's derivative in its own (d gate and d up interleaved like the weight's rows), each on fp8
inputs; only the quantizations are passes of their own.
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


def _gemm_fp8(a: torch.Tensor, b_weight: torch.Tensor, recipe: str, dtype: torch.dtype, **fused):
    """``a @ b_weight.T`` with both quantized along their last dimension (this GEMM's K): ``b_weight`` is the
    ``(N, K)`` "weight" of the product, read K-major as the fp8 GEMM takes it. ``fused``: the GEMM's epilogue
    arguments (``gated``, ``epilogue``, its operands and ``out_dtypes``), D then stored in ``dtype``."""
    from epicute import gemm, quantize

    a_recipe, b_recipe = RECIPES[recipe]
    qa, sa = quantize(a, recipe=a_recipe)
    qb, sb = quantize(b_weight, recipe=b_recipe)
    b_scale = sb.t() if b_recipe == "rowwise" else sb
    if fused:
        return gemm(qa, qb.t(), a_scale=sa, b_scale=b_scale, **fused)
    return gemm(qa, qb.t(), a_scale=sa, b_scale=b_scale, out_dtype=dtype)


def _weight_grad_fp8(dy: torch.Tensor, x: torch.Tensor, recipe: str, dtype: torch.dtype) -> torch.Tensor:
    """``dy.T @ x``: the tokens are the K of this GEMM, padded with zero rows to a multiple of 16 (they add
    nothing), ``dy``'s transpose quantized along them and ``x``'s transpose as the weight."""
    pad = -x.shape[0] % 16
    dy_t = torch.nn.functional.pad(dy.t(), (0, pad)).contiguous()
    x_t = torch.nn.functional.pad(x.t(), (0, pad)).contiguous()
    return _gemm_fp8(dy_t, x_t, recipe, dtype)


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
            dw = _weight_grad_fp8(dy, x, ctx.recipe, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(dy.dtype)
        return dx, dw, db, None


def fp8_gated_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation="silu", *,
                  recipe: str = "blockwise") -> torch.Tensor:  # fmt: skip
    """:func:`epicute.nn.functional.gated_mlp` trained in fp8 (see the module docstring): ``w_gate_up`` the
    interleaved ``(2 * hidden, d)`` weight, ``w_down`` ``(d_out, hidden)``; output and gradients in ``x``'s dtype,
    master weights in theirs. ``d``, ``hidden`` and ``d_out`` must be multiples of 16 (the fp8 rows' alignment);
    the recipe is blockwise (DeepSeek-V3's: activations and gradients per 1 x 128, weights per 128 x 128)."""
    from epicute.nn.functional import _check_weights, _rows

    if recipe != "blockwise":
        raise ConfigError(
            f"recipe={recipe!r}: the fp8 gated MLP takes the blockwise recipe, whose scales the gated GEMM applies in "
            "its mainloop to gate and up alike (rowwise scales would have to enter the fused activation and its "
            "derivative as operands: not built)"
        )
    _check_weights(w_gate_up, w_down, x.shape[-1], gated=True)
    sizes = {"d": w_gate_up.shape[1], "hidden": w_down.shape[1], "d_out": w_down.shape[0]}
    if any(n % 16 for n in sizes.values()):
        raise ShapeError(f"gated MLP sizes {sizes}: fp8 training needs multiples of 16 (fp8 rows are 16-byte aligned "
                         "for TMA)")  # fmt: skip
    x2 = _rows(x, "x", w_gate_up.shape[1])
    y = _Fp8GatedMLP.apply(x2, w_gate_up, w_down, activation, recipe)
    return y.reshape(*x.shape[:-1], w_down.shape[0])


class _Fp8GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, activation, recipe: str):
        from epicute.epilogue.backward import SAVED
        from epicute.nn.functional import _programs

        forward_epi, backward_epi = _programs(activation, True, False)
        up = _gemm_fp8(x, w_gate_up, recipe, x.dtype, gated=True, epilogue=forward_epi)
        h = up["D"]
        y = _gemm_fp8(h, w_down, recipe, x.dtype)
        ctx.save_for_backward(x, w_gate_up, w_down, h, up[SAVED["acc"]], up[SAVED["acc_up"]])
        ctx.backward_epi, ctx.recipe = backward_epi, recipe
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        from epicute.epilogue.backward import DACC, DACC_UP, SAVED

        x, w_gate_up, w_down, h, gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        needs, recipe = ctx.needs_input_grad, ctx.recipe
        # dh = dy @ w_down with the activation's derivative in its epilogue: d gate and d up, interleaved.
        grads = _gemm_fp8(dy, w_down.t().contiguous(), recipe, x.dtype, epilogue=ctx.backward_epi,
                          out_dtypes={DACC: x.dtype, DACC_UP: x.dtype}, **{SAVED["acc"]: gate, SAVED["acc_up"]: up})
        dacc = grads[DACC] if isinstance(grads, dict) else grads  # D alone: the paired d gate and d up
        dx = _gemm_fp8(dacc, w_gate_up.t().contiguous(), recipe, x.dtype) if needs[0] else None
        dw_gate_up = _weight_grad_fp8(dacc, x, recipe, w_gate_up.dtype) if needs[1] else None
        dw_down = _weight_grad_fp8(dy, h, recipe, w_down.dtype) if needs[2] else None
        return dx, dw_gate_up, dw_down, None, None


__all__ = ["RECIPES", "fp8_gated_mlp", "fp8_linear"]
