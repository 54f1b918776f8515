"""Split-KV's second kernel: the partial results of each split combined into O and LSE.

Split ``i`` of a query row wrote its normalized O_i over its keys and their log-sum-exp
LSE_i. Over all keys::

    LSE = log(sum_i exp(LSE_i)),    O = sum_i exp(LSE_i - LSE) * O_i

One warp per query row: lane ``l`` reads LSE_l and LSE_{l+32} (at most 64 splits) at once,
the row's maximum and sum come from shuffles, and each lane owns ``head_dim / 32``
consecutive columns of O, which it reads from each split as one vector. Splits are added
in index order, so the result does not depend on which split finished first
(deterministic). A row no split saw a key of (all LSE_i = -inf) gets O = 0 and
LSE = -inf, as the one-kernel path writes it.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, cute

from epicute.attention.plan import MAX_SPLITS
from epicute.attention.softmax import LOG2_E

#: Query rows per CTA: one warp each.
ROWS_PER_CTA = 4
#: Splits each lane reads the LSE of: lane ``l`` holds splits ``l``, ``l + 32``, ...
SPLITS_PER_LANE = -(-MAX_SPLITS // 32)


class SplitCombineSm90:
    """The combine kernel for one (O dtype, head_dim)."""

    def __init__(self, out_dtype, head_dim: int):
        self.out_dtype = out_dtype
        self.head_dim = head_dim
        self.cols_per_lane = head_dim // 32

    @cute.jit
    def __call__(
        self,
        o_part: cute.Tensor,
        lse_part: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream,
    ):
        """``o_part`` fp32 ``(splits, batch, seqlen_q, heads, head_dim)``, ``lse_part`` fp32
        ``(splits, batch, heads, seqlen_q)``; writes O ``(batch, seqlen_q, heads, head_dim)`` and LSE
        ``(batch, heads, seqlen_q)``."""
        rows = cute.size(mO, mode=[0]) * cute.size(mO, mode=[1]) * cute.size(mO, mode=[2])
        self.kernel(o_part, lse_part, mO, mLSE).launch(
            grid=(cute.ceil_div(rows, ROWS_PER_CTA), 1, 1), block=[32 * ROWS_PER_CTA, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, o_part: cute.Tensor, lse_part: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        batch_n, seqlen_q, heads = cute.size(mO, mode=[0]), cute.size(mO, mode=[1]), cute.size(mO, mode=[2])
        row = bidx * ROWS_PER_CTA + tidx // 32
        if row < batch_n * seqlen_q * heads:
            head = row % heads
            q = (row // heads) % seqlen_q
            batch = row // (heads * seqlen_q)
            splits = cute.size(o_part, mode=[0])
            # Lane l holds splits l, l + 32, ...: their LSEs are read at once and reduced by shuffles, where a
            # loop over the splits waited on one dependent load after another.
            lse = []
            for j in cutlass.range_constexpr(SPLITS_PER_LANE):
                i = lane + 32 * j
                value = lse_part[cutlass.min(i, splits - 1), batch, head, q]
                lse.append(cutlass.select_(i < splits, value, -Float32.inf))
            top = lse[0]
            for j in cutlass.range_constexpr(1, SPLITS_PER_LANE):
                top = cutlass.max(top, lse[j])
            top = cute.arch.warp_reduction_max(top)
            # exp2 of (LSE_i - top) in base 2; top = -inf (no split saw a key) is shifted to 0 so
            # every term is exp2(-inf) = 0 rather than NaN.
            shift = cutlass.select_(top == -Float32.inf, Float32(0.0), top)
            weights = [cute.math.exp2((x - shift) * LOG2_E, fastmath=True) for x in lse]
            total = weights[0]
            for j in cutlass.range_constexpr(1, SPLITS_PER_LANE):
                total = total + weights[j]
            total = cute.arch.warp_reduction_sum(total)
            empty = total == Float32(0.0)
            inv_total = cutlass.select_(empty, Float32(0.0), cute.arch.rcp_approx(total))
            weights = [w * inv_total for w in weights]
            cols = (self.cols_per_lane,)
            acc = cute.make_rmem_tensor(cols, Float32)
            acc.fill(0.0)
            # In split order (deterministic); unrolled so several splits' loads are in flight.
            for i in cutlass.range(splits, unroll=4):
                held = weights[0]
                for j in cutlass.range_constexpr(1, SPLITS_PER_LANE):
                    held = cutlass.select_(i >= 32 * j, weights[j], held)
                weight = cute.arch.shuffle_sync(held, i % 32)
                part = cute.local_tile(o_part[i, batch, q, head, None], cols, (lane,))
                acc.store(acc.load() + part.load() * weight)
            out = cute.local_tile(mO[batch, q, head, None], cols, (lane,))
            out.store(acc.load().to(self.out_dtype))
            if lane == 0:
                mLSE[batch, head, q] = cutlass.select_(
                    empty, -Float32.inf, shift + cute.math.log2(total, fastmath=True) / Float32(LOG2_E)
                )


__all__ = ["ROWS_PER_CTA", "SplitCombineSm90"]
