"""Train a Llama-shaped transformers model on epicute: one line patches it, a plain AdamW loop trains it.

    python examples/train_llama.py                 # a Hopper GPU: Llama-3-8B-shaped layers (2 of them), bf16
    python examples/train_llama.py --tiny          # any machine: a tiny config on the reference backend (CPU)

The model is built from a config (random weights, nothing downloaded). ``patch`` swaps its MLPs for
``epicute.nn.GatedMLP`` (gate, up and SwiGLU in one GEMM; a backward fused across the MLP's GEMMs) and runs its
attention on ``epicute.attention``; the loop is the one you would write for the unpatched model. It learns one
fixed batch, so the loss falls step by step.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import transformers

import epicute
from epicute.integrations.transformers import patch

#: (config, batch, sequence length) for a GPU run and for a CPU run
SIZES = {
    "gpu": (dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 num_hidden_layers=2, vocab_size=32000), 2, 1024),
    "tiny": (dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=512), 2, 32),
}  # fmt: skip


def main(argv: list[str] | None = None) -> list[float]:
    """Train and return the losses, one per step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (the reference backend)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=None, help="AdamW's learning rate (default: 1e-3 tiny, 1e-4)")
    args = parser.parse_args(argv)
    sizes, batch, seqlen = SIZES["tiny" if args.tiny else "gpu"]
    device = "cpu" if args.tiny else "cuda"

    torch.manual_seed(0)
    config = transformers.LlamaConfig(max_position_embeddings=max(seqlen, 64), **sizes)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    print("patched:", patch(model))  # {'GatedMLP': 2, 'Linear': 0, 'MoEExperts': 0, 'attention': 2}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or (1e-3 if args.tiny else 1e-4))
    ids = torch.randint(0, config.vocab_size, (batch, seqlen), device=device)

    losses = []
    backend = epicute.use_backend("reference") if args.tiny else contextlib.nullcontext()
    with backend:
        for step in range(args.steps):
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # reads the loss back: the step has finished
            print(f"step {step}: loss {losses[-1]:.4f}  ({(time.perf_counter() - start) * 1e3:.1f} ms)")
    return losses


if __name__ == "__main__":
    main()
