"""Training steps on the GPU, as a training loop runs them: gradients that are the same bits run to run, and a
torch.compile'd step captured in a CUDA graph, then replayed on new inputs (and new routing) against float64
autograd of the same math."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import epicute
from epicute.nn import functional as EF

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
TOL = 1e-2  # bf16 storage of the outputs, saved activations and gradients (8 significant bits)


@dataclass
class Layer:
    """A layer's tensors (``leaves`` train; ``fixed`` do not), its epicute call and its float64 torch math."""

    leaves: dict[str, torch.Tensor]
    fixed: dict[str, torch.Tensor]
    run: Callable[..., torch.Tensor]
    math: Callable[..., torch.Tensor]
    reroute: Callable[[], None] = lambda: None  # new fixed inputs of the same shapes, in place


def _param(*shape, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16) * scale).requires_grad_()


def linear_layer() -> Layer:
    """Linear + bias + GELU + residual; K = 512 plans the saved pre-activation and a zero-K gradient pass."""
    tokens, d, out = 1001, 512, 264
    leaves = {"x": _param(tokens, d), "w": _param(out, d, scale=d**-0.5), "b": _param(out), "r": _param(tokens, out)}

    def run(x, w, b, r):
        return EF.linear(x, w, b, epilogue=lambda acc, residual: epicute.ops.gelu(acc) + residual, residual=r)

    def math(x, w, b, r):
        return F.gelu(F.linear(x, w, b)) + r

    return Layer(leaves, {}, run, math)


def gated_mlp_layer() -> Layer:
    """SwiGLU MLP over an interleaved gate/up weight (its backward fuses d gate, d up into the down GEMM's)."""
    tokens, d, hidden = 777, 512, 1048
    leaves = {"x": _param(tokens, d), "w13": _param(2 * hidden, d, scale=d**-0.5),
              "w_down": _param(d, hidden, scale=hidden**-0.5)}  # fmt: skip

    def run(x, w13, w_down):
        return EF.gated_mlp(x, w13, w_down, activation="silu")

    def math(x, w13, w_down):
        blocks = w13.unflatten(0, (hidden // 8, 2, 8))  # epicute.interleave_gate_up's blocks of 8
        gate, up = blocks[:, 0].flatten(0, 1), blocks[:, 1].flatten(0, 1)
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), w_down)

    return Layer(leaves, {}, run, math)


