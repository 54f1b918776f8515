"""Random output epilogues for the attention kernel, checked against the CPU reference.

The programs are the GEMM fuzzer's (tests/gemm/epilogue_fuzz.py: the op table's
ops, up to MAX_DEPTH deep, bounded values, jumps only on stable values) drawn
for attention's epilogue: operands are scalars, ``(head_dim,)`` row vectors and
``(batch, seqlen_q, heads, head_dim)`` tiles; D (O) is bf16, fp16 or fp8 and aux
tiles bf16, fp16 or fp8 (every output is staged in Q's 16-bit buffer); any
reduction. The same checks apply: tolerances per dtype, fp8 one-step flips,
bitwise-equal reductions across two runs.

**O is exact.** The GEMM fuzzer's premise is an accumulator both sides compute
bit for bit alike. Here each query sees one key (``seqlen_k = 1``) or, causally
aligned bottom-right, none, and q is zero: its one score is exactly 0, its
softmax weight exactly 1 (``exp2(0)``) or its row is empty, so O is the key's V
row or 0, exactly, on both sides. (With random q, the weight ``exp2(s * c - m * c)``
need not be exactly 1 when one side fuses a multiply into an fma: a d256 case's fp8
cast of O then flipped at a rounding midpoint, and a ``col_amax`` of it moved.)
What the fuzzer tests is the epilogue; attention's own math has its tests
(tests/attention/test_attention_gpu.py).

``python -m tests.attention.epilogue_fuzz PROGRAM_SEED CASE_SEED`` reruns a case.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import torch

import epicute
from tests.gemm import epilogue_fuzz as gemm_fuzz
from tests.gemm.epilogue_fuzz import FP8, Output, Program

ATTENTION = gemm_fuzz.Family(
    "attention", ("scalar", "row"), (torch.bfloat16, torch.float16, FP8), (4, 2, 2),
    (torch.bfloat16, torch.float16, FP8), outs=False,
)  # fmt: skip


def random_program(seed: int) -> Program:
    return gemm_fuzz.random_program(seed, ATTENTION)


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool


def random_shape(case_seed: int) -> Shape:
    """Ragged seqlen_q, one key, MHA/GQA/MQA, every head_dim (d64 runs three warpgroups)."""
    rng = random.Random(case_seed)
    heads_kv = rng.choice((1, 2))
    return Shape(
        batch=rng.choice((1, 2)), seqlen_q=rng.choice((1, 17, 129, 255, 1000, rng.randrange(1, 1100, 2))),
        heads_q=heads_kv * rng.choice((1, 2)), heads_kv=heads_kv, head_dim=rng.choice((64, 128, 256)),
        causal=rng.random() < 0.3,
    )  # fmt: skip


def make_inputs(program: Program, shape: Shape, case_seed: int, device: str):
    gen = torch.Generator().manual_seed(case_seed)
    rng = random.Random(case_seed ^ 0x5EED)
    b, sq, hq, hkv, d = shape.batch, shape.seqlen_q, shape.heads_q, shape.heads_kv, shape.head_dim
    dtype = program.ab_dtype

    def values(*dims, dtype):
        return torch.randn(dims, generator=gen).clamp(-3.0, 3.0).to(device=device, dtype=dtype)

    q = torch.zeros(b, sq, hq, d, dtype=dtype, device=device)
    k = values(b, 1, hkv, d, dtype=dtype)
    # O is V's row: |O| <= 1 < LEAF_BOUND, as the generator assumes of acc.
    v = (torch.rand(b, 1, hkv, d, generator=gen) * 2 - 1).to(device=device, dtype=dtype)
    operands = {}
    for op in program.operands:
        if op.kind == "scalar":
            operands[op.name] = round(rng.choice((-1, 1)) * rng.uniform(0.25, 3.0), 4)
        elif op.kind == "row":
            operands[op.name] = values(d, dtype=op.dtype)
        else:
            operands[op.name] = values(b, sq, hq, d, dtype=op.dtype)
    out = torch.full_like(q, float("nan"), dtype=program.d_dtype) if rng.random() < 0.5 else None
    return q, k, v, operands, out


def expected_shape(role: str, shape: Shape) -> tuple[int, ...]:
    if role in ("D", "aux"):
        return (shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim)
    if role == "amax":
        return ()
    extent = shape.seqlen_q if role.startswith("row_") else shape.head_dim
    return (shape.batch, shape.heads_q, extent)


def check_output(out: Output, got: torch.Tensor, ref: torch.Tensor, shape: Shape) -> str | None:
    expected = expected_shape(out.role, shape)
    if tuple(got.shape) != expected or got.dtype != out.dtype:
        return f"{out.name}: {tuple(got.shape)} {got.dtype}, expected {expected} {out.dtype}"
    if out.dtype is FP8:
        why = gemm_fuzz.fp8_mismatch(got, ref)
        return f"{out.name}: {why}" if why else None
    tol = gemm_fuzz.TOLERANCE[out.dtype] if out.role in ("D", "aux") else gemm_fuzz.REDUCTION_TOLERANCE
    err = gemm_fuzz.rel_err(got.float().cpu(), ref.float().cpu())
    return f"{out.name}: rel err {err:.3e} > {tol:.0e}" if not err < tol else None


def _as_dict(result) -> dict[str, torch.Tensor]:
    return result if isinstance(result, dict) else {"D": result}


def run_case(program: Program, case_seed: int, device: str = "cuda", backend: str = "kernel") -> list[str]:
    """Run one case through ``backend`` and the reference; the problems found (empty: it passed)."""
    shape = random_shape(case_seed)
    q, k, v, operands, out = make_inputs(program, shape, case_seed, device)
    out_dtypes = program.out_dtypes()

    def run(backend=backend, out=out):
        return _as_dict(epicute.attention(q, k, v, causal=shape.causal, epilogue=program.fn, out=out,
                                          out_dtypes=out_dtypes, backend=backend, **operands))  # fmt: skip

    got = run()
    ref = run("reference", None)
    names = [o.name for o in program.outputs]
    if sorted(got) != sorted(names) or sorted(ref) != sorted(names):
        return [f"outputs: got {sorted(got)}, reference {sorted(ref)}, the program returns {sorted(names)}"]
    problems = []
    if out is not None and got["D"].data_ptr() != out.data_ptr():
        problems.append("D: not written into out")
    for o in program.outputs:
        why = check_output(o, got[o.name], ref[o.name], shape)
        if why:
            problems.append(why)
    reductions = [o.name for o in program.outputs if o.role in gemm_fuzz.REDUCTION_OPS]
    if reductions:
        again = run()
        problems += [f"{r}: differs bitwise between two runs" for r in reductions if not torch.equal(again[r], got[r])]
    return problems


def describe(program: Program, case_seed: int, problems: list[str]) -> str:
    operands = ", ".join(f"{o.name}: {o.kind} {o.dtype}" for o in program.operands) or "none"
    return (
        f"program seed {program.seed}, case seed {case_seed} "
        f"(rerun: python -m tests.attention.epilogue_fuzz {program.seed} {case_seed})\n"
        f"shape {random_shape(case_seed)}, q/k/v {program.ab_dtype}\n"
        f"operands {operands}; outputs {[(o.name, str(o.dtype)) for o in program.outputs]}\n"
        f"{program.source}" + "\n".join(f"  - {p}" for p in problems)
    )


def cases(count: int, base_seed: int, shapes_per_program: int = 2) -> list[tuple[Program, int]]:
    return gemm_fuzz.cases(count, base_seed, shapes_per_program, random_program)


if __name__ == "__main__":
    gemm_fuzz.rerun(sys.argv, random_program, run_case, describe)
