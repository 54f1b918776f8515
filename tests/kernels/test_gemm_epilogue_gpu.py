"""GPU correctness of fused epilogues against the CPU reference interpreter.

Each program runs through the kernel (the default backend) and through
``backend="reference"`` (float32 on the CPU) on the same random operands; the
kernel's D must match within bf16 rounding. Shapes are ragged in M and N, and
the operand kinds cover scalars, row vectors, column vectors and full tiles.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, device="cuda", dtype=dtype)


PROGRAMS = {
    "bias_gelu": (lambda acc, bias: ops.gelu(acc + bias), {"bias": "row"}),
    "bias_gelu_tanh": (lambda acc, bias: ops.gelu(acc + bias, approximate="tanh"), {"bias": "row"}),
    "ffn_out": (lambda acc, bias, residual, alpha: ops.gelu(alpha * acc + bias) + residual,
                {"bias": "row", "residual": "tile", "alpha": "scalar"}),
    "alpha_beta_c": (lambda acc, alpha, beta, C: alpha * acc + beta * C, {"alpha": "scalar", "beta": "scalar", "C": "tile"}),
    "residual_add": (lambda acc, residual: acc + residual, {"residual": "tile"}),
    "row_col_scale": (lambda acc, scale_m, scale_n: acc * scale_m * scale_n, {"scale_m": "col", "scale_n": "row"}),
    "swish": (lambda acc, bias: ops.silu(acc + bias), {"bias": "row"}),
    "relu_clamp": (lambda acc: ops.clamp(ops.relu(acc), hi=1.5), {}),
    "sigmoid_gate": (lambda acc, gate: ops.sigmoid(gate) * acc, {"gate": "tile"}),
    "tanh_softcap": (lambda acc, cap: cap * ops.tanh(acc / cap), {"cap": "scalar"}),
    "exp_log": (lambda acc: ops.log(ops.exp(acc * 0.25) + 1.0), {}),
    "softplus": (lambda acc, bias: ops.softplus(acc - bias), {"bias": "col"}),
    "where_mask": (lambda acc, thr: ops.where(acc > thr, acc, acc * 0.1), {"thr": "row"}),
    "min_max": (lambda acc, lo, hi: ops.maximum(ops.minimum(acc, hi), lo), {"lo": "col", "hi": "row"}),
    "fma_sqrt": (lambda acc, s: ops.fma(acc, s, ops.sqrt(ops.abs(acc) + 1.0)), {"s": "row"}),
    "rsqrt_div": (lambda acc, c: acc / (c * c + 1.0) * ops.rsqrt(ops.abs(c) + 1.0), {"c": "tile"}),
    "cast_round": (lambda acc, bias: ops.cast(acc, torch.float16) + bias, {"bias": "row"}),
    "exp2_neg": (lambda acc: -ops.exp2(ops.minimum(acc * 0.1, 4.0)), {}),
}


def make_operand(kind: str, l: int, m: int, n: int, batched: bool):
    if kind == "scalar":
        return float(torch.randn(()).item()) + 2.0
    shape = {"row": (n,), "col": (m,), "tile": (m, n)}[kind]
    if batched:
        shape = (l, *shape)
    return rand(*shape)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_matches_reference(name):
    fn, kinds = PROGRAMS[name]
    for m, n, k, l in ((1000, 1000 + 8 * 17, 136, 1), (129, 4104, 520, 3), (17, 8, 8, 1)):
        batched = l > 1
        a = rand(l, m, k) if batched else rand(m, k)
        b = (rand(l, k, n) if batched else rand(k, n)) / k**0.5
        operands = {p: make_operand(kind, l, m, n, batched) for p, kind in kinds.items()}
        operands = {p: (epicute.ColVector(v) if kinds[p] == "col" and m == n else v) for p, v in operands.items()}
        out = torch.full(((l,) if batched else ()) + (m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = epicute.gemm(a, b, epilogue=fn, out=out, **operands)
        ref = epicute.gemm(a, b, epilogue=fn, backend="reference", **operands)
        got_d = got if isinstance(got, torch.Tensor) else got["D"]
        ref_d = ref if isinstance(ref, torch.Tensor) else ref["D"]
        assert got_d.data_ptr() == out.data_ptr()
        err = rel_err(out.float().cpu(), ref_d.float().cpu())
        assert err <= 1e-2, f"{name}: rel err {err:.2e} at {(m, n, k, l)}"


def test_fused_epilogue_in_every_kernel_path():
    def ffn(acc, bias, residual, alpha):
        return ops.gelu(alpha * acc + bias) + residual

    m, n, k = 1000, 2056, 520
    a, b = rand(m, k), rand(k, n) / k**0.5
    bias, residual = rand(n), rand(m, n)
    ref = epicute.gemm(a, b, epilogue=ffn, backend="reference", bias=bias, residual=residual, alpha=0.7)
    for config in ({"cluster_m": 2, "persistent": True}, {"persistent": False, "tile_n": 128}, {"tile_n": 64}):
        got = epicute.gemm(a, b, epilogue=ffn, config=config, bias=bias, residual=residual, alpha=0.7)
        assert rel_err(got.float().cpu(), ref.float().cpu()) <= 1e-2, config
