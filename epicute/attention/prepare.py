"""One path from an attention call to its kernel: :func:`prepare`.

Every entry point -- :func:`epicute.attention` on both backends,
:func:`epicute.explain_attention`, ``epicute compile``'s ``[[attention]]`` jobs and
``epicute explain attention`` -- checks its tensors (:func:`check_attention_args`) and
gets from :func:`prepare` everything the launch uses: the traced score_mod and
output epilogue (:class:`Hook`: their operands resolved by shape, their fusions),
the plan, the epilogue chain and the compiled variant. So what ``explain``
prints is the plan and the chain of the kernel that runs, by construction.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from epicute.attention.fp8 import FP8_INPUT_DTYPES, NO_BACKWARD, stored_dtype
from epicute.attention.plan import AttentionConfig, AttentionPlan, AttentionProblem, plan_attention
from epicute.attention.validate import AttentionCall
from epicute.epilogue.dtypes import DTYPE_BYTES, TORCH_TO_IR, ir_dtype
from epicute.epilogue.fusion import EpilogueFusion, ScoreModFusion
from epicute.epilogue.operands import OperandSpec, Pin
from epicute.epilogue.schedule import ATTENTION_SM90, Stage, plain_graph, schedule
from epicute.epilogue.score_mod import ScoreMod
from epicute.epilogue.score_mod import score_mod as as_score_mod
from epicute.epilogue.tracer import Epilogue, as_epilogue
from epicute.errors import ConfigError, DeviceError, EpilogueError, OutputError
from epicute.runtime.checks import config_pins
from epicute.runtime.target import Target


def ir_dtypes(dtypes: dict | None) -> dict[str, str]:
    """``out_dtypes`` (torch dtypes or IR names) as IR names."""
    if dtypes is not None and not isinstance(dtypes, Mapping):
        raise OutputError(f"out_dtypes is a {type(dtypes).__name__}; pass a dict by output name, e.g. "
                          "out_dtypes={'D': torch.float8_e4m3fn}")  # fmt: skip
    return {name: ir_dtype(dtype, f"out_dtypes[{name!r}]") for name, dtype in (dtypes or {}).items()}


#: Attention operand kind -> the epilogue IR kind it is traced as (see module docstring).
_IR_KIND = {"scalar": "scalar", "head": "col", "row": "row", "tile": "tile"}


@functools.lru_cache(maxsize=1024)
def cached_plan(
    problem: AttentionProblem, overrides: tuple, target: Target | None = None, plain_output: bool = True,
    score_mod: bool = False,
) -> AttentionPlan:
    """:func:`plan_attention` for ``target`` (None: the current one), once per argument set."""
    return plan_attention(problem, target, plain_output, score_mod, **dict(overrides))


def _operand_kind(hook: str, name: str, value: Any, p: AttentionProblem) -> tuple[str, Any]:
    """(attention kind, value) of one operand of ``hook`` ("score_mod" or "epilogue")."""
    if isinstance(value, Pin):
        if value.kind != "scalar":
            raise EpilogueError(
                f"operand {name!r}: {type(value).__name__} pins are for GEMM epilogues; "
                "attention infers kinds from shapes"
            )
        value = value.value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return "scalar", float(value)
    if not isinstance(value, torch.Tensor):
        raise EpilogueError(f"operand {name!r}: expected a torch tensor or a Python number, got {type(value).__name__}")
    if value.numel() == 1:  # a meta tensor has no value to read: only explain takes one (the plan ignores it)
        return "scalar", 0.0 if value.device.type == "meta" else float(value.item())
    if value.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise EpilogueError(f"operand {name!r} has dtype {value.dtype}; use bf16, fp16 or fp32 (e.g. {name}.float())")
    shape = tuple(value.shape)
    if hook == "score_mod" and shape == (p.heads_q,):
        return "head", value
    if hook == "epilogue" and shape == (p.head_dim,):
        return "row", value
    if hook == "epilogue" and shape == (p.batch, p.seqlen_q, p.heads_q, p.head_dim):
        return "tile", value
    accepted = (
        f"a number or a per-head vector ({p.heads_q},)"
        if hook == "score_mod"
        else f"a number, a ({p.head_dim},) vector or a (batch, seqlen_q, heads, head_dim) = "
        f"{(p.batch, p.seqlen_q, p.heads_q, p.head_dim)} tile"
    )
    raise EpilogueError(f"operand {name!r} of the {hook} has shape {shape}; it must be {accepted}")


class Hook:
    """One traced hook (score_mod or epilogue) resolved against a problem."""

    def __init__(
        self, hook: str, fn: Epilogue, values: dict[str, Any], p: AttentionProblem, out_dtype: str,
        out_dtypes: dict | None = None,
    ):  # fmt: skip
        self.fn = fn
        missing = [name for name in fn.params if name not in values and name not in fn.defaults]
        if missing:
            raise EpilogueError(f"{hook} {fn.name!r} needs operands {missing}: pass them as keyword arguments")
        self.operands = {
            name: _operand_kind(hook, name, values[name] if name in values else fn.defaults[name], p)
            for name in fn.params
        }
        dtypes = {n: "fp32" if k == "scalar" else TORCH_TO_IR[v.dtype] for n, (k, v) in self.operands.items()}
        kinds = {n: _IR_KIND[k] for n, (k, _) in self.operands.items()}
        self.graph = fn.trace(kinds, dtypes, out_dtypes, d_dtype=out_dtype)
        self.signature = tuple((n, k, dtypes[n]) for n, (k, _) in self.operands.items())
        if hook == "score_mod":
            self.fusion = ScoreModFusion(self.graph, self.signature)
        else:
            self.fusion = EpilogueFusion(self.graph, self.signature, style=ATTENTION_SM90)
            _check_staged_outputs(self.fusion, out_dtype)

    def kernel_operands(self, device: torch.device) -> tuple[tuple, tuple]:
        """The kernel's operand tensors and fp32 scalars, in the fusion's order (operands no output
        depends on are not passed)."""
        fusion = self.fusion
        if isinstance(fusion, ScoreModFusion):
            names, scalars = [n for n, _, _ in fusion.tensor_operands], [n for n, _, _ in fusion.scalar_operands]
        else:
            names = [n for role, n, _ in fusion.tensor_args if role in ("tile", "row")]
            scalars = list(fusion.scalar_inputs)
        for name in names:
            value = self.operands[name][1]
            if value.device != device:
                raise DeviceError(f"operand {name!r} is on {value.device}; move it to {device}")
        return tuple(self.operands[n][1] for n in names), tuple(self.operands[n][1] for n in scalars)

    def reference_specs(self, p: AttentionProblem) -> dict[str, OperandSpec]:
        """Operands in the IR's canonical ``(L, M, N)`` views, ``L = batch * heads`` (CPU copies, differentiable:
        the reference backend trains a score_mod's per-head vectors as the kernels' backward does)."""
        L = p.batch * p.heads_q
        specs = {}
        for name, (kind, value) in self.operands.items():
            if kind == "scalar":
                specs[name] = OperandSpec(name, "scalar", "fp32", value)
                continue
            t = value.cpu()
            if kind == "head":
                t = t.repeat(p.batch)[:, None].expand(L, p.seqlen_q)
            elif kind == "row":
                t = t[None, :].expand(L, p.head_dim)
            else:
                t = t.permute(0, 2, 1, 3).reshape(L, p.seqlen_q, p.head_dim)
            specs[name] = OperandSpec(name, _IR_KIND[kind], TORCH_TO_IR[value.dtype], t)
        return specs


def _check_staged_outputs(fusion: EpilogueFusion, q_dtype: str) -> None:
    """The kernel stages each stored output in Q's shared memory (one ``tile_m x head_dim`` tile of
    ``q_dtype``: q's, or bf16 for fp8 q, whose buffer is sized for bf16 O): wider outputs do not fit."""
    limit = DTYPE_BYTES[q_dtype]
    for name, dtype in fusion.tile_output_dtypes.items():
        if DTYPE_BYTES[dtype] > limit:
            fix = "out_dtypes={'D': ...}" if name == "D" else f"out_dtypes={{{name!r}: torch.bfloat16}}"
            raise EpilogueError(
                f"attention output {name!r} is {dtype}: the kernel stages every output in Q's {q_dtype} buffer, "
                f"so outputs are at most {limit}-byte types; store it as bf16, fp16 or fp8 ({fix}, or an "
                "ops.cast in the epilogue)"
            )


