"""The standalone fp8 quantizer (``epicute.quantize``, 1 x 128 groups) against torch.compile of the same math (H200).

Usage: python bench/quantize.py [--shapes MxK,...] [--pairs] [--out PATH]

Each case quantizes a bf16 activation of a real model's shape (per row and 128 columns, e4m3, UE8M0 scales as
DeepSeek-V3's recipe takes them) and reports GB/s of the bytes it must move: x read once (2 bytes a value), q
written (1 byte) and the fp32 scales. The peer, ``torch_compile``, is :func:`torch_group_quantize` (the same math
in torch, the layout epicute returns) under ``torch.compile``. Each contender's result is checked against
epicute's reference on the CPU first (dequantized, relative error). Timed in interleaved rounds with L2 flushed
(``time_flushed``, medians). The H200's HBM moves at most 4.8 TB/s: the issue's target is 80 % of it (3840 GB/s).
Writes bench/results/quantize.json (unit GB/s).

``--pairs`` times the tile quantizer instead (``quantize_pair``: x along its rows and x.t() along the tokens from
one read, what fp8 training quantizes each activation, gradient and weight by), for the three pairs fp8 training
takes: an activation (rows 1 x 128, columns 128 x 128 blocks), a gradient (1 x 128 both ways), a weight (blocks
both ways); bytes: x read once, both fp8 outputs and their scales written. The peer is the same math in torch
(:func:`torch_pair`) under ``torch.compile``. Writes bench/results/quantize_pairs.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import Row, check_contenders, finish_peer_run, start_peer_run, time_interleaved

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "quantize.json"
PAIRS_OUT = DEFAULT_OUT.with_name("quantize_pairs.json")
#: (rows, columns) recipes of what fp8 training quantizes: an activation, a gradient, a weight
PAIRS = (("groups", "blocks"), ("groups", "groups"), ("blocks", "blocks"))
#: (tokens, hidden) of the activations a model's first fp8 GEMM reads: Llama-3-8B's hidden and MLP widths,
#: DeepSeek-V3's hidden, Qwen3-30B-A3B's, at a training step's token counts
SHAPES = ((8192, 4096), (8192, 14336), (16384, 7168), (32768, 2048), (4096, 18432))
HBM_GBS = 4800.0
TOLERANCE = 2e-2  # relative, of the dequantized values against the reference's: one fp8 rounding


def torch_group_quantize(x):
    """The peer: per row and 128 columns, ``scale = 2 ** ceil(log2(max(amax, 1e-4) / 448))``, q = x / scale in
    e4m3 (saturating); scales ``(M, K / 128)`` M-major."""
    import torch

    m, k = x.shape
    groups = x.float().view(m, k // 128, 128)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-4) / 448.0)))
    q = (groups * (1.0 / scale)[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(m, k)
    return q, scale.t().contiguous().t()


def _torch_recipe(x, recipe: str):
    import torch

    m, k = x.shape
    v = x.float()
    if recipe == "groups":
        amax = v.view(m, k // 128, 128).abs().amax(-1)
        expanded = lambda s: s[..., None].expand(m, k // 128, 128).reshape(m, k)  # noqa: E731
    else:
        amax = v.view(m // 128, 128, k // 128, 128).abs().amax(dim=(1, 3))
        expanded = lambda s: s[:, None, :, None].expand(m // 128, 128, k // 128, 128).reshape(m, k)  # noqa: E731
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-4) / 448.0)))
    q = (v * expanded(1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale.t().contiguous().t() if recipe == "groups" else scale


def torch_pair(x, rows: str, columns: str):
    """The peer of ``--pairs``: ``x`` by recipe ``rows`` and ``x.t()`` by recipe ``columns`` (sizes multiples of
    128: no padding), UE8M0 scales, in the layouts ``quantize_pair`` returns."""
    return _torch_recipe(x, rows), _torch_recipe(x.t(), columns)


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(","))  # type: ignore[misc]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="comma-separated MxK list")
    parser.add_argument("--pairs", action="store_true", help="time the tile quantizer (quantize_pair) instead")
    pairs = "--pairs" in sys.argv
    args = start_peer_run(parser, PAIRS_OUT if pairs else DEFAULT_OUT)
    if args is None:
        return 2
    import torch

    if args.pairs:
        compiled = torch.compile(torch_pair)
        cases = [run_pair(m, k, rows, columns, compiled) for m, k in args.shapes for rows, columns in PAIRS]
        rows_, oks = zip(*cases)
        return finish_peer_run(args.out, "quantize_pairs", list(rows_), all(oks), unit="GB/s")
    compiled = torch.compile(torch_group_quantize)
    rows, oks = zip(*(run_case(m, k, compiled) for m, k in args.shapes))
    return finish_peer_run(args.out, "quantize", list(rows), all(oks), unit="GB/s")


def run_case(m: int, k: int, compiled) -> tuple[Row, bool]:
    import torch

    import epicute

    x = (torch.randn(m, k, device="cuda") * torch.rand(k, device="cuda") * 30).to(torch.bfloat16)
    with epicute.use_backend("reference"):
        ref_q, ref_s = epicute.quantize(x[:256].cpu(), ue8m0=True)  # a slice: the CPU reference is slow
    want = ref_q.double() * ref_s.double().repeat_interleave(128, -1)

    def error(result) -> float:
        q, s = result
        got = q[:256].double().cpu() * s[:256].double().cpu().repeat_interleave(128, -1)
        return ((got - want).norm() / want.norm()).item()

    calls = {"epicute": lambda: epicute.quantize(x, ue8m0=True), "torch_compile": lambda: compiled(x)}
    return timed_row(f"bf16 -> e4m3 1x128 ue8m0 {m}x{k}", calls, error, m * k * 3 + m * (k // 128) * 4)


def timed_row(case: str, calls: dict, error, moved: int) -> tuple[Row, bool]:
    """Each contender checked (``error`` of its result under :data:`TOLERANCE`), timed in interleaved rounds with
    L2 flushed, and reported in GB/s of the ``moved`` bytes."""
    from epicute.benchmark import time_flushed

    # Both approximate x within an fp8 rounding; a peer whose fp32 log2 puts a scale on the other power of two
    # differs by about that much.
    timed, ok = check_contenders({name: (fn, fn) for name, fn in calls.items()}, error, TOLERANCE)
    times = time_interleaved(timed, timer=time_flushed)
    row: Row = {"case": case}
    for name, ms in times.items():
        row[name] = round(moved / (ms * 1e-3) / 1e9, 1)
    print(f"{case}: " + ", ".join(f"{n} {ms * 1e3:.1f} us ({row[n]} GB/s)" for n, ms in times.items())
          + f"; epicute at {row.get('epicute', 0) / HBM_GBS:.0%} of {HBM_GBS:.0f} GB/s")  # fmt: skip
    return row, ok


def run_pair(m: int, k: int, rows: str, columns: str, compiled) -> tuple[Row, bool]:
    import torch

    from epicute.quantize.api import quantize_pair

    x = (torch.randn(m, k, device="cuda") * torch.rand(k, device="cuda") * 30).to(torch.bfloat16)
    ref = quantize_pair(x[:256, :256].cpu(), rows, columns, ue8m0=True, backend="reference")

    def dequantized(pair, recipe):
        q, s = pair
        q, s = q[:256, :256].double().cpu(), s.double().cpu()
        if recipe == "groups":
            return q * s[:256].repeat_interleave(128, -1)[:, :256]
        return q * s[:2, :2].repeat_interleave(128, 0).repeat_interleave(128, 1)

    want = [dequantized(p, r) for p, r in zip(ref, (rows, columns))]

    def error(result) -> float:
        got = [dequantized(p, r) for p, r in zip(result, (rows, columns))]
        return max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))

    calls = {"epicute": lambda: quantize_pair(x, rows, columns, ue8m0=True),
             "torch_compile": lambda: compiled(x, rows, columns)}  # fmt: skip
    scales = sum(m * k // 128 * 4 // (128 if r == "blocks" else 1) for r in (rows, columns))
    return timed_row(f"bf16 -> e4m3 rows {rows}, columns {columns} ue8m0 {m}x{k}", calls, error, m * k * 4 + scales)


if __name__ == "__main__":
    sys.exit(main())
