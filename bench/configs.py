"""Kernel configurations side by side: the measurements behind the planner's choices.

Usage: python bench/configs.py [--shapes MxNxK,...] [--epilogue] [--out PATH]
For each shape, times every configuration in CANDIDATES (pinned through
``config=``; stages are fitted by the planner) plus the planner's own choice and
cuBLAS, on rotating inputs with CUDA events. ``--epilogue`` times
``gelu(alpha*acc + bias) + residual`` fused instead of the plain GEMM. Writes
bench/results/configs.json (or configs_epilogue.json): one row per shape, one
key per configuration, TFLOPS.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch
from common import Row, time_cuda, write_result
from gemm import ALL_SHAPES, make_sets, parse_shapes, rel_error, rotating

RESULTS = Path(__file__).resolve().parent / "results"
CANDIDATES: dict[str, dict] = {
    "coop_128x256_c2x1": {"tile_n": 256, "cluster_m": 2, "persistent": True},
    "coop_128x224_c2x1": {"tile_n": 224, "cluster_m": 2, "persistent": True},
    "coop_128x192_c2x1": {"tile_n": 192, "cluster_m": 2, "persistent": True},
    "coop_128x128_c2x1": {"tile_n": 128, "cluster_m": 2, "persistent": True},
    "pp_128x128_c1x1": {"schedule": "pingpong", "tile_n": 128},
    "pp_128x128_c2x1": {"schedule": "pingpong", "tile_n": 128, "cluster_m": 2},
    "pp_128x128_c1x2": {"schedule": "pingpong", "tile_n": 128, "cluster_n": 2},
    "pp_128x192_c1x1": {"schedule": "pingpong", "tile_n": 192},
    "pp_128x192_c2x1": {"schedule": "pingpong", "tile_n": 192, "cluster_m": 2},
    "pp_64x256_c2x1": {"schedule": "pingpong", "tile_m": 64, "tile_n": 256, "cluster_m": 2},
    # under-filled problems (small M): more, narrower tiles
    "coop_128x64_c2x1": {"tile_n": 64, "cluster_m": 2, "persistent": True},
    "pp_64x128_c1x1": {"schedule": "pingpong", "tile_m": 64, "tile_n": 128},
    "pp_64x128_c2x1": {"schedule": "pingpong", "tile_m": 64, "tile_n": 128, "cluster_m": 2},
    "coop_128x128_c1x1": {"tile_n": 128, "persistent": True},
    "coop_planned": {"schedule": "cooperative"},
    "pp_planned": {"schedule": "pingpong"},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=ALL_SHAPES)
    parser.add_argument("--epilogue", action="store_true", help="time the bias+gelu+residual epilogue fused")
    parser.add_argument("--only", help="comma-separated candidate names (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import epicute

    @epicute.epilogue
    def ffn_out(acc, bias, residual, alpha):
        return epicute.ops.gelu(alpha * acc + bias) + residual

    names = args.only.split(",") if args.only else list(CANDIDATES)
    configs = {"planner": None, **{name: CANDIDATES[name] for name in names}}
    rows: list[Row] = []
    for m, n, k in args.shapes:
        sets = make_sets(m, n, k)
        bias = epicute.RowVector(torch.randn(n, device="cuda", dtype=torch.bfloat16))
        residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        row: Row = {"case": f"bf16 {m}x{n}x{k}"}
        for name, config in configs.items():
            if args.epilogue:

                def fn(a, b, d, config=config, bias=bias, residual=residual):
                    return epicute.gemm(a, b, epilogue=ffn_out, out=d, config=config,
                                        bias=bias, residual=residual, alpha=0.5)  # fmt: skip
            else:

                def fn(a, b, d, config=config):
                    return epicute.gemm(a, b, out=d, config=config)

            try:
                if not args.epilogue:
                    a0, b0, _ = sets[0]
                    err = rel_error(fn, a0, b0, a0.float() @ b0.float())
                    if not err <= 1e-2:
                        raise AssertionError(f"rel err {err:.2e}")
                ms = time_cuda(rotating(fn, sets))
                row[name] = round(2 * m * n * k / ms / 1e9, 1)
            except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported, not fatal
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}")
                row[name] = None
        if not args.epilogue:
            cublas_ms = time_cuda(rotating(lambda a, b, d: torch.matmul(a, b, out=d), sets))
            row["cublas"] = round(2 * m * n * k / cublas_ms / 1e9, 1)
        best = max((v, key) for key, v in row.items() if isinstance(v, float))
        print(
            f"{row['case']}: " + "  ".join(f"{key} {v}" for key, v in row.items() if key != "case") + f"  -> {best[1]}"
        )
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    out = args.out or RESULTS / ("configs_epilogue.json" if args.epilogue else "configs.json")
    command = shlex.join(["python", "bench/configs.py", *sys.argv[1:]])
    write_result(out, "configs", command, "TFLOPS", True, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
