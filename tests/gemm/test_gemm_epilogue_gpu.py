"""GPU correctness of fused epilogues against the CPU reference interpreter.

Each program runs through the kernel (the default backend) and through
``backend="reference"`` (float32 on the CPU) on the same random operands; the
kernel's D must match within bf16 rounding. Shapes are ragged in M and N, and
the operand kinds cover scalars, row vectors, column vectors and full tiles.
Further programs cover aux outputs (fp32 and bf16, returned or written into
NaN-poisoned ``outs``), reductions (within 1e-4 and bitwise equal run to run),
fp8 outputs (checked as in tests/gemm/epilogue_fuzz.py: at most rare
one-step rounding flips) and the three ready schedules, output shapes included.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from tests.conftest import rel_err
from tests.gemm.epilogue_fuzz import fp8_mismatch

pytestmark = pytest.mark.gpu


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, device="cuda", dtype=dtype)


PROGRAMS = {
    "bias_gelu": (lambda acc, bias: ops.gelu(acc + bias), {"bias": "row"}),
    "bias_gelu_tanh": (lambda acc, bias: ops.gelu(acc + bias, approximate="tanh"), {"bias": "row"}),
    "ffn_out": (
        lambda acc, bias, residual, alpha: ops.gelu(alpha * acc + bias) + residual,
        {"bias": "row", "residual": "tile", "alpha": "scalar"},
    ),
    "alpha_beta_c": (
        lambda acc, alpha, beta, C: alpha * acc + beta * C,
        {"alpha": "scalar", "beta": "scalar", "C": "tile"},
    ),
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
    shape = {"row": (n,), "col": (m, 1), "tile": (m, n)}[kind]
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
    for config in (
        {"cluster_m": 2, "persistent": True},
        {"persistent": False, "tile_n": 128},
        {"tile_n": 64},
        {"tile_n": 224, "cluster_m": 2},
        {"schedule": "pingpong", "tile_n": 128, "cluster_m": 2},
        {"schedule": "pingpong", "tile_n": 192},
    ):
        got = epicute.gemm(a, b, epilogue=ffn, config=config, bias=bias, residual=residual, alpha=0.7)
        assert rel_err(got.float().cpu(), ref.float().cpu()) <= 1e-2, config


# --- aux outputs, reductions, fp8 outputs, the ready schedules -----------------

FP8 = torch.float8_e4m3fn
#: (M, N, K, L): ragged M and N (N a multiple of 16 so fp8 outputs fit), batched included.
SHAPES = ((1000, 1136, 136, 1), (129, 4112, 520, 3), (17, 16, 8, 1))


def problem(m, n, k, l):
    """Random a, b (acc ~ N(0, 1)) and the leading batch dims of every output."""
    lead = (l,) if l > 1 else ()
    return rand(*lead, m, k), rand(*lead, k, n) / k**0.5, lead


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def assert_close(got, ref, shape, dtype, tol, what):
    assert tuple(got.shape) == shape and got.dtype == dtype, f"{what}: {tuple(got.shape)} {got.dtype}"
    if dtype == FP8:
        why = fp8_mismatch(got, ref)
        assert why is None, f"{what}: {why}"
        return
    err = rel_err(got.float().cpu(), ref.float().cpu())
    assert err < tol, f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize("pre_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("via", ["out_dtypes", "outs"])
def test_aux_pre_activation_output(pre_dtype, via):
    def fn(acc, bias):
        return {"D": ops.gelu(acc + bias), "pre": acc + bias}

    for m, n, k, l in SHAPES:
        a, b, lead = problem(m, n, k, l)
        bias = rand(*lead, n)
        out, pre = nan_like(lead + (m, n), torch.bfloat16), nan_like(lead + (m, n), pre_dtype)
        extra = {"out_dtypes": {"pre": pre_dtype}} if via == "out_dtypes" else {"outs": {"pre": pre}}
        got = epicute.gemm(a, b, epilogue=fn, out=out, bias=bias, **extra)
        ref = epicute.gemm(a, b, epilogue=fn, backend="reference", out_dtypes={"pre": pre_dtype}, bias=bias)
        assert set(got) == {"D", "pre"} and got["D"].data_ptr() == out.data_ptr()
        if via == "outs":
            assert got["pre"].data_ptr() == pre.data_ptr()
        where = (m, n, k, l)
        assert_close(got["D"], ref["D"], lead + (m, n), torch.bfloat16, 1e-2, f"D at {where}")
        tol = 1e-4 if pre_dtype == torch.float32 else 1e-2
        assert_close(got["pre"], ref["pre"], lead + (m, n), pre_dtype, tol, f"pre at {where}")


#: name -> (epilogue, operand kinds); reductions are every output but D.
REDUCTION_PROGRAMS = {
    "row_sum_col_amax": (lambda acc: {"D": acc, "rs": ops.row_sum(acc), "ca": ops.col_amax(acc)}, {}),
    "row_max": (lambda acc, bias: {"D": ops.relu(acc + bias), "rm": ops.row_max(acc + bias)}, {"bias": "row"}),
    # All values <= -1: a masked (out-of-problem) lane folding in 0 or garbage would show.
    "max_of_negatives": (lambda acc: {"D": acc, "rm": ops.row_max(-abs(acc) - 1.0),
                                      "cm": ops.col_max(-abs(acc) - 1.0)}, {}),
    "col_sum": (lambda acc, s: {"D": acc * s, "cs": ops.col_sum(acc * s)}, {"s": "col"}),
    "amax": (lambda acc, t: {"D": acc + t, "am": ops.amax(acc + t), "ra": ops.row_amax(acc)}, {"t": "tile"}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REDUCTION_PROGRAMS))
def test_reductions_match_reference_and_are_deterministic(name):
    fn, kinds = REDUCTION_PROGRAMS[name]
    for m, n, k, l in SHAPES:
        a, b, lead = problem(m, n, k, l)
        operands = {p: make_operand(kind, l, m, n, l > 1) for p, kind in kinds.items()}
        out = nan_like(lead + (m, n), torch.bfloat16)
        got = epicute.gemm(a, b, epilogue=fn, out=out, **operands)
        again = epicute.gemm(a, b, epilogue=fn, **operands)
        ref = epicute.gemm(a, b, epilogue=fn, backend="reference", **operands)
        assert set(got) == set(ref) and got["D"].data_ptr() == out.data_ptr()
        where = f"{name} at {(m, n, k, l)}"
        assert_close(got["D"], ref["D"], lead + (m, n), torch.bfloat16, 1e-2, f"D of {where}")
        for r in set(got) - {"D"}:
            op = {"rs": "row", "rm": "row", "ra": "row", "ca": "col", "cm": "col", "cs": "col", "am": "all"}[r]
            shape = () if op == "all" else lead + ((m,) if op == "row" else (n,))
            assert_close(got[r], ref[r], shape, torch.float32, 1e-4, f"{r} of {where}")
            assert torch.equal(got[r], again[r]), f"{r} of {where} differs between two runs"


@pytest.mark.parametrize("m,n,k,l", SHAPES)
def test_tensor_quant_fp8_with_amax(m, n, k, l):
    a, b, lead = problem(m, n, k, l)
    scale = 250.0  # ~7% of |acc * scale| pass 448: saturation is exercised
    out = nan_like(lead + (m, n), FP8)
    got = epicute.gemm(a, b, epilogue=epicute.epilogues.tensor_quant, out=out, out_dtypes={"D": FP8}, scale=scale)
    ref = epicute.gemm(a, b, epilogue=epicute.epilogues.tensor_quant, backend="reference", out_dtypes={"D": FP8},
                       scale=scale)  # fmt: skip
    assert set(got) == {"D", "amax"} and got["D"].data_ptr() == out.data_ptr()
    assert_close(got["D"], ref["D"], lead + (m, n), FP8, None, f"D at {(m, n, k, l)}")
    assert_close(got["amax"], ref["amax"], (), torch.float32, 1e-4, f"amax at {(m, n, k, l)}")
    assert got["amax"].item() > 448.0 and got["D"].float().abs().max().item() == 448.0


@pytest.mark.parametrize("d_dtype", [FP8, torch.bfloat16])
def test_row_col_quant(d_dtype):
    for m, n, k, l in SHAPES:
        a, b, lead = problem(m, n, k, l)
        scale_m, scale_n = rand(*lead, m, dtype=torch.float32) * 30, rand(*lead, n, dtype=torch.float32)
        operands = {"scale_m": scale_m, "scale_n": scale_n}
        got = epicute.gemm(a, b, epilogue=epicute.epilogues.row_col_quant, out_dtypes={"D": d_dtype}, **operands)
        ref = epicute.gemm(a, b, epilogue=epicute.epilogues.row_col_quant, backend="reference",
                           out_dtypes={"D": d_dtype}, **operands)  # fmt: skip
        assert_close(got, ref, lead + (m, n), d_dtype, 1e-2, f"D at {(m, n, k, l)}")


@pytest.mark.parametrize("c_kind", ["tile", "row", "col"])
def test_plain_schedule(c_kind):
    pin = {"tile": epicute.Tile, "row": epicute.RowVector, "col": epicute.ColVector}[c_kind]
    for m, n, k, l in SHAPES:
        a, b, lead = problem(m, n, k, l)
        c = pin(make_operand(c_kind, l, m, n, l > 1))
        out = nan_like(lead + (m, n), torch.bfloat16)
        got = epicute.gemm(a, b, epilogue=epicute.epilogues.plain, out=out, alpha=0.5, beta=-1.5, C=c)
        ref = epicute.gemm(a, b, epilogue=epicute.epilogues.plain, backend="reference", alpha=0.5, beta=-1.5, C=c)
        assert got.data_ptr() == out.data_ptr()
        assert_close(got, ref, lead + (m, n), torch.bfloat16, 1e-2, f"D at {(m, n, k, l)}")


def test_a_clusters_spare_tile_past_n_writes_no_reduction_partials():
    """Cluster 1x2 over an odd number of 64-wide tiles (N = 264: 5 tiles, 3 clusters): the last cluster's second CTA
    lies wholly past N. Its row and whole-tile partials once went one tile past their workspaces' end, where a
    row_max's -inf identity landed in the next allocation (the col_sum's workspace here: its result was -inf)."""
    a, b = rand(553, 200), rand(264, 200).t()
    bias = rand(264)

    def every_reduction(acc, bias):
        y = acc + bias
        return {"D": y, "rs": ops.row_sum(y), "rm": ops.row_max(y), "cs": ops.col_sum(y), "cm": ops.col_max(y),
                "am": ops.amax(y)}  # fmt: skip

    config = {"tile_n": 64, "cluster_m": 1, "cluster_n": 2}
    got = epicute.gemm(a, b, epilogue=every_reduction, bias=bias, out_dtype=torch.float32, config=config)
    y = a.double() @ b.double() + bias.double()
    assert rel_err(got["D"], y) < 1e-5
    assert rel_err(got["rs"], y.sum(1)) < 1e-5 and rel_err(got["cs"], y.sum(0)) < 1e-5
    assert rel_err(got["rm"], y.amax(1)) < 1e-6 and rel_err(got["cm"], y.amax(0)) < 1e-6
    assert rel_err(got["am"], y.abs().amax()) < 1e-6


@pytest.mark.parametrize("delay", [True, False])
@pytest.mark.parametrize(
    "config",
    [{"schedule": "cooperative"}, {"schedule": "pingpong", "tile_n": 192},
     {"persistent": False, "epi_reuses_ab_smem": True, "ab_stages": 3}, {"split_k": 3}],
    ids=["cooperative", "pingpong", "one_tile_per_cta", "split_k"],
)  # fmt: skip
def test_the_store_issued_now_or_one_subtile_later(config, delay):
    """``delay_tma_store`` both ways on every kernel path, with an aux output and a vector, several tiles per CTA
    where persistent: the same D and aux as the reference, every subtile stored once (NaN-poisoned outputs)."""
    m, n, k = (515, 1000, 1032) if "split_k" in config or "persistent" in config else (2055, 4104, 1032)
    a, b, bias = rand(m, k), rand(k, n) / k**0.5, rand(n)

    def fn(acc, bias):
        return {"D": ops.gelu(acc + bias), "pre": acc + bias}

    outs = {"pre": torch.full((m, n), float("nan"), device="cuda")}
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    pinned = {**config, "delay_tma_store": delay}
    plan = epicute.explain(a, b, epilogue=fn, out=out, outs=outs, config=pinned, file=None, bias=bias)
    assert plan.config.delay_tma_store is delay
    got = epicute.gemm(a, b, epilogue=fn, out=out, outs=outs, config=pinned, bias=bias)
    ref = epicute.gemm(a, b, epilogue=fn, out_dtypes={"pre": torch.float32}, backend="reference", bias=bias)
    assert not torch.isnan(out).any() and not torch.isnan(outs["pre"]).any()
    assert rel_err(got["D"].cpu(), ref["D"]) < 1e-2 and rel_err(outs["pre"].cpu(), ref["pre"]) < 1e-4


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("shape", [(2055, 4104, 1032), (129, 200, 64)], ids=["tiles_per_cta", "one_tile"])
def test_d_staged_in_the_operand_ring(shape, reuse):
    """``reuse_smem_c`` (ReuseSmemC) both ways: D staged in the residual's ring slot, the slot given back once
    its store has been read, over several tiles per CTA and a ragged edge (NaN-poisoned D)."""
    m, n, k = shape
    a, b, bias, residual = rand(m, k), rand(k, n) / k**0.5, rand(n), rand(m, n)

    def ffn(acc, bias, residual):
        return ops.gelu(acc + bias) + residual

    config = {"schedule": "cooperative", "tile_n": 192, "reuse_smem_c": reuse}
    plan = epicute.explain(a, b, epilogue=ffn, config=config, file=None, bias=bias, residual=residual)
    assert plan.config.reuse_smem_c is reuse
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # a second call finds the ring's barriers as the first left them
        got = epicute.gemm(a, b, epilogue=ffn, out=out, config=config, bias=bias, residual=residual)
    ref = epicute.gemm(a, b, epilogue=ffn, backend="reference", bias=bias, residual=residual)
    assert not torch.isnan(got).any() and rel_err(got.cpu(), ref) < 1e-2
