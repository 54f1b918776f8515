"""One small epicute.gemm call for compute-sanitizer to watch (see bench/device.sh).

Usage: python bench/sanitize_case.py small|ragged|pingpong
`small` is one aligned 128x256x64 tile problem; `ragged` (M=129, N=136, K=72) exercises the
partial-tile paths; `pingpong` gives every CTA of the ping-pong schedule two or three ragged
tiles, so both warpgroups' turns and the shared staging buffers are exercised. Prints
PASS/FAIL and exits 1 on failure.
"""

from __future__ import annotations

import sys

import torch

#: name -> (M, N, K, config overrides)
CASES: dict[str, tuple[int, int, int, dict]] = {
    "small": (128, 256, 64, {}),
    "ragged": (129, 136, 72, {}),
    "pingpong": (2049, 2056, 72, {"schedule": "pingpong", "tile_n": 128}),
}
TOLERANCE = 1e-2


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print(f"usage: {sys.argv[0]} {'|'.join(CASES)}")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import epicute  # imported late: it needs the CuTe DSL, which CPU-only machines may lack

    name = sys.argv[1]
    m, n, k, config = CASES[name]
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    # NaN poison: any element the kernel fails to write makes the error NaN, hence FAIL.
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    epicute.gemm(a, b, out=out, config=config)
    torch.cuda.synchronize()
    ref = a.float() @ b.float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ok = err <= TOLERANCE  # False for NaN too
    print(f"{'PASS' if ok else 'FAIL'} {name} {m}x{n}x{k}: rel err {err:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
