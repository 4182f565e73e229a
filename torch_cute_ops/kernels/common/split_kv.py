"""Split-KV (flash-decoding) pieces of the attention forward.

When a forward's tiles leave most SMs idle (decode against a long cache), each tile's key range
is split over several CTAs. Each split normalizes its own O and stores it with its lse in fp32
(:func:`store_partial`, straight from registers: decode tiles are a few rows), and a second
kernel of the same compiled function merges the splits (:class:`SplitKvCombine`):

    lse = log sum_s exp(lse_s),    out = sum_s exp(lse_s - lse) O_s

With attention sinks the row's sink joins that sum as one more term, ``exp(sink)``, whose O is 0.

Layouts: the partials are (splits * B, S_q, H_q, D) and (splits * B, H_q, S_q), split-major
(entry ``split * B + b``); the merged O and lse as the forward kernel sees them, (S, D, H, B)
and (S, H, B). A split that saw no key has lse -inf and weight 0; a row that no split saw gets
0 and lse -inf.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .flash_common import LOG2_E, acc_as_rows_cols


@cute.jit
def store_partial(acc_o: cute.Tensor, lse: cute.Tensor, mOpart: cute.Tensor, mLSEpart: cute.Tensor, thr_pv,
                  head: Int32, slot: Int32, row_start: Int32, seqlen_q: Int32, head_dim: cutlass.Constexpr[int]):
    """This split's normalized O (a consumer warpgroup's 64 x D accumulator) and its rows' lse
    into the fp32 partials at entry ``slot``, seen as (S_q, D, H_q, splits * B) and (S_q, H_q,
    splits * B); rows past ``seqlen_q`` are not stored."""
    tOcO = acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((64, head_dim))))
    acc = acc_as_rows_cols(acc_o)
    for r in cutlass.range_constexpr(cute.size(lse)):
        row = row_start + tOcO[r, 0][0]
        if row < seqlen_q:
            if tOcO[0, 0][1] == 0:
                mLSEpart[row, head, slot] = lse[r]
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                mOpart[row, tOcO[r, c][1], head, slot] = acc[r, c]


class SplitKvCombine:
    """The merge of the splits, one warp per output row (b, s, h). Lane i holds split i's lse
    (the host keeps splits <= 32: runtime.attention.MAX_SPLITS), the warp reduces them with
    shuffles, and each lane sums its columns (lane, lane + 32, ...) over the splits, weights
    shuffled from their lanes. A row's loads do not wait on one another: it costs two memory
    round trips (the lse, then the partial O), not one per split (the merge runs after the whole
    forward grid, so its latency is the step's)."""

    threads = 128
    rows_per_cta = threads // 32

    def __init__(self, dtype, head_dim: int, sink: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        # attention sinks: the row's sink joins the merge as one more split whose O is 0
        self.sink = sink

    @cute.kernel
    def kernel(self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSink: cute.Tensor, num_splits: Int32):
        D = self.head_dim
        cute.arch.griddepcontrol_wait()  # launched early: the splits' partials come first
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % 32
        row = cute.arch.block_idx()[0] * self.rows_per_cta + tidx // 32
        seqlen, heads, batch = mO.shape[0], mO.shape[2], mO.shape[3]
        h = row % heads
        s = (row // heads) % seqlen
        b = row // (heads * seqlen)
        if b < batch:  # the same for the whole warp: the shuffles below see every lane
            split_lse = -Float32.inf
            if lane < num_splits:
                split_lse = mLSEpart[lane * batch + b, h, s]
            lse_max = cute.arch.warp_reduction_max(split_lse)
            sink = -Float32.inf
            if cutlass.const_expr(self.sink):
                sink = mSink[s, h, b]
                lse_max = cute.arch.fmax(lse_max, sink)
            safe_max = 0.0 if lse_max == -Float32.inf else lse_max
            total = cute.arch.warp_reduction_sum(
                cute.math.exp2((split_lse - safe_max) * LOG2_E, fastmath=True))
            if cutlass.const_expr(self.sink):
                total += cute.math.exp2((sink - safe_max) * LOG2_E, fastmath=True)
            lse = -Float32.inf if total == 0.0 else safe_max + cute.math.log2(total, fastmath=True) * (1.0 / LOG2_E)
            safe_lse = 0.0 if total == 0.0 else lse
            weight = cute.math.exp2((split_lse - safe_lse) * LOG2_E, fastmath=True)  # 0 past the splits
            cols_per_lane = (D + 31) // 32
            acc = cute.make_rmem_tensor((cols_per_lane,), Float32)
            acc.fill(0.0)
            for i in cutlass.range(num_splits, unroll=8):  # 8 splits' loads in flight
                split_weight = cute.arch.shuffle_sync(weight, i)
                for j in cutlass.range_constexpr(cols_per_lane):
                    if D % 32 == 0 or lane + 32 * j < D:
                        acc[j] += split_weight * mOpart[i * batch + b, s, h, lane + 32 * j]
            for j in cutlass.range_constexpr(cols_per_lane):
                if D % 32 == 0 or lane + 32 * j < D:
                    mO[s, lane + 32 * j, h, b] = acc[j].to(self.dtype)
            if lane == 0:
                mLSE[s, h, b] = lse


def split_fakes(head_dim: int) -> tuple:
    """Fake split-KV partials (splits * B, S_q, H_q, D) and (splits * B, H_q, S_q), fp32, and the
    split count; unsplit variants are handed placeholders."""
    sym = cute.sym_int32
    o_part = cute.runtime.make_fake_compact_tensor(Float32, (sym(), sym(), sym(), head_dim), stride_order=(3, 2, 1, 0),
                                                   assumed_align=16)
    lse_part = cute.runtime.make_fake_compact_tensor(Float32, (sym(), sym(), sym()), stride_order=(2, 1, 0),
                                                     assumed_align=4)
    return o_part, lse_part, Int32(1)
