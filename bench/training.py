"""Training steps (forward + backward) of bf16 MLPs and MoE experts: epicute.nn.functional vs torch, compile, Liger.

TFLOPS of the step (see Unit below).

Usage: python bench/training.py [--cases llama3_8b_mlp,gpt_mlp,linear_gelu_residual,mixtral_experts,qwen3_moe_experts,
       mixtral_experts_fp8,qwen3_moe_experts_fp8]
       [--tokens 8192,16384] [--no-max-autotune] [--profile] [--dry] [--out PATH]
Cases (T tokens, bf16 on the GPU, weights in ``nn.Linear``'s (out, in) layout, no dropout):

- ``llama3_8b_mlp`` (T 8192 and 16384): ``down(silu(x @ Wg^T) * (x @ Wu^T))``, hidden 4096, intermediate
  14336, no biases; Wg, Wu (14336, 4096), Wd (4096, 14336);
- ``gpt_mlp`` (T 8192 and 16384): ``gelu(x @ W1^T + b1) @ W2^T + b2``, 4096 -> 16384 -> 4096, erf GELU
  (``F.gelu``'s default);
- ``linear_gelu_residual`` (T 8192): ``gelu(x @ W^T + b) + residual``, W (4096, 4096), residual (T, 4096);
- ``mixtral_experts`` (T 8192): Mixtral-8x7B's expert block, hidden 4096, intermediate 14336, 8 experts, top-2;
- ``qwen3_moe_experts`` (T 8192): Qwen3-30B-A3B's expert block, hidden 2048, MoE intermediate 768, 128 experts,
  top-8;
- ``mixtral_experts_fp8``, ``qwen3_moe_experts_fp8`` (T 8192 and 16384): those expert blocks trained in fp8
  (:func:`setup_moe_experts_fp8`: epicute's fp8 and bf16 experts, ``torch._grouped_mm`` bf16, torchao's fp8 rowwise
  grouped GEMM), checked within 2^-3 as below;
- ``llama3_8b_mlp_fp8`` (T 8192 and 16384): the Llama MLP trained in fp8 (issue 59): ``epicute`` is
  ``epicute.nn.fp8_gated_mlp`` (DeepSeek-V3's blockwise recipe, all six GEMMs fp8), ``epicute_bf16`` epicute's
  bf16 ``gated_mlp`` on the same leaves, ``torchao_float8_rowwise`` torchao's float8 training
  (``convert_to_float8_training`` with the ``"rowwise"`` recipe on a module of three ``nn.Linear`` holding the
  weights, under ``torch.compile`` as torchao advises), left out with the reason where torchao does not import;
  ``torch_eager`` bf16. Checked against float32 autograd within 2^-3 (fp8's inputs rounded to e4m3:
  tests/nn/fp8_cases.py), not 1e-2.

The MoE cases are the experts only (no router): ``out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``
with ``e = top_k_index[t, j]``, weights in transformers 5's layout: ``gate_up_proj`` (E, 2I, H) holding
``[gate; up]`` (gate first), ``down_proj`` (E, H, I). The routing is fixed, drawn once per case outside the
timing (seeded): Zipf-skewed expert popularity as in bench/grouped.py (expert i's share ~ 1/(i+1), shuffled),
each token's k distinct experts drawn in proportion to it (``top_k_index`` (T, k) int64), its weights a softmax
of random values (``top_k_weights`` (T, k) float32, rows summing to 1); the rows per expert are printed.

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

The MoE cases' contenders instead:

- ``epicute``: ``moe_experts(x, gate_up, down_proj, top_k_index, top_k_weights, activation="silu",
  interleaved=True)``: its layer's own gate/up weight, interleaved once at load (untimed, as for the SwiGLU MLP;
  its gradient is compared with ``interleave_gate_up`` of the reference's), the routing sorted inside the call
  (timed);
- ``torch_grouped_mm``: transformers' ``grouped_mm_experts_forward`` (no biases, no expert-parallel sentinels):
  the (token, slot) pairs sorted by expert, their rows gathered, int32 offsets (cumsum of a ``histc`` of the
  experts), ``torch._grouped_mm(rows, gate_up_proj.transpose(-2, -1), offs=offsets, out_dtype=torch.bfloat16)``
  as ../shared/bench/PEERS.md calls it, ``silu(gate) * up``, the same for ``down_proj``, times the routing weight
  (float32), back to token order and each token's k rows summed;
- ``torch_eager_loop``: transformers 5's ``MixtralExperts.forward`` (``Qwen3MoeExperts``' is the same): a
  Python loop over the experts hit, ``F.linear`` with ``gate_up_proj[e]``, chunk, ``silu(gate) * up``,
  ``F.linear`` with ``down_proj[e]``, times the weight, ``index_add_`` into the tokens;
- ``torch_grouped_mm_compile``: ``torch_grouped_mm`` under ``torch.compile`` (default mode, static shapes),
  compiled by its checked first step; where it does not compile, the reason is printed and it is left out.

Every contender's first step is checked, not timed, against float32 autograd of the same math on the same
values (TF32 off; for the MoE cases a loop over the experts in float32): the output and every leaf's gradient
(the MoE cases: x, gate_up_proj, down_proj), the largest relative error (Frobenius norm) counts. In the SwiGLU
MLP, epicute's fused gate/up gradient is compared with ``interleave_gate_up`` of the reference's two. Then all are
timed as ``triton.testing.do_bench`` times them (L2 flushed before each step, :func:`epicute.benchmark.time_flushed`),
medians of interleaved rounds.

Unit: TFLOPS of the step, 3 x the forward's GEMM FLOPs (forward, input gradient, weight gradient;
elementwise work not counted): 3 x 6·T·H·I for the SwiGLU MLP, 3 x 4·T·H·F for the GELU MLP, 3 x 2·T·H·N for
the linear, 3 x (2·T·k·H·2I + 2·T·k·I·H) = 3 x 6·T·k·H·I for the MoE experts (the routed rows only; sorting,
gathering and summing not counted). TFLOPS, not milliseconds per step, because ``common.finish_peer_run`` writes
every result as higher-is-better; the milliseconds per step are printed beside them. Writes
bench/results/training.json (and $OUT/training.json when OUT is set).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from common import Row, announced, check_contenders, finish_peer_run, host_ms, time_interleaved

HIDDEN = 4096
#: MoE expert blocks: name -> (hidden H, intermediate I, experts E, experts per token k)
MOE = {
    "mixtral_experts": (4096, 14336, 8, 2),  # Mixtral-8x7B
    "qwen3_moe_experts": (2048, 768, 128, 8),  # Qwen3-30B-A3B
}
#: name -> (default token counts, hidden size, FLOPs of one forward per token / hidden size: 6·I, 4·F, 2·N, 6·k·I)
CASES = {
    "llama3_8b_mlp": ((8192, 16384), HIDDEN, 6 * 14336),
    "llama3_8b_mlp_fp8": ((8192, 16384), HIDDEN, 6 * 14336),
    "gpt_mlp": ((8192, 16384), HIDDEN, 4 * 16384),
    "linear_gelu_residual": ((8192,), HIDDEN, 2 * HIDDEN),
    **{name: ((8192,), hidden, 6 * top_k * inter) for name, (hidden, inter, _, top_k) in MOE.items()},
    **{f"{name}_fp8": ((8192, 16384), hidden, 6 * top_k * inter) for name, (hidden, inter, _, top_k) in MOE.items()},
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
    takes them (inputs first); ``torch_fn`` is the float32 reference's math and, unless ``peers`` and ``compiled``
    say otherwise, the ``torch_eager`` contender and the compiled ones; ``epicute_leaves`` are the leaves of
    epicute's call (its gate/up weight may be its own, interleaved copy); ``liger_fn`` takes ``torch_fn``'s
    arguments; ``derived`` maps the reference's gradients (name -> tensor) to the reference of gradients that only
    epicute's leaves have. ``peers`` (label -> function of ``torch_fn``'s arguments) replaces ``torch_eager``;
    ``compiled`` (label -> (function of ``torch_fn``'s arguments, torch.compile mode)) replaces the compiled
    ``torch_fn``."""

    inputs: Tensors
    weights: Tensors
    torch_fn: Callable[..., torch.Tensor]
    epicute_leaves: Tensors
    epicute_call: Callable[[], torch.Tensor]
    liger_fn: Callable[..., torch.Tensor] | None = None
    derived: Callable[[Tensors], Tensors] | None = None
    peers: dict[str, Callable[..., torch.Tensor]] | None = None
    compiled: dict[str, tuple[Callable[..., torch.Tensor], str | None]] | None = None
    #: more contenders with leaves of their own: label -> (leaves, step forward)
    others: dict[str, tuple[Tensors, Callable[[], torch.Tensor]]] | None = None
    tolerance: float = TOLERANCE


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

    inter = CASES["llama3_8b_mlp"][2] // 6
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


