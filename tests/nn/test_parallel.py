"""epicute.nn layers under torch.distributed: tensor-parallel plans (ColwiseParallel / RowwiseParallel on DTensor)
and FSDP2, forward and backward, in a CPU ``gloo`` world (the GEMMs by the reference backend).

Each test spawns its ranks; every rank checks its results against float64 autograd of the same math on the whole
(unsharded) weights, relative error, fresh random inputs, odd sizes. bf16 layers: 2e-2 (two bf16 roundings of
outputs and gradients, the reduction's bf16 all-reduce on top).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.nn.gloo_world import AVAILABLE, spawn

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs torch.distributed with gloo")

BF16 = torch.bfloat16
TOL = 2e-2
HIDDEN, INNER, OUT, TOKENS = 40, 192, 24, 13  # INNER splits over 2, 3, 4 and 8 ranks into multiples of 8 (TMA rows)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.detach().cpu().double() - want).norm() / want.norm()).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _mlp(seed: int):
    """Two epicute Linears (the first with a fused GELU) and their weights in float64, the same on every rank."""
    import epicute
    from epicute.nn import Linear

    torch.manual_seed(seed)
    up = Linear(HIDDEN, INNER, epilogue=lambda acc: epicute.ops.gelu(acc), dtype=BF16)
    down = Linear(INNER, OUT, dtype=BF16)
    model = torch.nn.Sequential(up, down)
    reference = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters()}
    return model, reference


def _reference_mlp(x: torch.Tensor, p: dict) -> torch.Tensor:
    h = torch.nn.functional.gelu(x @ p["0.weight"].T + p["0.bias"])
    return h @ p["1.weight"].T + p["1.bias"]


def _check_mlp_step(model, reference: dict, seed: int) -> None:
    """A forward and backward of ``model`` (sharded or not) against float64 autograd: output, x's gradient and every
    parameter's gradient (gathered whole)."""
    torch.manual_seed(seed)  # the same input and upstream gradient on every rank, as a replicated input is
    x = torch.randn(TOKENS, HIDDEN, dtype=BF16, requires_grad=True)
    grad = torch.randn(TOKENS, OUT, dtype=BF16)
    y = model(x)
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    want = _reference_mlp(x64, reference)
    want.backward(grad.double())
    errors = {"out": _rel(_full(y), want.detach()), "x": _rel(x.grad, x64.grad)}
    errors |= {name: _rel(_full(p.grad), reference[name].grad) for name, p in model.named_parameters()}
    assert all(e < TOL for e in errors.values()), errors


