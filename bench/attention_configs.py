"""Attention kernel configurations side by side: the measurements behind ``default_config``.

Usage: python bench/attention_configs.py [--out PATH]
For one case per head_dim (causal and not), times epicute.attention under each
candidate configuration of that head_dim (pinned through ``config=``; the
first, ``planner``, pins nothing) next to flash-attn-4's cute kernel, on the
same inputs with CUDA events. Writes bench/results/attention_configs.json:
one row per case, one key per configuration, TFLOPS.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
from pathlib import Path

import torch
from attention import contenders
from common import Row, time_cuda, write_result

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention_configs.json"
#: (head_dim, seqlen, batch, heads) -> candidate name -> pinned AttentionConfig fields
CANDIDATES: dict[tuple[int, int, int, int], dict[str, dict]] = {
    (64, 4096, 8, 8): {
        "planner": {},
        "m128": {"tile_m": 128},
        "m192_n112": {"tile_n": 112},
        "m192_n144": {"tile_n": 144},
        "m192_stages3": {"stages": 3},
    },
    (128, 8192, 4, 16): {
        "planner": {},
        "stages3": {"stages": 3},
        "n176": {"tile_n": 176},
        "n160": {"tile_n": 160},
        "n112": {"tile_n": 112},
    },
    (256, 8192, 2, 32): {
        "planner": {},
        "n64": {"tile_n": 64},
        "pingpong": {"pingpong": True},
        "n64_pingpong": {"tile_n": 64, "pingpong": True},
        "late_rescale": {"rescale_o_early": False},
    },
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import epicute

    fa_cute = contenders().get("fa_cute")
    rows: list[Row] = []
    for (d, s, b, h), configs in CANDIDATES.items():
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = 4 * b * h * s * s * d // (2 if causal else 1)
            row: Row = {"case": f"d{d} b{b} h{h} s{s}" + (" causal" if causal else "")}
            fns = {
                name: functools.partial(epicute.attention, q, k, v, causal=causal, config=c)
                for name, c in configs.items()
            }
            if fa_cute is not None:
                fns["fa_cute"] = functools.partial(fa_cute, q, k, v, causal)
            reference = None
            for name, fn in fns.items():
                try:
                    out = fn()
                    if reference is None:
                        reference = out.float()
                    err = ((out.float() - reference).norm() / reference.norm()).item()
                    if not err <= 1e-2:
                        raise AssertionError(f"rel err {err:.2e} against {next(iter(fns))}")
                    row[name] = round(flops / time_cuda(fn, warmup=3, iters=15) / 1e9, 1)
                except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported, not fatal
                    print(f"  {row['case']} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                    row[name] = None
            best = max((v, key) for key, v in row.items() if isinstance(v, float))
            print(
                f"{row['case']}: "
                + "  ".join(f"{key} {v}" for key, v in row.items() if key != "case")
                + f"  -> {best[1]}"
            )
            rows.append(row)
    command = shlex.join(["python", "bench/attention_configs.py", *sys.argv[1:]])
    write_result(args.out, "attention_configs", command, "TFLOPS", True, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
