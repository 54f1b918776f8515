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
Master weights stay in their own dtype. Each operand is quantized once, along the K of each GEMM that takes it:
one read of x gives its forward rows and (when ``dw`` is needed) its transpose along the tokens, one read of w its
blocks and their transpose (the tile quantizer, :func:`epicute.quantize.api.quantize_pair`), and the backward's
fp8 copies are saved instead of the 16-bit tensors.

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


def _quantized(x: torch.Tensor, rows: str | None, columns: str | None):
    """``x`` quantized along its rows by recipe ``rows`` and ``x.t()`` (its K padded with zero rows to a multiple
    of 16) by recipe ``columns``, each ``(q, scales)`` or ``None`` where not asked: one read of ``x``
    (:func:`epicute.quantize.api.quantize_pair`) for the blockwise recipes, torch operations for rowwise ones."""
    from epicute.quantize.api import TILE_RECIPES, quantize, quantize_pair

    if {rows, columns} <= {None, *TILE_RECIPES}:
        return quantize_pair(x, rows, columns)
    pad = -x.shape[0] % 16
    made_rows = quantize(x, recipe=rows) if rows else None
    made_columns = quantize(torch.nn.functional.pad(x.t(), (0, pad)).contiguous(), recipe=columns) if columns else None
    return made_rows, made_columns


def _product(a, b, recipe: str, offsets: torch.Tensor | None = None, **gemm_args):
    """``a @ b.T`` of two quantized ``(q, scales)`` operands, ``a`` ``(M, K)`` and ``b`` ``(N, K)`` both along
    their K (B is read K-major, as the fp8 GEMM takes it); ``gemm_args``: the GEMM's output dtype or epilogue.
    With ``offsets``, the variable-K grouped GEMM of a weight gradient: ``D[e] = a[:, K of e] @ b[:, K of e].T``."""
    from epicute import gemm, grouped_gemm

    (qa, sa), (qb, sb) = a, b
    sb = sb.t() if recipe == "rowwise" else sb
    if offsets is not None:
        return grouped_gemm(qa, qb.t(), offsets, a_scale=sa, b_scale=sb, **gemm_args)
    return gemm(qa, qb.t(), a_scale=sa, b_scale=sb, **gemm_args)


def _flat(*pairs):
    """Quantized operands (or ``None``) as the flat tensors ``save_for_backward`` takes; :func:`_pairs` undoes it."""
    return [t for pair in pairs for t in (pair if pair is not None else (None, None))]


