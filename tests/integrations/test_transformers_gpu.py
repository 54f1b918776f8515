"""epicute.integrations.transformers.patch on the GPU: a small Llama-shaped model's training step with the kernels
(the patched MLPs' gated GEMM and fused backward, the linears) against the unpatched model in torch's bf16."""

from __future__ import annotations

import copy

import pytest
import torch

import epicute
from epicute.integrations.transformers import patch
from tests.integrations.block_step import generate_logits_error, mlp_block_step

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

TOL = 2e-2  # bf16 end to end through the decoder layers; torch's bf16 model is the peer


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generate_reads_only_the_cached_keys(cache):
    """Decode steps on the kernels (a static cache's empty slots never attended: seqused_k from the positions)."""
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1368, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    patched = copy.deepcopy(original)
    patch(patched, linears=True)
    with torch.no_grad():
        prompt = torch.randint(0, 1000, (3, 37), device="cuda")
        assert generate_logits_error(original, patched, prompt, cache, new_tokens=9) < TOL


@pytest.mark.parametrize(("linears", "compiled"), [(False, False), (True, False), (True, True)])
def test_patched_llama_trains_like_the_original(linears, compiled):
    """compiled: the patched model under torch.compile (epicute's ops opaque, their backward through the ops)."""
    torch._dynamo.reset()
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1368, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    patched = copy.deepcopy(original)
    patch(patched, linears=linears)
    ids = torch.randint(0, 1000, (2, 333), device="cuda")
    losses = []
    for model in (original, torch.compile(patched, dynamic=False) if compiled else patched):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach().double())
    assert (losses[1] - losses[0]).abs() / losses[0].abs() < TOL
    for layer in range(2):
        ref, mlp = original.model.layers[layer].mlp, patched.model.layers[layer].mlp
        want = epicute.interleave_gate_up(ref.gate_proj.weight.grad, ref.up_proj.weight.grad).double()
        assert ((mlp.gate_up.grad.double() - want).norm() / want.norm()).item() < TOL


def test_patched_mixtral_experts_train_like_the_original():
    """One MoE block on the same hidden states (the same routing on both sides: see the CPU test)."""
    config = transformers.MixtralConfig(hidden_size=512, intermediate_size=1368, num_hidden_layers=1,
                                        num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                        num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    original = transformers.MixtralForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    patched = copy.deepcopy(original)
    assert patch(patched)["MoEExperts"] == 1
    hidden = torch.randn(2, 333, 512, device="cuda", dtype=torch.bfloat16)
    upstream = torch.randn_like(hidden)
    (out0, _, grads0), (out1, _, grads1) = (mlp_block_step(m, hidden, upstream) for m in (original, patched))
    assert ((out1.double() - out0.double()).norm() / out0.double().norm()).item() < TOL
    # The patched experts train their gate/up weight interleaved: its gradient is the interleaved original's.
    grads0["experts.gate_up"] = epicute.interleave_gate_up(*grads0.pop("experts.gate_up_proj").chunk(2, dim=-2))
    assert sorted(grads1) == sorted(grads0)
    for name, want in grads0.items():
        assert ((grads1[name].double() - want.double()).norm() / want.double().norm()).item() < TOL, name