def setup_llama3_8b_mlp_fp8(EF, tokens: int) -> Setup:
    from epicute.nn import fp8_gated_mlp

    base = setup_llama3_8b_mlp(EF, tokens)
    leaves = base.epicute_leaves
    x, w_gate_up, w_down = leaves["x"], leaves["w_gate_up"], leaves["w_down"]
    others = {"epicute_bf16": (leaves, lambda: EF.gated_mlp(x, w_gate_up, w_down, activation="silu"))}
    try:
        others["torchao_float8_rowwise"] = torchao_float8_mlp(base.inputs["x"], base.weights)
    except Exception as exc:  # noqa: BLE001 - a peer that does not import or convert is reported and left out
        print(f"  torchao_float8_rowwise not run: {type(exc).__name__}: {exc}")
    return Setup(
        inputs=base.inputs, weights=base.weights, torch_fn=swiglu_mlp, epicute_leaves=leaves,
        epicute_call=lambda: fp8_gated_mlp(x, w_gate_up, w_down, recipe="blockwise"), derived=base.derived,
        compiled={}, others=others, tolerance=2.0**-3,
    )  # fmt: skip


def torchao_float8_mlp(x: torch.Tensor, weights: Tensors) -> tuple[Tensors, Callable[[], torch.Tensor]]:
    """torchao's float8 training of the SwiGLU MLP: three ``nn.Linear`` holding the weights (storage shared),
    converted by ``convert_to_float8_training`` (rowwise recipe), compiled; (its leaves, its step forward)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    class SwiGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shapes = {name: w.shape for name, w in weights.items()}
            for name, (out_f, in_f) in shapes.items():
                linear = torch.nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=torch.bfloat16)
                linear.weight = torch.nn.Parameter(weights[name].detach())
                setattr(self, name, linear)

        def forward(self, x):
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))

    module = convert_to_float8_training(SwiGLU(), config=Float8LinearConfig.from_recipe_name("rowwise"))
    compiled = torch.compile(module, dynamic=False)
    leaves = {"x": x, **{name: getattr(module, name).weight for name in weights}}
    return leaves, lambda: compiled(x)


def setup_gpt_mlp(EF, tokens: int) -> Setup:
    ffn = CASES["gpt_mlp"][2] // 4
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


def moe_routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed routing on the CPU: ``top_k_index`` (T, k) int64, each token's k distinct experts drawn in
    proportion to a Zipf popularity (expert i's share ~ 1/(i+1), shuffled: bench/grouped.py's skew), and
    ``top_k_weights`` (T, k) float32, a softmax of random values (rows summing to 1)."""
    gen = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    popularity = popularity[torch.randperm(experts, generator=gen)]
    probs = (popularity / popularity.sum()).expand(tokens, experts).contiguous()
    top_k_index = torch.multinomial(probs, top_k, replacement=False, generator=gen)
    top_k_weights = torch.randn(tokens, top_k, generator=gen).softmax(dim=-1)
    return top_k_index, top_k_weights


