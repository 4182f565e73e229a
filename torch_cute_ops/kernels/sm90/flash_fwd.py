"""FlashAttention-3 style forward for Hopper (sm_90a), in the CuTe DSL.

One CTA = one producer warpgroup + ``num_wg`` consumer warpgroups; each consumer
warpgroup owns 64 query rows of a ``tile_m = 64 * num_wg`` query block.

* producer (warp 0): TMA loads of Q (one 64-row slab per consumer WG), and of K and
  V through two ``num_stages`` mbarrier pipelines, in the order the consumers use
  them (K of block n-1 before V of block n);
* consumers (``setmaxnreg`` gives them the registers): S = Q K^T with both operands
  in smem (WGMMA SS), online softmax in fp32 with exp2 and the scale folded in,
  P converted to 16 bits in registers and O += P V with P as the register A
  operand (WGMMA RS). Inside a warpgroup the GEMMs of block n overlap the softmax
  of block n+1 (issue S(n) and O += P(n+1) V(n+1), then wait for S only); across
  warpgroups, named barriers hand the tensor cores round-robin (ping-pong), so
  one WG's softmax runs under another's GEMMs;
* causal masks only on the key blocks that cross the diagonal; blocks fully
  above it are never loaded (the score masks, attn_mask's included, are composed in
  flash_fwd_mask.py);
* a persistent scheduler (``tile_scheduler.AttentionTileScheduler``): static for
  equal-length tiles; causal tiles longest-first and claimed dynamically from an
  atomic counter by the producer warp, which passes each claim to the consumers
  through smem, so the next tile's loads overlap the current tile's epilogue;
* epilogue: O normalized in registers, written to the WG's Q slab in smem and
  stored with TMA (rows past seqlen_q are clipped by TMA); LSE from registers.
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...runtime.attention import FwdConfig
from ...runtime.spec import KernelSpec
from ..common.flash_common import (
    LOG2_E, acc_as_operand_a, acc_as_rows_cols, convert_to_16bit, swizzled_smem_layout, tiled_wgmma, transposed_view,
    warpgroup_gemm,
)
from ..common.mask import BLOCK_BITS, BLOCK_FULL, KeyRange
from ..common.softmax import OnlineSoftmax, scale_rows
from ..common.tile_scheduler import AttentionTileScheduler, TileSource
from ..common.seqlen import PACKED_QUERIES, PAGED_KEYS, SeqBounds, gqa_rows, load_rows, seq_major, store_rows, zero_rows
from ..common.mask_args import mask_fakes
from ..common.split_kv import SplitKvCombine, split_fakes, store_partial
from .flash_fwd_mask import ScoreMasks

_CUTE_DTYPE = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}

# named barrier ids (0 is __syncthreads)
_BAR_EPILOGUE = 1  # + consumer WG index
_BAR_SCHED = 4  # + consumer WG index


def _select(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def _qk_gemm(tiled_mma, acc_shape, tSrQ, tSrK, stage, wait):
    acc_s = cute.make_rmem_tensor(acc_shape, Float32)
    warpgroup_gemm(tiled_mma, acc_s, tSrQ, tSrK[None, None, None, stage], True, wait)
    return acc_s


def _pv_gemm(tiled_mma, acc_o, tOrP, tOrVt, stage, wait):
    warpgroup_gemm(tiled_mma, acc_o, tOrP, tOrVt[None, None, None, stage], False, wait)


def _scores_to_p(tOrP, acc_s):
    """P = exp'd scores in 16 bits, laid out as the A operand of the PV WGMMA."""
    convert_to_16bit(acc_as_operand_a(acc_s), tOrP)


