"""A patched transformers model under a tensor-parallel plan (tensor_parallel_plan): attention projections split by
heads, gated MLPs by features, in a CPU gloo world (the GEMMs and attention by the reference backend), trained
against the same model in float64 on one process.

Tolerance: 2e-2 relative, bf16 end to end through two decoder layers (the sharded model's reductions all-reduce in
bf16 on top), as tests/integrations/test_transformers.py.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.nn.gloo_world import AVAILABLE, spawn

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs torch.distributed with gloo")
transformers = pytest.importorskip("transformers")

TOL = 2e-2


def _tiny_sizes(world: int = 2) -> dict:
    """A tiny model's sizes that split over ``world`` ranks: one key/value head and two query heads of 64 per rank,
    72 MLP features per rank (a multiple of 8: TMA's 16-byte rows); at two ranks 256 hidden, 4/2 heads, 144."""
    return {"hidden_size": 128 * world, "intermediate_size": 72 * world, "num_attention_heads": 2 * world,
            "num_key_value_heads": world}  # fmt: skip


def _tiny_llama(kv_heads: int | None = None, world: int = 2):
    sizes = _tiny_sizes(world) | ({"num_key_value_heads": kv_heads} if kv_heads else {})
    config = transformers.LlamaConfig(num_hidden_layers=2, vocab_size=96, max_position_embeddings=64, **sizes)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def _rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _device() -> str:
    """The world's device: CPU tensors in a gloo world (the reference backend), each rank's GPU in an NCCL one (the
    kernels; test_transformers_parallel_gpu.py). The float64 reference stays on the CPU."""
    return "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"


def _llama_step(rank: int, world: int, sequence_parallel: bool = False, batch: int = 2) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import epicute
    from epicute.distributed import collective
    from epicute.integrations.transformers import patch, tensor_parallel_plan
    from tests.nn.test_parallel import _counting_collectives

    calls = _counting_collectives(collective)
    mesh = init_device_mesh(_device(), (world,))
    model = _tiny_llama(world=world)
    reference = copy.deepcopy(model).double()
    model.to(_device())
    patch(model, linears=True)
    plan = tensor_parallel_plan(model, world, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        assert {"model.layers.0", "model.layers.1.post_attention_layernorm", "model.norm", "lm_head"} <= set(plan)
    else:
        assert sorted({key.rsplit(".", 1)[-1] for key in plan}) == ["k_proj", "mlp", "o_proj", "q_proj", "v_proj"]
    parallelize_module(model, mesh, plan)
    torch.manual_seed(1)  # the same tokens on every rank (sequence-parallel: each layer keeps this rank's share)
    ids = torch.randint(0, 96, (batch, 10 * world if sequence_parallel else 19))
    loss = model(input_ids=ids.to(_device()), labels=ids.to(_device())).loss
    loss.backward()
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    layer, ref_layer = model.model.layers[1], reference.model.layers[1]
    errors = {
        "loss": _rel(loss.detach(), want.detach()),
        "embed_tokens": _rel(model.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad),
        "lm_head": _rel(model.lm_head.weight.grad, reference.lm_head.weight.grad),
        "norm": _rel(_full(model.model.norm.weight.grad), reference.model.norm.weight.grad),
    }
    for norm in ("input_layernorm", "post_attention_layernorm"):  # sequence-parallel: each rank's tokens' share, summed
        errors[norm] = _rel(_full(getattr(layer, norm).weight.grad), getattr(ref_layer, norm).weight.grad)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        errors[proj] = _rel(_full(getattr(layer.self_attn, proj).weight.grad),
                            getattr(ref_layer.self_attn, proj).weight.grad)  # fmt: skip
    errors["down_proj"] = _rel(_full(layer.mlp.down_proj.weight.grad), ref_layer.mlp.down_proj.weight.grad)
    assert all(e < TOL for e in errors.values()), errors
    if not sequence_parallel:
        return
    if batch == 1:  # a rank's tokens are one block of rows: the MLPs' and o_proj's collectives run in their GEMMs
        assert calls["gather"] >= 2 and calls["scatter"] >= 4, calls
    # A sequence that does not split evenly is refused on every rank alike, before any collective.
    with pytest.raises(epicute.ConfigError, match=f"a sequence of {10 * world - 1} tokens does not split evenly"):
        model(input_ids=ids[:, 1:].to(_device()))


def test_a_patched_llama_split_by_heads_and_features_trains_like_the_whole_one():
    spawn(_llama_step, 2)


@pytest.mark.parametrize("batch", (1, 2))
def test_a_patched_llama_trains_sequence_parallel_like_the_whole_one(batch):
    """Tokens sharded between the layers (norms on each rank's tokens, the MLPs and o_proj with their collectives
    inside the GEMMs; with two sequences a rank's tokens are no single block, and the layers gather first)."""
    spawn(functools.partial(_llama_step, sequence_parallel=True, batch=batch), 2)


def test_patched_models_train_split_over_four_ranks():
    """The same steps in a world of 4 ranks (tiny models sized so one key/value head goes to each rank): Llama by heads
    and features, then sequence-parallel with one sequence; Qwen3 and Mixtral sequence-parallel."""
    for step in (_llama_step, functools.partial(_llama_step, sequence_parallel=True, batch=1),
                 functools.partial(_qwen3_step, sequence_parallel=True),
                 functools.partial(_mixtral_step, sequence_parallel=True)):  # fmt: skip
        spawn(step, 4)


def test_a_patched_llama_trains_sequence_parallel_over_eight_ranks():
    spawn(functools.partial(_llama_step, sequence_parallel=True, batch=1), 8)


def test_heads_that_do_not_split_are_refused():
    """One key/value head cannot go to two ranks: a typed error naming the layer, before anything is sharded."""
    import epicute
    from epicute.integrations.transformers import patch, tensor_parallel_plan

    model = _tiny_llama(kv_heads=1)
    patch(model, linears=True)
    with pytest.raises(epicute.ConfigError, match="4 query and 1 key/value heads do not split over 2 ranks"):
        tensor_parallel_plan(model, 2)
    with pytest.raises(epicute.ConfigError, match="patch\\(model, linears=True\\) first"):
        tensor_parallel_plan(_tiny_llama(), 2)


def _qwen3_step(rank: int, world: int, sequence_parallel: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from epicute.integrations.transformers import patch, tensor_parallel_plan

    mesh = init_device_mesh(_device(), (world,))
    config = transformers.Qwen3Config(num_hidden_layers=2, head_dim=64, vocab_size=96, max_position_embeddings=64,
                                      **_tiny_sizes(world))  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    reference = copy.deepcopy(model).double()
    model.to(_device())
    patch(model, linears=True)
    plan = tensor_parallel_plan(model, world, sequence_parallel=sequence_parallel)
    assert "model.layers.1.self_attn.q_norm" in plan and "model.layers.1.self_attn.k_norm" in plan
    parallelize_module(model, mesh, plan)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 10 * world))
    loss = model(input_ids=ids.to(_device()), labels=ids.to(_device())).loss
    loss.backward()
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    attn, ref_attn = model.model.layers[1].self_attn, reference.model.layers[1].self_attn
    errors = {"loss": _rel(loss.detach(), want.detach())}
    for norm in ("q_norm", "k_norm"):  # one weight over every head: each rank's heads' share, summed over ranks
        errors[norm] = _rel(_full(getattr(attn, norm).weight.grad), getattr(ref_attn, norm).weight.grad)
    for proj in ("q_proj", "k_proj", "o_proj"):
        errors[proj] = _rel(_full(getattr(attn, proj).weight.grad), getattr(ref_attn, proj).weight.grad)
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("heads", "sequence"))
def test_a_patched_qwen3_with_per_head_norms_trains_split_like_the_whole_one(sequence_parallel):
    """Qwen3 normalizes each head's q and k with one weight shared by the heads the split scatters."""
    spawn(functools.partial(_qwen3_step, sequence_parallel=sequence_parallel), 2)


