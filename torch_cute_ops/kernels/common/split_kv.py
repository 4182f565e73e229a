"""Split-KV (flash-decoding) pieces of the attention forward.

When a forward's tiles leave most SMs idle (decode against a long cache), each tile's key range
is split over several CTAs. Each split normalizes its own O and stores it with its lse in fp32
(:func:`store_partial`, straight from registers: decode tiles are a few rows), and a second
kernel of the same compiled function merges the splits (:class:`SplitKvCombine`):

    lse = log sum_s exp(lse_s),    out = sum_s exp(lse_s - lse) O_s

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
    """The merge of the splits: one output row (b, s, h) per group of ``threads_per_row``
    threads, 8 columns per thread and step (one column at a time for head dims that are not a
    multiple of 64)."""

    threads = 128
    threads_per_row = 8
    rows_per_cta = threads // threads_per_row

    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.kernel
    def kernel(self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               num_splits: Int32):
        per_row = self.threads_per_row
        cute.arch.griddepcontrol_wait()  # launched early: the splits' partials come first
        tidx = cute.arch.thread_idx()[0]
        row = cute.arch.block_idx()[0] * self.rows_per_cta + tidx // per_row
        lane = tidx % per_row
        seqlen, heads, batch = mO.shape[0], mO.shape[2], mO.shape[3]
        h = row % heads
        s = (row // heads) % seqlen
        b = row // (heads * seqlen)
        if b < batch:
            lse_max = -Float32.inf
            for i in cutlass.range(num_splits, unroll=4):  # independent loads: keep several in flight
                lse_max = cutlass.max(lse_max, mLSEpart[i * batch + b, h, s])
            safe_max = 0.0 if lse_max == -Float32.inf else lse_max
            total = Float32(0.0)
            for i in cutlass.range(num_splits, unroll=4):
                total += cute.math.exp2((mLSEpart[i * batch + b, h, s] - safe_max) * LOG2_E, fastmath=True)
            lse = -Float32.inf if total == 0.0 else safe_max + cute.math.log2(total, fastmath=True) * (1.0 / LOG2_E)
            safe_lse = 0.0 if total == 0.0 else lse
            vectorized = self.head_dim % (8 * per_row) == 0
            for k in cutlass.range_constexpr(self.head_dim // (8 * per_row) if vectorized else 0):
                chunk = lane + k * per_row
                acc = cute.make_rmem_tensor((8,), Float32)
                acc.fill(0.0)
                for i in cutlass.range(num_splits, unroll=4):
                    weight = cute.math.exp2((mLSEpart[i * batch + b, h, s] - safe_lse) * LOG2_E, fastmath=True)
                    part = cute.local_tile(mOpart[i * batch + b, s, h, None], (8,), (chunk,)).load()
                    acc.store(acc.load() + part * weight)
                cute.local_tile(mO[s, None, h, b], (8,), (chunk,)).store(acc.load().to(self.dtype))
            for col in cutlass.range_constexpr(0 if vectorized else self.head_dim):
                if col % per_row == lane:
                    value = Float32(0.0)
                    for i in cutlass.range(num_splits, unroll=1):
                        weight = cute.math.exp2((mLSEpart[i * batch + b, h, s] - safe_lse) * LOG2_E, fastmath=True)
                        value += mOpart[i * batch + b, s, h, col] * weight
                    mO[s, col, h, b] = value.to(self.dtype)
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
