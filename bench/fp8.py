"""fp8 GEMM throughput: epicute.gemm with fp8 inputs vs cuBLAS (torch._scaled_mm), in TFLOPS.

Usage: python bench/fp8.py [--shapes 8192x8192x8192,...]
       [--recipes tensorwise,rowwise,blockwise,blockwise_quantize,blockwise_swiglu_quantize] [--out PATH]
Recipes (``case`` names them): tensorwise (fp32 scalar tensors on the GPU), rowwise (A per row,
B per column) and blockwise (A per 1x128, B per 128x128 block of K), e4m3 inputs, bf16 output,
A row-major (M, K) and B as ``w.t()`` of a row-major (N, K) weight, as ``../shared/bench/PEERS.md``
calls ``torch._scaled_mm``. Peers, named by recipe: ``cublas_<recipe>`` (its default: the fp8
partial sums promoted to fp32 along K) and ``cublas_<recipe>_fast`` (``use_fast_accum=True``: no
promotion, as epicute's tensorwise and rowwise kernels); blockwise promotes in both.
``blockwise_quantize`` rows time epicute's blockwise GEMM with the fused quantize-for-next-GEMM
epilogue (SiLU, then ``ops.quantize_groups``: fp8 D and UE8M0 scales) against the same GEMM with a
bf16 D (``epicute_plain``), with the SiLU alone, bf16 D (``epicute_silu``), and with the quantization alone
of the product (``epicute_quantize``: fp8 D and scales, no activation). ``blockwise_swiglu_quantize`` rows
(an MLP's gate/up projection quantized for its fp8 down projection, DeepSeek-V3's dense MLP by default: 4096
tokens, 7168 -> 2 x 18432; ``MxNxK`` names D's N, B has 2N columns, gate and up interleaved in blocks of 8) time
epicute's gated blockwise GEMM with SwiGLU and 1x128 UE8M0 ``quantize_groups`` fused (``epicute``; with a bf16
SwiGLU D and no quantization, ``epicute_swiglu``) against ``torch._scaled_mm`` with the same blockwise scales
(rowwise ones, constant along K for every contender, where the installed torch takes no blockwise scales) and
then the same SwiGLU and quantization written in torch and compiled with ``torch.compile``
(``scaled_mm_compiled``); TFLOPS count the 2 x M x 2N x K of the GEMM. Every
contender's first call is checked against a float32 reference of the dequantized math and not
timed; then all are timed as ``triton.testing.do_bench`` times them (L2 flushed before each call,
calls back to back: fp8 GEMMs run at the H100's power cap, see
:func:`epicute.benchmark.time_flushed`), medians of interleaved rounds. A cached fp8 call costs
~20 us of host time (``bench/runtime.py``), under the flush's ~0.1 ms; one with the quantize
epilogue ~57 us, which the small shape's figure follows (its flushed time is host-bound). Writes
bench/results/fp8.json (and $OUT/fp8.json when OUT is set).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from common import Row, check_contenders, finish_peer_run, start_peer_run, time_interleaved
from gemm import parse_shapes

ALL_SHAPES = [
    (8192, 8192, 8192), (4096, 14336, 4096), (2048, 7168, 7168), (4096, 4096, 4096), (128, 7168, 2048),
    (1024, 4096, 14336), (16384, 4096, 4096),
]  # fmt: skip
#: Gated recipes' shapes (M, N of D, K): DeepSeek-V3's dense MLP (B is K x 2N).
MLP_SHAPES = [(4096, 18432, 7168)]
GATED_RECIPES = ("blockwise_swiglu_quantize",)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fp8.json"
TOLERANCE = 2e-2
E4M3 = torch.float8_e4m3fn


@functools.cache
def scaled_mm_takes_blockwise() -> bool:
    """Whether the installed torch's ``_scaled_mm`` takes blockwise scales (1x128 A, 128x128 B)."""
    a = torch.ones(128, 256, device="cuda").to(E4M3)
    b = torch.ones(128, 256, device="cuda").to(E4M3).t()
    try:
        sa, sb = torch.ones(2, 128, device="cuda").t(), torch.ones(1, 2, device="cuda").t()
        torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return True