def describe_routing(top_k_index: torch.Tensor, experts: int) -> str:
    rows = torch.bincount(top_k_index.flatten(), minlength=experts)
    return (f"routing: Zipf, {top_k_index.shape[0]} tokens x top-{top_k_index.shape[1]} over {experts} experts; "
            f"rows per expert {int(rows.min())}-{int(rows.max())} (mean {rows.float().mean().item():.0f})")  # fmt: skip


def grouped_mm_experts(x, gate_up_proj, down_proj, *, top_k_index, top_k_weights):
    """transformers' ``grouped_mm_experts_forward`` (no biases, no expert-parallel sentinels) on
    ``torch._grouped_mm``, called as ../shared/bench/PEERS.md calls it: rows sorted by expert, the weights
    (E, N, K) row-major passed as ``.transpose(-2, -1)``, int32 cumulative group ends."""
    tokens, top_k = top_k_index.shape
    experts = gate_up_proj.shape[0]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    rows = x[perm // top_k]
    weights = top_k_weights.reshape(-1)[perm]
    # transformers' histc (not bincount: no data-dependent size under torch.compile / CUDA graphs); the CPU's
    # histc takes floats, CUDA's ints
    ids = expert_ids.float() if expert_ids.device.type == "cpu" else expert_ids.int()
    offsets = torch.cumsum(torch.histc(ids, bins=experts, min=0, max=experts - 1), dim=0, dtype=torch.int32)
    h = torch._grouped_mm(rows, gate_up_proj.transpose(-2, -1), offs=offsets, out_dtype=torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)
    h = torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets, out_dtype=torch.bfloat16)
    weighted = h * weights.unsqueeze(-1)  # float32, as the routing weights
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    # as transformers: back to (token, slot) order, each token's k rows summed (float32, deterministic)
    return weighted[inverse].view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def torchao_fp8_experts(x, gate_up_proj, down_proj, *, top_k_index, top_k_weights):
    """:func:`grouped_mm_experts` on torchao's fp8 rowwise grouped GEMM for training
    (``torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm``: both operands quantized per row,
    forward and backward in fp8). It takes groups of multiples of 16 rows only (its own padding asserts "not yet
    supported"), so each expert's rows are placed on a multiple of 16 in a buffer with room for any routing (zero
    rows between experts), as a user of it must."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_grouped_mm

    def mm(a, b, offsets):
        return fp8_grouped_mm(a, b, offsets, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)

    tokens, top_k = top_k_index.shape
    experts = gate_up_proj.shape[0]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    counts = torch.histc(expert_ids.int(), bins=experts, min=0, max=experts - 1).long()
    padded = (counts + 15) // 16 * 16
    ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    rows_total = perm.numel()
    dest = torch.arange(rows_total, device=x.device) + (ends - padded - starts)[expert_ids]
    capacity = -(-(rows_total + 15 * experts) // 16) * 16
    rows = x.new_zeros(capacity, x.shape[1]).index_copy(0, dest, x[perm // top_k])
    offsets = ends.to(torch.int32)
    h = mm(rows, gate_up_proj.transpose(-2, -1), offsets)
    gate, up = h.chunk(2, dim=-1)
    h = mm((F.silu(gate) * up).contiguous(), down_proj.transpose(-2, -1), offsets)[dest]
    weighted = h * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[inverse].view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def eager_expert_loop(x, gate_up_proj, down_proj, *, top_k_index, top_k_weights):
    """transformers 5's ``MixtralExperts.forward`` (``Qwen3MoeExperts.forward`` is the same)."""
    experts = gate_up_proj.shape[0]
    out = torch.zeros_like(x)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gate, up = F.linear(x[token_idx], gate_up_proj[expert_idx]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down_proj[expert_idx])
        h = h * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def moe_reference(x, gate_up_proj, down_proj, *, top_k_index, top_k_weights):
    """The same math for the float32 reference: a loop over every expert, its weights from ``unbind`` (one
    stacked gradient, not a full-size one per expert)."""
    out = torch.zeros_like(x)
    for e, (w_gate_up, w_down) in enumerate(zip(gate_up_proj.unbind(0), down_proj.unbind(0))):
        token, slot = torch.where(top_k_index == e)
        gate, up = F.linear(x[token], w_gate_up).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w_down) * top_k_weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