class FlashFwdSm90(ScoreMasks):
    def __init__(self, dtype, head_dim: int, causal: bool, config: FwdConfig, local: bool = False,
                 softcap: bool = False, rows: str = "dense", attn_mask: str = "none", split_kv: bool = False,
                 rows_per_query: int = 1, bounded_scores: bool = False, sink: bool = False,
                 page_rows: int = 0):
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        # a (left, right) window, both bounds runtime values (causal is the fixed right = 0)
        self.local = local
        self.softcap = softcap  # scores soft-capped before the mask (runtime cap value)
        # capped scores with a cap whose exponentials fit without a running max (the host's
        # runtime.attention.softcap_kind): the softmax's max is 0 for good, O is never rescaled
        self.bounded_scores = bounded_scores
        assert not bounded_scores or softcap, "only capped scores are bounded"
        # where each batch entry's rows are: dense, packed (varlen) or padded (common.seqlen)
        self.rows = rows
        # entries with their own query rows: tiles may be empty
        self.ragged = rows in ("packed", "padded", "packed_paged")
        self.paged = rows in PAGED_KEYS  # K/V blocks found through a page table
        # pages smaller than a key tile (16, 32 rows): each K/V block is tile_n / page_rows TMA boxes
        # of one page each, into the rows of the same swizzled tile (a multiple of the swizzle
        # atom's 8 rows, so every box starts on an atom); 0: one box per block
        self.page_rows = page_rows
        assert not page_rows or (self.paged and config.tile_n % page_rows == 0 and page_rows % 8 == 0)
        # PyTorch's attn_mask ("bool" or "add"itive) read where its block summary says partial
        self.attn_mask = attn_mask
        self.masked = attn_mask != "none"
        assert attn_mask == "none" or config.tile_n % 32 == 0, "bit-packed masks need whole words per key block"
        # flash-decoding: each tile's key range split over num_splits CTAs, which store fp32
        # partial O and lse; a combine kernel merges them
        self.split_kv = split_kv
        # pack-GQA with several query tokens: rows are the (token, head) pairs of one kv head
        # (common.seqlen.gqa_rows), the band is per token. They are no TMA box: the producer
        # warp gathers Q with cp.async and the epilogue stores O row by row.
        self.rows_per_query = rows_per_query
        self.gathered_rows = rows_per_query > 1
        # attention sinks: a logit per query head in every row's denominator, joined at the
        # softmax finalize (split variants: at the combine, after the splits' own lse)
        self.sink = sink
        self.combine = SplitKvCombine(dtype, head_dim, sink)
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.num_wg = config.num_wg
        self.num_stages = config.num_stages
        self.pingpong = config.pingpong and config.num_wg > 1
        self.separate_o = config.separate_o
        self.dynamic_schedule = config.dynamic_schedule
        self.l2_kv_mib = config.l2_kv_mib
        # Where O takes the max correction. With ping-pong the WG holding the tensor-core
        # turn must issue at once, so O is rescaled after the softmax, off that path;
        # without it, rescaling while S is computed hides the FMULs (large O at D >= 192).
        self.rescale_before_pv = not self.pingpong
        # a row's max moves only when it grows by more than this (log2 units; 0: always),
        # which skips O's rescale in most blocks (ping-pong: off the other WG's GEMM window)
        self.rescale_threshold = config.rescale_threshold
        self.num_threads = 128 * (config.num_wg + 1)
        # 64K registers per SM: the producer WG keeps few, the consumers get the rest
        self.consumer_regs, self.producer_regs = {1: (240, 24), 2: (240, 24), 3: (160, 32)}[config.num_wg]

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, S_q, H_q, D)
        mK: cute.Tensor,  # (B, S_k, H_kv, D)
        mV: cute.Tensor,  # (B, S_k, H_kv, D)
        mO: cute.Tensor,  # (B, S_q, H_q, D)
        mLSE: cute.Tensor,  # (B, H_q, S_q) fp32
        mTileCounter: cute.Tensor,  # (1,) int32, zero: the dynamic schedule's claims
        mSeqInfoQ: cute.Tensor,  # int32 row bounds (common.seqlen): packed, cu_seqlens (B + 1,);
        mSeqInfoK: cute.Tensor,  # padded, the first and one-past-last real key (B,); dense: unread;
        #                      kvcache / packed_paged as common.seqlen says
        max_seqlen_q: Int32,  # packed: the longest sequences (grid, L2 sections); kvcache: pages per entry
        max_seqlen_k: Int32,  # kvcache, packed_paged: the page size
        mMask: cute.Tensor,  # masked variants: attn_mask (B, H_q, S_q, S_k), any strides, a bool one
        #                      bit-packed (mask_args); else unread
        mMaskBits: cute.Tensor,  # additive variants: the mask's zeros, bit-packed (mask_args); else unread
        mMaskBlocks: cute.Tensor,  # its block summary (B, H_q, M blocks, N blocks) int8 (BLOCK_*)
        mMaskRange: cute.Tensor,  # (B, H_q, M blocks, 2) int32: the first and past-last live key block
        softmax_scale: Float32,
        window_left: Int32,  # local variants: the band (see KeyRange); ignored otherwise
        window_right: Int32,
        softcap: Float32,  # softcap variants: the cap; ignored otherwise
        max_ctas: Int32,
        stream: cuda.CUstream,
        mOpart: cute.Tensor,  # split variants: (splits * B, S_q, H_q, D) fp32 partial O; else unread
        mLSEpart: cute.Tensor,  # (splits * B, H_q, S_q) fp32 partial lse
        num_splits: Int32,
        mSink: cute.Tensor,  # sink variants: each row's sink, fp32, lse's shape with zero strides on
        #                      all but the heads (a (H_q,) vector seen as (B, H_q, S_q)); else unread
    ):
        D = self.head_dim
        # (S, D, H, B): TMA tiles modes 0-1, heads and batch index the rest
        mQ, mK, mV, mO = [seq_major(t) for t in (mQ, mK, mV, mO)]
        mLSE = _select(mLSE, [2, 1, 0])  # (S_q, H_q, B)
        mSink = _select(mSink, [2, 1, 0])  # indexed as lse is
        mO_final, mLSE_final, mSink_final = mO, mLSE, mSink  # the combine's view (split variants)
        tma_mQ_src, tma_mO_src = mQ, mO  # gathered rows: the TMA atoms are built but never used
        mQ, mO, mLSE, mSink = self._rows(mQ, 2), self._rows(mO, 2), self._rows(mLSE, 1), self._rows(mSink, 1)
        # packed: B = 1 and S the total; the sequences' bounds come from cu_seqlens
        seqlen_q, seqlen_k, batch = cute.size(mQ, mode=[0]), mK.shape[0], mQ.shape[3]
        # kvcache: the page table's row length and the page size come in the max_seqlen slots
        pages_per_entry, page_size = max_seqlen_q, max_seqlen_k
        if const_expr(self.rows in PACKED_QUERIES):
            seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
            batch = SeqBounds.num_entries(batch, mSeqInfoQ, self.rows)
        if const_expr(self.rows == "packed_paged"):  # max_seqlen_k: the page size
            pages_per_entry = SeqBounds.pages_per_entry(mSeqInfoQ, mSeqInfoK)
            seqlen_q, seqlen_k = max_seqlen_q * self.rows_per_query, pages_per_entry * page_size

        q_layout = swizzled_smem_layout(self.dtype, 64, D, self.num_wg)
        k_layout = swizzled_smem_layout(self.dtype, self.tile_n, D, self.num_stages)
        v_layout = swizzled_smem_layout(self.dtype, self.tile_n, D, self.num_stages)
        slab_layout = cute.select(q_layout, mode=[0, 1])

        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = tiled_wgmma(self.dtype, k_major, k_major, (self.tile_m, self.tile_n),
                                   atoms_mn=(self.num_wg, 1))
        tiled_mma_pv = tiled_wgmma(self.dtype, k_major, mn_major, (64, D),
                                   a_source=warpgroup.OperandSource.RMEM)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(load_op, tma_mQ_src, slab_layout, (64, D))
        k_box, v_box = cute.select(k_layout, mode=[0, 1]), cute.select(v_layout, mode=[0, 1])
        if const_expr(self.page_rows):  # a box per page: the tile's first page_rows rows
            k_box, v_box = [cute.composition(box, (self.page_rows, D)) for box in (k_box, v_box)]
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(load_op, mK, k_box, (self.page_rows or self.tile_n, D))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(load_op, mV, v_box, (self.page_rows or self.tile_n, D))
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), tma_mO_src, slab_layout, (64, D)
        )
        tx_bytes = [
            cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1]))
            for layout in (q_layout, k_layout, v_layout)
        ]
        tx_bytes[0] = tx_bytes[0] * self.num_wg

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 4 if self.dynamic_schedule else 0]
            next_tile: cute.struct.MemRange[Int32, 2 if self.dynamic_schedule else 0]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(v_layout)], 1024]
            sO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_layout) if self.separate_o else 0], 1024
            ]

        num_heads = mQ.shape[2]
        num_m_blocks = (seqlen_q + self.tile_m - 1) // self.tile_m
        if const_expr(self.rows == "packed_paged"):
            # tiles are the entries' query blocks, listed one after another (common.seqlen), not
            # max_seqlen_q's blocks of every entry: a decode row is one block, not a chunk's count
            num_m_blocks = 1
        heads_per_section = AttentionTileScheduler.heads_per_section_for(
            seqlen_k, 2 * D * self.dtype.width // 8, num_heads * batch, self.l2_kv_mib << 20
        )
        mO_rows, mLSE_rows, tiles_batch = mO, mLSE, batch
        if const_expr(self.rows == "packed_paged"):  # at most this many blocks: each entry's last may be partial
            tiles_batch = (cute.size(mQ, mode=[0]) + self.tile_m - 1) // self.tile_m + batch
        if const_expr(self.split_kv):  # (split, batch) pairs take the batch's place in the schedule
            mO_rows, mLSE_rows = self._rows(seq_major(mOpart), 2), self._rows(_select(mLSEpart, [2, 1, 0]), 1)
            tiles_batch = batch * num_splits
        num_tiles = num_m_blocks * num_heads * tiles_batch
        self.kernel(
            mQ if const_expr(self.gathered_rows) else tma_mQ, tma_mK, tma_mV, tma_mO, mO_rows, mLSE_rows,
            mTileCounter, mSeqInfoQ, mSeqInfoK, tiles_batch,
            num_splits,
            mMask, mMaskBits, mMaskBlocks, mMaskRange, 1.0 / softmax_scale, pages_per_entry, page_size,
            tma_q, tma_k, tma_v, tma_o,
            tiled_mma_qk, tiled_mma_pv,
            q_layout, k_layout, v_layout,
            *self._softmax_scales(softmax_scale, softcap), window_left, window_right,
            num_m_blocks, heads_per_section, mSink,
            tx_bytes[0], tx_bytes[1], tx_bytes[2],
            SharedStorage,
        ).launch(
            grid=[cutlass.min(num_tiles, max_ctas), 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )
        if const_expr(self.split_kv):
            rows = cute.size(mO_final.shape[0]) * cute.size(mO_final.shape[2]) * cute.size(mO_final.shape[3])
            self.combine.kernel(mOpart, mLSEpart, mO_final, mLSE_final, mSink_final, num_splits).launch(
                grid=[cute.ceil_div(rows, self.combine.rows_per_cta), 1, 1],
                block=[self.combine.threads, 1, 1], stream=stream, use_pdl=True)

    def _rows(self, t: cute.Tensor, head_mode: int) -> cute.Tensor:
        """A q-like (S, ..., H, ...) view as the kernel indexes its rows: gathered rows,
        ((group, S_q), ..., H_kv, ...) (common.seqlen.gqa_rows); else ``t`` itself."""
        return gqa_rows(t, self.rows_per_query, head_mode) if const_expr(self.gathered_rows) else t

    def _softmax_scales(self, softmax_scale: Float32, softcap: Float32):
        """(scale_log2 of the softmax's exp2, scale of the scores before tanh when capped)."""
        if const_expr(self.softcap):
            return softcap * LOG2_E, softmax_scale / softcap
        return softmax_scale * LOG2_E, softmax_scale

    # ---------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mO_rows: cute.Tensor,  # O as plain gmem: the store of ragged entries
        mLSE: cute.Tensor,
        mTileCounter: cute.Tensor,
        mSeqInfoQ: cute.Tensor,
        mSeqInfoK: cute.Tensor,
        num_batch: Int32,
        num_splits: Int32,
        mMask: cute.Tensor,
        mMaskBits: cute.Tensor,
        mMaskBlocks: cute.Tensor,
        mMaskRange: cute.Tensor,
        inv_scale: Float32,
        pages_per_entry: Int32,  # kvcache: the page table's row length and the page size
        page_size: Int32,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_o: cute.CopyAtom,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        v_layout: cute.ComposedLayout,
        scale_log2: Float32,
        cap_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_m_blocks: Int32,
        heads_per_section: Int32,
        mSink: cute.Tensor,
        tx_bytes_q: cutlass.Constexpr[int],
        tx_bytes_k: cutlass.Constexpr[int],
        tx_bytes_v: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # one arrive per consumer warp (lane 0 signals)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_wg)
        pipe_k, pipe_v = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(),
                num_stages=stages,
                producer_group=tma_warp,
                consumer_group=consumer_warps,
                tx_count=tx,
                defer_sync=True,
            )
            for mbar, stages, tx in (
                (storage.mbar_k, self.num_stages, tx_bytes_k),
                (storage.mbar_v, self.num_stages, tx_bytes_v),
            )
        ]
        if const_expr(self.gathered_rows):
            # Q gathered by the producer warp's 32 lanes, each arriving when its copies land
            pipe_q = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_q.data_ptr(), num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.num_wg),
                defer_sync=True)
        else:
            pipe_q = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=tma_warp,
                consumer_group=consumer_warps, tx_count=tx_bytes_q, defer_sync=True)
        pipe_tile, tile_slots = None, None
        if const_expr(self.dynamic_schedule):
            # the next tile, claimed by the producer warp, read by every consumer thread
            pipe_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(),
                num_stages=2,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.num_wg),
                defer_sync=True,
            )
            tile_slots = storage.next_tile.get_tensor(cute.make_layout(2))
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sO = sQ  # the WG's Q slab is free once its last QK GEMM is done
        if const_expr(self.separate_o):
            sO = storage.sO.get_tensor(q_layout.outer, swizzle=q_layout.inner)

        # ragged entries: longest first too, so that the empty blocks of short ones run last
        scheduler = AttentionTileScheduler(
            num_m_blocks, mQ.shape[2], num_batch, heads_per_section, self.causal or self.ragged or self.masked,
            self.dynamic_schedule,
        )
        tile_source = TileSource(scheduler, pipe_tile, tile_slots, mTileCounter)
        splits = (num_batch, num_splits)  # the schedule's batch and the split count
        pipeline.pipeline_init_wait()
        if const_expr(self.split_kv):
            # the combine may launch now (it waits for this whole grid): a persistent grid is
            # resident from the start, so its CTAs only take the SMs' spare slots
            cute.arch.griddepcontrol_launch_dependents()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v,
                             pipe_q, pipe_k, pipe_v, tile_source, mSeqInfoQ, mSeqInfoK, mMaskRange,
                             window_left, window_right, pages_per_entry, page_size, splits)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(mO, mO_rows, mLSE, sQ, sK, sV, sO, tma_o, tiled_mma_qk, tiled_mma_pv,
                         pipe_q, pipe_k, pipe_v, tile_source, scale_log2, cap_scale,
                         cute.size(mQ, mode=[0]), mK.shape[0], mSeqInfoQ, mSeqInfoK, (mMask, mMaskBits), mMaskBlocks,
                         mMaskRange, inv_scale, window_left, window_right, pages_per_entry, page_size, splits,
                         mSink)

    # -------------------------------------------------------------- producer
    @cute.jit
    def produce(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v,
                pipe_q, pipe_k, pipe_v, tile_source: TileSource, mSeqInfoQ, mSeqInfoK, mMaskRange,
                window_left: Int32, window_right: Int32, pages_per_entry: Int32, page_size: Int32, splits):
        D = self.head_dim
        scheduler = tile_source.scheduler
        q_per_kv = mQ.shape[2] // mK.shape[2]
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        tile = scheduler.first_tile()
        while scheduler.is_valid(tile):
            m_block, head, slot = scheduler.coords(tile)
            batch, split = self.split_of(slot, splits)
            if const_expr(self.rows == "packed_paged"):
                m_block, batch = self.entry_block(batch, mSeqInfoQ, mSeqInfoK, pages_per_entry)
            head_kv = head // q_per_kv
            bounds = SeqBounds(batch, cute.size(mQ, mode=[0]), mK.shape[0], mSeqInfoQ, mSeqInfoK, self.rows,
                               pages_per_entry=pages_per_entry, page_size=page_size,
                               rows_per_query=self.rows_per_query)
            if self.tile_has_rows(m_block, bounds):
                keys = self.key_range(m_block, bounds, window_left, window_right, mMaskRange, head, batch, split,
                                      splits)
                # ((TMA atom), rest) views of the smem stages and the gmem tiles (page boxes: per box)
                tKsK, tKgK, tVsV, tVgV = None, None, None, None
                if const_expr(not self.page_rows):
                    gK = cute.local_tile(bounds.k_rows(mK, head_kv, batch), (self.tile_n, D), (None, 0))
                    gV = cute.local_tile(bounds.k_rows(mV, head_kv, batch), (self.tile_n, D), (None, 0))
                    tKsK, tKgK = self._tma_views(tma_k, sK, gK)
                    tVsV, tVgV = self._tma_views(tma_v, sV, gV)
                n_min, n_max = keys.n_block_min, keys.n_block_max
                load_k = partial(self.load_kv_block, tma_k, tKsK, tKgK, sK, mK, pipe_k, bounds=bounds, head_kv=head_kv)
                load_v = partial(self.load_kv_block, tma_v, tVsV, tVgV, sV, mV, pipe_v, bounds=bounds, head_kv=head_kv)
                if n_max > n_min:
                    pipe_k.producer_acquire(kv_state)
                    load_k(n_max - 1, kv_state)
                self.load_q(mQ, sQ, tma_q, pipe_q, q_state, m_block, head, batch, bounds)
                q_state.advance()
                if n_max > n_min:
                    # K of block n-1 goes before V of block n: the consumers' order
                    for i in cutlass.range(n_max - 1 - n_min, unroll=1):
                        n = n_max - 1 - i
                        v_state = kv_state.clone()
                        kv_state.advance()
                        pipe_k.producer_acquire(kv_state)
                        load_k(n - 1, kv_state)
                        pipe_v.producer_acquire(v_state)
                        load_v(n, v_state)
                    pipe_v.producer_acquire(kv_state)
                    load_v(n_min, kv_state)
                    kv_state.advance()
            tile, tile_state = tile_source.produce_next(tile, tile_state)

    @cute.jit
    def load_q(self, mQ, sQ, tma_q, pipe_q, q_state, m_block, head, batch, bounds: SeqBounds):
        """The tile's Q slabs: one TMA box each, or (gathered rows) cp.async of the real rows by
        the warp's lanes (the consumers zero the others)."""
        pipe_q.producer_acquire(q_state)
        if const_expr(self.gathered_rows):
            lane = cute.arch.lane_idx()
            gQ = mQ[None, None, head, batch]
            if const_expr(self.rows in PACKED_QUERIES):  # the entry's rows of the packed tokens
                gQ = bounds.q_rows(mQ, head, batch)
            for w in cutlass.range_constexpr(self.num_wg):
                load_rows(gQ, sQ[None, None, w], (m_block * self.num_wg + w) * 64, bounds.seqlen_q, lane, 32)
            cute.arch.cp_async_mbarrier_arrive_noinc(pipe_q.producer_get_barrier(q_state))
        else:
            gQ = cute.local_tile(bounds.q_rows(mQ, head, batch), (64, self.head_dim), (None, 0))
            tQsQ, tQgQ = self._tma_views(tma_q, sQ, gQ)
            for w in cutlass.range_constexpr(self.num_wg):
                cute.copy(tma_q, tQgQ[None, m_block * self.num_wg + w], tQsQ[None, w],
                          tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

    @staticmethod
    def _tma_views(atom, s: cute.Tensor, g: cute.Tensor):
        """(smem per stage, gmem per tile) partitions for a TMA atom."""
        return cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
        )

    def kv_tile(self, tXgX, tma, sX, mX, n_block, bounds: SeqBounds, head_kv):
        """The gmem TMA view of key block ``n_block``: a slice of the entry's blocks, or (paged)
        the block's rows in its page of the cache."""
        if const_expr(self.paged):
            rows = cute.domain_offset((bounds.key_row(n_block * self.tile_n), 0), mX[None, None, head_kv, 0])
            _, tXgX = self._tma_views(tma, sX, cute.local_tile(rows, (self.tile_n, self.head_dim), (None, 0)))
            return tXgX[None, 0]
        return tXgX[None, n_block]

    def load_kv_block(self, tma, tXsX, tXgX, sX, mX, pipe, n_block, state, bounds: SeqBounds, head_kv):
        """Start the TMA load of key block ``n_block`` into the pipeline stage ``state``: one box,
        or (pages smaller than the block) one box per page (:meth:`load_page_boxes`)."""
        if self.page_rows:
            self.load_page_boxes(tma, sX, mX, n_block, state.index, pipe.producer_get_barrier(state), bounds,
                                 head_kv)
        else:
            cute.copy(tma, self.kv_tile(tXgX, tma, sX, mX, n_block, bounds, head_kv), tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def load_page_boxes(self, tma, sX, mX, n_block, stage, barrier, bounds: SeqBounds, head_kv):
        """Key block ``n_block`` as one TMA box per page, each looked up in the page table, all on
        one barrier. A page wholly past the entry's keys is read from past the cache's end (its
        table column may not exist): zeros, whose bytes still count towards the transaction."""
        D = self.head_dim
        per_block = self.tile_n // self.page_rows
        boxes = cute.flat_divide(sX, (self.page_rows, D))  # (page_rows, D, boxes, 1, stages)
        cache = mX[None, None, head_kv, 0]
        for j in cutlass.range_constexpr(per_block):
            page = n_block * per_block + j  # the entry's page (the page size is page_rows: no division)
            row = mX.shape[0]
            if page * self.page_rows < bounds.seqlen_k:
                row = bounds.page_table[bounds.page_base + page] * self.page_rows
            gX = cute.local_tile(cute.domain_offset((row, 0), cache), (self.page_rows, D), (None, 0))
            tBsX, tBgX = self._tma_views(tma, boxes[None, None, j, 0, None], gX)
            cute.copy(tma, tBgX[None, 0], tBsX[None, stage], tma_bar_ptr=barrier)

    @cute.jit
    def entry_block(self, block, mSeqInfoQ: cute.Tensor, mSeqInfoK: cute.Tensor, pages_per_entry: Int32):
        """packed_paged: (m_block, entry) of the scheduled query block ``block``, from the entries'
        first blocks (common.seqlen), by binary search: the last entry whose first block is at most
        ``block``. A block past the last entry's is that entry's, past its end (no rows)."""
        entries = cute.size(mSeqInfoQ.shape[0]) - 1
        first_blocks = cute.domain_offset((2 * entries + entries * pages_per_entry,), mSeqInfoK)
        low, high = Int32(0), entries
        while high - low > 1:
            middle = (low + high) // 2
            if first_blocks[middle] <= block:
                low = middle
            else:
                high = middle
        return block - first_blocks[low], low

    def tile_has_rows(self, m_block, bounds: SeqBounds):
        """Dense tiles always do; a ragged schedule covers the longest entry's blocks."""
        if const_expr(self.ragged):
            return m_block * self.tile_m < bounds.seqlen_q
        return True

    def key_range(self, m_block, bounds: SeqBounds, window_left: Int32, window_right: Int32,
                  mMaskRange: cute.Tensor, head, batch, split, splits) -> KeyRange:
        keys = KeyRange(self.tile_m, self.tile_n, self.causal, m_block, bounds.seqlen_q, bounds.seqlen_k,
                        self.local, window_left, window_right, self.rows_per_query)
        if const_expr(self.masked):
            # the attn_mask's live key blocks (no causal or window with a mask)
            keys.n_block_min = mMaskRange[batch, head, m_block, 0]
            keys.n_block_max = mMaskRange[batch, head, m_block, 1]
        if const_expr(self.split_kv):  # this split's share of the blocks (empty when none is left)
            per_split = (keys.n_block_max - keys.n_block_min + splits[1] - 1) // splits[1]
            first = keys.n_block_min + split * per_split
            keys.n_block_min = first
            keys.n_block_max = cutlass.max(cutlass.min(keys.n_block_max, first + per_split), first)
        return keys

    def split_of(self, slot, splits) -> tuple:
        """(batch, split) of a scheduled tile's batch slot (split-major)."""
        if const_expr(self.split_kv):
            batch = splits[0] // splits[1]
            return slot % batch, slot // batch
        return slot, 0

    # ------------------------------------------------------------- consumers
    @cute.jit
    def consume(self, mO, mO_rows, mLSE, sQ, sK, sV, sO, tma_o, tiled_mma_qk, tiled_mma_pv,
                pipe_q, pipe_k, pipe_v, tile_source: TileSource,
                scale_log2: Float32, cap_scale: Float32, seqlen_q: Int32, seqlen_k: Int32,
                mSeqInfoQ, mSeqInfoK, user_mask, mMaskBlocks, mMaskRange, inv_scale: Float32,
                window_left: Int32, window_right: Int32, pages_per_entry: Int32, page_size: Int32, splits,
                mSink):
        D = self.head_dim
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_tidx = tidx % 128

        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(wg_tidx)
        # the CTA's query rows as one (tile_m, D) tile: the slabs stacked along M
        q_rows = cute.group_modes(cute.select(sQ.layout, mode=[0, 2, 1]), 0, 2)
        sQ_tile = cute.make_tensor(sQ.iterator, q_rows)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ_tile))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(transposed_view(sV)))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((64, self.tile_n)))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, D)), Float32)
        acc_s_shape = tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n))

        # (row, col) of every score this thread holds, and thread 0's (static)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = acc_as_rows_cols(thr_qk.partition_C(cS))
        t0ScS = acc_as_rows_cols(tiled_mma_qk.get_slice(0).partition_C(cS))

        softmax = OnlineSoftmax(scale_log2, cute.size(tScS, mode=[0]), self.rescale_threshold,
                                fixed_max=self.bounded_scores)
        o_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)

        # the DSL's loops take no closures: bind the fragments with partial
        qk_gemm = partial(_qk_gemm, tiled_mma_qk, acc_s_shape, tSrQ, tSrK)
        pv_gemm = partial(_pv_gemm, tiled_mma_pv, acc_o, tOrP, tOrVt)
        to_p = partial(_scores_to_p, tOrP)
        scheduler = tile_source.scheduler

        if const_expr(self.pingpong):
            if wg == 0:  # the first WG starts with the tensor-core token
                cute.arch.barrier_arrive(barrier_id=_BAR_SCHED, number_of_threads=256)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        tile = scheduler.first_tile()
        while scheduler.is_valid(tile):
            m_block, head, slot = scheduler.coords(tile)
            batch, split = self.split_of(slot, splits)
            if const_expr(self.rows == "packed_paged"):
                m_block, batch = self.entry_block(batch, mSeqInfoQ, mSeqInfoK, pages_per_entry)
            bounds = SeqBounds(batch, seqlen_q, seqlen_k, mSeqInfoQ, mSeqInfoK, self.rows,
                               pages_per_entry=pages_per_entry, page_size=page_size,
                               rows_per_query=self.rows_per_query)
            if self.tile_has_rows(m_block, bounds):
                keys = self.key_range(m_block, bounds, window_left, window_right, mMaskRange, head, batch, split,
                                      splits)
                row_start = m_block * self.tile_m + wg * 64
                sink = None
                if const_expr(self.sink and not self.split_kv):  # read now: its latency hides under the keys
                    sink = self.row_sinks(mSink, thr_pv, head, batch, row_start, bounds)
                masks = self.tile_mask(tScS, t0ScS, m_block, head, batch, bounds, window_left, window_right,
                                       cap_scale, user_mask, inv_scale)

                softmax.reset()
                acc_o.fill(0.0)
                o_scale.fill(1.0)
                if const_expr(self.gathered_rows):
                    # the producer gathers only real rows: this WG zeroes the rest of its slab
                    # (rows the producer leaves alone, so no race with its copies)
                    zero_rows(sQ[None, None, wg], bounds.seqlen_q - row_start, wg_tidx, 128)
                pipe_q.consumer_wait(q_state)
                if const_expr(self.gathered_rows):
                    cute.arch.fence_view_async_shared()  # the lanes' cp.async writes and the zeros, seen by WGMMA
                    cute.arch.barrier(barrier_id=_BAR_EPILOGUE + wg, number_of_threads=128)
                kv_state = self.attend_keys(kv_state, keys, qk_gemm, pv_gemm, to_p, masks, softmax, acc_o,
                                            o_scale, pipe_q, pipe_k, pipe_v, q_state, wg,
                                            (mMaskBlocks, batch, head, m_block))
                if const_expr(self.split_kv):
                    out_scale, lse = softmax.finalize()
                    scale_rows(acc_o, out_scale)
                    store_partial(acc_o, lse, mO_rows, mLSE, thr_pv, head, slot, row_start, bounds.seqlen_q, D)
                else:
                    self.epilogue(acc_o, softmax, mO, mO_rows, mLSE, sO[None, None, wg], tma_o, tiled_mma_pv,
                                  thr_pv, wg, wg_tidx, m_block, head, batch, row_start, bounds, sink)
                if const_expr(not self.separate_o):
                    pipe_q.consumer_release(q_state)
                q_state.advance()
            tile, tile_state = tile_source.consume_next(tile, tile_state)

    @cute.jit
    def attend_keys(self, kv_state, keys, qk_gemm, pv_gemm, to_p, masks, softmax: OnlineSoftmax,
                    acc_o, o_scale, pipe_q, pipe_k, pipe_v, q_state, wg, mask_blocks):
        """One tile's walk over its key blocks ``keys`` (newest first), O and the softmax
        accumulated; Q is released as soon as the last QK GEMM is issued when O has its own smem.
        ``masks``: :meth:`tile_mask`'s; ``mask_blocks``: (mMaskBlocks, batch, head, m_block), the
        tile's attn_mask block summary (read by masked variants only)."""
        mask, load_words, bits_mask = masks
        n_min, n_max = keys.n_block_min, keys.n_block_max
        banded = self.causal or self.local
        if n_max > n_min:
            # last key block first: it alone may hold keys past seqlen_k
            pipe_k.consumer_wait(kv_state)
            acc_s = qk_gemm(kv_state.index, 0)
            pipe_k.consumer_release(kv_state)
            first_block = {"col_start": (n_max - 1) * self.tile_n, "causal": self.causal, "mask_seqlen": True}
            if const_expr(bits_mask is not None):  # an additive mask: by its bits where they say all
                mMaskBlocks, batch, head, m_block = mask_blocks
                if mMaskBlocks[batch, head, m_block, n_max - 1] == BLOCK_BITS:
                    bits_mask(acc_s, **first_block)
                else:
                    mask(acc_s, **first_block)
            else:
                mask(acc_s, **first_block)
            softmax.step(acc_s, is_first=True)
            to_p(acc_s)
            # blocks n_max-2 .. n_min, newest first: those crossing the band's right edge
            # (masked), the inside (no mask), those crossing its left edge (local, masked)
            right_end = cutlass.max(cutlass.min(keys.n_block_min_masked, n_max - 1), n_min)
            if const_expr(banded):
                for i in cutlass.range(n_max - 1 - right_end, unroll=1):
                    kv_state = self.overlapped_block(
                        kv_state, n_max - 2 - i, qk_gemm, pv_gemm, to_p, mask, True,
                        softmax, acc_o, o_scale, pipe_k, pipe_v, wg)
            free_end = n_min
            if const_expr(self.local):
                free_end = cutlass.max(cutlass.min(keys.n_block_min_unmasked, right_end), n_min)
            if const_expr(self.masked):
                # attn_mask: each block as its summary says (full: no mask, else masked: by its
                # bits for a bool mask and an additive one's BLOCK_BITS, else by its values);
                # the next block's kind is read one block ahead, off the critical path
                mMaskBlocks, batch, head, m_block = mask_blocks
                blocks = mMaskBlocks[batch, head, m_block, None]
                kind = blocks[cutlass.max(right_end - 1, 0)]
                for i in cutlass.range(right_end - free_end, unroll=1):
                    n_block = right_end - 1 - i
                    next_kind = blocks[cutlass.max(n_block - 1, 0)]
                    if kind == BLOCK_FULL:
                        kv_state = self.overlapped_block(
                            kv_state, n_block, qk_gemm, pv_gemm, to_p, mask, False,
                            softmax, acc_o, o_scale, pipe_k, pipe_v, wg)
                    else:
                        if const_expr(bits_mask is None):
                            kv_state = self.overlapped_block(
                                kv_state, n_block, qk_gemm, pv_gemm, to_p, mask, True,
                                softmax, acc_o, o_scale, pipe_k, pipe_v, wg, load_words)
                        else:
                            if kind == BLOCK_BITS:
                                kv_state = self.overlapped_block(
                                    kv_state, n_block, qk_gemm, pv_gemm, to_p, bits_mask, True,
                                    softmax, acc_o, o_scale, pipe_k, pipe_v, wg, load_words)
                            else:
                                kv_state = self.overlapped_block(
                                    kv_state, n_block, qk_gemm, pv_gemm, to_p, mask, True,
                                    softmax, acc_o, o_scale, pipe_k, pipe_v, wg)
                    kind = next_kind
            else:
                for i in cutlass.range(right_end - free_end, unroll=1):
                    kv_state = self.overlapped_block(
                        kv_state, right_end - 1 - i, qk_gemm, pv_gemm, to_p, mask, False,
                        softmax, acc_o, o_scale, pipe_k, pipe_v, wg)
            if const_expr(self.local):
                for i in cutlass.range(free_end - n_min, unroll=1):
                    kv_state = self.overlapped_block(
                        kv_state, free_end - 1 - i, qk_gemm, pv_gemm, to_p, mask, True,
                        softmax, acc_o, o_scale, pipe_k, pipe_v, wg)
            # all QK GEMMs are done: with its own O buffer, Q can be refilled now,
            # under the last P V and the epilogue
            if const_expr(self.separate_o):
                pipe_q.consumer_release(q_state)
            # the last P V
            if const_expr(self.rescale_before_pv):
                scale_rows(acc_o, o_scale, not self.bounded_scores)
            pipe_v.consumer_wait(kv_state)
            pv_gemm(kv_state.index, 0)
            pipe_v.consumer_release(kv_state)
            kv_state.advance()
        else:
            if const_expr(self.separate_o):
                pipe_q.consumer_release(q_state)
        return kv_state

    @cute.jit
    def overlapped_block(self, kv_state, n_block, qk_gemm, pv_gemm, to_p, mask,
                         masked: cutlass.Constexpr[bool], softmax: OnlineSoftmax,
                         acc_o, o_scale, pipe_k, pipe_v, wg, load_words=None):
        """S(n) = Q K(n)^T and O += P(n+1) V(n+1) in flight together, then softmax(S(n)).
        ``load_words``: a bool attn_mask's loader, issued first so its latency hides."""
        mask_args = {}
        if const_expr(load_words is not None):
            mask_args = {"words": load_words(col_start=n_block * self.tile_n)}
        v_state = kv_state.clone()
        kv_state.advance()
        pipe_k.consumer_wait(kv_state)
        self.sched_wait(wg)
        acc_s = qk_gemm(kv_state.index, -1)
        if const_expr(self.rescale_before_pv):
            # the previous block's max correction, under S's GEMM
            scale_rows(acc_o, o_scale, not self.bounded_scores)
        pipe_v.consumer_wait(v_state)
        pv_gemm(v_state.index, -1)
        self.sched_pass(wg)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(kv_state)
        if const_expr(masked or self.softcap):  # a block on the band's edge, or capped scores
            mask(acc_s, col_start=n_block * self.tile_n, causal=self.causal and masked, mask_seqlen=False,
                 **mask_args)
        row_scale, grew = softmax.step(acc_s, is_first=False)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        to_p(acc_s)  # P(n+1) is consumed: overwrite it
        if const_expr(not self.bounded_scores):  # bounded scores: O is never rescaled
            if const_expr(self.rescale_before_pv):
                o_scale.store(row_scale.load())
            else:
                scale_rows(acc_o, row_scale, grew)
        return kv_state

    def sched_wait(self, wg):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_BAR_SCHED + wg, number_of_threads=256)

    def sched_pass(self, wg):
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(
                barrier_id=_BAR_SCHED + (wg + 1) % self.num_wg, number_of_threads=256
            )

    @cute.jit
    def row_sinks(self, mSink: cute.Tensor, thr_pv, head, batch, row_start, bounds: SeqBounds) -> cute.Tensor:
        """The sink logit of each O row this thread holds (rows past the entry's end: 0, unused)."""
        tOcO = acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((64, self.head_dim))))
        sink = cute.make_rmem_tensor(cute.size(tOcO, mode=[0]), Float32)
        for r in cutlass.range_constexpr(cute.size(sink)):
            sink[r] = 0.0
            row = row_start + tOcO[r, 0][0]
            if row < bounds.seqlen_q:
                sink_row, entry = bounds.q_index(row, batch)
                sink[r] = mSink[sink_row, head, entry]
        return sink

    @cute.jit
    def epilogue(self, acc_o, softmax: OnlineSoftmax, mO, mO_rows, mLSE, sO, tma_o, tiled_mma_pv, thr_pv,
                 wg, wg_tidx, m_block, head, batch, row_start, bounds: SeqBounds, sink=None):
        D = self.head_dim
        out_scale, lse = softmax.finalize(sink)
        scale_rows(acc_o, out_scale)

        # LSE: the lane holding column 0 of a row writes it
        tOcO = acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((64, D))))
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = row_start + tOcO[r, 0][0]
                if row < bounds.seqlen_q:
                    lse_row, entry = bounds.q_index(row, batch)
                    mLSE[lse_row, head, entry] = lse[r]

        # O: registers -> this WG's O slab in smem -> TMA store
        rO = cute.make_rmem_tensor_like(acc_o, self.dtype)
        convert_to_16bit(acc_o, rO)
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma_pv).get_slice(wg_tidx)
        cute.copy(thr_store, thr_store.retile(rO), thr_store.partition_D(sO))
        cute.arch.fence_view_async_shared()  # smem writes visible to the TMA unit
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE + wg, number_of_threads=128)
        if const_expr(self.ragged and self.gathered_rows):  # packed (token, head) rows: no whole tiles
            store_rows(sO, bounds.q_rows(mO_rows, head, batch), bounds.seqlen_q - row_start, wg_tidx, 128, row_start)
        elif const_expr(self.ragged):
            # rows past the entry's end are not its own: plain stores, row by row
            gO = cute.local_tile(bounds.q_rows(mO_rows, head, batch), (64, D), (m_block * self.num_wg + wg, 0))
            store_rows(sO, gO, bounds.seqlen_q - row_start, wg_tidx, 128)
        elif const_expr(self.gathered_rows):
            store_rows(sO, mO_rows[None, None, head, batch], bounds.seqlen_q - row_start, wg_tidx, 128, row_start)
        else:
            if wg_tidx < 32:
                gO = cute.local_tile(mO[None, None, head, batch], (64, D), (None, 0))
                tOsO, tOgO = self._tma_views(tma_o, sO, gO)
                cute.copy(tma_o, tOsO, tOgO[None, m_block * self.num_wg + wg])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # the slab may be rewritten (next O, or next Q when shared) once the store has read it
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE + wg, number_of_threads=128)