#: flash-attn keywords epicute.attention spells otherwise (or lacks), and what to pass instead.
FLASH_ATTN_KEYWORDS = {
    "dropout_p": "epicute.attention has no attention dropout; train without it (leave it out for 0)",
    "window_size": ("a sliding window is a score_mod that hides the keys outside it, e.g. score_mod=lambda s, b, h, "
                    "q_idx, kv_idx: ops.where(q_idx - kv_idx < 4096, s, float('-inf')); leave it out for (-1, -1)"),
    "softcap": ("pass score_mod=lambda s, b, h, q_idx, kv_idx: cap * ops.tanh(s / cap) (epicute.ops); leave it out "
                "for 0"),
    "alibi_slopes": ("pass score_mod=lambda s, b, h, q_idx, kv_idx, slopes: s + slopes * (kv_idx - q_idx), "
                     "slopes=alibi_slopes (a per-head vector operand, learnable too)"),
    "return_attn_probs": "the probabilities are never stored; return_lse=True returns the log-sum-exp of each row",
}  # fmt: skip


def hooks_of(
    call: AttentionCall, score_mod, epilogue, operands: dict, out_dtypes: dict | None = None
) -> tuple[Hook | None, Hook | None]:
    """The traced score_mod and output epilogue of a call (``out_dtypes``: stored dtypes of the
    epilogue's outputs by name, as :func:`epicute.gemm` takes them)."""
    p = call.problem
    sm = None if score_mod is None else as_score_mod(score_mod)
    epi = None if epilogue is None else as_epilogue(epilogue)
    if sm is not None and not isinstance(sm, ScoreMod):
        raise EpilogueError("score_mod must be a function f(score, b, h, q_idx, kv_idx, *operands)")
    declared = set(sm.params if sm else ()) | set(epi.params if epi else ())
    unknown = sorted(set(operands) - declared)
    for name in unknown:
        if name in FLASH_ATTN_KEYWORDS:
            raise ConfigError(f"{name}= (flash-attn's keyword): {FLASH_ATTN_KEYWORDS[name]}")
    if unknown:
        raise EpilogueError(
            f"operands {unknown} are not parameters of the score_mod or the epilogue (they take {sorted(declared)})"
        )
    if out_dtypes and epi is None:
        raise EpilogueError(f"out_dtypes {sorted(out_dtypes)} were given without an epilogue")
    if epi is not None and p.varlen:
        raise ConfigError("epilogue= with cu_seqlens: packed sequences take no output epilogue yet; apply it to "
                          "the packed O after attention")  # fmt: skip
    score = None if sm is None else Hook("score_mod", sm, operands, p, "fp32")
    out = None if epi is None else Hook("epilogue", epi, operands, p, stored_dtype(p.dtype), out_dtypes)
    return score, out


