"""Attention score modifiers: ``score_mod(score, b, h, q_idx, kv_idx, *operands)``, traced.

The same tracer, ops and IR as epilogues: ``score`` is the accumulator (one
scaled score ``q . k * softmax_scale`` per (query, key)), and the four indices
become ``index`` leaves of the graph, in the attention problem
``(L, M, N) = (batch * heads, seqlen_q, seqlen_k)``: ``b`` and ``h`` vary with L,
``q_idx`` with M, ``kv_idx`` with N. Operands after the indices are scalars or
per-head vectors (ALiBi slopes), passed by name at the call.

Example:
    >>> import epicute
    >>> @epicute.score_mod
    ... def alibi(score, b, h, q_idx, kv_idx, slopes):
    ...     return score + slopes * (kv_idx - q_idx)
"""

from __future__ import annotations

from collections.abc import Callable

from epicute.epilogue.tracer import Epilogue


class ScoreMod(Epilogue):
    """A traceable score modifier (see module docstring)."""

    LEAF_PARAMS = ("b", "h", "q_idx", "kv_idx")

    def __repr__(self) -> str:
        return f"<score_mod {self.name}(score, b, h, q_idx, kv_idx{''.join(', ' + p for p in self.params)})>"


def score_mod(fn: Callable) -> ScoreMod:
    """Decorator: make ``fn(score, b, h, q_idx, kv_idx, *operands)`` a score modifier for ``epicute.attention``."""
    return fn if isinstance(fn, ScoreMod) else ScoreMod(fn)