# ---------------------------------------------------------------------- family


def build(spec: KernelSpec):
    dtype = _CUTE_DTYPE[spec["dtype"]]
    head_dim, causal = spec["head_dim"], spec["causal"]
    kernel = FlashFwdSm90(dtype, head_dim, causal, FwdConfig(*spec["config"]), spec["local"], spec["softcap"],
                          spec["rows"], spec["attn_mask"], spec["split_kv"], spec.get("rows_per_query", 1),
                          spec.get("bounded_scores", False), spec.get("sink", False), spec.get("page_rows", 0))

    def bhsd(elem):
        # (B, S, H, D), any strides but the last; 16-byte aligned rows for TMA
        align = 128 // elem.width
        stride = tuple(cute.sym_int64(divisibility=align) for _ in range(3)) + (1,)
        shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim)
        return cute.runtime.make_fake_tensor(elem, shape, stride, assumed_align=16)

    lse = cute.runtime.make_fake_tensor(
        Float32,
        (cute.sym_int32(), cute.sym_int32(), cute.sym_int32()),
        (cute.sym_int64(), cute.sym_int64(), 1),
        assumed_align=4,
    )
    # the sinks as lse's shape sees them: a (H_q,) vector with zero strides on the rest
    sink = cute.runtime.make_fake_tensor(
        Float32, (cute.sym_int32(), cute.sym_int32(), cute.sym_int32()),
        (cute.sym_int64(), cute.sym_int64(), cute.sym_int64()), assumed_align=4)
    counter = cute.runtime.make_fake_compact_tensor(Int32, (1,), assumed_align=4)
    # the row bounds of a packed or padded variant; a dense one is passed a placeholder it never reads
    cu_seqlens = lambda: cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    fake_args = (bhsd(dtype), bhsd(dtype), bhsd(dtype), bhsd(dtype), lse, counter, cu_seqlens(), cu_seqlens(),
                 Int32(0), Int32(0), *mask_fakes(spec["attn_mask"], dtype), 1.0, Int32(0), Int32(0),
                 Float32(1.0),
                 132, stream, *split_fakes(head_dim), sink)
    return kernel, fake_args
