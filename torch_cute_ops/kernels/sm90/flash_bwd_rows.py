"""The attention backward's row kernels (sm_90a): before and after the main kernel.

* ``preprocess``: per (b, s, h) row, ``delta = rowsum(dO * O)`` and ``lse * log2(e)`` in fp32,
  written to (B, H, S_q) copies padded to whole query blocks (so that the main kernel's TMA
  loads them whole); padding rows, and rows that attend to nothing, get lse = +inf (P = 0).
  Its CTAs also zero the fp32 dQ accumulator, an even contiguous share each (no fill launch).
  With attention sinks, each row's ``exp(sink[h] - lse) * delta`` is summed per CTA, whose rows
  then share one head (head-major rows), and subtracted from ``dsink[h]`` with one fp32 reduction:
  the sink's gradient with no pass of its own over O and dO.
* ``postprocess``: the fp32 dQ accumulator, which the main kernel's writer warps fill with bulk
  reduce-adds in accumulator order (:func:`accumulator_order`), put back at the (row, col) the
  dQ GEMM's C partition gives each value, times the softmax scale, in the input dtype.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ...runtime.attention import STAT_PAD as _STAT_PAD
from ..common.flash_common import LOG2_E
from ..common.seqlen import SeqBounds, seq_major, store_rows

# the postprocess's smem dQ tile: its rows padded by 16 bytes (8 half-precision values)
_DQ_ROW_PAD = 8


def accumulator_order(chunk: cute.Tensor, thread: Int32, values: int) -> cute.Tensor:
    """Thread ``thread``'s (4, values / 4) view of a warpgroup's fp32 dQ tile kept in
    accumulator order: its value ``4 c + j`` at ``512 c + 4 thread + j`` (128 threads), so
    that the 16-byte groups of a warp are contiguous."""
    base = (chunk.iterator + 4 * thread).align(16)
    return cute.make_tensor(base, cute.make_layout((4, values // 4), stride=(1, 4 * 128)))


class FlashBwdRowKernels:
    """Pre- and postprocess of one backward variant: a group of threads per (b, s, h) row, 16
    contiguous bytes of dO / O per thread and chunk, so that a warp reads whole 128-byte lines."""

    row_threads = 128
    post_threads = 256  # the dQ GEMM's two warpgroups

    def __init__(self, dtype, head_dim: int, tile_m: int, rows: str, sink: bool = False):
        self.dtype = dtype
        self.sink = sink
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.rows = rows
        self.ragged = rows != "dense"
        chunks = head_dim // 8
        self.threads_per_row = 8 if chunks % 8 == 0 else 4
        self.chunks_per_thread = chunks // self.threads_per_row
        self.rows_per_cta = self.row_threads // self.threads_per_row

    @cute.jit
    def _row_coords(self, num_h):
        """This thread's (b, s, h) row (h fastest; the batch entry is the grid's y) and its
        lane in the row's thread group. Sink variants go head-major, s fastest: the grid covers
        each head's padded rows, a multiple of the CTA's, so a CTA's rows share their head."""
        tidx = cute.arch.thread_idx()[0]
        row = cute.arch.block_idx()[0] * self.rows_per_cta + tidx // self.threads_per_row
        lane = tidx % self.threads_per_row
        if const_expr(self.sink):
            rows_per_head = cute.arch.grid_dim()[0] * self.rows_per_cta // num_h
            return cute.arch.block_idx()[1], row % rows_per_head, row // rows_per_head, lane
        return cute.arch.block_idx()[1], row // num_h, row % num_h, lane

    @cute.jit
    def _sink_grad(self, term: Float32, h, mdSink: cute.Tensor):
        """``dsink[h] -= `` the CTA's sum of its rows' ``term`` (given by each row's lane 0; 0 on
        the other lanes): warp shuffles, then the warps' sums through shared memory."""
        warp_sums = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.row_threads // 32))
        warp_sum = cute.arch.warp_reduction_sum(term)
        tidx = cute.arch.thread_idx()[0]
        if tidx % 32 == 0:
            warp_sums[tidx // 32] = warp_sum
        cute.arch.sync_threads()
        if tidx == 0:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(self.row_threads // 32):
                total += warp_sums[w]
            cute.arch.red(mdSink.iterator + h, -total, op="add", dtype=Float32, sem="relaxed", scope="gpu")

    @cute.jit
    def _zero_share(self, mdQacc: cute.Tensor):
        """This CTA's contiguous share of the (compact) fp32 dQ accumulator, zeroed in 16-byte
        stores: the grid's CTAs split it evenly whatever its layout, so the main kernel's adds
        need no separate fill launch before them."""
        flat = cute.make_tensor(mdQacc.iterator, cute.make_layout(cute.size(mdQacc)))
        grid_x, grid_y, _ = cute.arch.grid_dim()
        block_x, block_y, _ = cute.arch.block_idx()
        vectors = cute.size(mdQacc) // 4  # tiles of tile_m * head_dim / 2 values: whole vectors
        share = cute.ceil_div(vectors, grid_x * grid_y)
        first = (block_y * grid_x + block_x) * share
        last = cutlass.min(first + share, vectors)
        zeros = cute.make_rmem_tensor((4,), Float32)
        zeros.fill(0.0)
        for v in cutlass.range(first + cute.arch.thread_idx()[0], last, self.row_threads, unroll=1):
            cute.local_tile(flat, (4,), (v,)).store(zeros.load())

    @cute.kernel
    def preprocess(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
                   mLSElog2: cute.Tensor, mdQacc: cute.Tensor, mSeqInfoQ: cute.Tensor, mSeqInfoK: cute.Tensor,
                   keys_extent: Int32, mSink: cute.Tensor, mdSink: cute.Tensor):
        # the main kernel may launch now and load K, V and Q: it waits for this grid before it
        # reads lse and delta or adds to the accumulator
        cute.arch.griddepcontrol_launch_dependents()
        self._zero_share(mdQacc)
        b, s, h, lane = self._row_coords(mO.shape[2])
        bounds = SeqBounds(b, mO.shape[1], keys_extent, mSeqInfoQ, mSeqInfoK, self.rows, _STAT_PAD)
        padded_q = mDelta.shape[2]
        if const_expr(self.ragged):
            padded_q = cute.ceil_div(bounds.seqlen_q, _STAT_PAD) * _STAT_PAD
        in_seq = s < bounds.seqlen_q
        q_row, q_entry = bounds.q_index(s, b)
        stat_row, stat_entry = bounds.padded_index(s, b)
        row_sum = Float32(0.0)
        if in_seq:
            o_row, do_row = mO[q_entry, q_row, h, None], mdO[q_entry, q_row, h, None]
            for k in cutlass.range_constexpr(self.chunks_per_thread):
                chunk = lane + k * self.threads_per_row
                o = cute.local_tile(o_row, (8,), (chunk,)).load().to(Float32)
                do = cute.local_tile(do_row, (8,), (chunk,)).load().to(Float32)
                row_sum += (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # every lane shuffles, valid row or not: the groups never straddle rows
        total = cute.arch.warp_reduction_sum(row_sum, threads_in_group=self.threads_per_row)
        if const_expr(self.sink):
            # this row's share of d loss / d sink[h]: -exp(sink - lse) * delta (0 past the entry)
            term = Float32(0.0)
            if in_seq and lane == 0:
                row_lse = mLSE[q_entry, h, q_row]
                if row_lse != -math.inf:  # a -inf sink and no key: no share
                    term = cute.math.exp2((mSink[h] - row_lse) * LOG2_E, fastmath=True) * total
            self._sink_grad(term, h, mdSink)
        if s < padded_q:
            if lane == 0:
                # rows past seqlen_q and rows that attend to nothing (lse = -inf) get
                # lse = +inf, so that P = exp2(S - lse) = 0 there and their gradient is zero
                lse = Float32(-math.inf)
                if in_seq:
                    lse = mLSE[q_entry, h, q_row]
                mLSElog2[stat_entry, h, stat_row] = cutlass.select_(lse == -math.inf, math.inf, lse * LOG2_E)
                mDelta[stat_entry, h, stat_row] = total

    def postprocess_smem_bytes(self) -> int:
        return self.tile_m * (self.head_dim + _DQ_ROW_PAD) * self.dtype.width // 8

    @cute.kernel
    def postprocess(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mSeqInfoQ: cute.Tensor, mSeqInfoK: cute.Tensor,
                    keys_extent: Int32, softmax_scale: Float32, mma_dq: cute.TiledMma):
        """One query block of one head: its two warpgroup tiles read in accumulator order, each
        value times the softmax scale (the main loop adds unscaled dS K) put in the input dtype
        at the (row, col) the dQ GEMM's C partition gives it in a shared-memory tile, and the
        tile's real rows stored in 16-byte vectors: a warp writes whole 128-byte lines."""
        tidx = cute.arch.thread_idx()[0]
        m_block, h, b = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()  # launched early: the main kernel's dQ adds come first
        bounds = SeqBounds(b, mdQ.shape[1], keys_extent, mSeqInfoQ, mSeqInfoK, self.rows, _STAT_PAD)
        if m_block * self.tile_m < bounds.seqlen_q:
            # rows padded by 16 bytes: the C partition's 8 rows of a warp hit 8 different bank quads
            sdQ = cutlass.memory.SmemAllocator().allocate_tensor(
                self.dtype, cute.make_layout((self.tile_m, self.head_dim), stride=(self.head_dim + _DQ_ROW_PAD, 1)),
                byte_alignment=16)
            row0, entry = bounds.padded_index(m_block * self.tile_m, b)
            tile = mdQacc[entry, h, row0 // self.tile_m, tidx // 128, None]
            tCsdQ = mma_dq.get_slice(tidx).partition_C(sdQ)
            values = cute.size(tCsdQ)
            acc = cute.make_rmem_tensor((4, values // 4), Float32)
            cute.autovec_copy(accumulator_order(tile, tidx % 128, values), acc)
            tCrdQ = cute.make_rmem_tensor_like(tCsdQ)
            for i in cutlass.range_constexpr(values):
                tCrdQ[i] = (acc[i % 4, i // 4] * softmax_scale).to(self.dtype)
            cute.autovec_copy(tCrdQ, tCsdQ)
            cute.arch.sync_threads()
            # the entry's rows of this block
            gdQ = cute.local_tile(bounds.q_rows(seq_major(mdQ), h, b), (self.tile_m, self.head_dim), (m_block, 0))
            store_rows(sdQ, gdQ, bounds.seqlen_q - m_block * self.tile_m, tidx, self.post_threads)
