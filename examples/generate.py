"""Generate with a Llama-shaped transformers model on epicute: ``patch`` it, then call ``generate()`` as usual.

    python examples/generate.py                  # a Hopper GPU: Llama-3-8B-shaped layers (2 of them), bf16
    python examples/generate.py --tiny           # any machine: a tiny config on the reference backend (CPU)

The model is built from a config (random weights, nothing downloaded). The prefill and every decode step run
their attention on ``epicute.attention`` (a decode step's one query per sequence attends to the whole cache, GQA
at the model's ratio) and their MLPs on ``epicute.nn.GatedMLP``. Every step's logits are compared with the
unpatched model's over the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
import transformers

import epicute
from epicute.integrations.transformers import patch

SIZES = {
    "gpu": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                num_hidden_layers=2, vocab_size=32000),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=512),
}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Generate; returns the tokens, epicute's logits of every step and the unpatched model's on the same tokens."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (the reference backend)")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"

    torch.manual_seed(0)
    config = transformers.LlamaConfig(max_position_embeddings=256, **SIZES["tiny" if args.tiny else "gpu"])
    original = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    model = copy.deepcopy(original)
    print("patched:", patch(model))
    prompt = torch.randint(0, config.vocab_size, (2, 24), device=device)

    backend = epicute.use_backend("reference") if args.tiny else contextlib.nullcontext()
    with backend, torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                             do_sample=False, pad_token_id=config.eos_token_id, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences
    # Each step's logits (the prefill's last position, then one decode step per token, reading the KV cache)
    # against the unpatched model's full forward over the same tokens.
    logits = torch.stack(out.logits, dim=1).float()
    with torch.no_grad():
        want = original(input_ids=tokens[:, :-1]).logits[:, prompt.shape[1] - 1 :].float()
    error = ((logits - want).norm() / want.norm()).item()
    print(f"logits of the prefill and {args.new_tokens - 1} decode steps, relative to the unpatched model: {error:.2e}")
    print("generated:", tokens[:, prompt.shape[1] :].tolist())
    return {"tokens": tokens, "logits": logits, "unpatched_logits": want}

if __name__ == "__main__":
    main()