def _pairs(tensors):
    return [None if tensors[i] is None else (tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: str):
        activations, weights = RECIPES[recipe]
        needs = ctx.needs_input_grad
        # Each operand once, along the K of every GEMM that takes it: x along ``in`` (forward) and along the tokens
        # (the weight gradient's B); the weight along ``in`` (forward) and ``out`` (the data gradient's B).
        x_rows, x_columns = _quantized(x, activations, weights if needs[1] else None)
        w_rows, w_columns = _quantized(weight, weights, weights if needs[0] else None)
        y = _product(x_rows, w_rows, recipe, out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(*_flat(x_columns, w_columns))
        ctx.recipe, ctx.has_bias, ctx.dtypes = recipe, bias is not None, (x.dtype, weight.dtype)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x_columns, w_columns = _pairs(ctx.saved_tensors)
        activations, _ = RECIPES[ctx.recipe]
        needs = ctx.needs_input_grad
        dy = dy.contiguous()
        dx = dw = db = None
        if needs[0] or needs[1]:
            dy_rows, dy_columns = _quantized(dy, activations if needs[0] else None, activations if needs[1] else None)
            if needs[0]:
                dx = _product(dy_rows, w_columns, ctx.recipe, out_dtype=ctx.dtypes[0])
            if needs[1]:
                dw = _product(dy_columns, x_columns, ctx.recipe, out_dtype=ctx.dtypes[1])
        if ctx.has_bias and needs[2]:
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

        activations, weights = RECIPES[recipe]
        needs = ctx.needs_input_grad
        forward_epi, backward_epi = _programs(activation, True, False)
        # As fp8_linear's: each operand once, along the K of every GEMM that takes it (see the module docstring).
        x_rows, x_columns = _quantized(x, activations, weights if needs[1] else None)
        w_rows, w_columns = _quantized(w_gate_up, weights, weights if needs[0] else None)
        up = _product(x_rows, w_rows, recipe, gated=True, epilogue=forward_epi)
        h_rows, h_columns = _quantized(up["D"], activations, weights if needs[2] else None)
        wd_rows, wd_columns = _quantized(w_down, weights, weights if needs[0] or needs[1] else None)
        y = _product(h_rows, wd_rows, recipe, out_dtype=x.dtype)
        ctx.save_for_backward(*_flat(x_columns, w_columns, h_columns, wd_columns), up[SAVED["acc"]],
                              up[SAVED["acc_up"]])  # fmt: skip
        ctx.backward_epi, ctx.recipe, ctx.dtypes = backward_epi, recipe, (x.dtype, w_gate_up.dtype, w_down.dtype)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        from epicute.epilogue.backward import DACC, DACC_UP, SAVED

        *saved, gate, up = ctx.saved_tensors
        x_columns, w_columns, h_columns, wd_columns = _pairs(saved)
        activations, _ = RECIPES[ctx.recipe]
        needs = ctx.needs_input_grad
        dy = dy.contiguous()
        dy_rows, dy_columns = _quantized(dy, activations if needs[0] or needs[1] else None,
                                         activations if needs[2] else None)  # fmt: skip
        dx = dw_gate_up = dw_down = None
        if needs[0] or needs[1]:
            # dh = dy @ w_down with the activation's derivative in its epilogue: d gate and d up, interleaved.
            grads = _product(dy_rows, wd_columns, ctx.recipe, epilogue=ctx.backward_epi,
                             out_dtypes={DACC: ctx.dtypes[0], DACC_UP: ctx.dtypes[0]},
                             **{SAVED["acc"]: gate, SAVED["acc_up"]: up})  # fmt: skip
            dacc = grads[DACC] if isinstance(grads, dict) else grads  # D alone: the paired d gate and d up
            dacc_rows, dacc_columns = _quantized(dacc, activations if needs[0] else None,
                                                 activations if needs[1] else None)  # fmt: skip
            if needs[0]:
                dx = _product(dacc_rows, w_columns, ctx.recipe, out_dtype=ctx.dtypes[0])
            if needs[1]:
                dw_gate_up = _product(dacc_columns, x_columns, ctx.recipe, out_dtype=ctx.dtypes[1])
        if needs[2]:
            dw_down = _product(dy_columns, h_columns, ctx.recipe, out_dtype=ctx.dtypes[2])
        return dx, dw_gate_up, dw_down, None, None


def fp8_moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down_proj: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, activation: str = "silu", *,
                    recipe: str = "blockwise") -> torch.Tensor:  # fmt: skip
    """:func:`epicute.nn.functional.moe_experts` trained in fp8 (``interleaved=True``: ``gate_up`` ``(E, 2I, H)`` is
    ``epicute.interleave_gate_up(gate, up)``, as :class:`~epicute.nn.MoEExperts` holds it; ``down_proj`` ``(E, H,
    I)``), DeepSeek-V3's blockwise recipe: the six grouped GEMMs of a step on fp8 inputs, output and gradients in
    ``x``'s dtype, master weights in theirs.

    The routed rows are laid out with each expert's starting on a multiple of 128 (:meth:`Routing.padded`: zero-
    weight rows between experts, within a capacity that holds any routing, so nothing is read back to the host),
    so that a 1 x 128 group or a 128 x 128 block of tokens never straddles two experts in the weight gradients,
    and every GEMM reads and writes that layout as it is (no copy into it).

    - forward: the tokens quantized once per row (1 x 128) and gathered by the gated GEMM through ``a_index``;
      the weights in 128 x 128 blocks of all experts at once (an expert's blocks never straddle the next's);
      the gated GEMM runs ``act(gate) * up * weight`` (zero on padding rows) and stores gate and up, as in bf16.
    - data gradients: the routed rows' gradient per row, the weights' transposed blocks (one read of each weight
      gives both); ``dh``'s GEMM carries the activation's derivative and the routing weight's gradient (a row sum).
    - weight gradients: variable-K fp8 grouped GEMMs over each expert's padded tokens (zero rows add nothing).

    ``H`` must be a multiple of 128 and ``I`` of 64 (each expert's weight rows whole 128-row blocks)."""
    from epicute.nn.functional import Routing, _Combine, check_routing
    from epicute.nn.parallel import is_distributed

    if recipe != "blockwise":
        raise ConfigError(f"recipe={recipe!r}: the fp8 experts take the blockwise recipe (DeepSeek-V3's), whose "
                          "scales the grouped GEMMs apply in their mainloops")  # fmt: skip
    if is_distributed(gate_up) or is_distributed(down_proj):
        raise ConfigError("fp8 experts with DTensor weights (a tensor-parallel plan): not built; train sharded "
                          "experts in bf16 (MoEExperts without fp8)")  # fmt: skip
    if gate_up.dim() != 3 or down_proj.dim() != 3:
        raise ShapeError(f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down_proj {tuple(down_proj.shape)}: "
                         "need (T, H), (E, 2I, H) and (E, H, I)")  # fmt: skip
    check_routing(x, top_k_index, top_k_weights, gate_up.shape[0], activation)
    experts, two_i, hidden = gate_up.shape
    if tuple(down_proj.shape) != (experts, hidden, two_i // 2) or x.shape[1] != hidden:
        raise ShapeError(f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down_proj.shape)} do not chain: need down_proj ({experts}, {hidden}, {two_i // 2}) "
                         f"and x (T, {hidden})")  # fmt: skip
    if hidden % 128 or two_i % 128:
        raise ShapeError(f"hidden size {hidden} and intermediate size {two_i // 2}: fp8 experts need the hidden size "
                         "a multiple of 128 and the intermediate size of 64 (each expert's weight rows are whole "
                         "128 x 128 blocks)")  # fmt: skip
    route = Routing.of(top_k_index, top_k_weights, experts).padded(EXPERT_ROWS_ALIGN)
    rows = _Fp8Experts.apply(x, gate_up, down_proj, route.weight, route, activation)
    return _Combine.apply(rows, *route.pairs)


#: Each expert's routed rows start on a multiple of this (the blockwise recipe's 128 tokens).
EXPERT_ROWS_ALIGN = 128


def _expert_blocks(weight: torch.Tensor, transposed: bool):
    """An ``(E, R, C)`` weight's 128 x 128 blocks (all experts in one pass) as the grouped GEMM's ``(G, K, N)`` B and
    its ``(G, NB, KB)`` scales: the forward's ``weight[e].T`` and, when ``transposed``, the data gradient's
    ``weight[e]`` (the same blocks transposed, from the same read)."""
    experts, r, c = weight.shape
    rows, columns = _quantized(weight.reshape(experts * r, c), "blocks", "blocks" if transposed else None)
    forward = (rows[0].view(experts, r, c).transpose(-2, -1), rows[1].view(experts, r // 128, -1))
    if columns is None:
        return forward, None
    # x.t() of all experts: (C, E * R), expert e's columns [e R, (e + 1) R) being weight[e].T.
    q, scales = columns
    backward = (q.view(c, experts, r).permute(1, 2, 0), scales.view(-1, experts, r // 128).permute(1, 0, 2))
    return forward, backward


class _Fp8Experts(torch.autograd.Function):
    """The experts' routed rows, padded per expert (before each token sums its ``k``): see :func:`fp8_moe_experts`.
    Rows past the last expert's end belong to no GEMM's group: they are never written, and nothing reads them (a
    weight gradient's K stops at the last end; the token sum reads routed rows only)."""

    @staticmethod
    def forward(ctx, x, gate_up, down_proj, weight, route, activation: str):
        from epicute import grouped_gemm
        from epicute.epilogue.backward import SAVED
        from epicute.nn.functional import _expert_programs
        from epicute.quantize import quantize

        needs = ctx.needs_input_grad
        forward_epi, backward_epi = _expert_programs(activation, weight_grad=needs[3])
        x_q, x_s = quantize(x, recipe="groups")
        gu_forward, gu_backward = _expert_blocks(gate_up, needs[0])
        up = grouped_gemm(x_q, gu_forward[0], route.offsets, a_index=route.token_of_row, a_scale=x_s,
                          b_scale=gu_forward[1], gated=True, epilogue=forward_epi, weight=weight)  # fmt: skip
        # h along I for the down projection, and along the tokens for down_proj's gradient: one read.
        h_rows, h_columns = _quantized(up["D"], "groups", "blocks" if needs[2] else None)
        down_forward, down_backward = _expert_blocks(down_proj, needs[0] or needs[1] or needs[3])
        y = grouped_gemm(h_rows[0], down_forward[0], route.offsets, a_scale=h_rows[1], b_scale=down_forward[1],
                         out_dtype=x.dtype)  # fmt: skip
        ctx.save_for_backward(x, up[SAVED["acc"]], up[SAVED["acc_up"]], weight,
                              *_flat(h_columns, gu_backward, down_backward))  # fmt: skip
        ctx.route, ctx.backward_epi = route, backward_epi
        ctx.dtypes = (x.dtype, gate_up.dtype, down_proj.dtype)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_rows):
        from epicute import grouped_gemm
        from epicute.epilogue.backward import DACC, DACC_UP, SAVED, operand_grad_name
        from epicute.nn.functional import _sum_slots

        x, gate, up, weight, *saved = ctx.saved_tensors
        h_columns, gu_backward, down_backward = _pairs(saved)
        route, needs = ctx.route, ctx.needs_input_grad
        dx = d_gate_up = d_down = d_weight = None
        # d_rows along H (dh's GEMM) and along the tokens (down_proj's gradient): one read.
        dd_rows, dd_columns = _quantized(d_rows.contiguous(), "groups" if needs[0] or needs[1] or needs[3] else None,
                                         "groups" if needs[2] else None)  # fmt: skip
        if needs[2]:  # dW_down[e] = d_rows[e]^T @ h[e], over the expert's padded tokens
            d_down = _product(dd_columns, h_columns, "blockwise", route.offsets, out_dtype=ctx.dtypes[2])
        if needs[0] or needs[1] or needs[3]:
            # dh = d_rows @ w_down with the activation's derivative in its epilogue: d gate and d up interleaved (as
            # gate_up's rows), and the routing weight's gradient.
            grads = grouped_gemm(dd_rows[0], down_backward[0], route.offsets, a_scale=dd_rows[1],
                                 b_scale=down_backward[1], epilogue=ctx.backward_epi,
                                 out_dtypes={DACC: ctx.dtypes[0], DACC_UP: ctx.dtypes[0]}, weight=weight,
                                 **{SAVED["acc"]: gate, SAVED["acc_up"]: up})  # fmt: skip
            dacc = grads[DACC] if needs[3] else grads  # D alone (the paired d gate and d up) without d_weight
            d_weight = grads[operand_grad_name("weight")].unsqueeze(-1) if needs[3] else None
            dacc_rows, dacc_columns = _quantized(dacc, "groups" if needs[0] else None, "groups" if needs[1] else None)
            if needs[0]:
                dx_rows = grouped_gemm(dacc_rows[0], gu_backward[0], route.offsets, a_scale=dacc_rows[1],
                                       b_scale=gu_backward[1], out_dtype=ctx.dtypes[0])  # fmt: skip
                dx = _sum_slots(dx_rows, route.slot_of, route.top_k)
            if needs[1]:  # dW_gate_up[e] = dacc[e]^T @ x[tokens of e]
                x_columns = _quantized(x[route.token_of_row], None, "blocks")[1]
                d_gate_up = _product(dacc_columns, x_columns, "blockwise", route.offsets, out_dtype=ctx.dtypes[1])
        return dx, d_gate_up, d_down, d_weight, None, None



__all__ = ["EXPERT_ROWS_ALIGN", "RECIPES", "fp8_gated_mlp", "fp8_linear", "fp8_moe_experts"]