def _mixtral_step(rank: int, world: int, sequence_parallel: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    from epicute.integrations.transformers import patch, tensor_parallel_plan
    from epicute.nn import MoEExperts

    mesh = init_device_mesh(_device(), (world,))
    config = transformers.MixtralConfig(num_hidden_layers=2, vocab_size=96, num_local_experts=5, num_experts_per_tok=2,
                                        max_position_embeddings=64, **_tiny_sizes(world))  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    reference = copy.deepcopy(model).double()
    model.to(_device())
    reference.config._experts_implementation = "eager"  # the expert loop in float64 (torch._grouped_mm has none)
    patch(model, linears=True)
    plan = tensor_parallel_plan(model, world, sequence_parallel=sequence_parallel)
    experts = [name for name, module in model.named_modules() if isinstance(module, MoEExperts)]
    assert len(experts) == 2 and all(name in plan for name in experts)
    # Sequence-parallel: each MoE block gathers its tokens (the router sees them all) and cuts them again.
    assert all((name.rpartition(".")[0] in plan) == sequence_parallel for name in experts)
    parallelize_module(model, mesh, plan)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 10 * world if sequence_parallel else 19))
    with CommDebugMode() as comms:
        loss = model(input_ids=ids.to(_device()), labels=ids.to(_device())).loss
    counts = {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}
    if sequence_parallel:  # each block's partial sums reduce-scattered by tokens, never all-reduced and cut
        assert counts.get("reduce_scatter_tensor", 0) >= 2 and not counts.get("all_reduce", 0), counts
    loss.backward()
    want = reference(input_ids=ids, labels=ids).loss
    # The loss only: a bf16 model may route a token to another expert than the float64 one after a last-bit
    # difference upstream (tests/integrations/test_transformers.py compares the experts' gradients on one block).
    assert _rel(loss.detach(), want.detach()) < TOL
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    # Every replicated weight (router, norms, embeddings) gets the whole gradient, the same on every rank.
    router = model.model.layers[1].mlp.gate.weight.grad
    gathered = [torch.empty_like(router) for _ in range(world)]
    torch.distributed.all_gather(gathered, router)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("features", "sequence"))
def test_a_patched_mixtral_trains_with_its_experts_split_by_features(sequence_parallel):
    spawn(functools.partial(_mixtral_step, sequence_parallel=sequence_parallel), 2)


def test_a_sequence_parallel_plan_needs_a_stack_of_decoder_layers():
    """Sequence parallelism shards the tokens of one stack of decoder layers with their two norms: a model without
    them is refused, naming what is missing, before anything is sharded."""
    import epicute
    from epicute.integrations.transformers import patch, tensor_parallel_plan
    from epicute.nn import GatedMLP

    mlp = torch.nn.Sequential(GatedMLP(64, 128))
    assert "0" in tensor_parallel_plan(mlp, 2)  # split by features: no layers needed
    with pytest.raises(epicute.ConfigError, match="no single stack of decoder layers"):
        tensor_parallel_plan(mlp, 2, sequence_parallel=True)
    model = _tiny_llama()
    patch(model, linears=True)
    del model.model.layers[1].post_attention_layernorm
    with pytest.raises(epicute.ConfigError, match="model.layers.1 has no post_attention_layernorm"):
        tensor_parallel_plan(model, 2, sequence_parallel=True)
