"""Split-K: problems too small to fill the GPU run K in slices, as a batch.

A GEMM with fewer output tiles than the GPU has SMs (the small-M shapes of
decoding and small batches) leaves most SMs idle however fast each tile runs.
Cutting K into ``S`` equal slices turns one ``(M, N, K)`` problem into a batch of
``S`` problems ``(M, N, K / S)``: A and B are *viewed* per slice through their
strides (no copy), the kernel writes each slice's fp32 partial product into an
``(S, M, N)`` workspace, and one ordered ``torch.sum`` over the slices rounds
once to D's dtype. No atomics, so results are bitwise reproducible run to run.

Where it applies: plain GEMMs (a fused epilogue must see the full sum), one
batch (``L == 1``), and K divisible by ``8 S`` (each slice's start must stay
16-byte aligned for TMA). The planner splits when the roofline, charged the
workspace traffic and the extra reduction launch, predicts a gain.
"""

from __future__ import annotations

from dataclasses import replace

from epicute.plan.config import DTYPE_BYTES, GemmProblem
from epicute.plan.hardware import Hardware
from epicute.plan.roofline import estimate_seconds

SPLITS = (2, 4, 8)
#: A slice keeps at least this many k elements (16 k-tiles), so the mainloop still pipelines.
MIN_SLICE_K = 1024
#: Host and GPU cost of the reduction's separate launch.
REDUCE_LAUNCH_S = 4e-6


def sliced(problem: GemmProblem, splits: int) -> GemmProblem:
    """The batch of ``splits`` K-slices the kernel runs: fp32 partials, one per slice."""
    return replace(problem, k=problem.k // splits, l=splits, d_dtype="fp32")


def feasible(problem: GemmProblem, splits: int) -> bool:
    return problem.l == 1 and problem.k % (8 * splits) == 0 and problem.k // splits >= MIN_SLICE_K


def estimate(problem: GemmProblem, hw: Hardware, splits: int) -> float:
    """Predicted seconds with ``splits`` slices (1: unsplit), the best of 128- and 256-wide tiles."""
    inner = sliced(problem, splits) if splits > 1 else problem
    kernel_s = min(estimate_seconds(inner, hw, 128, tile_n) for tile_n in (128, 256))
    if splits == 1:
        return kernel_s
    workspace = splits * problem.m * problem.n * 4  # written by the kernel, read by the sum
    result = problem.m * problem.n * DTYPE_BYTES[problem.d_dtype]
    return kernel_s + (workspace + result) / (hw.hbm_tb_per_s * 1e12) + REDUCE_LAUNCH_S


def choose_split_k(problem: GemmProblem, hw: Hardware) -> tuple[int, str | None]:
    """How many K-slices to run (1: no split), and why; only problems that fill under a wave split."""
    tiles = -(-problem.m // 128) * -(-problem.n // 128) * problem.l
    if tiles >= hw.num_sms:
        return 1, None
    options = [s for s in SPLITS if feasible(problem, s)]
    if not options:
        return 1, None
    times = {s: estimate(problem, hw, s) for s in (1, *options)}
    best = min(times, key=times.__getitem__)
    if best == 1:
        return 1, None
    return best, (
        f"split-K {best}: {tiles} 128x128 tiles fill under a wave; {best} K-slices estimated "
        f"{times[best] * 1e6:.0f} us (reduction included) vs {times[1] * 1e6:.0f} us unsplit"
    )