@dataclass(frozen=True)
class PreparedAttention:
    """Everything the launch of one attention call uses."""

    plan: AttentionPlan
    score: Hook | None = None
    epilogue: Hook | None = None

    @property
    def output_dtypes(self) -> dict[str, str]:
        """Each stored tile output's IR dtype, O (``"D"``) first."""
        if self.epilogue is None:
            return {"D": stored_dtype(self.plan.problem.dtype)}
        return self.epilogue.fusion.tile_output_dtypes

    @property
    def chain(self) -> tuple[Stage, ...]:
        """The output epilogue the kernel runs: the epilogue's chain, or the plain one (store O)."""
        if self.epilogue is not None:
            return self.epilogue.fusion.stages
        return schedule(plain_graph(stored_dtype(self.plan.problem.dtype)), style=ATTENTION_SM90).stages

    def variant(self):
        """The compiled kernel this call runs (its cache key names it: the target's arch, not its SM count)."""
        return self._variant

    @functools.cached_property
    def _variant(self):
        # Once per prepared call: a repeat call (remembered by epicute.attention) launches it every time.
        from epicute.attention.launch import AttentionVariant

        p = self.plan.problem
        return AttentionVariant(
            self.plan.config, p.dtype, p.causal, None if self.score is None else self.score.fusion,
            None if self.epilogue is None else self.epilogue.fusion, self.plan.target.arch, p.page_size, p.seqused_k,
            p.varlen,
        )  # fmt: skip

    def check_backward(self) -> None:
        """Raise :class:`~epicute.errors.ConfigError` naming what the backward does not cover (both backends: a
        program tried on the reference backend meets the kernels' rules)."""
        from epicute.attention.backward_plan import BACKWARD_HEAD_DIMS

        p = self.plan.problem
        refusals = [
            (p.dtype in FP8_INPUT_DTYPES, NO_BACKWARD),
            (p.head_dim not in BACKWARD_HEAD_DIMS,
             f"head_dim={p.head_dim}: the backward supports head_dim {BACKWARD_HEAD_DIMS}"),
            (self.epilogue is not None, "epilogue=: an output epilogue has no backward; apply it after attention"),
            (p.page_size > 0, "page_table=: a paged KV cache is for inference"),
            (p.seqused_k, "seqused_k=: pass the keys each sequence uses as k and v of that length"),
        ]  # fmt: skip
        for refused, why in refusals:
            if refused:
                raise ConfigError(f"attention backward: {why}; or call under torch.no_grad() (inference)")

    def backward_variant(self, deterministic: bool = False, operand_grads: bool = False):
        """The backward kernel of this call (:mod:`epicute.attention.backward`), adding dQ's parts in a fixed
        order if ``deterministic`` and summing the score_mod's per-head vectors' gradients if ``operand_grads``;
        raises :class:`~epicute.errors.ConfigError` naming what the backward does not cover. Planned once per
        prepared call and options (a training step's backward asks again every step)."""
        key = (deterministic, operand_grads)
        found = self._backward_variants.get(key)
        if found is None:
            found = self._backward_variants[key] = self._plan_backward(deterministic, operand_grads)
        return found

    @functools.cached_property
    def _backward_variants(self) -> dict:
        return {}

    def _plan_backward(self, deterministic: bool, operand_grads: bool):
        from epicute.attention import backward_plan
        from epicute.attention.backward import BackwardVariant

        self.check_backward()
        p, target = self.plan.problem, self.plan.target
        score = None if self.score is None else self.score.fusion
        cfg = backward_plan.backward_config(p.head_dim, score is not None)
        heads = backward_plan.heads_per_cta(cfg, p.causal, deterministic, p.group, p.seqlen_q, target.l2_bytes,
                                            DTYPE_BYTES[p.dtype])  # fmt: skip
        return BackwardVariant(
            cfg, p.dtype, p.causal, score, target.arch, p.varlen, deterministic,
            operand_grads and self.score is not None and bool(self.score.fusion.tensor_operands),
            heads_per_cta=heads, head_split=heads < p.group,
        )  # fmt: skip


