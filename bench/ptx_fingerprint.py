"""Fingerprint the device PTX of a fixed set of kernel variants (no GPU needed).

A refactor of kernel code that should not change what runs is checked by
comparing fingerprints before and after it: byte-identical PTX means identical
kernels, so neither correctness nor speed can have moved; where the PTX differs,
the SASS opcode histograms (``nvdisasm`` from the ``nvidia-cuda-nvdisasm`` wheel)
say whether the machine code did. The variants are the
compile tests' matrices (every GEMM path, every fused-epilogue kind, every
attention head_dim, score_mod and epilogue) plus the planner's picks for the
benchmarked shapes.

    python bench/ptx_fingerprint.py --out /tmp/after.json [--only gemm|epilogue|attention]
    python bench/ptx_fingerprint.py --compare /tmp/before.json /tmp/after.json
    python bench/ptx_fingerprint.py --match "planned (8192" --keep /tmp/ptx   # the PTX itself, to diff

Run it on a checkout of the old commit (``git worktree add``, ``PYTHONPATH`` set to it)
for the "before" file. Comments and debug-file lines are dropped before hashing.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _nvdisasm() -> str | None:
    """nvdisasm from the ``nvidia-cuda-nvdisasm`` wheel (or PATH): SASS without a GPU."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia

        for base in nvidia.__path__:
            for candidate in Path(base).glob("*/bin/nvdisasm"):
                return str(candidate)
    except ImportError:
        pass
    return None


def _sass_summary(cubins: list[Path]) -> dict:
    """SASS instruction count and opcode histogram (opcode with its modifiers) of the cubins."""
    tool = _nvdisasm()
    if tool is None or not cubins:
        return {}
    ops: collections.Counter = collections.Counter()
    for cubin in cubins:
        text = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True, check=False).stdout
        for line in text.splitlines():
            m = _SASS_LINE.match(line)
            if m:
                ops[m.group(2)] += 1
    return {"sass_instructions": sum(ops.values()), "sass_ops": dict(sorted(ops.items()))}


def _normalized(ptx: str) -> str:
    keep = [line for line in ptx.splitlines() if not line.lstrip().startswith(("//", ".file", ".loc"))]
    return "\n".join(keep)


def _variants(only: str | None):
    """(id, thunk compiling the variant) pairs."""
    import torch

    sys.path.insert(0, str(ROOT))
    from epicute.attention.backward import BackwardVariant, PreprocessVariant, compile_backward, compile_preprocess
    from epicute.attention.backward_plan import backward_config
    from epicute.attention.launch import AttentionVariant, CombineVariant, compile_attention, compile_combine
    from epicute.attention.plan import AttentionProblem, default_config, plan_attention
    from epicute.attention.prepare import hooks_of
    from epicute.gemm import GemmProblem, plan_gemm
    from epicute.gemm.compile import GemmVariant, compile_gemm
    from epicute.gemm.heuristics import choose_config
    from epicute.gemm.launch import variant_of
    from epicute.runtime.target import H100_SXM
    from tests.attention import test_attention_compile as attention_tests
    from tests.attention.test_backward_compile import meta_call
    from tests.gemm import test_epilogue_compile as epilogue_tests
    from tests.gemm import test_gemm_compile as gemm_tests

    out = []
    if only in (None, "gemm"):
        for v in gemm_tests.VARIANTS:
            cfg = v[0]
            out.append((f"gemm {gemm_tests._variant_id(v)} s{cfg.ab_stages}e{cfg.num_epi_stages}",
                        lambda v=v: compile_gemm(GemmVariant(*v))))  # fmt: skip
        for mnk in [(8192, 8192, 8192), (4096, 4096, 4096), (256, 4096, 14336), (1024, 14336, 4096), (1, 8, 8)]:
            plan = plan_gemm(GemmProblem(*mnk), "h100-sxm")
            out.append((f"gemm planned {mnk}", lambda plan=plan: compile_gemm(variant_of(plan))))
        swapped = plan_gemm(GemmProblem(16, 4096, 14336, b_major="k"), "h100-sxm")  # a decode GEMM: swap-AB
        out.append(("gemm planned decode (16, 4096, 14336)", lambda: compile_gemm(variant_of(swapped))))
        for mnk in [(8192, 8192, 8192), (128, 7168, 2048)]:  # fp8 with blockwise scales: the promoting mainloop
            fp8 = GemmProblem(*mnk, ab_dtype="fp8e4m3", b_major="k", block_scaled=True)
            blockwise = plan_gemm(fp8, "h100-sxm")
            out.append((f"gemm planned fp8 blockwise {mnk}", lambda p=blockwise: compile_gemm(variant_of(p))))
    if only in (None, "epilogue"):
        dtypes = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4m3"}
        for name, (fn, kinds, out_dtypes, overrides) in sorted(epilogue_tests.EPILOGUES.items()):
            fusion = epilogue_tests.fusion_of(fn, kinds, out_dtypes=out_dtypes)
            d_dtype = dtypes[(out_dtypes or {"D": torch.bfloat16})["D"]]
            cfg = choose_config(GemmProblem(4096, 4096, 4096, d_dtype=d_dtype), epilogue=fusion.buffers(),
                                **overrides)  # fmt: skip
            out.append((f"epilogue {name}", lambda cfg=cfg, d=d_dtype, f=fusion:
                        compile_gemm(GemmVariant(cfg, "bf16", d, "k", "n", fusion=f))))  # fmt: skip
    if only in (None, "attention"):
        for d in (64, 128, 256):
            for causal in (False, True):
                out.append((f"attention d{d} causal={causal}", lambda d=d, c=causal:
                            compile_attention(AttentionVariant(default_config(d, c), "bf16", c))))  # fmt: skip

        def softcap(s, b, h, q_idx, kv_idx, cap):
            return cap * attention_tests.ops.tanh(s / cap)

        score, _ = attention_tests.fusions(softcap, cap=30.0)
        out.append(
            (
                "attention d128 softcap",
                lambda: compile_attention(AttentionVariant(default_config(128, True), "bf16", True, score_mod=score)),
            )
        )

        def gated(o, gate, bias, alpha):
            return alpha * o * attention_tests.ops.sigmoid(gate) + bias

        _, epi = attention_tests.fusions(epilogue=gated, gate=torch.randn(2, 100, 8, 128), bias=torch.randn(128),
                                         alpha=2.0)  # fmt: skip
        out.append(
            (
                "attention d128 epilogue",
                lambda: compile_attention(AttentionVariant(default_config(128, False), "bf16", False, epilogue=epi)),
            )
        )
        for d, causal in ((64, False), (128, True)):
            out.append((f"attention backward d{d} causal={causal}", lambda d=d, c=causal:
                        compile_backward(BackwardVariant(backward_config(d), "bf16", c))))  # fmt: skip
        # The key-range paths: packed GQA decode over a paged cache with split-KV (a padded group of 7 too),
        # packed sequences forward and backward, a score_mod's backward.
        for heads_q in (32, 56):
            problem = AttentionProblem(1, 1, 65536, heads_q, 8, 128, causal=True, page_size=128, seqused_k=True)
            decode = plan_attention(problem, H100_SXM).config
            paged = AttentionVariant(decode, "bf16", True, page_size=128, seqused_k=True)
            out.append((f"attention decode paged gqa{heads_q // 8}", lambda v=paged: compile_attention(v)))
        varlen = AttentionVariant(default_config(128, True), "bf16", True, varlen=True)
        out.append(("attention d128 varlen causal", lambda: compile_attention(varlen)))
        out.append(("attention backward d128 varlen causal", lambda: compile_backward(
            BackwardVariant(backward_config(128), "bf16", True, varlen=True))))  # fmt: skip
        out.append(("attention backward d64 varlen deterministic", lambda: compile_backward(
            BackwardVariant(backward_config(64), "bf16", False, varlen=True, deterministic=True))))  # fmt: skip
        # The softmax's helpers: split-KV's combine and the backward's preprocess (LSE into log2 units).
        out.append(("attention combine d128", lambda: compile_combine(CombineVariant("bf16", 128))))
        for packed in (False, True):
            prep = PreprocessVariant("bf16", 128, 128, varlen=packed, has_dlse=packed)
            out.append((f"attention backward preprocess d128 varlen={packed}", lambda p=prep: compile_preprocess(p)))
        bwd_score = hooks_of(meta_call(), softcap, None, {"cap": 30.0})[0]
        out.append(("attention backward d128 softcap causal", lambda: compile_backward(
            BackwardVariant(backward_config(128, score_mod=True), "bf16", True, bwd_score.fusion))))  # fmt: skip
    return out


