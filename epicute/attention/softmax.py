"""The softmax of the attention kernels, in base 2: one scale rule and one online softmax for every kernel.

Scores become exp2's argument by one factor, :func:`exp2_scale` (``softmax_scale * log2 e``; ``log2 e`` alone after
a score_mod, which sees and returns scaled scores); LSE is kept in natural-log units at the API and in log2 units
inside the backward (``LOG2_E``, ``LN_2``). :class:`OnlineSoftmax` is the forward's running softmax over a query
tile's key blocks: each block's scores folded into the row maxima and sums, P left in place for the PV GEMM, and
O rescaled when a row's maximum moves (lazily, past :data:`RESCALE_THRESHOLD`).
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, cute

from epicute.sm90.fragments import acc_rows_cols

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
#: Lazy rescaling (AttentionConfig.lazy_rescale): a row's reference max moves only when a block
#: raises it by more than this many powers of two, so unnormalized P stays <= 2**8 (exact enough
#: in bf16/fp16, and far from overflow in the fp32 row sums).
RESCALE_THRESHOLD = 8.0


def exp2_scale(softmax_scale, score_mod: bool):
    """The factor that turns a score into exp2's argument: ``softmax_scale * log2 e``, or, where a score_mod ran
    (``score_mod``: it sees scaled scores, so the scale is applied before it), ``log2 e`` alone."""
    if score_mod:
        return Float32(LOG2_E)
    return softmax_scale * LOG2_E


class OnlineSoftmax:
    """A query tile's softmax over its key blocks, folded in one block at a time (the forward kernels'): row
    maxima, sums and the scale O takes when a maximum moves live in registers, one entry per row a thread holds
    (``acc_rows_cols`` of the S accumulator)."""

    def __init__(self, lazy_rescale: bool):
        self.lazy_rescale = lazy_rescale

    @cute.jit
    def fold(self, acc_S, row_max, row_sum, row_scale, scale_log2, is_first: cutlass.Constexpr[bool]):
        """Fold one S block into the running row max/sum; S becomes P (unnormalized); row_scale rescales O.

        With ``lazy_rescale`` a row keeps its reference max until a block raises it by more than
        ``RESCALE_THRESHOLD`` (log2 units): P stays below 2**RESCALE_THRESHOLD, the sum and O stay
        consistent with the max actually used (which LSE reads), and row_scale is exactly 1 on every
        other block, so :meth:`rescale_lazy` can skip O's rescale.
        """
        S = acc_rows_cols(acc_S)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            s_row = S[r, None].load()
            init = -Float32.inf if cutlass.const_expr(is_first) else row_max[r]
            # The 4 lanes of a quad hold the rest of the row (whole rows per warp: see plan.attention).
            # Float32(): the shuffle reduction uses fmax only for Float32, else a compare/select pair.
            m = cute.arch.warp_reduction_max(Float32(s_row.reduce(cute.ReductionOp.MAX, init, 0)), threads_in_group=4)
            m_prev = row_max[r]
            grows = True
            if cutlass.const_expr(self.lazy_rescale and not is_first):
                # NaN (both -inf: nothing unmasked yet) compares false: the row keeps -inf.
                grows = (m - m_prev) * scale_log2 > Float32(RESCALE_THRESHOLD)
                m = cutlass.select_(grows, m, m_prev)
            row_max[r] = m
            # A row that saw only masked scores keeps max -inf; exp2 must see 0 there, not NaN.
            m_safe = cutlass.select_(m == -Float32.inf, Float32(0.0), m)
            p = cute.math.exp2(s_row * scale_log2 - m_safe * scale_log2, fastmath=True)
            S[r, None].store(p)
            if cutlass.const_expr(is_first):
                row_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                row_scale[r] = Float32(1.0)
            else:
                scale = cute.math.exp2((m_prev - m_safe) * scale_log2, fastmath=True)
                if cutlass.const_expr(self.lazy_rescale):
                    scale = cutlass.select_(grows, scale, Float32(1.0))
                row_scale[r] = scale
                # The reduction starts from the rescaled running sum (no separate add of a block sum).
                row_sum[r] = p.reduce(cute.ReductionOp.ADD, row_sum[r] * scale, 0)

    @cute.jit
    def rescale(self, acc_O, row_scale):
        O = acc_rows_cols(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            O[r, None].store(O[r, None].load() * row_scale[r])

    @cute.jit
    def rescale_lazy(self, acc_O, row_scale):
        """O's rescale in the loop: skipped by a warp none of whose rows changed its max (lazy_rescale)."""
        if cutlass.const_expr(self.lazy_rescale):
            changed = row_scale[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(row_scale)):
                changed = changed | (row_scale[r] != Float32(1.0))
            if cute.arch.vote_any_sync(changed):
                self.rescale(acc_O, row_scale)
        else:
            self.rescale(acc_O, row_scale)


__all__ = ["LN_2", "LOG2_E", "RESCALE_THRESHOLD", "OnlineSoftmax", "exp2_scale"]
