"""Training steps (forward + backward) of bf16 MLP layers: epicute.nn.functional vs torch, torch.compile and Liger.

TFLOPS of the step (see Unit below).

Usage: python bench/training.py [--cases llama3_8b_mlp,gpt_mlp,linear_gelu_residual] [--tokens 8192,16384]
       [--no-max-autotune] [--dry] [--out PATH]
Cases (T tokens, bf16 on the GPU, weights in ``nn.Linear``'s (out, in) layout, no dropout):

- ``llama3_8b_mlp`` (T 8192 and 16384): ``down(silu(x @ Wg^T) * (x @ Wu^T))``, hidden 4096, intermediate
  14336, no biases; Wg, Wu (14336, 4096), Wd (4096, 14336);
- ``gpt_mlp`` (T 8192 and 16384): ``gelu(x @ W1^T + b1) @ W2^T + b2``, 4096 -> 16384 -> 4096, erf GELU
  (``F.gelu``'s default);
- ``linear_gelu_residual`` (T 8192): ``gelu(x @ W^T + b) + residual``, W (4096, 4096), residual (T, 4096).

One step of every contender, alike: the ``.grad`` of its leaves set to None, ``out = layer(x)``, then
``out.backward(grad)`` with a fixed random bf16 ``grad``; x (and the residual) require grad like the weights,
so a step runs the forward GEMMs and both backward GEMM sets (the input's and the weights' gradients).
Contenders, same inputs, same run:

- ``epicute``: ``epicute.nn.functional``: ``gated_mlp(x, w_gate_up, w_down, activation="silu")`` with the gate
  and up weights interleaved once, outside the timing (``epicute.interleave_gate_up``); ``mlp(x, w1, b1, w2, b2,
  activation="gelu")``; ``linear(x, w, b, epilogue=gelu(acc) + residual, residual=residual)``;
- ``torch_eager``: the same math in ``F.linear``, ``F.silu`` and ``F.gelu``;
- ``torch_compile`` and ``torch_compile_max_autotune``: that eager function as a module's forward (the weights
  its parameters, sharing storage with the other contenders', as a model holds them) under ``torch.compile``,
  default mode and ``mode="max-autotune"`` (CUDA graphs included), static shapes, caches reset per case;
  compiled (forward and backward) by the checked first step, outside the timing. ``--no-max-autotune`` leaves
  the latter out (its compile takes minutes per case);
- ``liger`` (the SwiGLU case only, where Liger Kernel has a kernel: its ``LigerSwiGLUMLP`` runs
  ``LigerSiLUMulFunction`` between torch's GEMMs, as here); left out, with the reason printed, where
  ``liger_kernel`` does not import. It has GEGLU but no GELU MLP, and nothing for the linear case.

Every contender's first step is checked, not timed, against float32 autograd of the same math on the same
values (TF32 off): the output and every leaf's gradient, the largest relative error (Frobenius norm) counts.
epicute's fused gate/up gradient is compared with ``interleave_gate_up`` of the reference's two. Then all are
timed as ``triton.testing.do_bench`` times them (L2 flushed before each step, :func:`epicute.benchmark.time_flushed`),
medians of interleaved rounds.

Unit: TFLOPS of the step, 3 x the forward's GEMM FLOPs (forward, input gradient, weight gradient;
elementwise work not counted): 3 x 6·T·H·I for the SwiGLU MLP, 3 x 4·T·H·F for the GELU MLP, 3 x 2·T·H·N for
the linear. TFLOPS, not milliseconds per step, because ``common.finish_peer_run`` writes every result as
higher-is-better; the milliseconds per step are printed beside them. Writes bench/results/training.json (and
$OUT/training.json when OUT is set).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from common import Row, check_contenders, finish_peer_run, time_interleaved

HIDDEN = 4096
#: name -> (default token counts, FLOPs of one forward per token / hidden size: 6·I, 4·F, 2·N)
CASES = {
    "llama3_8b_mlp": ((8192, 16384), 6 * 14336),
    "gpt_mlp": ((8192, 16384), 4 * 16384),
    "linear_gelu_residual": ((8192,), 2 * HIDDEN),
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "training.json"
TOLERANCE = 1e-2
#: time_flushed's budget per contender and round: a step takes ~1-40 ms, so ~10-200 timed steps.
TIMING = {"warmup_ms": 100.0, "rep_ms": 300.0}

Tensors = dict[str, torch.Tensor]


@dataclass
class Setup:
    """One case's tensors and contenders' layers.

    ``inputs`` (x, and the residual) and ``weights`` are bf16 leaves requiring grad, in the order ``torch_fn``
    takes them (inputs first); ``epicute_leaves`` are the leaves of epicute's call (its gate/up weight is its
    own, interleaved copy); ``liger_fn`` takes ``torch_fn``'s arguments; ``derived`` maps the reference's
    gradients (name -> tensor) to the reference of gradients that only epicute's leaves have."""

    inputs: Tensors
    weights: Tensors
    torch_fn: Callable[..., torch.Tensor]
    epicute_leaves: Tensors
    epicute_call: Callable[[], torch.Tensor]
    liger_fn: Callable[..., torch.Tensor] | None = None
    derived: Callable[[Tensors], Tensors] | None = None


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16).requires_grad_()


