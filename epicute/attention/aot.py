"""The attention family's ahead-of-time jobs: an ``[[attention]]`` spec entry -> its variants.

Registered into :data:`epicute.runtime.aot.JOB_KINDS`; the format is in :mod:`epicute.runtime.aot`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epicute.errors import ConfigError, EpilogueError
from epicute.runtime.aot import JOB_KINDS, check_fields, config_pins, import_object, is_size, operand_kind

if TYPE_CHECKING:
    from epicute.runtime.target import Target


def attention_variants(entry: dict, target: Target | None = None) -> list:
    """The attention variants the calls described by one ``[[attention]]`` entry would compile on
    ``target`` (None: the current one), deduplicated.

    Each is found by running :func:`epicute.attention`'s own checks and hook
    tracing on tiny CPU tensors of the entry's dtype and operand kinds, so its
    key is the one a real call of any size makes.
    """
    import itertools

    import torch

    from epicute.attention.api import hooks_of, kernel_variant
    from epicute.attention.plan import AttentionConfig
    from epicute.attention.validate import check_attention_args
    from epicute.epilogue.dtypes import IR_TO_TORCH
    from epicute.epilogue.score_mod import score_mod as as_score_mod
    from epicute.epilogue.tracer import as_epilogue

    allowed = {"dtype", "head_dim", "causal", "heads", "config", "score_mod", "epilogue", "operands"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ConfigError(f"unknown fields {unknown}; known are {sorted(allowed)}")
    dtype = entry.get("dtype", "bf16")
    if dtype not in ("bf16", "fp16"):
        raise ConfigError(f"dtype {dtype!r} must be 'bf16' or 'fp16'")
    heads = entry.get("heads", [1, 1])
    if not (isinstance(heads, list) and len(heads) == 2 and all(is_size(h) and h > 0 for h in heads)):
        raise ConfigError(f"heads = {heads!r}; give [heads_q, heads_kv], e.g. [32, 8]")
    check_fields(entry, str, "score_mod", "epilogue")
    check_fields(entry, dict, "operands")
    pins = config_pins(entry, AttentionConfig)
    hooks = {
        "score_mod": as_score_mod(import_object(entry["score_mod"])) if entry.get("score_mod") else None,
        "epilogue": as_epilogue(import_object(entry["epilogue"])) if entry.get("epilogue") else None,
    }
    declared = {p: hook for hook in hooks.values() if hook is not None for p in hook.params}
    operands = entry.get("operands") or {}
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
    head_dims, causals = (entry.get(f, default) for f, default in (("head_dim", 128), ("causal", False)))
    head_dims, causals = (x if isinstance(x, list) else [x] for x in (head_dims, causals))
    if not head_dims or not all(is_size(d) for d in head_dims):
        raise ConfigError(f"head_dim = {entry['head_dim']!r}; give 64, 128, 256 or a list of them")
    if not causals or not all(isinstance(c, bool) for c in causals):
        raise ConfigError(f"causal = {entry['causal']!r}; give true, false or a list of them")
    heads_q, heads_kv = heads
    variants = {}
    for head_dim, causal in itertools.product(head_dims, causals):
        q = torch.zeros(1, 1, heads_q, head_dim, dtype=IR_TO_TORCH[dtype])
        kv = torch.zeros(1, 1, heads_kv, head_dim, dtype=IR_TO_TORCH[dtype])
        shapes = {"head": (heads_q,), "row": (head_dim,), "tile": tuple(q.shape)}
        values = {
            name: 0.0 if kind == "scalar" else torch.zeros(shapes[kind], dtype=IR_TO_TORCH[dt])
            for name, (kind, dt) in specs.items()
        }
        call = check_attention_args(q, kv, kv, causal=causal, softmax_scale=None, require_cuda=False)
        score, epi = hooks_of(call, hooks["score_mod"], hooks["epilogue"], values)
        variant = kernel_variant(call, score, epi, pins, target)
        variants.setdefault(variant.key(), (variant, f"d{head_dim} {dtype}" + (" causal" if causal else "")))
    return list(variants.values())


JOB_KINDS["attention"] = attention_variants
