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
from typing import Any

from epicute.epilogue.graph import REDUCTIONS, Node
from epicute.epilogue.proxy import Recorder, Value
from epicute.epilogue.tracer import Epilogue
from epicute.errors import EpilogueError

#: What a score_mod result of each kind varies with (in the problem ``(L, M, N) = (batch * heads, q, kv)``).
_VARIES = {
    "col": "a value per query row (a function of q_idx, b or h, not of kv_idx or the score)",
    "row": "a value per key (a function of kv_idx, not of q_idx or the score)",
    "scalar": "one value for every score (made of numbers and scalar operands)",
}


class ScoreMod(Epilogue):
    """A traceable score modifier (see module docstring)."""

    LEAF_PARAMS = ("b", "h", "q_idx", "kv_idx")
    HOOK = "score_mod"
    SIGNATURE = "f(score, b, h, q_idx, kv_idx, *operands)"
    value_name = "score"

    @classmethod
    def _not_a_function(cls, fn: Any) -> str:
        return f"score_mod must be a function {cls.SIGNATURE}; got {type(fn).__name__}"

    def _first_param_error(self) -> str:
        return f"score_mod {self.name!r}: its first parameter must be the score, e.g. {self.SIGNATURE}"

    def _leaf_params_error(self) -> str:
        return (
            f"score_mod {self.name!r}: takes the score first, then the positional indices b, h, q_idx, kv_idx, then "
            f"its operands, e.g. {self.SIGNATURE}"
        )

    def _outputs(self, result: Any, rec: Recorder) -> dict[str, Node]:
        """A score_mod returns one value, the new score: one per (query, key)."""
        if isinstance(result, dict):
            raise EpilogueError(
                f"score_mod {self.name!r} returned a dict {tuple(result)}; a score_mod returns one value, the new "
                f"score (e.g. return {self.value_name} * 0.5); outputs such as reductions belong to the epilogue"
            )
        if not isinstance(result, Value) or result._rec is not rec:
            raise EpilogueError(
                f"score_mod {self.name!r} returned {type(result).__name__}, not a value computed from "
                f"{self.value_name}, the indices and the operands in this trace: return the new score"
            )
        node = result.node
        if node.op in REDUCTIONS:
            raise EpilogueError(
                f"score_mod {self.name!r} returns ops.{node.op}(...), a reduction: a score_mod maps each score to a "
                "new one; reductions are outputs of the attention epilogue"
            )
        if node.kind != "tile":
            raise EpilogueError(
                f"score_mod {self.name!r} returns {_VARIES[node.kind]}; it must return one score per (query, key): "
                f"a function of {self.value_name} (e.g. {self.value_name} + slopes * (kv_idx - q_idx))"
            )
        return {"D": node}

    def __repr__(self) -> str:
        return f"<score_mod {self.name}(score, b, h, q_idx, kv_idx{''.join(', ' + p for p in self.params)})>"


def score_mod(fn: Callable) -> ScoreMod:
    """Decorator: make ``fn(score, b, h, q_idx, kv_idx, *operands)`` a score modifier for ``epicute.attention``."""
    return fn if isinstance(fn, ScoreMod) else ScoreMod(fn)
