"""One small epicute call for compute-sanitizer to watch (see bench/device.sh).

Usage: python bench/sanitize_case.py small|ragged|pingpong|epilogue|attention
`small` is one aligned 128x256x64 tile problem; `ragged` (M=129, N=136, K=72) exercises the
partial-tile paths; `pingpong` gives every CTA of the ping-pong schedule two or three ragged
tiles, so both warpgroups' turns and the shared staging buffers are exercised; `epilogue` runs
every stage of the GEMM's epilogue chain (a TMA-loaded operand tile, a parked vector, an aux tile
staged beside D, row/column/whole reductions) under ping-pong; `attention` runs attention's
output chain (O and an aux tile staged in turn in Q's buffer, reductions) on persistent CTAs,
some of which walk two tiles. Prints PASS/FAIL and exits 1 on failure.
"""

from __future__ import annotations

import sys

import torch

#: name -> (M, N, K, config overrides) of the GEMM cases
GEMM_CASES: dict[str, tuple[int, int, int, dict]] = {
    "small": (128, 256, 64, {}),
    "ragged": (129, 136, 72, {}),
    "pingpong": (2049, 2056, 72, {"schedule": "pingpong", "tile_n": 128}),
    "epilogue": (2049, 2056, 72, {"schedule": "pingpong", "tile_n": 128}),
}
CASES = (*GEMM_CASES, "attention")
TOLERANCE = 1e-2


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()  # NaN when unwritten


def gemm_case(name: str) -> dict[str, float]:
    import epicute
    from epicute import ops

    m, n, k, config = GEMM_CASES[name]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    # NaN poison: any element the kernel fails to write makes the error NaN, hence FAIL.
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    if name != "epilogue":
        epicute.gemm(a, b, out=out, config=config)
        return {"D": rel_err(out, a.float() @ b.float())}
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def epi(acc, bias, residual):
        y = acc + bias
        return {"D": y + residual, "pre": y, "rs": ops.row_sum(acc), "cm": ops.col_amax(acc), "am": ops.amax(acc)}

    got = epicute.gemm(a, b, epilogue=epi, out=out, config=config, bias=bias, residual=residual)
    ref = epicute.gemm(a, b, epilogue=epi, bias=bias, residual=residual, backend="reference")
    return {name: rel_err(got[name], ref[name].to(got[name].device)) for name in ref}


def attention_case() -> dict[str, float]:
    import epicute
    from epicute import ops

    # 12 m-blocks x 12 heads = 144 tiles: more than SMs, so some CTAs walk two.
    q, k, v = (torch.randn(1, 1500, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def epi(o):
        return {"D": o, "half": ops.cast(o * 0.5, torch.float16), "rs": ops.row_sum(o), "am": ops.amax(o)}

    # Static persistent tiles: racecheck reports the dynamic tile slot's hand-off (a producer's plain
    # shared-memory writes, ordered for the consumers by mbarriers), which it does not model
    # (bench/NOTES.md, 'Sanitizer' under 'The house finished'); the outputs' staging in Q's buffer
    # is the same either way.
    config = {"persistent": True, "dynamic_tiles": False}
    got = epicute.attention(q, k, v, causal=True, epilogue=epi, config=config)
    ref = epicute.attention(q, k, v, causal=True, epilogue=epi, backend="reference")
    return {name: rel_err(got[name], ref[name].to(got[name].device)) for name in ref}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print(f"usage: {sys.argv[0]} {'|'.join(CASES)}")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    name = sys.argv[1]
    torch.manual_seed(0)
    errors = attention_case() if name == "attention" else gemm_case(name)
    torch.cuda.synchronize()
    ok = all(err <= TOLERANCE for err in errors.values())  # False for NaN too
    listed = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(f"{'PASS' if ok else 'FAIL'} {name}: rel err {listed}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