def setup_moe_experts(EF, name: str, tokens: int) -> Setup:
    import epicute

    hidden, inter, experts, top_k = MOE[name]
    top_k_index, top_k_weights = moe_routing(tokens, experts, top_k)
    print(f"  {describe_routing(top_k_index, experts)}")
    top_k_index, top_k_weights = top_k_index.cuda(), top_k_weights.cuda()
    x = _randn(tokens, hidden)
    gate_up_proj = _randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    down_proj = _randn(experts, hidden, inter, scale=inter**-0.5)
    # epicute's layer owns its gate/up weight interleaved (built once at load, untimed), as GatedMLP's is
    gate_up = epicute.interleave_gate_up(*gate_up_proj.detach().chunk(2, dim=-2)).requires_grad_()
    routed = {"top_k_index": top_k_index, "top_k_weights": top_k_weights}
    grouped = functools.partial(grouped_mm_experts, **routed)
    return Setup(
        inputs={"x": x},
        weights={"gate_up_proj": gate_up_proj, "down_proj": down_proj},
        torch_fn=functools.partial(moe_reference, **routed),
        epicute_leaves={"x": x, "gate_up_interleaved": gate_up, "down_proj": down_proj},
        epicute_call=lambda: EF.moe_experts(
            x, gate_up, down_proj, top_k_index, top_k_weights, activation="silu", interleaved=True
        ),
        derived=lambda ref: {"gate_up_interleaved": epicute.interleave_gate_up(*ref["gate_up_proj"].chunk(2, dim=-2))},
        peers={"torch_grouped_mm": grouped, "torch_eager_loop": functools.partial(eager_expert_loop, **routed)},
        compiled={"torch_grouped_mm_compile": (grouped, None)},
    )


