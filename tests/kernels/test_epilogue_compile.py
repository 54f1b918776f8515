"""Compile fused-epilogue GEMM variants for sm_90a (no GPU needed).

Each epilogue is traced by the real frontend, lowered to an EpilogueFusion and
compiled into the persistent GEMM. What the kernel cannot emit yet (aux outputs,
reductions, fp8 quantization) must be refused with a clear EpilogueError.
"""

from __future__ import annotations

import pytest
import torch

from epicute import EpilogueError, epilogues, ops
from epicute.epilogue.tracer import as_epilogue
from epicute.kernels.epilogue_emit import EpilogueFusion
from epicute.plan import GemmConfig
from epicute.runtime.compile import GemmVariant, compile_gemm

pytestmark = pytest.mark.compile


def fusion_of(fn, kinds: dict[str, str], dtypes: dict[str, str] | None = None) -> EpilogueFusion:
    epi = as_epilogue(fn)
    dtypes = dtypes or {k: ("fp32" if kind == "scalar" else "bf16") for k, kind in kinds.items()}
    graph = epi.trace(kinds, dtypes, {"D": torch.bfloat16}, d_dtype=torch.bfloat16)
    return EpilogueFusion(graph, tuple((k, kinds[k], dtypes[k]) for k in epi.params))


EPILOGUES = {
    "bias_gelu": (lambda acc, bias: ops.gelu(acc + bias), {"bias": "row"}),
    "alpha_acc_beta_c": (epilogues.plain, {"alpha": "scalar", "beta": "scalar", "C": "tile"}),
    "residual_add": (lambda acc, residual: acc + residual, {"residual": "tile"}),
    "row_col_scales": (lambda acc, scale_m, scale_n: ops.cast(acc * scale_m * scale_n, torch.float16),
                       {"scale_m": "col", "scale_n": "row"}),
    "swish": (lambda acc, bias: ops.silu(acc + bias), {"bias": "row"}),
    "ffn_out": (lambda acc, bias, residual, alpha: ops.gelu(alpha * acc + bias) + residual,
                {"bias": "row", "residual": "tile", "alpha": "scalar"}),
    "where_compare": (lambda acc, thr: ops.where(acc > thr, acc, ops.softplus(acc)), {"thr": "col"}),
    "sigmoid_gate_fp16": (lambda acc, gate: ops.sigmoid(gate) * ops.tanh(acc), {"gate": "tile"}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EPILOGUES))
def test_fused_epilogue_compiles(name):
    fn, kinds = EPILOGUES[name]
    dtypes = {k: ("fp32" if kind == "scalar" else "fp16" if name.endswith("fp16") else "bf16") for k, kind in kinds.items()}
    fusion = fusion_of(fn, kinds, dtypes)
    cfg = GemmConfig(tile_n=128, ab_stages=6) if name == "ffn_out" else GemmConfig()
    assert callable(compile_gemm(GemmVariant(cfg, "bf16", "bf16", "k", "n", 132, fusion=fusion)))


@pytest.mark.parametrize(
    "fn,kinds,match",
    [
        (lambda acc: {"D": acc, "pre": acc * 2.0}, {}, "only the main output 'D'"),
        (lambda acc: {"D": acc, "rs": ops.row_sum(acc)}, {}, "only the main output 'D'"),
        (epilogues.tensor_quant, {"scale": "scalar"}, "only the main output 'D'"),
        (lambda acc, s: ops.quantize(acc, s), {"s": "scalar"}, "quantize"),
    ],
)
def test_not_yet_emitted_features_are_refused(fn, kinds, match):
    with pytest.raises(EpilogueError, match=match):
        fusion_of(fn, kinds)