def moe_layer() -> Layer:
    """Top-8 of 16 experts (so a token's gradient sums eight routed rows: their order shows in the bits)."""
    tokens, hidden, inter, experts, top_k = 301, 256, 136, 16, 8
    leaves = {"x": _param(tokens, hidden), "gate_up": _param(experts, 2 * inter, hidden, scale=hidden**-0.5),
              "down": _param(experts, hidden, inter, scale=inter**-0.5),
              "weights": torch.rand(tokens, top_k, device=DEVICE).softmax(-1).requires_grad_()}  # fmt: skip
    index = torch.empty(tokens, top_k, device=DEVICE, dtype=torch.long)

    def reroute():
        index.copy_(torch.rand(tokens, experts, device=DEVICE).argsort(-1)[:, :top_k])

    reroute()

    def run(x, gate_up, down, weights, index):
        return EF.moe_experts(x, gate_up, down, index, weights)

    def math(x, gate_up, down, weights, index):
        out = torch.zeros_like(x)
        for slot in range(top_k):
            e = index[:, slot]
            gate, up = (gate_up[e] @ x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
            out = out + weights[:, slot, None] * (down[e] @ (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return out

    return Layer(leaves, {"index": index}, run, math, reroute)


def gathered_rows_layer() -> Layer:
    """``epicute.grouped_gemm`` reading routed rows in place (``a_index``, each token 8 times): its backward sums a
    token's 8 row gradients (``sum_rows_by_index``)."""
    tokens, k, n, groups, top_k = 301, 256, 136, 16, 8
    leaves = {"x": _param(tokens, k), "w": _param(groups, n, k, scale=k**-0.5)}
    index = torch.empty(tokens * top_k, device=DEVICE, dtype=torch.int32)
    offsets = torch.empty(groups, device=DEVICE, dtype=torch.int32)

    def reroute():
        experts = torch.rand(tokens, groups, device=DEVICE).argsort(-1)[:, :top_k].reshape(-1)
        order = torch.argsort(experts, stable=True)
        index.copy_(order // top_k)
        offsets.copy_(torch.cumsum(torch.bincount(experts, minlength=groups), 0))

    reroute()

    def run(x, w, index, offsets):
        return epicute.grouped_gemm(x, w.transpose(-2, -1), offsets, a_index=index)

    def math(x, w, index, offsets):
        group = torch.searchsorted(offsets.long(), torch.arange(index.numel(), device=DEVICE), right=True)
        return (w[group] @ x[index.long()].unsqueeze(-1)).squeeze(-1)

    return Layer(leaves, {"index": index, "offsets": offsets}, run, math, reroute)


LAYERS = {"linear": linear_layer, "gated_mlp": gated_mlp_layer, "moe_experts": moe_layer,
          "gathered_rows": gathered_rows_layer}  # fmt: skip


def _step(layer: Layer, run: Callable, upstream: torch.Tensor) -> torch.Tensor:
    y = run(**layer.leaves, **layer.fixed)
    y.backward(upstream)
    return y


def _errors(layer: Layer, y: torch.Tensor, upstream: torch.Tensor) -> dict[str, float]:
    ref_leaves = {name: t.detach().double().requires_grad_() for name, t in layer.leaves.items()}
    want = layer.math(**ref_leaves, **layer.fixed)
    want.backward(upstream.double())

    def rel(got, ref):
        return ((got.double() - ref).norm() / ref.norm()).item()

    return {"out": rel(y, want.detach())} | {n: rel(t.grad, ref_leaves[n].grad) for n, t in layer.leaves.items()}


@pytest.mark.parametrize("name", list(LAYERS))
def test_gradients_are_the_same_bits_run_to_run(name):
    """Every reduction of a backward (bias gradients, split-K, a token's routed rows) adds in a fixed order."""
    layer = LAYERS[name]()
    upstream = torch.randn_like(layer.run(**layer.leaves, **layer.fixed))
    runs = []
    for _ in range(3):
        for t in layer.leaves.values():
            t.grad = None
        _step(layer, layer.run, upstream)
        runs.append({n: t.grad.clone() for n, t in layer.leaves.items()})
    for later in runs[1:]:
        assert all(torch.equal(later[n], runs[0][n]) for n in runs[0]), name


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_compiled_training_step_replays_in_a_cuda_graph(name):
    """torch.compile(fullgraph=True), warmed up on a side stream, captured (forward and backward) in one CUDA
    graph, then replayed after new values are copied into the inputs (and, for MoE, new routing): the gradients
    the replay leaves in ``.grad`` match float64 autograd on the new inputs."""
    torch._dynamo.reset()
    layer = LAYERS[name]()
    compiled = torch.compile(layer.run, fullgraph=True)
    upstream = torch.randn_like(layer.run(**layer.leaves, **layer.fixed))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles, plans and allocates outside the capture
        for _ in range(2):
            for t in layer.leaves.values():
                t.grad = None
            _step(layer, compiled, upstream)
    torch.cuda.current_stream().wait_stream(side)
    for t in layer.leaves.values():
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _step(layer, compiled, upstream)
    with torch.no_grad():
        for t in layer.leaves.values():
            t.copy_(torch.randn_like(t) * t.std())
        upstream.copy_(torch.randn_like(upstream))
    layer.reroute()
    y.data.fill_(float("nan"))  # the replay's output memory, poisoned (.data: y may be a view autograd guards)
    for t in layer.leaves.values():
        t.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    errors = _errors(layer, y, upstream)
    assert all(e < TOL for e in errors.values()), errors