def _tensor_parallel_mlp(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model, reference = _mlp(seed=1234)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    assert isinstance(model[0].weight, DTensor) and model[0].weight.placements == (Shard(0),)
    assert model[1].weight.placements == (Shard(1),)
    _check_mlp_step(model, reference, seed=99)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_colwise_then_rowwise_mlp_trains_like_the_whole_one(world):
    """Llama-style column-then-row split (the fused GELU on each rank's columns, the bias added after the partial
    sums are reduced)."""
    spawn(_tensor_parallel_mlp, world)


def _counting_collectives(collective) -> dict[str, int]:
    """Count this process's fused collective GEMMs (``collective``'s schedules), by kind, from now on."""
    calls = {"gather": 0, "scatter": 0}

    def counting(key: str, inner):
        def counted(*args, **kwargs):
            calls[key] += 1
            return inner(*args, **kwargs)

        return counted

    collective._all_gather_gemm = counting("gather", collective._all_gather_gemm)
    collective._gemm_reduce_scatter = counting("scatter", collective._gemm_reduce_scatter)
    return calls


def sequence_parallel_mlp(rank: int, world: int, batch: int, gelu: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import epicute
    from epicute.distributed import collective
    from epicute.nn import Linear
    from epicute.nn.parallel import SequenceColwiseParallel, SequenceRowwiseParallel

    calls = _counting_collectives(collective)
    dev = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"  # the GPU test runs this too
    mesh = init_device_mesh(dev, (world,))
    torch.manual_seed(2024)
    activation = (lambda acc: epicute.ops.gelu(acc)) if gelu else None  # under autograd: its backward derived
    model = torch.nn.Sequential(Linear(HIDDEN, INNER, epilogue=activation, dtype=BF16),
                                Linear(INNER, OUT, dtype=BF16)).to(dev)  # fmt: skip
    reference = {name: p.detach().cpu().double().requires_grad_() for name, p in model.named_parameters()}
    parallelize_module(model, mesh, {"0": SequenceColwiseParallel(), "1": SequenceRowwiseParallel()})
    tokens = 5 * world  # five (odd) per rank
    own = slice(rank * 5, (rank + 1) * 5)
    torch.manual_seed(11)
    x = torch.randn(batch, tokens, HIDDEN, dtype=BF16)
    grad = torch.randn(batch, tokens, OUT, dtype=BF16)
    x_own = x[:, own].to(dev).requires_grad_()
    y = model(x_own)  # this rank's tokens in, this rank's tokens out
    y.backward(grad[:, own].to(dev))
    x64 = x.double().requires_grad_()
    p = reference
    hidden = x64 @ p["0.weight"].T + p["0.bias"]
    want = (torch.nn.functional.gelu(hidden) if gelu else hidden) @ p["1.weight"].T + p["1.bias"]
    want.backward(grad.double())
    errors = {"out": _rel(y, want[:, own].detach()), "x": _rel(x_own.grad, x64.grad[:, own])}
    errors |= {name: _rel(_full(q.grad), reference[name].grad) for name, q in model.named_parameters()}
    assert all(e < TOL for e in errors.values()), errors
    # One sequence: each rank's tokens are one block of rows, and both layers' collectives run inside their GEMMs,
    # forward and backward. Several: the tokens are gathered and scattered around plain GEMMs.
    assert calls == ({"gather": 2, "scatter": 2} if batch == 1 else {"gather": 0, "scatter": 0}), calls

    # Inference: the up projection's epilogue fused after the gathered GEMM.
    up = Linear(HIDDEN, INNER, epilogue=lambda acc: epicute.ops.gelu(acc), dtype=BF16).to(dev)
    w64, b64 = up.weight.detach().cpu().double(), up.bias.detach().cpu().double()
    parallelize_module(up, mesh, SequenceColwiseParallel())
    with torch.no_grad():
        h = up(x[:, own].to(dev))  # every token, this rank's features
    columns = slice(rank * (INNER // world), (rank + 1) * (INNER // world))
    assert _rel(h, torch.nn.functional.gelu(x.double() @ w64.T + b64)[..., columns]) < TOL
    assert calls["gather"] == (3 if batch == 1 else 0)


@pytest.mark.parametrize(("world", "batch", "gelu"),
                         [(2, 1, False), (3, 1, False), (8, 1, False), (2, 2, False), (2, 1, True)])  # fmt: skip
def test_sequence_parallel_layers_fuse_their_collectives_into_the_gemms(world, batch, gelu):
    """SequenceColwiseParallel then SequenceRowwiseParallel train like the whole model; with one sequence the
    all-gather and the reduce-scatter run inside the GEMMs (epicute.distributed), forward and backward, the up
    projection's epilogue (a GELU) inside its gathered GEMM too."""
    spawn(functools.partial(sequence_parallel_mlp, batch=batch, gelu=gelu), world)


def _refusals(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import epicute
    from epicute.nn import Linear

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(7)
    row = Linear(INNER, OUT, epilogue=lambda acc: epicute.ops.relu(acc), dtype=BF16)
    parallelize_module(row, mesh, RowwiseParallel())
    with pytest.raises(epicute.EpilogueError, match="row-parallel linear"):
        row(torch.randn(TOKENS, INNER, dtype=BF16))

    col = Linear(HIDDEN, INNER, epilogue=lambda acc, residual: acc + residual, dtype=BF16)
    parallelize_module(col, mesh, ColwiseParallel())
    x = torch.randn(TOKENS, HIDDEN, dtype=BF16)
    residual = torch.randn(TOKENS, INNER, dtype=BF16)
    with pytest.raises(epicute.EpilogueError, match="operand 'residual' is a plain tensor"):
        col(x, residual=residual)
    # Sharded like the output, the operand fuses, and its gradient is its own shard's.
    sharded = distribute_tensor(residual, mesh, [Shard(1)]).requires_grad_()
    y = col(x, residual=sharded)  # ColwiseParallel hands back this rank's columns, a plain tensor
    y.backward(torch.ones_like(y))
    want = x.double() @ col.weight.full_tensor().double().T + col.bias.full_tensor().double() + residual.double()
    columns = INNER // world
    assert _rel(y, want[:, rank * columns : (rank + 1) * columns]) < TOL
    assert torch.equal(_full(sharded.grad), torch.ones_like(residual))

    from epicute.nn import fp8_moe_experts

    gate_up = distribute_tensor(torch.randn(2, 256, 128, dtype=BF16), mesh, [Shard(1)])
    with pytest.raises(epicute.ConfigError, match="fp8 experts with DTensor weights"):
        fp8_moe_experts(torch.randn(4, 128, dtype=BF16), gate_up, torch.randn(2, 128, 128, dtype=BF16),
                        torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1))  # fmt: skip


def test_what_a_sharded_layer_cannot_fuse_is_refused_and_a_sharded_operand_fuses():
    spawn(_refusals, 2)


def _fsdp_mlp(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model, reference = _mlp(seed=4321)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _check_mlp_step(model, reference, seed=5)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_trains_like_the_whole_model(world):
    """fully_shard gathers each layer's parameters into plain tensors before its forward: epicute's layers run
    unchanged, and the reduce-scattered gradients match the whole model's."""
    spawn(_fsdp_mlp, world)


def _swiglu_mlp64(x64: torch.Tensor, leaves: dict, grad: torch.Tensor) -> torch.Tensor:
    """A gated MLP's float64 output from its checkpoint's weights (``leaves``), backward run with ``grad``."""
    gate, up = x64 @ leaves["gate_proj.weight"].T, x64 @ leaves["up_proj.weight"].T
    want = (torch.nn.functional.silu(gate) * up) @ leaves["down_proj.weight"].T
    want.backward(grad.double())
    return want


def _checkpoint_grads(mlp) -> dict[str, torch.Tensor]:
    """A sharded GatedMLP's gradients in its checkpoint's layout: gate_up's split as the state dict splits it."""
    grads = type(mlp)(HIDDEN, INNER, dtype=BF16, device="meta")
    grads.gate_up = torch.nn.Parameter(mlp.gate_up.grad.full_tensor(), requires_grad=False)
    grads.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.grad.full_tensor(), requires_grad=False)
    return grads.state_dict()


def _gated_mlp(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    import epicute
    from epicute.nn import GatedMLP
    from epicute.nn.parallel import GatedMLPParallel

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(11)
    mlp = GatedMLP(HIDDEN, INNER, activation="silu", dtype=BF16)
    whole = {name: t.detach().double() for name, t in mlp.state_dict().items()}  # the checkpoint's gate/up/down
    leaves = {name: t.clone().requires_grad_() for name, t in whole.items()}
    parallelize_module(mlp, mesh, GatedMLPParallel())
    assert mlp.gate_up.placements == (Shard(0),) and mlp.down_proj.weight.placements == (Shard(1),)
    # The sharded module's state dict still has the checkpoint's layout (each key a DTensor of the same values).
    assert {name: _full(t).double() for name, t in mlp.state_dict().items()}.keys() == whole.keys()
    assert all(torch.equal(_full(t).double(), whole[name]) for name, t in mlp.state_dict().items())
    torch.manual_seed(3)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=BF16, requires_grad=True)
    grad = torch.randn(2, TOKENS, HIDDEN, dtype=BF16)
    y = mlp(x)  # the reduced output, a plain tensor on every rank
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    want = _swiglu_mlp64(x64, leaves, grad)
    errors = {"out": _rel(y, want.detach()), "x": _rel(x.grad, x64.grad)}
    errors |= {name: _rel(g, leaves[name].grad) for name, g in _checkpoint_grads(mlp).items()}
    assert all(e < TOL for e in errors.values()), errors
    with pytest.raises(epicute.ConfigError, match="intermediate_size=40"):
        parallelize_module(GatedMLP(HIDDEN, 40, dtype=BF16), mesh, GatedMLPParallel())


def sequence_gated_mlp(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from epicute.distributed import collective
    from epicute.nn import GatedMLP
    from epicute.nn.parallel import GatedMLPParallel

    calls = _counting_collectives(collective)
    dev = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"  # the GPU test runs this too
    mesh = init_device_mesh(dev, (world,))
    torch.manual_seed(11)
    mlp = GatedMLP(HIDDEN, INNER, activation="silu", dtype=BF16).to(dev)
    leaves = {name: t.detach().cpu().double().requires_grad_() for name, t in mlp.state_dict().items()}
    parallelize_module(mlp, mesh, GatedMLPParallel(input_layouts=Shard(1), output_layouts=Shard(1)))
    tokens = 5 * world  # five (odd) per rank
    own = slice(rank * 5, (rank + 1) * 5)
    torch.manual_seed(3)
    x = torch.randn(1, tokens, HIDDEN, dtype=BF16)
    grad = torch.randn(1, tokens, HIDDEN, dtype=BF16)
    x_own = x[:, own].to(dev, copy=True).requires_grad_()
    y = mlp(x_own)  # this rank's tokens in, this rank's tokens out
    y.backward(grad[:, own].to(dev))
    x64 = x.double().requires_grad_()
    want = _swiglu_mlp64(x64, leaves, grad)
    errors = {"out": _rel(y, want[:, own].detach()), "x": _rel(x_own.grad, x64.grad[:, own])}
    errors |= {name: _rel(g, leaves[name].grad) for name, g in _checkpoint_grads(mlp).items()}
    assert all(e < TOL for e in errors.values()), errors
    # Both projections' collectives inside their GEMMs, forward and backward (each one's data gradient the other).
    assert calls == {"gather": 2, "scatter": 2}, calls


@pytest.mark.parametrize("world", [2, 8])
def test_a_sequence_parallel_gated_mlp_gathers_and_scatters_inside_its_gemms(world):
    """GatedMLPParallel(input_layouts=Shard(1), output_layouts=Shard(1)): each rank passes and gets back its tokens;
    the gate/up GEMM gathers them (SwiGLU in its epilogue), the down GEMM reduce-scatters; trained like the whole."""
    spawn(sequence_gated_mlp, world)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_gated_mlp_split_by_features_trains_like_the_whole_one(world):
    """GatedMLPParallel: gate/up by rows and down by columns over the same features; the fused MLP (its backward
    across the two GEMMs included) on each rank, one reduction of the outputs."""
    spawn(_gated_mlp, world)


def _experts(rank: int, world: int) -> None:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from epicute.nn import MoEExperts
    from epicute.nn.parallel import GatedMLPParallel

    mesh = init_device_mesh("cpu", (world,))
    num_experts, top_k = 5, 2
    torch.manual_seed(21)
    layer = MoEExperts(num_experts, HIDDEN, INNER, dtype=BF16)
    whole = {name: t.detach().double().requires_grad_() for name, t in layer.state_dict().items()}
    parallelize_module(layer, mesh, GatedMLPParallel())
    assert layer.gate_up.placements == (Shard(1),) and layer.down_proj.placements == (Shard(2),)
    torch.manual_seed(22)  # the same tokens and routing on every rank, as a replicated router gives
    x = torch.randn(TOKENS, HIDDEN, dtype=BF16, requires_grad=True)
    index = torch.stack([torch.randperm(num_experts - 1)[:top_k] for _ in range(TOKENS)])  # expert 4 never picked
    weights = torch.softmax(torch.randn(TOKENS, top_k), -1).requires_grad_()
    grad = torch.randn(TOKENS, HIDDEN, dtype=BF16)
    y = layer(x, index, weights)
    y.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
    want = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for t in range(TOKENS):
        for j in range(top_k):
            e = int(index[t, j])
            g, u = F.linear(x64[t], whole["gate_up_proj"][e]).chunk(2)
            want = want.index_add(
                0, torch.tensor([t]), (w64[t, j] * F.linear(F.silu(g) * u, whole["down_proj"][e]))[None]
            )
    want.backward(grad.double())
    # The weights' gradients in the checkpoint's layout, as the state dict hook de-interleaves the weight.
    grads = MoEExperts(num_experts, HIDDEN, INNER, dtype=BF16, device="meta")
    grads.gate_up = torch.nn.Parameter(layer.gate_up.grad.full_tensor(), requires_grad=False)
    grads.down_proj = torch.nn.Parameter(layer.down_proj.grad.full_tensor(), requires_grad=False)
    errors = {"out": _rel(y, want.detach()), "x": _rel(x.grad, x64.grad), "weights": _rel(weights.grad, w64.grad)}
    errors |= {name: _rel(g, whole[name].grad) for name, g in grads.state_dict().items()}
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("world", [2, 8])
def test_moe_experts_split_by_features_train_like_the_whole_layer(world):
    """GatedMLPParallel on MoEExperts: every expert's gate/up rows and down columns split over the same features,
    each rank routing every token through its share, one reduction; the router weights' gradient sums the ranks'."""
    spawn(_experts, world)


def _more_refusals(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import epicute
    from epicute.nn import Linear
    from epicute.nn import functional as EF
    from epicute.nn.parallel import GatedMLPParallel

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    x = torch.randn(TOKENS, HIDDEN, dtype=BF16)
    # A reduction of a column-parallel layer would hold each rank's own columns' share.
    col = Linear(HIDDEN, INNER, epilogue=lambda acc: {"D": acc, "rs": epicute.ops.row_sum(acc)}, dtype=BF16)
    parallelize_module(col, mesh, ColwiseParallel(use_local_output=False))
    for tokens in (x, x.reshape(1, TOKENS, HIDDEN)):  # (13,) and (1, 13) row sums: no tile for either
        with pytest.raises(epicute.EpilogueError, match="output 'rs' is a reduction"):
            col(tokens)
    # A weight on a 2-D mesh: the tensor-parallel dimension's 1-D mesh is what the layer takes.
    square = init_device_mesh("cpu", (1, world))
    w = distribute_tensor(torch.randn(INNER, HIDDEN, dtype=BF16), square, [Replicate(), Shard(0)])
    with pytest.raises(epicute.ConfigError, match="2-D device mesh"):
        EF.linear(x, w)
    # A sharded weight's shards run their own paths (gathered, scattered): an output dtype is not carried through.
    rows = distribute_tensor(torch.randn(INNER, HIDDEN, dtype=BF16), mesh, [Shard(0)])
    with pytest.raises(epicute.ConfigError, match="out_dtype with a tensor-parallel"):
        EF.linear(x, rows, out_dtype=torch.float32)
    # A gated MLP's two weights split together, and only the interleaved gate/up weight of experts splits.
    gate_up = distribute_tensor(torch.randn(2 * INNER, HIDDEN, dtype=BF16), mesh, [Shard(0)])
    down = distribute_tensor(torch.randn(HIDDEN, INNER, dtype=BF16), mesh, [Replicate()])
    with pytest.raises(epicute.ConfigError, match="split together"):
        EF.gated_mlp(x, gate_up, down)
    experts_gate_up = distribute_tensor(torch.randn(3, 2 * INNER, HIDDEN, dtype=BF16), mesh, [Shard(1)])
    experts_down = distribute_tensor(torch.randn(3, HIDDEN, INNER, dtype=BF16), mesh, [Shard(2)])
    index, weights = torch.zeros(TOKENS, 1, dtype=torch.long), torch.ones(TOKENS, 1)
    with pytest.raises(epicute.ConfigError, match="interleaved=False"):
        EF.moe_experts(x, experts_gate_up, experts_down, index, weights)
    with pytest.raises(epicute.ConfigError, match="not a Linear"):
        parallelize_module(Linear(HIDDEN, INNER, dtype=BF16), mesh, GatedMLPParallel())


def test_more_that_a_sharded_layer_refuses_names_the_fix():
    spawn(_more_refusals, 2)
