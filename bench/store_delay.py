"""The TMA store issued per subtile or one subtile later (``delay_tma_store``, CUTLASS's DelayTmaStore), A/B (H200).

Usage: python bench/store_delay.py [--out PATH]

For the epilogue benchmark's shapes, a plain GEMM and a fused epilogue without operand tiles (gelu(alpha * acc +
bias): a vector and a scalar; operand tiles keep the store per subtile, see ``epicute.epilogue.schedule.delayable``)
each run with ``config={"delay_tma_store": True}`` (``epicute``) and ``False`` (``epicute_store_per_subtile``), the
rest planned, timed in interleaved rounds with L2 flushed (medians). The two outputs of the fused epilogue are
checked equal within bf16 rounding first. Writes bench/results/configs_store_delay.json (TFLOPS): the planner's
evidence, not a peer comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import Row, finish_peer_run, start_peer_run, time_interleaved

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "configs_store_delay.json"
SHAPES = ((8192, 8192, 8192), (4096, 14336, 4096), (1000, 14336, 4096), (1024, 14336, 4096), (512, 4096, 4096))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = start_peer_run(parser, DEFAULT_OUT)
    if args is None:
        return 2
    import torch

    import epicute
    from epicute import ops
    from epicute.benchmark import time_flushed

    def bias_gelu(acc, bias, alpha):
        return ops.gelu(alpha * acc + bias)

    rows: list[Row] = []
    ok = True
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        fused = {"epilogue": bias_gelu, "bias": bias, "alpha": 0.5}
        calls = {}
        for kind, kw in (("plain", {}), ("bias_gelu", fused)):
            for delay in (True, False):
                pinned = {"config": {"delay_tma_store": delay}, **kw}
                calls[kind, delay] = lambda a=a, b=b, pinned=pinned: epicute.gemm(a, b, **pinned)
        got, want = calls["bias_gelu", True]().float(), calls["bias_gelu", False]().float()
        ok &= ((got - want).norm() / want.norm()).item() < 1e-2
        times = time_interleaved({f"{kind} {delay}": fn for (kind, delay), fn in calls.items()}, timer=time_flushed)
        for kind in ("plain", "bias_gelu"):
            flops = 2 * m * n * k
            tflops = {delay: round(flops / (times[f"{kind} {delay}"] * 1e-3) / 1e12, 1) for delay in (True, False)}
            rows.append({"case": f"{kind} {m}x{n}x{k}", "epicute": tflops[True],
                         "epicute_store_per_subtile": tflops[False]})  # fmt: skip
            print(f"{rows[-1]['case']}: delayed {tflops[True]}, per subtile {tflops[False]} TFLOPS "
                  f"({tflops[True] / tflops[False]:.3f}x)")  # fmt: skip
    return finish_peer_run(args.out, "configs", rows, ok)


if __name__ == "__main__":
    sys.exit(main())