def attention_pins(config: Any, problem: AttentionProblem) -> tuple[tuple[str, Any], ...]:
    """``config=``'s :class:`AttentionConfig` pins, checked (:func:`~epicute.runtime.checks.config_pins`); head_dim
    is q's, so a pin may only repeat it."""
    pins = config_pins(config, AttentionConfig)
    head_dim = dict(pins).get("head_dim", problem.head_dim)
    if head_dim != problem.head_dim:
        raise ConfigError(f"config['head_dim']={head_dim}: head_dim is q's ({problem.head_dim}); drop the pin")
    return pins


def prepare(
    call: AttentionCall,
    score_mod=None,
    epilogue=None,
    operands: dict | None = None,
    out_dtypes: dict | None = None,
    config: dict | None = None,
    target: Target | None = None,
) -> PreparedAttention:
    """The hooks traced against ``call``'s problem (``out_dtypes``: stored dtypes of the epilogue's
    outputs, torch dtypes or IR names), and the problem planned for ``target`` (None: the current
    GPU, else an H100 SXM) with ``config``'s pins."""
    pins = attention_pins(config, call.problem)
    score, epi = hooks_of(call, score_mod, epilogue, operands or {}, ir_dtypes(out_dtypes))
    plan = cached_plan(call.problem, pins, target, epi is None, score is not None)
    return PreparedAttention(plan, score, epi)


__all__ = ["Hook", "PreparedAttention", "attention_pins", "cached_plan", "hooks_of", "ir_dtypes", "prepare"]