def make_mlp_inputs(m: int, n: int, k: int) -> tuple:
    """(a, b, a_scale, b_scale, peer_scales) of a gated blockwise case: B ``(K, 2N)``, as ``w.t()`` of the
    interleaved ``(2N, K)`` weight; blockwise scales as ``torch._scaled_mm`` takes them, and the peer's: the
    same, or where its ``_scaled_mm`` takes no blockwise scales, rowwise ones whose product is the same (every
    contender's scales then constant along K, and B's along each 128-column block)."""
    assert n % 128 == 0, "the torch peer quantizes whole 128-column groups"
    a = (torch.randn(m, k, device="cuda") * 0.5).to(E4M3)
    b = (torch.randn(2 * n, k, device="cuda") * 0.5).to(E4M3).t()
    kb, nb = -(-k // 128), 2 * n // 128
    if scaled_mm_takes_blockwise():
        sa, sb = torch.rand(kb, m, device="cuda").t() + 0.5, torch.rand(nb, kb, device="cuda").t() + 0.5
        return a, b, sa, sb, (sa, sb)
    rows, blocks = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(nb, device="cuda") + 0.5
    sa = rows.expand(m, kb).t().contiguous().t()  # (M, KB), M-major
    sb = blocks[:, None].expand(nb, kb).t().contiguous().t()  # (KB, NB) as torch takes it: (NB, KB) transposed
    return a, b, sa, sb, (rows, blocks.repeat_interleave(128)[None, :])


def make_inputs(m: int, n: int, k: int, recipe: str) -> tuple:
    """(a, b, a_scale, b_scale) for one case, scales as ``torch._scaled_mm`` takes them."""
    if recipe in GATED_RECIPES:
        return make_mlp_inputs(m, n, k)[:4]
    a = (torch.randn(m, k, device="cuda") * 0.5).to(E4M3)
    b = (torch.randn(n, k, device="cuda") * 0.5).to(E4M3).t()
    if recipe == "tensorwise":
        sa, sb = torch.rand((), device="cuda") + 0.5, torch.rand((), device="cuda") + 0.5
    elif recipe == "rowwise":
        sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    else:  # blockwise (PEERS.md)
        sa = torch.rand(-(-k // 128), m, device="cuda").t()
        sb = torch.rand(-(-n // 128), -(-k // 128), device="cuda").t()
    return a, b, sa, sb


def contenders(recipe: str) -> dict:
    """Functions of ``(a, b, a_scale, b_scale, out=None)`` returning D: epicute, then cuBLAS as
    PEERS.md calls it (``use_fast_accum=False``: its fp8 partial sums are promoted to fp32 along K)
    and with fast accumulation (``use_fast_accum=True``: the WGMMA's own accumulator throughout, as
    epicute's tensorwise and rowwise kernels do). cuBLAS allocates D (``out`` is only for epicute's
    NaN-poisoned check); timed, every contender allocates it."""
    import epicute  # imported late: it needs the CuTe DSL

    def cublas(fast: bool):
        def run(a, b, sa, sb, out=None):
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)

        return run

    def plain(a, b, sa, sb, out=None):
        return epicute.gemm(a, b, a_scale=sa, b_scale=sb, out=out)

    if recipe == "blockwise_swiglu_quantize":  # the gated MLP against _scaled_mm + the compiled SwiGLU/quantize
        return {
            "epicute": lambda a, b, sa, sb, out=None: epicute.gemm(a, b, a_scale=sa, b_scale=sb, gated=True,
                                                                   epilogue=swiglu_then_quantize),
            "epicute_swiglu": lambda a, b, sa, sb, out=None: {"swiglu": epicute.gemm(a, b, a_scale=sa, b_scale=sb,
                                                                                    gated=True, epilogue=swiglu)},
        }  # fmt: skip
    if recipe == "blockwise_quantize":  # the fused quantize-for-next-GEMM epilogue against the plain GEMM
        return {
            "epicute": lambda a, b, sa, sb, out=None: epicute.gemm(a, b, a_scale=sa, b_scale=sb,
                                                                   epilogue=silu_then_quantize),
            "epicute_plain": plain,
            "epicute_silu": lambda a, b, sa, sb, out=None: {"silu": epicute.gemm(a, b, a_scale=sa, b_scale=sb,
                                                                                epilogue=silu_only, out=out)},
            "epicute_quantize": lambda a, b, sa, sb, out=None: {"quantized": epicute.gemm(
                a, b, a_scale=sa, b_scale=sb, epilogue=quantize_only)},
        }  # fmt: skip
    found = {"epicute": plain, f"cublas_{recipe}": cublas(False)}
    if recipe != "blockwise":  # cuBLAS's blockwise recipe always promotes
        found[f"cublas_{recipe}_fast"] = cublas(True)
    return found


def silu_then_quantize(acc):
    """The quantize-for-next-GEMM epilogue: SiLU, then fp8 e4m3 per row and group of 128 columns, UE8M0 scales."""
    from epicute import ops

    q, scales = ops.quantize_groups(ops.silu(acc), ue8m0=True)
    return {"D": q, "scales": scales}


def quantize_only(acc):
    """The quantization alone (no activation): what ``quantize_groups`` costs over the plain GEMM."""
    from epicute import ops

    q, scales = ops.quantize_groups(acc, ue8m0=True)
    return {"D": q, "scales": scales}


def swiglu_then_quantize(gate, up):
    """A gated MLP's epilogue: SwiGLU, then fp8 e4m3 per row and group of 128 columns, UE8M0 scales."""
    from epicute import ops

    q, scales = ops.quantize_groups(ops.silu(gate) * up, ue8m0=True)
    return {"D": q, "scales": scales}


def swiglu(gate, up):
    """SwiGLU alone, bf16 D: what the quantization adds is the difference."""
    from epicute import ops

    return ops.silu(gate) * up


def torch_swiglu_quantize(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The peer's epilogue in torch: ``y`` ``(M, 2N)`` holds gate and up interleaved in blocks of 8 columns;
    SwiGLU in fp32, then per row and group of 128 columns ``scale = max(amax, 1e-4) / 448`` rounded up to a
    power of two (UE8M0), D = x / scale in e4m3 (saturating), the scales ``(M, N/128)`` M-major (the next
    GEMM's blockwise A scale): ``epicute.ops.quantize_groups``' math."""
    m, n2 = y.shape
    gate_up = y.view(m, n2 // 16, 2, 8).float()
    x = (torch.nn.functional.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]).reshape(m, n2 // 256, 128)
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(dim=-1).clamp(min=1e-4) / 448.0)))
    q = (x * (1.0 / scale)[..., None]).clamp(-448.0, 448.0).to(E4M3).reshape(m, n2 // 2)
    return q, scale.t().contiguous().t()


@functools.cache
def compiled_swiglu_quantize():
    return torch.compile(torch_swiglu_quantize)


def mlp_peers(peer_scales: tuple) -> dict:
    """``torch._scaled_mm`` (blockwise scales, or rowwise ones of the same product: :func:`make_mlp_inputs`)
    into a bf16 ``(M, 2N)``, then :func:`torch_swiglu_quantize` compiled with ``torch.compile``."""
    sa, sb = peer_scales
    name = "scaled_mm_compiled" if scaled_mm_takes_blockwise() else "scaled_mm_rowwise_compiled"

    def run(a, b, _sa, _sb, out=None):
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        q, scales = compiled_swiglu_quantize()(y)
        return {"D": q, "scales": scales}

    return {name: run}


def silu_only(acc):
    """The quantize epilogue's SiLU alone, bf16 D: what the quantization adds is the difference."""
    from epicute import ops

    return ops.silu(acc)


def checked_value(result, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what a contender returned, what it should be) as float32: a quantized output dequantized, against the
    reference's own quantization of SiLU of the product (an fp8 rounding may flip, never more)."""
    if not isinstance(result, dict):
        return result.float(), ref
    if "swiglu" in result:
        return result["swiglu"].float(), swiglu_of(ref)
    if "silu" in result:
        return result["silu"].float(), torch.nn.functional.silu(ref)
    from epicute.epilogue.group_quant import group_quantize

    if "quantized" in result:  # the quantization alone, of the product itself
        result = result["quantized"]
    elif result["D"].shape[-1] * 2 == ref.shape[-1]:  # gated: SwiGLU of the interleaved gate and up
        ref = swiglu_of(ref)
    else:
        ref = torch.nn.functional.silu(ref)
    q, scales = group_quantize(ref[None], "fp8e4m3", ue8m0=True)

    def dequantized(values, s):
        return values.float() * s.repeat_interleave(128, dim=-1)[..., : values.shape[-1]]

    return dequantized(result["D"], result["scales"]), dequantized(q[0], scales[0])


def swiglu_of(product: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a gated GEMM's float32 ``(M, 2N)`` product (gate and up interleaved in blocks of 8 columns)."""
    m, n2 = product.shape
    gate, up = product.view(m, n2 // 16, 2, 8).unbind(-2)
    return (torch.nn.functional.silu(gate) * up).reshape(m, n2 // 2)


def reference(a, b, sa, sb, recipe: str) -> torch.Tensor:
    if recipe.startswith("blockwise"):
        a_deq = a.float() * sa.repeat_interleave(128, dim=1)[:, : a.shape[1]]
        b_deq = b.float() * sb.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[: b.shape[0], : b.shape[1]]
        return a_deq @ b_deq
    return (a.float() @ b.float()) * sa * sb


def run_case(shape, recipe: str) -> tuple[Row, bool]:
    from epicute.benchmark import time_flushed  # imported late: it needs the CuTe DSL

    m, n, k = shape
    gated = recipe in GATED_RECIPES
    peers = {}
    if gated:  # B has 2N columns: gate and up
        *inputs, peer_scales = make_mlp_inputs(m, n, k)
        peers = mlp_peers(peer_scales)
    else:
        inputs = make_inputs(m, n, k, recipe)
    a, b, sa, sb = inputs
    ref = reference(a, b, sa, sb, recipe)
    row: Row = {"case": f"{recipe} e4m3 {m}x{'2x' if gated else ''}{n}x{k}"}
    print(row["case"])

    def poisoned(fn):  # the checked call writes a fresh NaN-poisoned D (where a contender takes out=)
        return lambda: fn(*inputs, out=torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16))

    calls = {name: (poisoned(fn), functools.partial(fn, *inputs)) for name, fn in {**contenders(recipe),
                                                                                    **peers}.items()}  # fmt: skip

    def error(result) -> float:
        got, want = checked_value(result, ref)
        return ((got - want).norm() / want.norm()).item()

    timed, ok = check_contenders(calls, error, TOLERANCE)
    flops = 2 * m * (2 * n if gated else n) * k
    for name, ms in time_interleaved(timed, timer=time_flushed).items():
        row[name] = round(flops / (ms * 1e-3) / 1e12, 1)
    return row, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, help="comma-separated MxNxK list (default: the issue's set)")
    parser.add_argument(
        "--recipes", default="tensorwise,rowwise,blockwise,blockwise_quantize,blockwise_swiglu_quantize"
    )
    args = start_peer_run(parser, DEFAULT_OUT)
    if args is None:
        return 2
    rows, all_ok = [], True
    for recipe in args.recipes.split(","):
        for shape in args.shapes or (MLP_SHAPES if recipe in GATED_RECIPES else ALL_SHAPES):
            row, ok = run_case(shape, recipe)
            rows.append(row)
            all_ok = all_ok and ok
            torch.cuda.empty_cache()
    return finish_peer_run(args.out, "fp8", rows, all_ok)


if __name__ == "__main__":
    sys.exit(main())
