"""FlashAttention-3 style attention backward for Hopper (sm_90a), in the CuTe DSL.

One compiled function runs three kernels on the current stream:

1. preprocess (flash_bwd_rows.py): ``delta = rowsum(dO * O)`` and ``lse * log2(e)`` (fp32,
   (B, H, S_q) padded to whole query blocks so that TMA can load them);
2. main kernel, one CTA per (key block, kv head, batch):
   * warpgroup 0, warp 0 (24 registers after ``setmaxnreg``): TMA producer. It loads
     the K and V tiles once (they stay resident in smem), then streams the Q tiles with
     their lse slice and the dO tiles with their delta slice, for every query head of the
     GQA group, through two ``num_stages`` pipelines;
   * warpgroups 1-2 (240 registers) recompute ``P = exp2(S * scale * log2 e - lse * log2 e)``
     and ``dS = P (dP - delta)`` from WGMMAs ``S = Q K^T`` and ``dP = dO V^T``, then
     ``dV += P^T dO``, ``dK += dS^T Q`` (fp32 accumulators in registers for the whole CTA)
     and ``dQ = dS K``. With 128-key blocks (head dims 64-128) S and dP are computed
     transposed, keys along WGMMA's M, so that each warpgroup holds P^T and dS^T of its
     own 64 keys in registers: dV and dK take them as register A operands, and only dS
     goes through smem (stmatrix), for dQ. With 64-key blocks (head dims 192, 256) P and
     dS both go through smem. Each warpgroup writes its half of the dQ tile to smem and
     moves on; causal blocks above the diagonal are never loaded nor computed;
   * warps 1 and 2 (one per MMA warpgroup): add each dQ tile to the fp32 accumulator in
     global memory with one 1-D bulk reduce-add (``cp.reduce.async.bulk``), handing the
     smem tile back through a pair of named barriers. The tile travels in accumulator
     order (each thread's values in 16-byte groups, a warp's groups contiguous: vector
     stores without bank conflicts, one base address), and the accumulator keeps that
     order: a (B, H, query block, warpgroup, tile) buffer that the postprocess puts back;
3. postprocess (flash_bwd_rows.py): scale the fp32 dQ accumulator by the softmax scale,
   convert it to the input dtype and put each value back at its (row, col) through a
   shared-memory tile, whose rows leave in 16-byte vectors.

Determinism: dK and dV are deterministic (a CTA owns its key block and loops over the
query heads of its kv head in a fixed order, so GQA needs no atomics); dQ's adds, their order
and the query-block walk are in flash_bwd_dq.py.
Extra memory: delta and lse * log2(e) (2 x B*H*S_q fp32, padded) and the dQ accumulator
(B*S_q*H*D fp32, S_q padded to whole query blocks; zeroed by the preprocess).
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from ...runtime.attention import STAT_PAD as _STAT_PAD, bwd_keys_in_rows
from ...runtime.spec import KernelSpec
from ..common.flash_common import (
    LOG2_E, acc_as_rows_cols, convert_to_16bit, swizzled_smem_layout, tiled_wgmma, transposed_view, warpgroup_gemm,
)
from ..common.mask import (
    BLOCK_BITS, BLOCK_FULL, apply_attn_mask, apply_mask_words, apply_softcap, load_mask_words, mask_scores,
    query_block_range,
)
from ..common.mask_args import mask_fakes
from ..common.seqlen import SeqBounds, seq_major, store_rows
from .flash_bwd_dq import DqAccumulation, hand_dq_to_writer, next_query_block
from .flash_bwd_rows import FlashBwdRowKernels, accumulator_order

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


_NUM_MMA_THREADS = 256  # two consumer warpgroups
_SMEM_BYTES = 227 * 1024  # shared memory a CTA may opt into on sm_90
# per-query statistics are padded to a multiple of every tile_m (and of 16 bytes for TMA)
_PRODUCER_REGS = 24
_MMA_REGS = 240
# named barriers (0 is __syncthreads)
_BAR_MMA = 1  # both MMA warpgroups: P/dS ready, P/dS free, epilogue


@cute.jit
def _to_dtype(acc: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
    frag = cute.make_rmem_tensor_like(acc, dtype)
    convert_to_16bit(acc, frag)
    return frag


class FlashBwdSm90(DqAccumulation):
    """The three kernels and their host function for one (dtype, head_dim, causal)."""

    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int, tile_n: int,
                 num_stages: int, local: bool = False, softcap: bool = False, rows: str = "dense",
                 attn_mask: str = "none", deterministic: bool = False, sink: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.local = local  # a (left, right) window, runtime bounds (see mask.KeyRange)
        self.softcap = softcap  # soft-capped scores (runtime cap value), d tanh kept per score
        # where each batch entry's rows are: dense, packed (varlen) or padded (common.seqlen);
        # packed, the fp32 statistics and the dQ accumulator live in per-sequence padded rows
        self.rows = rows
        self.ragged = rows != "dense"
        # PyTorch's attn_mask ("bool" or "add"itive), read in the blocks its summary says partial
        self.attn_mask = attn_mask
        self.masked = attn_mask != "none"
        self.deterministic = deterministic  # dQ added in a fixed key-block order (see the docstring)
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.dq_cols = head_dim // 2  # each MMA warpgroup owns half of the dQ columns
        self.dq_chunk = tile_m * self.dq_cols  # one warpgroup's dQ tile, fp32
        # pre/postprocess; with attention sinks the preprocess also forms the sinks' gradient (the
        # main kernel is the same: the forward's lse already holds the sink, so P is right)
        self.row_kernels = FlashBwdRowKernels(dtype, head_dim, tile_m, rows, sink)
        # With two 64-key halves per block, S and dP are computed transposed (S^T = K Q^T,
        # keys along WGMMA's M): each warpgroup then holds P^T and dS^T of its own keys in
        # registers, exactly the A operands of dV += P^T dO and dK += dS^T Q, and only dS
        # goes through smem (for dQ). Narrower key blocks split S by keys along N instead.
        self.swap_sdp = bwd_keys_in_rows(tile_n)
        # 128 query rows: S^T, dP^T (64 fp32 each), P^T (32) and dK, dV (64) fill the 240
        # registers, so dV's WGMMA waits until dS is formed instead of overlapping it (its
        # register operand in flight made ptxas serialize the WGMMAs)
        self.dv_after_ds = self.swap_sdp and tile_m == 128
        # dK, dV tile (tile_n, head_dim) split over the two MMA warpgroups
        self.dkv_atoms = (2, 1) if self.swap_sdp else (1, 2)
        # One Q / dO stage (head dim 256): the next block's loads wait for this block's last
        # GEMM on them, so dK goes before dQ and the loads run under dQ's GEMM and its store.
        # With two stages dQ goes first and its store runs under dK's GEMM instead.
        self.dq_last = num_stages == 1
        # a full backward's key blocks start their walks at different query blocks (flash_bwd_dq.py
        # says why, and where ordered adds may)
        self.rotate = not (causal or local or self.masked) and rows == "dense"
        # ordered adds over walks in step: a head's key blocks launch among other heads' (same file;
        # the host passes one head at a time where a mask staggers the walks)
        self.interleave_heads = deterministic and not (causal or local) and rows == "dense"
        self.pds_stages = self._pds_stages()

    def _pds_stages(self) -> int:
        """P and dS buffers (one per Q stage where shared memory holds them, else one, which a
        barrier then guards): K, V, the Q and dO stages and the fp32 dQ tiles come first."""
        elem = self.dtype.width // 8
        fixed = (elem * (2 * self.num_stages * self.tile_m * self.head_dim + 2 * self.tile_n * self.head_dim)
                 + 4 * self.tile_m * self.head_dim + 2 * 4 * self.tile_m * self.num_stages)
        per_stage = elem * self.tile_m * self.tile_n * (1 if self.swap_sdp else 2)
        return self.num_stages if fixed + self.num_stages * per_stage <= _SMEM_BYTES else 1

    # ---------------------------------------------------------------- host side
    def _make_mmas(self):
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN

        sources = warpgroup.OperandSource
        tiled = partial(tiled_wgmma, self.dtype)

        swap = self.swap_sdp
        if swap:  # S^T = K Q^T and dP^T = V dO^T: (tile_n, tile_m), warpgroups split the keys
            mma_sdp = tiled(k_major, k_major, (self.tile_n, self.tile_m), (2, 1))
        else:  # S = Q K^T and dP = dO V^T: (tile_m, tile_n), warpgroups split the keys
            mma_sdp = tiled(k_major, k_major, (self.tile_m, self.tile_n), (1, 2))
        # dV = P^T dO and dK = dS^T Q: (tile_n, head_dim); P^T, dS^T from registers or smem
        dkv_tile = (self.tile_n, self.head_dim)
        if swap:
            mma_dkv = tiled(k_major, mn_major, dkv_tile, self.dkv_atoms, sources.RMEM)
        else:
            mma_dkv = tiled(mn_major, mn_major, dkv_tile, self.dkv_atoms)
        # dQ = dS K: (tile_m, head_dim), warpgroups split the head dim; dS is stored as the
        # accumulator holds it, so it is MN-major when S was computed transposed
        mma_dq = tiled(mn_major if swap else k_major, mn_major, (self.tile_m, self.head_dim), (1, 2))
        return mma_sdp, mma_dkv, mma_dq

    @cute.jit
    def __call__(self, mdO: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mDelta: cute.Tensor, mLSElog2: cute.Tensor,
                 mdQacc: cute.Tensor, mDqOrder: cute.Tensor, mDqTurns: cute.Tensor, dq_interleave: Int32,
                 mSeqInfoQ: cute.Tensor, mSeqInfoK: cute.Tensor,
                 max_seqlen_q: Int32, max_seqlen_k: Int32, mMask: cute.Tensor, mMaskBits: cute.Tensor,
                 mMaskBlocks: cute.Tensor,
                 mMaskRange: cute.Tensor, softmax_scale: Float32, window_left: Int32,
                 window_right: Int32, softcap: Float32, stream, mSink: cute.Tensor, mdSink: cute.Tensor):
        # per batch entry: its query rows, padded to whole query blocks for the statistics
        # (pad: delta 0, lse +inf), and its key rows
        batch, seqlen_q, padded_q, seqlen_k = mQ.shape[0], mQ.shape[1], mDelta.shape[2], mK.shape[1]
        if const_expr(self.rows == "packed"):
            batch = SeqBounds.num_entries(batch, mSeqInfoQ, self.rows)
            seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
            padded_q = cute.ceil_div(max_seqlen_q, _STAT_PAD) * _STAT_PAD
        heads, keys_extent = cute.size(mQ.shape[2]), mK.shape[1]
        rows = self.row_kernels
        rows.preprocess(mO, mdO, mLSE, mDelta, mLSElog2, mdQacc, mSeqInfoQ, mSeqInfoK, keys_extent, mSink,
                        mdSink).launch(
            grid=(cute.ceil_div(padded_q * heads, rows.rows_per_cta), batch, 1),
            block=[rows.row_threads, 1, 1], stream=stream)
        self._launch_main(mdO, mQ, mK, mV, mLSElog2, mdK, mdV, mDelta, mdQacc, (mDqOrder, mDqTurns, dq_interleave),
                          mSeqInfoQ, mSeqInfoK,
                          (mMask, mMaskBits, mMaskBlocks, mMaskRange), batch, seqlen_k, softmax_scale, window_left,
                          window_right, softcap, stream)
        rows.postprocess(mdQacc, mdQ, mSeqInfoQ, mSeqInfoK, keys_extent, softmax_scale,
                         self._make_mmas()[2]).launch(
            grid=(cute.ceil_div(seqlen_q, self.tile_m), heads, batch),
            block=[rows.post_threads, 1, 1], smem=rows.postprocess_smem_bytes(), stream=stream, use_pdl=True)

    @cute.jit
    def _launch_main(self, mdO, mQ, mK, mV, mLSElog2, mdK, mdV, mDelta, mdQacc, dq_order, mSeqInfoQ, mSeqInfoK,
                     mask_args, batch, seqlen_k, softmax_scale, window_left, window_right, softcap, stream):
        # (B, S, H, D) -> (S, D, H, B): TMA tiles over (S, D); (B, H, S) -> (S, H, B)
        mQ, mK, mV, mdO, mdK, mdV = [seq_major(t) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSElog2, mDelta = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
                            for t in (mLSElog2, mDelta)]
        mma_sdp, mma_dkv, mma_dq = self._make_mmas()

        # Q, dO: MN-major B of dK/dV; K: MN-major B of dQ
        sQ_layout = swizzled_smem_layout(self.dtype, self.tile_m, self.head_dim, self.num_stages,
                                         self.head_dim // self.dkv_atoms[1])
        sdO_layout = sQ_layout
        sKV_layout = swizzled_smem_layout(self.dtype, self.tile_n, self.head_dim, None, self.dq_cols)
        # P and dS as their accumulators hold them, one buffer per Q stage, so that writing
        # block i+1's never waits for the other warpgroup's block-i GEMMs (with one stage a
        # barrier orders them). Transposed, only dS is stored: the A of dQ, MN-major.
        if const_expr(self.swap_sdp):
            sdS_layout = swizzled_smem_layout(self.dtype, self.tile_n, self.tile_m, self.pds_stages, self.tile_m)
            sP_layout = sdS_layout  # never allocated: P stays in registers
        else:
            pds_slice = self.tile_n // self.dkv_atoms[0]
            sP_layout = swizzled_smem_layout(self.dtype, self.tile_m, self.tile_n, self.pds_stages, pds_slice)
            sdS_layout = sP_layout
        # lse * log2(e) with Q, delta with dO: one query block per stage
        sStat_layout = cute.make_layout((self.tile_m, self.num_stages))
        # fp32 dQ tile of each warpgroup, in accumulator order (see _consume)
        sdQ_layout = cute.make_layout((self.dq_chunk, 2))

        g2s, s2g = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        q_tile = (self.tile_m, self.head_dim)
        kv_tile = (self.tile_n, self.head_dim)
        tma_Q, gmem_Q = cpasync.make_tiled_tma_atom(g2s, mQ, cute.select(sQ_layout, mode=[0, 1]), q_tile)
        tma_dO, gmem_dO = cpasync.make_tiled_tma_atom(g2s, mdO, cute.select(sdO_layout, mode=[0, 1]), q_tile)
        tma_K, gmem_K = cpasync.make_tiled_tma_atom(g2s, mK, sKV_layout, kv_tile)
        tma_V, gmem_V = cpasync.make_tiled_tma_atom(g2s, mV, sKV_layout, kv_tile)
        tma_dK, gmem_dK = cpasync.make_tiled_tma_atom(s2g, mdK, sKV_layout, kv_tile)
        tma_dV, gmem_dV = cpasync.make_tiled_tma_atom(s2g, mdV, sKV_layout, kv_tile)
        stat_tile = cute.make_layout(self.tile_m)
        tma_LSE, gmem_LSE = cpasync.make_tiled_tma_atom(g2s, mLSElog2, stat_tile, (self.tile_m,))
        tma_Delta, gmem_Delta = cpasync.make_tiled_tma_atom(g2s, mDelta, stat_tile, (self.tile_m,))

        dtype, stages, stat_size = self.dtype, self.num_stages, cute.cosize(sStat_layout)
        p_size = 0 if const_expr(self.swap_sdp) else cute.cosize(sP_layout)

        @cute.struct
        class SharedStorage:
            kv_bar: cute.struct.MemRange[cutlass.Int64, 2]
            q_bar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            do_bar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, stat_size], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, stat_size], 128]
            if const_expr(p_size > 0):
                sP: cute.struct.Align[cute.struct.MemRange[dtype, p_size], 1024]

        # a Q (dO) stage's barrier counts the tile and its lse (delta) slice
        self.q_bytes = (cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
                        + self.tile_m * Float32.width // 8)
        self.kv_bytes = cute.size_in_bytes(self.dtype, sKV_layout)

        grid = (cute.ceil_div(seqlen_k, self.tile_n), cute.size(mK.shape[2]), batch)
        self._main_kernel(
            tma_Q, tma_dO, tma_K, tma_V, tma_dK, tma_dV, tma_LSE, tma_Delta,
            gmem_Q, gmem_dO, gmem_K, gmem_V, gmem_dK, gmem_dV, mdQacc, *dq_order, gmem_LSE, gmem_Delta,
            mdK, mdV, mSeqInfoQ, mSeqInfoK, *mask_args, 1.0 / softmax_scale,
            mma_sdp, mma_dkv, mma_dq,
            sQ_layout, sKV_layout, sP_layout, sdS_layout, sdQ_layout, sStat_layout,
            *self._softmax_scales(softmax_scale, softcap), softmax_scale, window_left, window_right, SharedStorage,
        ).launch(grid=grid, block=[128 + _NUM_MMA_THREADS, 1, 1],
                 smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1, use_pdl=True)

    def _softmax_scales(self, softmax_scale: Float32, softcap: Float32):
        """(scale_log2 that recomputes P with exp2, scale of the scores before tanh when capped)."""
        if const_expr(self.softcap):
            return softcap * LOG2_E, softmax_scale / softcap
        return softmax_scale * LOG2_E, softmax_scale

    # ---------------------------------------------------------------- main kernel
    @cute.kernel
    def _main_kernel(
        self,
        tma_Q: cute.CopyAtom, tma_dO: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom,
        tma_dK: cute.CopyAtom, tma_dV: cute.CopyAtom,
        tma_LSE: cute.CopyAtom, tma_Delta: cute.CopyAtom,
        mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
        mdK: cute.Tensor, mdV: cute.Tensor,
        mdQacc: cute.Tensor,  # (B, H, query blocks, warpgroup, tile) fp32, accumulator order
        mDqOrder: cute.Tensor,  # deterministic: (B, H, query blocks, warpgroup) int32 add counts
        mDqTurns: cute.Tensor,  # deterministic with a mask: (B, H_kv, key blocks, query blocks) turns
        dq_interleave: Int32,  # deterministic: heads whose key blocks' launches interleave
        mLSElog2: cute.Tensor, mDelta: cute.Tensor,
        mdK_rows: cute.Tensor, mdV_rows: cute.Tensor,  # dK, dV as plain gmem: the ragged store
        mSeqInfoQ: cute.Tensor, mSeqInfoK: cute.Tensor,
        mMask: cute.Tensor, mMaskBits: cute.Tensor, mMaskBlocks: cute.Tensor, mMaskRange: cute.Tensor,
        inv_scale: Float32,
        mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,  # unused when P stays in registers (swap_sdp)
        sdS_layout: cute.ComposedLayout, sdQ_layout: cute.Layout,
        sStat_layout: cute.Layout,
        scale_log2: Float32, cap_scale: Float32, softmax_scale: Float32, window_left: Int32, window_right: Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, kv_head, batch = self._launch_coords(dq_interleave)
        if warp_idx == 0:
            for atom in (tma_Q, tma_dO, tma_K, tma_V, tma_dK, tma_dV, tma_LSE, tma_Delta):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        swizzled = [("sQ", sQ_layout), ("sdO", sQ_layout), ("sK", sKV_layout),
                    ("sV", sKV_layout), ("sdS", sdS_layout)]
        if const_expr(not self.swap_sdp):
            swizzled.append(("sP", sP_layout))
        smem = {name: getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)
                for name, layout in swizzled}
        smem["sdQ"] = storage.sdQ.get_tensor(sdQ_layout)
        smem["sLSE"] = storage.sLSE.get_tensor(sStat_layout)
        smem["sDelta"] = storage.sDelta.get_tensor(sStat_layout)

        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # PipelineTmaAsync releases with one arrive per consumer warp
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, _NUM_MMA_THREADS // 32)
        make = lambda bar, stages, tx: pipeline.PipelineTmaAsync.create(
            barrier_storage=bar.data_ptr(), num_stages=stages, producer_group=producer,
            consumer_group=consumers, tx_count=tx, defer_sync=True)
        pipe_kv = make(storage.kv_bar, 1, 2 * self.kv_bytes)
        pipe_q = make(storage.q_bar, self.num_stages, self.q_bytes)
        pipe_do = make(storage.do_bar, self.num_stages, self.q_bytes)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        bounds = SeqBounds(batch, mQ.shape[0], mK.shape[0], mSeqInfoQ, mSeqInfoK, self.rows, _STAT_PAD)
        group = mQ.shape[2] // mK.shape[2]
        m_block_min, m_block_max = self._m_block_range(n_block, bounds.seqlen_q, bounds.seqlen_k,
                                                       window_left, window_right)
        if const_expr(self.masked):  # the query blocks the attn_mask leaves live for this key block
            m_block_min = mMaskRange[batch, kv_head, n_block, 0]
            m_block_max = mMaskRange[batch, kv_head, n_block, 1]

        # a ragged grid covers the longest entry's key blocks: the others' CTAs leave at once
        if self._block_has_keys(n_block, bounds):
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
                if warp_idx == 0:
                    self._produce((tma_Q, tma_LSE), (tma_dO, tma_Delta), tma_K, tma_V,
                                  (mQ, mLSElog2), (mdO, mDelta), mK, mV, smem,
                                  pipe_kv, pipe_q, pipe_do, n_block, kv_head, batch, group,
                                  m_block_min, m_block_max, bounds)
                elif warp_idx <= 2:
                    self._write_dq(mdQacc, (mDqOrder, mDqTurns), smem["sdQ"], warp_idx - 1, n_block, kv_head,
                                   batch, group, m_block_min, m_block_max, bounds, window_left, window_right)
            else:
                cute.arch.setmaxregister_increase(_MMA_REGS)
                self._consume(mdK, mdV, mdK_rows, mdV_rows, tma_dK, tma_dV,
                              mma_sdp, mma_dkv, mma_dq, smem, pipe_kv, pipe_q, pipe_do,
                              scale_log2, cap_scale, softmax_scale, n_block, kv_head, batch, group,
                              m_block_min, m_block_max, bounds, window_left, window_right,
                              (mMask, mMaskBits, mMaskBlocks, inv_scale))

    def _block_has_keys(self, n_block, bounds: SeqBounds):
        if const_expr(self.ragged):
            return n_block * self.tile_n < bounds.seqlen_k
        return True

    def _m_block_range(self, n_block: Int32, seqlen_q, seqlen_k, window_left: Int32, window_right: Int32):
        """Query blocks that see key block ``n_block``: ``(m_block_min, m_block_max)``."""
        return query_block_range(n_block, seqlen_q, seqlen_k, window_left, window_right, self.tile_m, self.tile_n,
                                 self.causal, self.local)

    @cute.jit
    def _produce(self, tma_q, tma_do, tma_K, tma_V, m_q, m_do, mK, mV, smem,
                 pipe_kv, pipe_q, pipe_do, n_block, kv_head, batch, group,
                 m_block_min, m_block_max, bounds: SeqBounds):
        """K and V once; then per query block, Q with its lse slice and dO with its delta
        slice (tma_q, m_q: the (tile, stat) atoms and tensors of each stream)."""
        kv_tile = (self.tile_n, self.head_dim)
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(state_kv)
        for atom, mX, sX in ((tma_K, mK, smem["sK"]), (tma_V, mV, smem["sV"])):
            gX = cute.local_tile(bounds.k_rows(mX, kv_head, batch), kv_tile, (n_block, 0))
            tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                               cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
            cute.copy(atom, tXgX, tXsX, tma_bar_ptr=pipe_kv.producer_get_barrier(state_kv))
        # launched early (programmatic dependent launch): K and V are inputs, lse and delta
        # come from the preprocess, whose grid must be done first
        cute.arch.griddepcontrol_wait()

        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        m_first = self._first_query_block(n_block, m_block_min, m_block_max, bounds)
        for g in cutlass.range(group, unroll=1):
            head = kv_head * group + g
            q_views = self._stream_views(tma_q, m_q, smem["sQ"], smem["sLSE"], head, batch, bounds)
            do_views = self._stream_views(tma_do, m_do, smem["sdO"], smem["sDelta"], head, batch, bounds)
            m_block = m_first
            for _ in cutlass.range(m_block_max - m_block_min, unroll=1):
                self._load_stage(tma_q, q_views, pipe_q, state_q, m_block)
                state_q.advance()
                self._load_stage(tma_do, do_views, pipe_do, state_do, m_block)
                state_do.advance()
                m_block = next_query_block(head, m_block, m_first, m_block_min, m_block_max)[1]

    @cute.jit
    def _stream_views(self, atoms, tensors, sX, sStat, head, batch, bounds: SeqBounds):
        """TMA views (smem stages, gmem blocks) of a (B, S, H, D) tile stream and its
        (B, H, S) per-row statistic, for one head."""
        (tma_X, tma_stat), (mX, mStat) = atoms, tensors
        gX = cute.local_tile(bounds.q_rows(mX, head, batch), (self.tile_m, self.head_dim), (None, 0))
        gStat = cute.local_tile(bounds.padded_stat(mStat, head, batch), (self.tile_m,), (None,))
        tXsX, tXgX = cpasync.tma_partition(tma_X, 0, cute.make_layout(1),
                                           cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tSsS, tSgS = cpasync.tma_partition(tma_stat, 0, cute.make_layout(1),
                                           cute.group_modes(sStat, 0, 1), cute.group_modes(gStat, 0, 1))
        return tXsX, tXgX, tSsS, tSgS

    @cute.jit
    def _load_stage(self, atoms, views, pipe, state, m_block):
        (tma_X, tma_stat), (tXsX, tXgX, tSsS, tSgS) = atoms, views
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        cute.copy(tma_X, tXgX[None, m_block], tXsX[None, state.index], tma_bar_ptr=bar)
        cute.copy(tma_stat, tSgS[None, m_block], tSsS[None, state.index], tma_bar_ptr=bar)

    @cute.jit
    def _by_query(self, tScS: cute.Tensor):
        """(query, [(row, col), ...]) for each query this thread's S fragment touches: its
        rows, or its columns when S is transposed. A statistic is loaded from smem once per
        query, next to its use (loaded ahead, they would all be live at once)."""
        rows, cols = cute.size(tScS, mode=[0]), cute.size(tScS, mode=[1])
        if const_expr(self.swap_sdp):
            return [(tScS[0, c][1], [(r, c) for r in range(rows)]) for c in range(cols)]
        return [(tScS[r, 0][0], [(r, c) for c in range(cols)]) for r in range(rows)]

    @cute.jit
    def _operand_fragments(self, mma_sdp, mma_dkv, mma_dq, smem, wg_idx, tidx):
        """The WGMMA operands of one MMA warpgroup (smem descriptors; with swap_sdp, the layout of
        P^T and dS^T as register-sourced A operands instead of their smem copies)."""
        sQ, sdO, sK, sV, sdS = smem["sQ"], smem["sdO"], smem["sK"], smem["sV"], smem["sdS"]
        swap = self.swap_sdp
        a_regs = tdVrPt = tdKrdSt = None
        # Transposed (swap), K and V are the A operands of S^T and dP^T and the staged Q and dO
        # the B operands.
        wg_sdp = mma_sdp.get_slice(wg_idx * 128)
        if const_expr(swap):
            tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
            tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
            tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
            tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        else:
            tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
            tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
            tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
            tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        wg_dkv = mma_dkv.get_slice(wg_idx * 128)
        tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed_view(sdO)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed_view(sQ)))
        if const_expr(swap):
            # P^T and dS^T as A operands from registers: the 16-bit copies of the S^T and
            # dP^T accumulators, whose C layout holds the A layout's registers in order
            thr_dkv = mma_dkv.get_slice(tidx)
            a_regs = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((self.tile_n, self.tile_m))).layout
        else:
            sP = smem["sP"]
            tdVrPt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed_view(sP)))
            tdKrdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed_view(sdS)))
        wg_dq = mma_dq.get_slice(wg_idx * 128)
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(transposed_view(sdS) if const_expr(swap) else sdS))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transposed_view(sK)))
        return tSrQ, tSrK, tdPrdO, tdPrV, tdVrdOt, tdKrQt, a_regs, tdVrPt, tdKrdSt, tdQrdS, tdQrKt

    @cute.jit
    def _consume(self, mdK, mdV, mdK_rows, mdV_rows, tma_dK, tma_dV,
                 mma_sdp, mma_dkv, mma_dq, smem, pipe_kv, pipe_q, pipe_do,
                 scale_log2, cap_scale, softmax_scale, n_block, kv_head, batch, group,
                 m_block_min, m_block_max, bounds: SeqBounds, window_left, window_right, user_mask):
        seqlen_q, seqlen_k = bounds.seqlen_q, bounds.seqlen_k
        tidx = cute.arch.thread_idx()[0] - 128
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        swap = self.swap_sdp
        sK, sV = smem["sK"], smem["sV"]
        sdS, sdQ, sLSE, sDelta = smem["sdS"], smem["sdQ"], smem["sLSE"], smem["sDelta"]

        (tSrQ, tSrK, tdPrdO, tdPrV, tdVrdOt, tdKrQt, a_regs, tdVrPt, tdKrdSt, tdQrdS,
         tdQrKt) = self._operand_fragments(mma_sdp, mma_dkv, mma_dq, smem, wg_idx, tidx)

        # accumulators
        sdp_tile = (self.tile_n, self.tile_m) if const_expr(swap) else (self.tile_m, self.tile_n)
        sdp_shape = mma_sdp.partition_shape_C(sdp_tile)
        acc_S = cute.make_rmem_tensor(sdp_shape, Float32)
        acc_dP = cute.make_rmem_tensor(sdp_shape, Float32)
        dkv_shape = mma_dkv.partition_shape_C((self.tile_n, self.head_dim))
        acc_dV = cute.make_rmem_tensor(dkv_shape, Float32)
        acc_dK = cute.make_rmem_tensor(dkv_shape, Float32)
        acc_dQ = cute.make_rmem_tensor(mma_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # (rows, cols) views of S / P and dP / dS, and of their coordinates in the tile
        acc_S_rc, acc_dP_rc = acc_as_rows_cols(acc_S), acc_as_rows_cols(acc_dP)
        # softcap: d(softcap * tanh(u)) / d(scaled score) = 1 - tanh(u)^2 per score, tanh(u)
        # recovered from P itself (P = exp2(tanh(u) * scale_log2 - lse * log2 e)): one MUFU.LG2
        # per score instead of a second fp32 fragment live from the exp to dS (it spilled)
        inv_scale_log2 = 1.0 / scale_log2 if const_expr(self.softcap) else None
        cS = cute.make_identity_tensor(sdp_tile)
        tScS = acc_as_rows_cols(mma_sdp.get_slice(tidx).partition_C(cS))
        t0ScS = acc_as_rows_cols(mma_sdp.get_slice(0).partition_C(cS))
        # P and dS registers -> smem with stmatrix
        store_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_sdp
        ).get_slice(tidx)
        tdSsdS = store_PdS.partition_D(sdS)
        if const_expr(not swap):
            tPsP = store_PdS.partition_D(smem["sP"])
        # dQ registers -> this warpgroup's fp32 smem tile (columns split across warpgroups), in
        # accumulator order: 16-byte groups, a warp's contiguous
        tdQsdQ = accumulator_order(sdQ[None, wg_idx], tidx % 128, cute.size(acc_dQ))
        tdQrdQ = cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape, stride=(1, 4)))

        by_query = self._by_query(tScS)

        consumer = pipeline.PipelineUserType.Consumer
        pipe_kv.consumer_wait(pipeline.make_pipeline_state(consumer, 1))
        state_q = pipeline.make_pipeline_state(consumer, self.num_stages)
        state_do = pipeline.make_pipeline_state(consumer, self.num_stages)
        offset = seqlen_k - seqlen_q
        last_key = n_block * self.tile_n + self.tile_n - 1
        # One flat loop over (query head of the group, query block). Every WGMMA group is
        # waited for inside its iteration: a WGMMA left in flight across the loop's back edge
        # (issuing the next S early) makes ptxas serialize all of them (C7515), -20% at 16k.
        num_m = m_block_max - m_block_min
        m_first = self._first_query_block(n_block, m_block_min, m_block_max, bounds)
        head, m_block = kv_head * group, m_first
        for _ in cutlass.range(group * num_m, unroll=1):
            q_idx, do_idx = state_q.index, state_do.index
            pds_idx = q_idx if const_expr(self.pds_stages == self.num_stages) else 0
            words = self._mask_words(user_mask, tScS, m_block, n_block, head, batch)  # before the waits
            # S = Q K^T, then dP = dO V^T
            pipe_q.consumer_wait(state_q)
            if const_expr(swap):
                warpgroup_gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, q_idx], True)
            else:
                warpgroup_gemm(mma_sdp, acc_S, tSrQ[None, None, None, q_idx], tSrK, True)
            pipe_do.consumer_wait(state_do)
            if const_expr(swap):
                warpgroup_gemm(mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, do_idx], True)
            else:
                warpgroup_gemm(mma_sdp, acc_dP, tdPrdO[None, None, None, do_idx], tdPrV, True)
            warpgroup.wait_group(1)

            # P = exp2(S * scale * log2(e) - lse * log2(e))
            self._cap_and_mask(acc_S, tScS, t0ScS, cap_scale, m_block, n_block, head, batch, last_key, offset,
                               seqlen_q, seqlen_k, window_left, window_right, user_mask, words)
            for query, coords in by_query:
                lse_log2 = sLSE[query, q_idx]
                for rc in coords:
                    acc_S_rc[rc] = cute.math.exp2(acc_S_rc[rc] * scale_log2 - lse_log2,
                                                  fastmath=True)
            rP = _to_dtype(acc_S, self.dtype)
            if const_expr(swap):
                if const_expr(not self.dv_after_ds):
                    # dV += P^T dO straight from registers, on the tensor cores while dS forms
                    warpgroup_gemm(mma_dkv, acc_dV, cute.make_tensor(rP.iterator, a_regs),
                                   tdVrdOt[None, None, None, do_idx], False)
            else:
                if const_expr(self.pds_stages == 1):
                    # single P/dS buffer: both warpgroups are done with the previous block's
                    cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=_NUM_MMA_THREADS)
                cute.copy(store_PdS, store_PdS.retile(rP), tPsP[None, None, None, pds_idx])

            # dS = P * (dP - delta)
            # dP done (dV still in flight where it overlaps dS)
            warpgroup.wait_group(1 if const_expr(swap and not self.dv_after_ds) else 0)
            self._dscores(acc_S_rc, acc_dP_rc, by_query, sDelta, sLSE, q_idx, do_idx, inv_scale_log2)
            rdS = _to_dtype(acc_dP, self.dtype)
            if const_expr(swap and self.pds_stages == 1):
                # single dS buffer: the other warpgroup's dQ of the previous block read it
                cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=_NUM_MMA_THREADS)
            cute.copy(store_PdS, store_PdS.retile(rdS), tdSsdS[None, None, None, pds_idx])
            cute.arch.fence_proxy("async.shared", space="cta")
            # dQ = dS K (and dV from smem P) read the columns of both warpgroups
            cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=_NUM_MMA_THREADS)

            if const_expr(swap and self.dv_after_ds):
                warpgroup_gemm(mma_dkv, acc_dV, cute.make_tensor(rP.iterator, a_regs),
                               tdVrdOt[None, None, None, do_idx], False)
            if const_expr(not swap):
                warpgroup_gemm(mma_dkv, acc_dV, tdVrPt[None, None, None, pds_idx],
                               tdVrdOt[None, None, None, do_idx], False)
            # dQ = dS K, dK += dS^T Q
            if const_expr(not self.dq_last):
                warpgroup_gemm(mma_dq, acc_dQ, tdQrdS[None, None, None, pds_idx], tdQrKt, True)
            if const_expr(swap):
                warpgroup_gemm(mma_dkv, acc_dK, cute.make_tensor(rdS.iterator, a_regs),
                               tdKrQt[None, None, None, q_idx], False)
            else:
                warpgroup_gemm(mma_dkv, acc_dK, tdKrdSt[None, None, None, pds_idx],
                               tdKrQt[None, None, None, q_idx], False)
            if const_expr(self.dq_last):
                warpgroup_gemm(mma_dq, acc_dQ, tdQrdS[None, None, None, pds_idx], tdQrKt, True)
                warpgroup.wait_group(1)  # dV and dK done: the single Q and dO stages are free
                pipe_do.consumer_release(state_do)
                pipe_q.consumer_release(state_q)
                warpgroup.wait_group(0)
            else:
                warpgroup.wait_group(1)  # dV and dQ done, dK still running
                pipe_do.consumer_release(state_do)
            state_do.advance()
            # dQ -> smem, for the writer warp's reduce-add (the postprocess applies the softmax
            # scale once, not once per key block)
            hand_dq_to_writer(tdQrdQ, tdQsdQ, wg_idx)
            if const_expr(not self.dq_last):
                warpgroup.wait_group(0)
                pipe_q.consumer_release(state_q)
            state_q.advance()
            head, m_block = next_query_block(head, m_block, m_first, m_block_min, m_block_max)

        # the postprocess may launch now: it waits for this whole grid before reading dQ
        cute.arch.griddepcontrol_launch_dependents()
        self._store_dkv(acc_dK, acc_dV, softmax_scale, mma_dkv, sK, sV, tma_dK, tma_dV,
                        mdK, mdV, mdK_rows, mdV_rows, tidx, n_block, kv_head, batch, bounds)

    @cute.jit
    def _mask_words(self, user_mask, tScS, m_block, n_block, head, batch):
        """The attn_mask's bits (a bool mask's, an additive one's zeros) for this thread's scores of
        one (query block, key block), loaded as words (``load_mask_words``; None unmasked). The
        mask is packed along the scores' columns: queries where S is computed transposed
        (``swap_sdp``), else keys, which the warpgroups split (the words of this warpgroup's half)."""
        words = None
        if const_expr(self.masked):
            mBits = user_mask[0] if const_expr(self.attn_mask == "bool") else user_mask[1]
            mBits = mBits[batch, head, None, None]
            if const_expr(self.swap_sdp):
                words = load_mask_words(mBits, tScS, n_block * self.tile_n, m_block * self.tile_m, self.tile_m)
            else:
                half = self.tile_n // 2
                own_cols = tScS[0, 0][1] // half * half
                words = load_mask_words(mBits, tScS, m_block * self.tile_m, n_block * self.tile_n + own_cols, half)
        return words

    @cute.jit
    def _cap_and_mask(self, acc_S, tScS, t0ScS, cap_scale, m_block, n_block, head, batch, last_key, offset,
                      seqlen_q, seqlen_k, window_left, window_right, user_mask, words):
        """Scores of one (query block, key block) before the exp: softcap, then the attn_mask's
        values where its block summary says partial (from ``words``, see :meth:`_mask_words`, for a
        bool mask and an additive one's BLOCK_BITS), then -inf outside the band and past the keys
        when the block crosses an edge."""
        mMask, _, mMaskBlocks, inv_scale = user_mask
        if const_expr(self.softcap):  # capped before the mask: masked scores stay -inf
            apply_softcap(acc_S, cap_scale)
        if const_expr(self.masked):  # attn_mask values where the block is not full
            status = mMaskBlocks[batch, head, m_block, n_block]
            if status != BLOCK_FULL:
                if const_expr(self.attn_mask == "bool"):
                    apply_mask_words(acc_S, tScS, t0ScS, words)
                else:
                    if status == BLOCK_BITS:
                        apply_mask_words(acc_S, tScS, t0ScS, words)
                    else:
                        apply_attn_mask(acc_S, tScS, mMask[batch, head, None, None], m_block * self.tile_m,
                                        n_block * self.tile_n, seqlen_q, seqlen_k, True, inv_scale,
                                        keys_in_rows=self.swap_sdp)
        needs_mask = last_key >= seqlen_k
        if const_expr(self.causal):
            needs_mask = needs_mask | (last_key > m_block * self.tile_m + offset)
        if const_expr(self.local):  # the block crosses the band's right or left edge
            needs_mask = needs_mask | (last_key > m_block * self.tile_m + offset + window_right)
            needs_mask = needs_mask | (n_block * self.tile_n < (m_block + 1) * self.tile_m - 1
                                       + offset - window_left)
        if needs_mask:
            mask_scores(acc_S, tScS, t0ScS, m_block * self.tile_m, n_block * self.tile_n,
                        seqlen_q, seqlen_k, self.causal, True, keys_in_rows=self.swap_sdp,
                        local=self.local, left=window_left, right=window_right)

    @cute.jit
    def _dscores(self, acc_S_rc, acc_dP_rc, by_query, sDelta, sLSE, q_idx, do_idx, inv_scale_log2):
        """dP -> dS = P * (dP - delta) in place, per query row (delta and lse from the stages
        ``do_idx`` and ``q_idx``); softcap also multiplies by d(softcap * tanh(u)) / du = 1 - tanh(u)^2, with
        tanh(u) recovered from P (see :meth:`_consume`)."""
        for query, coords in by_query:
            delta = sDelta[query, do_idx]
            if const_expr(self.softcap):
                lse_log2 = sLSE[query, q_idx]
            for rc in coords:
                p = acc_S_rc[rc]
                acc_dP_rc[rc] = p * (acc_dP_rc[rc] - delta)
                if const_expr(self.softcap):
                    # clamped to tanh's range: P = 0 (masked, underflowed, or a row whose
                    # lse is +inf) then gives a finite factor times dS = 0
                    tanh_u = (cute.math.log2(cute.arch.fmax(p, Float32(1e-37)), fastmath=True)
                              + lse_log2) * inv_scale_log2
                    tanh_u = cute.arch.fmin(cute.arch.fmax(tanh_u, Float32(-1.0)), Float32(1.0))
                    acc_dP_rc[rc] = acc_dP_rc[rc] * (1.0 - tanh_u * tanh_u)

    @cute.jit
    def _store_dkv(self, acc_dK, acc_dV, softmax_scale, mma_dkv, sK, sV, tma_dK, tma_dV,
                   mdK, mdV, mdK_rows, mdV_rows, tidx, n_block, kv_head, batch, bounds: SeqBounds):
        """dK (times the softmax scale) and dV -> smem (reusing K and V) -> TMA store."""
        acc_dK.store(acc_dK.load() * softmax_scale)
        rdK = _to_dtype(acc_dK, self.dtype)
        rdV = _to_dtype(acc_dV, self.dtype)
        store = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_dkv
        ).get_slice(tidx)
        # every MMA warpgroup is done reading K and V
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=_NUM_MMA_THREADS)
        cute.copy(store, store.retile(rdK), store.partition_D(sK))
        cute.copy(store, store.retile(rdV), store.partition_D(sV))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=_NUM_MMA_THREADS)
        kv_tile = (self.tile_n, self.head_dim)
        if const_expr(self.ragged):
            # rows past the entry's end are not its own: plain stores, row by row
            for mX, sX in ((mdK_rows, sK), (mdV_rows, sV)):
                gX = cute.local_tile(bounds.k_rows(mX, kv_head, batch), kv_tile, (n_block, 0))
                store_rows(sX, gX, bounds.seqlen_k - n_block * self.tile_n, tidx, _NUM_MMA_THREADS)
        elif tidx < 32:
            for atom, mX, sX in ((tma_dK, mdK, sK), (tma_dV, mdV, sV)):
                gX = cute.local_tile(mX[None, None, kv_head, batch], kv_tile, (n_block, 0))
                tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                   cute.group_modes(sX, 0, 2),
                                                   cute.group_modes(gX, 0, 2))
                cute.copy(atom, tXsX, tXgX)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


