"""Where a GEMM epilogue stages and stores D, A/B on the H200: the planner's evidence for two choices.

Usage: python bench/epilogue_staging.py --what delay|reuse [--shapes MxNxK,...] [--out PATH]

- ``delay``: each subtile's TMA store issued per subtile or one subtile later (``delay_tma_store``, CUTLASS's
  DelayTmaStore), for a plain GEMM and a fused epilogue without operand tiles (gelu(alpha * acc + bias)); operand
  tiles keep the store per subtile (``epicute.epilogue.schedule.delayable``). Writes
  bench/results/configs_store_delay.json: ``epicute`` delayed, ``epicute_store_per_subtile`` not.
- ``reuse``: D staged in its own buffers or in the residual's operand ring (``reuse_smem_c``, CUTLASS's
  ReuseSmemC) for gelu(acc + bias) + residual on cooperative 128x192 tiles, where the freed shared memory buys a
  fifth A/B stage; the planner's default plan (ping-pong) of the same epilogue beside them. Writes
  bench/results/configs_reuse_smem_c.json: ``epicute`` reused, ``epicute_own_staging`` not, ``epicute_planner``.

Each pair is pinned through ``config=`` (the rest planned), checked equal within bf16 rounding, and timed in
interleaved rounds with L2 flushed (medians).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import Row, finish_peer_run, start_peer_run, time_interleaved

RESULTS = Path(__file__).resolve().parent / "results"
OUT = {"delay": RESULTS / "configs_store_delay.json", "reuse": RESULTS / "configs_reuse_smem_c.json"}
SHAPES = ((8192, 8192, 8192), (4096, 14336, 4096), (1000, 14336, 4096), (1024, 14336, 4096), (512, 4096, 4096))
COOPERATIVE_192 = {"schedule": "cooperative", "tile_n": 192}


def contenders(what: str, a, b, bias, residual) -> dict[str, tuple[str, dict]]:
    """case kind -> contender -> gemm keyword arguments."""
    from epicute import ops

    if what == "delay":
        def bias_gelu(acc, bias, alpha):
            return ops.gelu(alpha * acc + bias)

        fused = {"epilogue": bias_gelu, "bias": bias, "alpha": 0.5}
        return {kind: {"epicute": {"config": {"delay_tma_store": True}, **kw},
                       "epicute_store_per_subtile": {"config": {"delay_tma_store": False}, **kw}}
                for kind, kw in (("plain", {}), ("bias_gelu", fused))}  # fmt: skip

    def ffn(acc, bias, residual):
        return ops.gelu(acc + bias) + residual

    fused = {"epilogue": ffn, "bias": bias, "residual": residual}
    return {"ffn": {"epicute": {"config": {**COOPERATIVE_192, "reuse_smem_c": True}, **fused},
                    "epicute_own_staging": {"config": {**COOPERATIVE_192, "reuse_smem_c": False}, **fused},
                    "epicute_planner": fused}}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=sorted(OUT), required=True)
    parser.add_argument("--shapes", type=lambda t: [tuple(int(v) for v in s.split("x")) for s in t.split(",")],
                        default=SHAPES, help="comma-separated MxNxK list")  # fmt: skip
    what = sys.argv[sys.argv.index("--what") + 1] if "--what" in sys.argv else "delay"
    args = start_peer_run(parser, OUT.get(what, OUT["delay"]))
    if args is None:
        return 2
    import torch

    import epicute
    from epicute.benchmark import time_flushed

    rows: list[Row] = []
    ok = True
    for m, n, k in args.shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        for kind, calls in contenders(args.what, a, b, bias, residual).items():
            fns = {name: (lambda a=a, b=b, kw=kw: epicute.gemm(a, b, **kw)) for name, kw in calls.items()}
            results = [fn().float() for fn in fns.values()]
            ok &= all(((r - results[0]).norm() / results[0].norm()).item() < 1e-2 for r in results[1:])
            times = time_interleaved(fns, timer=time_flushed)
            row: Row = {"case": f"{kind} {m}x{n}x{k}"}
            row.update({name: round(2 * m * n * k / (ms * 1e-3) / 1e12, 1) for name, ms in times.items()})
            rows.append(row)
            print(", ".join(f"{key} {value}" for key, value in row.items()))
    return finish_peer_run(args.out, "configs", rows, ok)


if __name__ == "__main__":
    sys.exit(main())
