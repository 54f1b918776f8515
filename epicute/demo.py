"""``epicute demo``: the five-minute tour, on a GPU or without one.

With a Hopper GPU it runs a bf16 GEMM, checks it against torch in float32 and
reports achieved TFLOPS next to cuBLAS. Without one it compiles the very same
kernel for sm_90a (proof that the toolchain works) and prints the plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from epicute.gemm import GemmPlan, GemmProblem, plan_gemm, render_plan
from epicute.gemm.api import explain, gemm
from epicute.gemm.compile import GEMM_CACHE
from epicute.gemm.launch import variant_of
from epicute.runtime.cache import KERNEL_CACHE


def _median_ms(fn: Callable[[], object], iters: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def _from_disk(plan: GemmPlan) -> bool:
    """Whether this process loaded the plan's kernel from the disk cache rather than compiling it."""
    return KERNEL_CACHE.events.get(variant_of(plan).key(), ("compiled", 0.0))[0] == "disk"


def run_demo(m: int = 8192, n: int = 8192, k: int = 8192, echo: Callable[[str], None] = print) -> bool:
    """Returns True when the demo's check passed (or, without a GPU, the kernel compiled)."""
    has_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if not has_gpu:
        echo("No Hopper GPU found: compiling the kernel for sm_90a only (no launch).")
        plan = plan_gemm(GemmProblem(m, n, k))
        echo(render_plan(plan))
        start = time.perf_counter()
        GEMM_CACHE.get(variant_of(plan))
        seconds = time.perf_counter() - start
        if _from_disk(plan):
            echo(f"\nloaded from the kernel cache in {seconds:.1f} s (compiled for sm_90a by an earlier run; "
                 "`epicute cache ls` lists it). Run on an H100 to execute it.")  # fmt: skip
        else:
            echo(f"\ncompiled for sm_90a in {seconds:.1f} s. Run on an H100 to execute it.")
        return True

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    plan = explain(a, b, file=None)
    echo(render_plan(plan))
    start = time.perf_counter()
    d = gemm(a, b)
    torch.cuda.synchronize()
    how = "load from the kernel cache" if _from_disk(plan) else "compile"
    echo(f"\nfirst call ({how} + run): {time.perf_counter() - start:.1f} s")
    ref = a.float() @ b.float()
    err = ((d.float() - ref).norm() / ref.norm()).item()
    ok = err <= 1e-2
    echo(f"relative error vs float32 torch: {err:.2e} ({'PASS' if ok else 'FAIL'})")
    flops = 2 * m * n * k
    ours = _median_ms(lambda: gemm(a, b))
    cublas = _median_ms(lambda: torch.matmul(a, b))
    echo(f"epicute: {ours:.3f} ms = {flops / ours / 1e9:.0f} TFLOPS")
    echo(f"cuBLAS : {cublas:.3f} ms = {flops / cublas / 1e9:.0f} TFLOPS  (torch.matmul, same inputs)")
    return ok