def swiglu_mlp(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def gelu_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def linear_gelu_residual(x, residual, w, b):
    return F.gelu(F.linear(x, w, b)) + residual


def liger_swiglu():
    """``LigerSwiGLUMLP``'s math as a function of swiglu_mlp's arguments, or None (the reason printed)."""
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"  liger            not run: liger_kernel does not import ({type(exc).__name__}: {exc})")
        return None

    with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # common.versions() does not record it
        print(f"  liger_kernel {importlib.metadata.version('liger-kernel')}")

    def liger(x, w_gate, w_up, w_down):
        # As LigerSwiGLUMLP calls it (the multipliers are its legacy numerics: 1.0 each).
        return F.linear(LigerSiLUMulFunction.apply(F.linear(x, w_gate), F.linear(x, w_up), 1.0, 1.0), w_down)

    return liger


def setup_llama3_8b_mlp(EF, tokens: int) -> Setup:
    import epicute

    inter = CASES["llama3_8b_mlp"][1] // 6
    x = _randn(tokens, HIDDEN)
    w_gate, w_up = _randn(inter, HIDDEN, scale=HIDDEN**-0.5), _randn(inter, HIDDEN, scale=HIDDEN**-0.5)
    w_down = _randn(HIDDEN, inter, scale=inter**-0.5)
    w_gate_up = epicute.interleave_gate_up(w_gate.detach(), w_up.detach()).requires_grad_()  # once, untimed
    return Setup(
        inputs={"x": x},
        weights={"w_gate": w_gate, "w_up": w_up, "w_down": w_down},
        torch_fn=swiglu_mlp,
        epicute_leaves={"x": x, "w_gate_up": w_gate_up, "w_down": w_down},
        epicute_call=lambda: EF.gated_mlp(x, w_gate_up, w_down, activation="silu"),
        liger_fn=liger_swiglu(),
        derived=lambda ref: {"w_gate_up": epicute.interleave_gate_up(ref["w_gate"], ref["w_up"])},
    )


