"""Compile fused-epilogue GEMM variants for sm_90a (no GPU needed).

Each epilogue is traced by the real frontend, lowered to an EpilogueFusion,
planned (its smem needs shape the config) and compiled into the GEMM: operand
tiles, vectors, scalars, aux outputs, reductions, fp8 outputs with amax, every
kernel path (persistent, one tile per CTA, clusters). Outputs the kernel cannot
store are refused with a clear EpilogueError.
"""

from __future__ import annotations

import pytest
import torch

from epicute import EpilogueError, epilogues, ops
from epicute.epilogue.fusion import EpilogueFusion
from epicute.epilogue.tracer import as_epilogue
from epicute.gemm import GemmProblem
from epicute.gemm.compile import GemmVariant, compile_gemm
from epicute.gemm.heuristics import choose_config

pytestmark = pytest.mark.compile


def fusion_of(fn, kinds: dict[str, str], dtypes: dict[str, str] | None = None, out_dtypes=None) -> EpilogueFusion:
    epi = as_epilogue(fn)
    dtypes = dtypes or {k: ("fp32" if kind == "scalar" else "bf16") for k, kind in kinds.items()}
    out_dtypes = out_dtypes or {"D": torch.bfloat16}
    graph = epi.trace(kinds, dtypes, out_dtypes, d_dtype=out_dtypes["D"])
    return EpilogueFusion(graph, tuple((k, kinds[k], dtypes[k]) for k in epi.params))


FP8 = {"D": torch.float8_e4m3fn}

#: name -> (epilogue, operand kinds, output dtypes, config overrides)
EPILOGUES = {
    "bias_gelu": (lambda acc, bias: ops.gelu(acc + bias), {"bias": "row"}, None, {}),
    "alpha_acc_beta_c": (epilogues.plain, {"alpha": "scalar", "beta": "scalar", "C": "tile"}, None, {}),
    "residual_add": (lambda acc, residual: acc + residual, {"residual": "tile"}, None, {"cluster_m": 2}),
    "row_col_scales_fp8": (epilogues.row_col_quant, {"scale_m": "col", "scale_n": "row"}, FP8, {}),
    "aux_pre_activation": (lambda acc, bias: {"D": ops.gelu(acc + bias), "pre": acc + bias}, {"bias": "row"},
                           {"D": torch.bfloat16, "pre": torch.float32}, {}),
    "row_sum_col_amax": (lambda acc: {"D": acc, "rs": ops.row_sum(acc), "ca": ops.col_amax(acc)}, {}, None, {}),
    "swish_two_outputs": (lambda acc, bias: {"D": ops.silu(acc + bias), "gate": ops.sigmoid(acc + bias)},
                          {"bias": "row"}, None, {"tile_n": 128}),
    "quantize_amax": (epilogues.tensor_quant, {"scale": "scalar"}, FP8, {}),
    "ffn_out_one_tile_per_cta": (lambda acc, bias, residual, alpha: ops.gelu(alpha * acc + bias) + residual,
                                 {"bias": "row", "residual": "tile", "alpha": "scalar"}, None,
                                 {"persistent": False, "epi_reuses_ab_smem": True, "ab_stages": 3}),
    "ffn_out_staged_in_the_residual_ring": (lambda acc, bias, residual: ops.gelu(acc + bias) + residual,
                                            {"bias": "row", "residual": "tile"}, None,
                                            {"schedule": "cooperative", "tile_n": 192, "reuse_smem_c": True,
                                             "num_c_stages": 3, "num_epi_stages": 2, "ab_stages": 5}),
    # a reduce-scatter's last GEMM at TP8: seven partials, D staged apart (ReuseSmemC would leave one A/B stage)
    "seven_partial_tiles": (lambda acc, p0, p1, p2, p3, p4, p5, p6: acc + p0 + p1 + p2 + p3 + p4 + p5 + p6,
                            {f"p{i}": "tile" for i in range(7)}, None, {}),
    "where_compare_fp16": (lambda acc, thr: ops.where(acc > thr, acc, ops.softplus(acc)), {"thr": "col"},
                           {"D": torch.float16}, {}),
    "pingpong_everything": (lambda acc, bias, scale_m, residual: {
                                "D": ops.gelu(acc * scale_m + bias) + residual, "pre": acc,
                                "rs": ops.row_sum(acc), "ca": ops.col_amax(acc), "am": ops.amax(acc)},
                            {"bias": "row", "scale_m": "col", "residual": "tile"}, None,
                            {"schedule": "pingpong", "tile_n": 192, "cluster_m": 2}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EPILOGUES))
def test_fused_epilogue_compiles(name):
    fn, kinds, out_dtypes, overrides = EPILOGUES[name]
    fusion = fusion_of(fn, kinds, out_dtypes=out_dtypes)
    d_dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4m3"}[
        (out_dtypes or {"D": torch.bfloat16})["D"]
    ]
    cfg = choose_config(GemmProblem(4096, 4096, 4096, d_dtype=d_dtype), epilogue=fusion.buffers(), **overrides)
    assert callable(compile_gemm(GemmVariant(cfg, "bf16", d_dtype, "k", "n", fusion=fusion)))


def test_kernel_tensor_arguments_follow_the_fusion_order():
    fusion = fusion_of(
        lambda acc, s, t, r, c: {"D": acc * s + t + r + c, "aux": acc, "rs": ops.row_sum(acc), "am": ops.amax(acc)},
        {"s": "scalar", "t": "tile", "r": "row", "c": "col"},
    )
    assert [role for role, _, _ in fusion.tensor_args] == ["tile", "row", "col", "aux", "workspace", "workspace"]
    assert fusion.scalar_inputs == ("s",)
    buffers = fusion.buffers()
    assert buffers.tile_inputs == ("bf16",) and buffers.aux_outputs == ("bf16",) and buffers.vectors == ("row", "col")
    assert any("finalize_reductions" in stage for stage in buffers.chain)


@pytest.mark.parametrize(
    "fn,kinds,match",
    [
        (lambda acc, bias: {"D": acc, "b2": bias * 2.0}, {"bias": "row"}, "output 'b2' is a row value"),
        (lambda acc: {"pre": acc}, {}, "without 'D', the main output"),
    ],
)
def test_epilogues_the_kernel_cannot_store_are_refused(fn, kinds, match):
    with pytest.raises(EpilogueError, match=match):
        fusion_of(fn, kinds)