def setup_moe_experts_fp8(EF, name: str, tokens: int) -> Setup:
    """The expert block trained in fp8 (issue 59): ``epicute`` is ``epicute.nn.fp8_moe_experts`` (blockwise recipe,
    the six grouped GEMMs fp8), ``epicute_bf16`` epicute's bf16 ``moe_experts`` on the same leaves,
    ``torch_grouped_mm`` bf16, ``torchao_fp8_rowwise`` torchao's fp8 grouped GEMM for training
    (:func:`torchao_fp8_experts`), left out with the reason where it does not run."""
    from epicute.nn import fp8_moe_experts

    base = setup_moe_experts(EF, name.removesuffix("_fp8"), tokens)
    leaves = base.epicute_leaves
    x, gate_up, down = leaves["x"], leaves["gate_up_interleaved"], leaves["down_proj"]
    route = base.peers["torch_grouped_mm"].keywords
    index, weights = route["top_k_index"], route["top_k_weights"]
    others = {"epicute_bf16": (leaves, base.epicute_call)}
    peers = {"torch_grouped_mm": base.peers["torch_grouped_mm"]}
    try:
        import torchao.prototype.moe_training  # noqa: F401 - a peer that does not import is reported and left out

        peers["torchao_fp8_rowwise"] = functools.partial(torchao_fp8_experts, **route)
    except Exception as exc:  # noqa: BLE001
        print(f"  torchao_fp8_rowwise not run: {type(exc).__name__}: {exc}")
    return Setup(
        inputs=base.inputs, weights=base.weights, torch_fn=base.torch_fn, epicute_leaves=leaves,
        epicute_call=lambda: fp8_moe_experts(x, gate_up, down, index, weights), derived=base.derived,
        peers=peers, compiled={}, others=others, tolerance=2.0**-3,
    )  # fmt: skip