def fingerprint(only: str | None, keep: Path | None = None, match: str = "") -> dict[str, dict]:
    dump = Path(tempfile.mkdtemp(prefix="epicute-ptx-"))
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(dump)
    os.environ["EPICUTE_CACHE"] = "0"
    result = {}
    for name, build in _variants(only):
        if match not in name:
            continue
        build()
        # Files are named after the kernel's signature, which variants share: empty the folder each time.
        new = sorted(dump.iterdir())
        text = "\n".join(_normalized(p.read_text()) for p in new if p.suffix == ".ptx")
        if keep is not None and text:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / (name.replace(" ", "_").replace("/", "_") + ".ptx")).write_text(text)
        entry = {"ptx": hashlib.sha256(text.encode()).hexdigest()[:16] if text else "no ptx"}
        entry.update(_sass_summary([p for p in new if p.suffix == ".cubin"]))
        for p in new:
            p.unlink()
        result[name] = entry
        print(f"{entry['ptx']}  {entry.get('sass_instructions', '?'):>6}  {name}", flush=True)
    shutil.rmtree(dump, ignore_errors=True)
    return result


def compare(before: dict, after: dict) -> int:
    """Variants fingerprinted in both files (``--only`` runs cover part of the set)."""
    common = sorted(set(before) & set(after))
    changed = [name for name in common if before[name]["ptx"] != after[name]["ptx"]]
    for name in common:
        a, b = before[name], after[name]
        line = f"{'PTX differs' if name in changed else 'same PTX   '}  {name}"
        if name in changed and "sass_ops" in a and "sass_ops" in b:
            ops = sorted(set(a["sass_ops"]) | set(b["sass_ops"]))
            moved = [f"{op} {a['sass_ops'].get(op, 0)}->{b['sass_ops'].get(op, 0)}" for op in ops
                     if a["sass_ops"].get(op, 0) != b["sass_ops"].get(op, 0)]  # fmt: skip
            counts = f"{a['sass_instructions']} -> {b['sass_instructions']}"
            line += f"  SASS {counts}: " + (", ".join(moved) or "same opcodes")
        print(line)
    print(f"{len(changed)} of {len(common)} differ in PTX")
    return 1 if changed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", choices=("gemm", "epilogue", "attention"))
    parser.add_argument("--match", default="", help="only the variants whose name contains this")
    parser.add_argument("--keep", type=Path, help="also write each variant's normalized PTX into this folder")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    result = fingerprint(args.only, args.keep, args.match)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
