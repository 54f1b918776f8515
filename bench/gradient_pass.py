"""The backward's gradient pass alone (the derived epilogue over a zero-K GEMM): the planned config against pinned
ones, and torch's elementwise backward of the same math, on the H200.

Usage: python bench/gradient_pass.py [--tokens 8192] [--out bench/results/gradient_pass.json]

Case: ``linear(x, w, b, epilogue=gelu(acc) + residual)`` at T x 4096 (bench/training.py's linear case). Its
backward plan is ``save``: the pass reads the saved pre-activation and D's gradient (bf16 tiles), writes
``dacc`` (bf16) and reduces the bias gradient (``col_sum``); the residual's gradient is D's own. The call is
captured from a real backward (the arguments the backward gives the pass), then timed with each config.
GB/s counts the tiles read and written once (3 x T x 4096 x 2 bytes).

Contenders: ``epicute`` (the planner's config), ``epicute_<pins>`` (configs pinned), ``torch_eager``
(``aten.gelu_backward`` and a row sum: what ``F.gelu``'s autograd runs) and ``torch_compile`` of that.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_contenders, finish_peer_run, host_ms, time_interleaved

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gradient_pass.json"
HIDDEN = 4096
PINNED = {
    "cooperative_128x256_c4": {"schedule": "cooperative", "tile_m": 128, "tile_n": 256, "num_c_stages": 4},
    "cooperative_128x128_c6": {"schedule": "cooperative", "tile_m": 128, "tile_n": 128, "num_c_stages": 6},
    "pingpong_128x128_c6": {"schedule": "pingpong", "tile_m": 128, "tile_n": 128, "num_c_stages": 6},
    "cooperative_128x256_c4_ab2": {
        "schedule": "cooperative",
        "tile_m": 128,
        "tile_n": 256,
        "num_c_stages": 4,
        "ab_stages": 2,
    },  # fmt: skip
}


def captured_pass(tokens: int) -> dict:
    """The gradient pass's call (a, b, epilogue, out_dtypes, operands), as a real backward makes it."""
    import epicute
    from epicute.nn import functional as EF

    torch_op = importlib.import_module("epicute.gemm.torch_op")
    make = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    x, residual, w, b = make(tokens, HIDDEN), make(tokens, HIDDEN), make(HIDDEN, HIDDEN), make(HIDDEN)
    seen: dict = {}
    original = torch_op._gemm

    def spy(a, b_, epilogue=None, out_dtypes=None, operands=None, gated=False, scales=None):
        if epilogue is not None and a.shape[-1] == 0:
            seen.update(a=a, b=b_, epilogue=epilogue, out_dtypes=out_dtypes, operands=dict(operands))
        return original(a, b_, epilogue, out_dtypes, operands, gated, scales)

    torch_op._gemm = spy
    try:
        y = EF.linear(x, w, b, epilogue=lambda acc, residual: epicute.ops.gelu(acc) + residual, residual=residual)
        y.backward(torch.randn_like(y))
    finally:
        torch_op._gemm = original
    if not seen:
        raise SystemExit("the backward ran no gradient pass: nothing to time")
    return seen


def print_host_cost(fn, repeats: int = 20) -> None:
    """Host microseconds of an ``epicute.gemm`` call of the pass (the GPU idle before each), and its profile."""
    import cProfile
    import pstats

    fn()
    print(f"  host time of epicute.gemm(the pass): {host_ms(fn, repeats) * 1e3:.1f} us (median of {repeats})")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import epicute
    from epicute.benchmark import time_flushed
    from epicute.epilogue.operands import Pin

    torch.manual_seed(0)
    call = captured_pass(args.tokens)
    # As the backward runs it: no grad recorded (the forward's bias, among the operands, requires grad).
    call["operands"] = {name: type(v)(v.value.detach()) if isinstance(v, Pin) else v.detach()
                        for name, v in call["operands"].items()}  # fmt: skip
    values = {name: v.value if isinstance(v, Pin) else v for name, v in call["operands"].items()}
    print("pass operands:", {name: (tuple(t.shape), t.dtype) for name, t in values.items()},
          "outputs:", call["out_dtypes"])  # fmt: skip
    plan = epicute.explain(call["a"], call["b"], epilogue=call["epilogue"], out_dtypes=call["out_dtypes"],
                           **call["operands"])  # fmt: skip
    print(str(plan).split("epilogue chain")[0])
    saved, grad, bias = values["saved_acc"], values["grad_D"], values["bias"]
    # The forward saved acc before the bias (the pass adds it); torch saves the pre-activation with it.
    pre = (saved.float() + bias.float()).to(saved.dtype)

    def run(config=None):  # prepared: the kernel's time, not the host's (print_host_cost shows that)
        prepared = epicute.prepare_gemm(call["a"], call["b"], epilogue=call["epilogue"], out_dtypes=call["out_dtypes"],
                                        config=config, **call["operands"])  # fmt: skip
        return lambda: prepared(call["a"], call["b"], **call["operands"])

    print_host_cost(lambda: epicute.gemm(call["a"], call["b"], epilogue=call["epilogue"],
                                         out_dtypes=call["out_dtypes"], **call["operands"]))  # fmt: skip

    def torch_math(grad, saved):
        dacc = torch.ops.aten.gelu_backward(grad, saved)
        return {"D": dacc, "d_bias": dacc.float().sum(0)}

    compiled = torch.compile(torch_math)
    calls = {"epicute": run(), **{f"epicute_{name}": run(cfg) for name, cfg in PINNED.items()}}
    calls |= {"torch_eager": lambda: torch_math(grad, pre), "torch_compile": lambda: compiled(grad, pre)}
    want = torch_math(grad.float(), saved.float() + bias.float())

    def error(got) -> float:
        return max(((got[k].float() - want[k]).norm() / want[k].norm()).item() for k in ("D", "d_bias"))

    timed, ok = check_contenders({name: (fn, fn) for name, fn in calls.items()}, error, 2e-2)
    times = time_interleaved(timed, timer=time_flushed)
    gbytes = 3 * args.tokens * HIDDEN * 2 / 1e9
    row = {"case": f"gelu_bias_residual pass T{args.tokens}"}
    for name, ms in times.items():
        row[name] = round(gbytes / (ms * 1e-3), 1)
        print(f"  {name:32s} {ms * 1e3:8.1f} us  {row[name]:8.1f} GB/s")
    return finish_peer_run(args.out, "gradient_pass", [row], ok, unit="GB/s")


if __name__ == "__main__":
    sys.exit(main())