def setup_gpt_mlp(EF, tokens: int) -> Setup:
    ffn = CASES["gpt_mlp"][1] // 4
    x = _randn(tokens, HIDDEN)
    w1, b1 = _randn(ffn, HIDDEN, scale=HIDDEN**-0.5), _randn(ffn, scale=0.1)
    w2, b2 = _randn(HIDDEN, ffn, scale=ffn**-0.5), _randn(HIDDEN, scale=0.1)
    print("  liger            not run: Liger Kernel has GEGLU, no GELU MLP kernel")
    return Setup(
        inputs={"x": x},
        weights={"w1": w1, "b1": b1, "w2": w2, "b2": b2},
        torch_fn=gelu_mlp,
        epicute_leaves={"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2},
        epicute_call=lambda: EF.mlp(x, w1, b1, w2, b2, activation="gelu"),
    )


def setup_linear_gelu_residual(EF, tokens: int) -> Setup:
    import epicute

    x, residual = _randn(tokens, HIDDEN), _randn(tokens, HIDDEN)
    w, b = _randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5), _randn(HIDDEN, scale=0.1)

    def gelu_residual(acc, residual):  # one function object: traced once, not per step
        return epicute.ops.gelu(acc) + residual

    print("  liger            not run: Liger Kernel has no linear + GELU + residual kernel")
    return Setup(
        inputs={"x": x, "residual": residual},
        weights={"w": w, "b": b},
        torch_fn=linear_gelu_residual,
        epicute_leaves={"x": x, "residual": residual, "w": w, "b": b},
        epicute_call=lambda: EF.linear(x, w, b, epilogue=gelu_residual, residual=residual),
    )


SETUPS = {
    "llama3_8b_mlp": setup_llama3_8b_mlp,
    "gpt_mlp": setup_gpt_mlp,
    "linear_gelu_residual": setup_linear_gelu_residual,
}


class Layer(torch.nn.Module):
    """``fn(*inputs, *weights)`` with the weights as parameters, sharing the given tensors' storage (each
    module's gradients its own): how a model holds them, and what torch.compile's CUDA graphs take as static
    (not copied in per step)."""

    def __init__(self, fn: Callable[..., torch.Tensor], weights: Tensors):
        super().__init__()
        self.fn = fn
        self.names = tuple(weights)
        for name, w in weights.items():
            self.register_parameter(name, torch.nn.Parameter(w.detach()))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(*inputs, *[getattr(self, name) for name in self.names])


def steps(leaves: Tensors, forward: Callable[[], torch.Tensor], grad: torch.Tensor):
    """(checked call, timed call) of one training step: the leaves' ``.grad`` set to None, ``forward()``, then
    its backward with ``grad``. The checked call returns the output and every leaf's gradient by name."""

    def step() -> torch.Tensor:
        for t in leaves.values():
            t.grad = None
        out = forward()
        out.backward(grad)
        return out

    def checked() -> Tensors:
        out = step()
        return {"out": out.detach(), **{name: t.grad for name, t in leaves.items()}}

    return checked, step