# -------------------------------------------------------------------- family / host API
def _bshd(dtype, head_dim):
    """A (B, S, H, D) tensor with any 16-byte aligned strides but a unit last one."""
    sym = lambda: cute.sym_int64(divisibility=8)
    return cute.runtime.make_fake_tensor(
        dtype, (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), head_dim),
        stride=(sym(), sym(), sym(), 1), assumed_align=16)


def build(spec: KernelSpec):
    dtype, head_dim = _DTYPES[spec["dtype"]], spec["head_dim"]
    tile_m, tile_n = spec["tile"]
    kernel = FlashBwdSm90(dtype, head_dim, spec["causal"], tile_m, tile_n, spec["stages"], spec["local"],
                          spec["softcap"], spec["rows"], spec["attn_mask"], spec.get("deterministic", False),
                          spec.get("sink", False))
    bhs = lambda: cute.runtime.make_fake_tensor(
        Float32, (cute.sym_int64(), cute.sym_int64(), cute.sym_int64()),
        stride=(cute.sym_int64(), cute.sym_int64(), cute.sym_int64()), assumed_align=4)
    # delta and lse * log2(e): (B, H, S_q padded to whole query blocks), TMA-loaded
    padded_stat = lambda: cute.runtime.make_fake_compact_tensor(
        Float32, (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(divisibility=_STAT_PAD)),
        stride_order=(2, 1, 0), assumed_align=16)
    # dQ accumulator (B, H, query blocks, warpgroup, tile): warpgroup tiles in accumulator order
    dq_accum = cute.runtime.make_fake_compact_tensor(
        Float32, (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), 2, tile_m * head_dim // 2),
        stride_order=(4, 3, 2, 1, 0), assumed_align=16)
    bshd = lambda: _bshd(dtype, head_dim)
    cu_seqlens = lambda: cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=4)
    fake_args = (
        bshd(), bshd(), bshd(), bshd(), bshd(),  # dout, q, k, v, out
        bhs(),  # lse
        bshd(), bshd(), bshd(),  # dq, dk, dv
        padded_stat(), padded_stat(), dq_accum,
        cute.runtime.make_fake_compact_tensor(  # dQ add order (deterministic variants; else unread)
            Int32, (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), cute.sym_int64()),
            stride_order=(3, 2, 1, 0), assumed_align=4),
        cute.runtime.make_fake_compact_tensor(  # dQ turns (deterministic masked variants; else unread)
            Int32, (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), cute.sym_int64()),
            stride_order=(3, 2, 1, 0), assumed_align=4),
        Int32(1),  # heads interleaved at launch (deterministic variants whose walks are in step)
        cu_seqlens(), cu_seqlens(), Int32(0), Int32(0),  # row bounds (common.seqlen), max_seqlen (q, k)
        *mask_fakes(spec["attn_mask"], dtype),
        Float32(1.0), Int32(0), Int32(0), Float32(1.0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        # the sinks (H_q,) and their gradient, fp32 (sink variants; else unread)
        cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int32(),), assumed_align=4),
        cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int32(),), assumed_align=4),
    )
    return kernel, fake_args
