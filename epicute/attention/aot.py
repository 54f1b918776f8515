"""The attention family's ahead-of-time jobs: an ``[[attention]]`` spec entry -> its variants.

Its family's declaration (:mod:`epicute.families`) names :func:`attention_variants`, which ``epicute compile`` runs per
entry; the format is in :mod:`epicute.runtime.aot`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epicute.errors import ConfigError, EpilogueError
from epicute.runtime.aot import check_fields, config_pins, import_object, is_size, operand_kind

if TYPE_CHECKING:
    from epicute.runtime.target import Target


def prepare_described(
    dtype: str = "bf16",
    head_dim: int = 128,
    causal: bool = False,
    heads: tuple[int, int] = (1, 1),
    score_mod: str | None = None,
    epilogue: str | None = None,
    operands: dict | None = None,
    pins: dict | None = None,
    target: Target | None = None,
    sizes: tuple[int, int, int] = (1, 1, 1),
):
    """:func:`epicute.attention.prepare.prepare` of calls described in text (a spec entry, the CLI):
    hooks as ``module:function`` paths, ``operands`` as ``{name: "kind[:dtype]"}`` (kind scalar,
    head, row or tile), on meta tensors of ``sizes`` = (batch, seqlen_q, seqlen_k); the checks and
    the hook tracing are :func:`epicute.attention`'s, so the plan and variant are the ones a real
    call of these kinds makes."""
    import torch

    from epicute.attention.prepare import prepare
    from epicute.attention.validate import check_attention_args
    from epicute.epilogue.dtypes import IR_TO_TORCH
    from epicute.epilogue.score_mod import score_mod as as_score_mod
    from epicute.epilogue.tracer import as_epilogue

    hooks = {
        "score_mod": as_score_mod(import_object(score_mod)) if score_mod else None,
        "epilogue": as_epilogue(import_object(epilogue)) if epilogue else None,
    }
    declared = {p: hook for hook in hooks.values() if hook is not None for p in hook.params}
    operands = operands or {}
    missing = sorted(p for p, hook in declared.items() if p not in operands and p not in hook.defaults)
    extra = sorted(set(operands) - set(declared))
    if missing or extra:
        raise EpilogueError(
            f"the hooks take operands {sorted(declared)}: give each as name = 'kind[:dtype]' "
            f"(missing {missing}, unexpected {extra})"
        )
    specs = {name: operand_kind(name, text, ("scalar", "head", "row", "tile")) for name, text in operands.items()}
    for name, (_, dt) in specs.items():
        if dt not in IR_TO_TORCH:
            raise EpilogueError(f"operand {name!r}: dtype {dt!r} is not one of {sorted(IR_TO_TORCH)}")
    (batch, seqlen_q, seqlen_k), (heads_q, heads_kv) = sizes, heads
    q = torch.empty(batch, seqlen_q, heads_q, head_dim, dtype=IR_TO_TORCH[dtype], device="meta")
    kv = torch.empty(batch, seqlen_k, heads_kv, head_dim, dtype=IR_TO_TORCH[dtype], device="meta")
    shapes = {"head": (heads_q,), "row": (head_dim,), "tile": tuple(q.shape)}
    values = {
        name: 0.0 if kind == "scalar" else torch.empty(shapes[kind], dtype=IR_TO_TORCH[dt], device="meta")
        for name, (kind, dt) in specs.items()
    }
    call = check_attention_args(q, kv, kv, causal=causal, softmax_scale=None, require_cuda=False)
    return prepare(call, hooks["score_mod"], hooks["epilogue"], values, None, pins, target)


def attention_variants(entry: dict, target: Target | None = None) -> list:
    """The attention variants the calls described by one ``[[attention]]`` entry would compile on
    ``target`` (None: the current one), deduplicated (:func:`prepare_described` of each
    head_dim x causal, so each key is the one a real call of any size makes)."""
    import itertools

    from epicute.attention.plan import AttentionConfig

    allowed = {"dtype", "head_dim", "causal", "heads", "config", "score_mod", "epilogue", "operands", "decode"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ConfigError(f"unknown fields {unknown}; known are {sorted(allowed)}")
    dtype = entry.get("dtype", "bf16")
    if dtype not in ("bf16", "fp16", "fp8e4m3"):
        raise ConfigError(f"dtype {dtype!r} must be 'bf16', 'fp16' or 'fp8e4m3'")
    heads = entry.get("heads", [1, 1])
    if not (isinstance(heads, list) and len(heads) == 2 and all(is_size(h) and h > 0 for h in heads)):
        raise ConfigError(f"heads = {heads!r}; give [heads_q, heads_kv], e.g. [32, 8]")
    check_fields(entry, str, "score_mod", "epilogue")
    check_fields(entry, dict, "operands")
    pins = config_pins(entry, AttentionConfig)
    head_dims, causals = (entry.get(f, default) for f, default in (("head_dim", 128), ("causal", False)))
    head_dims, causals = (x if isinstance(x, list) else [x] for x in (head_dims, causals))
    if not head_dims or not all(is_size(d) for d in head_dims):
        raise ConfigError(f"head_dim = {entry['head_dim']!r}; give 64, 128, 256 or a list of them")
    if not causals or not all(isinstance(c, bool) for c in causals):
        raise ConfigError(f"causal = {entry['causal']!r}; give true, false or a list of them")
    check_fields(entry, bool, "decode")
    # (batch, seqlen_q, seqlen_k) of the described calls, named in the job's text: a prefill shape,
    # and with decode one token per sequence over a long cache, on one sequence (split) and many.
    shapes = [((1, PREFILL_ROWS, PREFILL_ROWS), "")]
    if entry.get("decode", False):
        shapes += [((1, 1, DECODE_KEYS), " decode split-kv"), ((DECODE_BATCH, 1, DECODE_KEYS), " decode")]
    variants = {}
    for head_dim, causal, (sizes, kind) in itertools.product(head_dims, causals, shapes):
        prepared = prepare_described(dtype, head_dim, causal, tuple(heads), entry.get("score_mod"),
                                     entry.get("epilogue"), entry.get("operands"), pins, target, sizes)  # fmt: skip
        variant = prepared.variant()
        what = f"d{head_dim} {dtype}" + (" causal" if causal else "") + kind
        variants.setdefault(variant.key(), (variant, what))
        if dtype == "fp8e4m3":  # the pass that lays V out before every fp8 call
            from epicute.attention.launch import ValueLayoutVariant

            value_pass = ValueLayoutVariant(head_dim, False, variant.arch)
            variants.setdefault(value_pass.key(), (value_pass, f"d{head_dim} fp8 value layout"))
    return list(variants.values())


#: Sizes of the calls an ``[[attention]]`` entry describes: any prefill shape plans alike; decode
#: shapes split their keys (one sequence) or not (a batch that fills the GPU).
PREFILL_ROWS, DECODE_KEYS, DECODE_BATCH = 1024, 65536, 1024