SETUPS = {
    "llama3_8b_mlp": setup_llama3_8b_mlp,
    "llama3_8b_mlp_fp8": setup_llama3_8b_mlp_fp8,
    "gpt_mlp": setup_gpt_mlp,
    "linear_gelu_residual": setup_linear_gelu_residual,
    **{name: functools.partial(setup_moe_experts, name=name) for name in MOE},
    **{f"{name}_fp8": functools.partial(setup_moe_experts_fp8, name=f"{name}_fp8") for name in MOE},
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


def run_case(EF, name: str, tokens: int, max_autotune: bool, profile: bool = False) -> tuple[Row, bool]:
    from epicute.benchmark import time_flushed

    torch._dynamo.reset()  # each case compiles afresh, for its own static shapes
    row: Row = {"case": f"{name} T{tokens}"}
    print(row["case"])
    setup = SETUPS[name](EF, tokens=tokens)
    grad = torch.randn(tokens, CASES[name][1], device="cuda").to(torch.bfloat16)
    ref = reference(setup, grad)
    inputs, weights = setup.inputs, setup.weights
    args = (*inputs.values(), *weights.values())
    calls = {"epicute": steps(setup.epicute_leaves, setup.epicute_call, grad)}
    for label, fn in (setup.peers or {"torch_eager": setup.torch_fn}).items():
        calls[label] = steps({**inputs, **weights}, lambda fn=fn: fn(*args), grad)
    for label, (leaves, forward) in (setup.others or {}).items():
        calls[label] = steps(leaves, forward, grad)
    compiled_fns = setup.compiled if setup.compiled is not None else {
        "torch_compile": (setup.torch_fn, None),
        "torch_compile_max_autotune": (setup.torch_fn, "max-autotune"),
    }
    for label, (fn, mode) in compiled_fns.items():
        if mode == "max-autotune" and not max_autotune:
            continue
        try:  # compiling happens in the first (checked) step: check_contenders prints why that fails, if it does
            layer = Layer(fn, weights)
            compiled = torch.compile(layer, mode=mode, dynamic=False)
        except Exception as exc:  # noqa: BLE001 - a peer that does not compile is reported and left out
            print(f"  {label:16s} not run: torch.compile failed ({type(exc).__name__}: {exc})")
            continue
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

    timed, ok = check_contenders(calls, error, setup.tolerance)
    if profile:
        print_kernels(timed["epicute"])
        print_host_profile(timed["epicute"], setup.epicute_call, grad)
    ref.clear()  # the float32 reference's memory, before the timing
    torch.cuda.empty_cache()
    flops = 3 * tokens * CASES[name][1] * CASES[name][2]
    times = time_interleaved(timed, timer=time_flushed, **TIMING)
    for label, ms in times.items():
        row[label] = round(flops / (ms * 1e-3) / 1e12, 1)
    print("  ms per step: " + ", ".join(f"{label} {ms:.3f}" for label, ms in times.items()))
    peer_times = [ms for label, ms in times.items() if not label.startswith("epicute")]
    if "epicute" in times and peer_times:  # from the times, not the rounded TFLOPS
        print(f"  epicute / best peer: {min(peer_times) / times['epicute']:.3f} (TFLOPS ratio, > 1: epicute faster)")
    return row, ok


def print_kernels(step: Callable[[], object], repeats: int = 3) -> None:
    """The CUDA kernels of ``repeats`` warm steps, by total GPU time (``torch.profiler``): where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    print(f"  epicute's kernels over {repeats} steps:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))


def print_host_profile(
    step: Callable[[], object], forward: Callable[[], torch.Tensor], grad: torch.Tensor, repeats: int = 10
) -> None:
    """Host milliseconds of a step, its forward and its backward (each queued without waiting on the GPU, which
    is idle before each), and where they went: ``torch.profiler``'s CPU ops, and ``cProfile`` of whole steps."""
    from torch.profiler import ProfilerActivity, profile

    outs: list[torch.Tensor] = []
    fwd = host_ms(lambda: outs.append(forward()), repeats)
    bwd = host_ms(lambda: outs.pop().backward(grad), repeats)
    print(f"  epicute's host ms, GPU idle before each (median of {repeats}): step {host_ms(step, repeats):.3f}, "
          f"forward {fwd:.3f}, backward {bwd:.3f}")  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=90))
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # the backward on this thread too, where cProfile sees it
        profiler.enable()
        for _ in range(repeats):
            step()
        profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(45)


def plan(cases: list[str], tokens: list[int] | None, max_autotune: bool) -> None:
    """What a run would measure, without a GPU (``--dry``)."""
    compiled = ["torch_compile", *(["torch_compile_max_autotune"] if max_autotune else [])]
    for name in cases:
        for t in tokens or CASES[name][0]:
            if name in MOE:
                peers_ = ["torch_grouped_mm", "torch_eager_loop", "torch_grouped_mm_compile (if it compiles)"]
            elif name == "llama3_8b_mlp_fp8":
                peers_ = ["torch_eager", "epicute_bf16", "torchao_float8_rowwise (if it imports)"]
            else:
                peers_ = ["torch_eager", *compiled, *(["liger (if it imports)"] if name == "llama3_8b_mlp" else [])]
            gflop = 3 * t * CASES[name][1] * CASES[name][2] / 1e9
            print(f"{name} T{t}: {gflop:.1f} GFLOP per step; epicute vs {', '.join(peers_)}")
            if name in MOE:  # the routing a run would draw (on the CPU, as the run draws it)
                hidden, inter, experts, top_k = MOE[name]
                routing = describe_routing(moe_routing(t, experts, top_k)[0], experts)
                print(f"  hidden {hidden}, intermediate {inter}; {routing}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=None,
                        help="comma-separated token counts T for every case (default: each case's own)")  # fmt: skip
    parser.add_argument("--no-max-autotune", dest="max_autotune", action="store_false",
                        help="leave out torch.compile(mode='max-autotune') (minutes of compile a case)")  # fmt: skip
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print epicute's kernels per step (torch.profiler) and its host time (cProfile)",
    )
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
              "gated_mlp, mlp, linear and moe_experts: run it with an epicute that has them",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference (the default; said, not assumed)
    rows, all_ok = [], True
    for name in cases:
        for tokens in args.tokens or CASES[name][0]:
            row, ok = run_case(EF, name, tokens, args.max_autotune, args.profile)
            rows.append(row)
            all_ok = all_ok and ok
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    return finish_peer_run(args.out, "training", rows, all_ok)


if __name__ == "__main__":
    sys.exit(main())
