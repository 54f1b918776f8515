"""Where one compiled step of a bench/models.py model spends its GPU time: epicute's patched model against HF's SDPA
model, both under ``torch.compile``, kernel by kernel and by kind (H200).

Usage: python bench/models_profile.py [--case llama_train] [--layers 2] [--accumulate] [--gaps] [--top 28]
       python bench/models_profile.py --compile-case gpt2_mlp_train [--gaps] [--top 28]

``--compile-case`` profiles one of bench/compile.py's cases instead: the unmodified model under ``torch.compile`` with
epicute's backend against plain ``torch.compile``, each step as bench/compile.py runs it.

Each contender runs three warm steps, then three steps timed by CUDA events around the step's call after an L2
flush (as ``bench/models.py`` times them, with the host time of the call beside), then one step under
torch.profiler: its kernels summed by name and by kind (epicute's, cuBLAS's, attention, Inductor's Triton, other),
the GPU span from the first kernel to the last. ``--accumulate`` leaves the gradients in place between training
steps (``bench/models.py`` does: each step adds into them); ``--gaps`` lists where the GPU waited between kernels
inside the step (the host behind it) and when the first kernel started. The kernel sums are what a step with no
host time would take: bench/NOTES.md ("Eighth session of 2026-11-29") reads issue 58's ceilings from them.
Prints only; writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import itertools
import re
import time

from models import CASES, build

#: kernel name -> kind, the first pattern that matches
KINDS = (
    ("epicute", re.compile(r"epicute|cutlass_kernel")),
    ("cublas", re.compile(r"nvjet|gemm|sm90_xmma|cublas|cutlass", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("triton", re.compile(r"^triton")),
)


def kind(name: str) -> str:
    return next((label for label, pattern in KINDS if pattern.search(name)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="llama_train", choices=sorted(CASES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--accumulate", action="store_true", help="keep the gradients between training steps")
    parser.add_argument("--gaps", action="store_true", help="where the GPU waited between the step's kernels")
    parser.add_argument("--top", type=int, default=28, help="kernels listed per contender")
    parser.add_argument("--compile-case", help="a bench/compile.py case: epicute's compile backend against plain "
                        "torch.compile on the unmodified model")  # fmt: skip
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    steps = _compile_case_steps(args.compile_case) if args.compile_case else _model_steps(args)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for label, step in steps.items():
        for _ in range(3):
            step()
        for _ in range(3):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()
            torch.cuda.synchronize()
            start.record()
            began = time.perf_counter()
            step()
            host = time.perf_counter() - began
            stop.record()
            torch.cuda.synchronize()
            print(f"[{label}] step {start.elapsed_time(stop):.2f} ms (CUDA events), host {host * 1e3:.2f} ms")
        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.gaps else [])
        with profile(activities=activities) as prof:
            flush.zero_()
            torch.cuda.synchronize()
            with torch.autograd.profiler.record_function("STEP"):
                step()
            torch.cuda.synchronize()
        events = prof.events()
        kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)  # fmt: skip
        if args.gaps:
            kernels = _print_gaps(label, events, kernels)
        by_name, calls, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
        for e in kernels:
            us = e.time_range.end - e.time_range.start
            by_name[e.name[:120]] += us
            calls[e.name[:120]] += 1
            by_kind[kind(e.name)] += us
        span = kernels[-1].time_range.end - kernels[0].time_range.start
        print(f"== {label}: span {span / 1e3:.2f} ms, kernels {sum(by_name.values()) / 1e3:.2f} ms: "
              + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in by_kind.most_common()))  # fmt: skip
        for name, us in by_name.most_common(args.top):
            print(f"   {us / 1e3:8.3f} ms x{calls[name]:3d}  [{kind(name)}] {name}")


def _model_steps(args) -> dict:
    """bench/models.py's case: a step of epicute's patched model and of HF's SDPA model, both compiled."""
    import torch

    from epicute.integrations.transformers import patch

    *_, batch, seqlen, training = CASES[args.case]
    sdpa = build(args.case, args.layers, "sdpa")
    ids = torch.randint(0, sdpa.config.vocab_size, (batch, seqlen), device="cuda")
    patched = copy.deepcopy(sdpa)
    patch(patched, linears=True)
    contenders = {"epicute": torch.compile(patched, dynamic=False),
                  "hf_sdpa_compile": torch.compile(copy.deepcopy(sdpa), dynamic=False)}  # fmt: skip

    def step(model):
        if training:
            model(input_ids=ids, labels=ids).loss.backward()
            if not args.accumulate:
                model.zero_grad(set_to_none=True)
        else:
            with torch.inference_mode():
                model(input_ids=ids)

    return {label: functools.partial(step, model) for label, model in contenders.items()}


def _compile_case_steps(name: str) -> dict:
    """bench/compile.py's case: the unmodified model's step under epicute's backend and under plain torch.compile."""
    import torch
    from compile import case_model, step_of

    from epicute.integrations import compile as EC

    model, inputs, _, training = case_model(name)
    return {label: step_of(torch.compile(copy.deepcopy(model), dynamic=False, **options), inputs, training)
            for label, options in (("epicute_backend", {"backend": EC.backend}), ("torch_compile", {}))}  # fmt: skip


def _print_gaps(label: str, events, kernels: list) -> list:
    """Print when the step's first kernel started and the longest waits between its kernels; returns the step's
    kernels (the flush before it left out)."""
    step = next(e for e in events if e.name == "STEP")
    began = step.time_range.start
    kernels = [e for e in kernels if e.time_range.start >= began]
    print(f"[{label}] host step {(step.time_range.end - began) / 1e3:.2f} ms (profiled); first kernel after "
          f"{(kernels[0].time_range.start - began) / 1e3:.2f} ms; last kernel ends "
          f"{(kernels[-1].time_range.end - began) / 1e3:.2f} ms")  # fmt: skip
    waits = [(b.time_range.start - a.time_range.end, a.name[:50], b.name[:50], (b.time_range.start - began) / 1e3)
             for a, b in itertools.pairwise(kernels) if b.time_range.start - a.time_range.end > 20]  # fmt: skip
    print(f"   waits over 20 us: {len(waits)}, {sum(w[0] for w in waits) / 1e3:.2f} ms in all")
    for us, before, after, at in sorted(waits, reverse=True)[:12]:
        print(f"     {us / 1e3:6.3f} ms at {at:7.2f} ms: {before} -> {after}")
    return kernels


if __name__ == "__main__":
    main()