def announced(label: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` printing how long it took (a compiling first call)."""

    def run():
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        print(f"  {label:16s} first step (compiles, untimed): {time.perf_counter() - start:.1f} s")
        return result

    return run


def reference(setup: Setup, grad: torch.Tensor) -> Tensors:
    """float32 autograd of ``torch_fn`` on the leaves' values: the output and every gradient by name, and the
    ``derived`` ones."""
    leaves = {name: t.detach().float().requires_grad_() for name, t in {**setup.inputs, **setup.weights}.items()}
    out = setup.torch_fn(*leaves.values())
    out.backward(grad.float())
    ref = {"out": out.detach(), **{name: t.grad for name, t in leaves.items()}}
    if setup.derived is not None:
        ref.update(setup.derived(ref))
    return ref


def relative_errors(got: Tensors, ref: Tensors) -> dict[str, float]:
    """Relative error (Frobenius norm) of each of ``got`` (inf where a gradient is missing)."""
    errors = {}
    for name, value in got.items():
        if value is None:
            errors[name] = float("inf")
            continue
        r = ref[name]
        errors[name] = ((value.float() - r).norm() / r.norm().clamp_min(1e-30)).item()
    return errors


def run_case(EF, name: str, tokens: int, max_autotune: bool) -> tuple[Row, bool]:
    from epicute.benchmark import time_flushed

    torch._dynamo.reset()  # each case compiles afresh, for its own static shapes
    row: Row = {"case": f"{name} T{tokens}"}
    print(row["case"])
    setup = SETUPS[name](EF, tokens)
    grad = torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)
    ref = reference(setup, grad)
    inputs, weights = setup.inputs, setup.weights
    args = (*inputs.values(), *weights.values())
    calls = {
        "epicute": steps(setup.epicute_leaves, setup.epicute_call, grad),
        "torch_eager": steps({**inputs, **weights}, lambda: setup.torch_fn(*args), grad),
    }
    modes = {"torch_compile": None, **({"torch_compile_max_autotune": "max-autotune"} if max_autotune else {})}
    for label, mode in modes.items():
        layer = Layer(setup.torch_fn, weights)
        compiled = torch.compile(layer, mode=mode, dynamic=False)
        leaves = {**inputs, **dict(layer.named_parameters())}
        checked, step = steps(leaves, lambda c=compiled: c(*inputs.values()), grad)
        calls[label] = (announced(label, checked), step)
    if setup.liger_fn is not None:
        liger = setup.liger_fn
        calls["liger"] = steps({**inputs, **weights}, lambda: liger(*args), grad)

    def error(got: Tensors) -> float:
        errors = relative_errors(got, ref)
        print("    rel err by tensor: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        return max(errors.values())

    timed, ok = check_contenders(calls, error, TOLERANCE)
    ref.clear()  # the float32 reference's memory, before the timing
    torch.cuda.empty_cache()
    flops = 3 * tokens * HIDDEN * CASES[name][1]
    times = time_interleaved(timed, timer=time_flushed, **TIMING)
    for label, ms in times.items():
        row[label] = round(flops / (ms * 1e-3) / 1e12, 1)
    print("  ms per step: " + ", ".join(f"{label} {ms:.3f}" for label, ms in times.items()))
    peer_times = [ms for label, ms in times.items() if not label.startswith("epicute")]
    if "epicute" in times and peer_times:  # from the times, not the rounded TFLOPS
        print(f"  epicute / best peer: {min(peer_times) / times['epicute']:.3f} (TFLOPS ratio, > 1: epicute faster)")
    return row, ok


def plan(cases: list[str], tokens: list[int] | None, max_autotune: bool) -> None:
    """What a run would measure, without a GPU (``--dry``)."""
    compiled = ["torch_compile", *(["torch_compile_max_autotune"] if max_autotune else [])]
    for name in cases:
        for t in tokens or CASES[name][0]:
            peers_ = ["torch_eager", *compiled, *(["liger (if it imports)"] if name == "llama3_8b_mlp" else [])]
            gflop = 3 * t * HIDDEN * CASES[name][1] / 1e9
            print(f"{name} T{t}: {gflop:.1f} GFLOP per step; epicute vs {', '.join(peers_)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=None,
                        help="comma-separated token counts T for every case (default: each case's own)")  # fmt: skip
    parser.add_argument("--no-max-autotune", dest="max_autotune", action="store_false",
                        help="leave out torch.compile(mode='max-autotune') (minutes of compile a case)")  # fmt: skip
    parser.add_argument("--dry", action="store_true", help="print the cases and contenders, run nothing (no GPU)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON path")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}: choose from {list(CASES)}")
    if args.dry:
        plan(cases, args.tokens, args.max_autotune)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    try:
        from epicute.nn import functional as EF
    except ImportError as exc:
        print(f"epicute.nn.functional does not import ({type(exc).__name__}: {exc}); this benchmark times its "
              "gated_mlp, mlp and linear: run it with an epicute that has them", file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference (the default; said, not assumed)
    rows, all_ok = [], True
    for name in cases:
        for tokens in args.tokens or CASES[name][0]:
            row, ok = run_case(EF, name, tokens, args.max_autotune)
            rows.append(row)
            all_ok = all_ok and ok
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    return finish_peer_run(args.out, "training", rows, all_ok)


if __name__ == "__main__":
    sys.exit(main())
