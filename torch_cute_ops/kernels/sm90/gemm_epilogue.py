"""The sm90 GEMM's epilogue: alpha, rowwise scales, bias and activation on the fp32 accumulator
fragment, and the two ways out of the registers (a mixin of :class:`.gemm.Sm90Gemm`):

* TMA stores (16-bit out): ``stmatrix`` into a small smem ring of ``64k x 32`` subtiles and
  TMA stores from there, the M/N tails clipped by the TMA unit;
* direct stores (fp32 out, swapped operands): each thread stores its values, predicated.
"""

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum

from ..common.activation import gated_activation, input_scale


class TmaStore(NamedTuple):
    """A tile group's path from registers through the smem ring to TMA stores."""
    r2s_copy: Any  # stmatrix of the out dtype
    tRS_sC: Any  # this thread's share of the ring's subtiles
    tRS_rAcc: Any  # the accumulator in stmatrix order
    tRS_rAcc_sub: Any  # one subtile's fp32 values
    tRS_rC: Any  # the same, converted
    store_pipeline: Any
    epi_barrier: Any
    is_store_warp: Any  # the warp that issues the TMA stores


class GemmEpilogue:
    """Epilogue methods of the sm90 GEMM; they read the variant's static configuration
    (dtypes, bias, scales, activation, tile) from the kernel object."""

    def _tma_store_setup(self, tiled_mma, acc, sC, group, group_tidx) -> TmaStore:
        """The registers -> stmatrix -> smem ring -> TMA store path of this tile group."""
        r2s_copy = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, Float32),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.out_dtype), tiled_mma),
        )
        thr_r2s = r2s_copy.get_slice(group_tidx)
        subtile_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_threads),
        )
        epi_barrier = pipeline.NamedBarrier(barrier_id=1 + group, num_threads=self.tile_threads)
        return TmaStore(r2s_copy, thr_r2s.partition_D(sC), r2s_copy.retile(acc),
                        cute.make_rmem_tensor(subtile_shape, Float32),
                        cute.make_rmem_tensor(subtile_shape, self.out_dtype),
                        store_pipeline, epi_barrier, group_tidx // 32 == 0)

    @cute.jit
    def _store_tma(self, tma_store, tma_atom_c, sC, mC_mnl, tile_m_idx, tile_n_idx, row_start, col_start,
                   batch_idx, subtiles_done, group):
        """The tile's subtiles through this group's smem ring and TMA stores; returns the
        ring's running subtile count."""
        r2s_copy, tRS_sC, tRS_rAcc, tRS_rAcc_sub, tRS_rC, store_pipeline, epi_barrier, is_store_warp = tma_store
        tile_m, tile_n, _ = self.tile_shape_mnk
        if cutlass.const_expr(self.shift_rows or self.shift_cols):
            tile_mn = cute.domain_offset((row_start, col_start), mC_mnl[None, None, batch_idx])
            gC_tile = cute.local_tile(tile_mn, (tile_m, tile_n), (0, 0))
        else:
            gC_tile = cute.local_tile(mC_mnl, (tile_m, tile_n), (None, None, None))[
                (None, None, tile_m_idx, tile_n_idx, batch_idx)]
        gC_subtiles = cute.zipped_divide(gC_tile, self.epi_tile)
        tCsC_store, tCgC_store = cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_subtiles,
        )
        subtile_grid = gC_subtiles.shape[1]
        subtile_order = cute.make_layout(subtile_grid, stride=(subtile_grid[1], 1))
        subtile_size = cute.size(tRS_rC)
        for subtile in cutlass.range_constexpr(cute.size(subtile_grid)):
            for v in cutlass.range_constexpr(subtile_size):
                tRS_rAcc_sub[v] = tRS_rAcc[subtile * subtile_size + v]
            tRS_rC.store(tRS_rAcc_sub.load().to(self.out_dtype))
            buffer = group * self.epi_stages + (subtiles_done + subtile) % self.epi_stages
            cute.copy(r2s_copy, tRS_rC, tRS_sC[(None, None, None, buffer)])
            # make the generic-proxy smem writes visible to the TMA unit
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if is_store_warp:
                cute.copy(tma_atom_c, tCsC_store[(None, buffer)],
                          tCgC_store[(None, subtile_order.get_hier_coord(subtile))])
                store_pipeline.producer_commit()
                store_pipeline.producer_acquire()
            # the next write into the ring waits until its buffer's store has read it
            epi_barrier.arrive_and_wait()
        return subtiles_done + cute.size(subtile_grid)

    @cute.jit
    def _column_values(self, tCcC, mBias, mScaleB, col_start, mn_shape, batch_idx) -> tuple:
        """This thread's per-column values of the tile (bias, rowwise scale_b): ({pair: (even
        column's, odd column's)}, same for scale_b), each loaded once and issued before the main
        loop so that their latency hides under it. The fragment's values are ((2 cols, 2 rows,
        n/8 col groups), m, n): a pair of adjacent columns, the first even, is one 32-bit load
        when both are inside N; columns past N read the last column's value (never stored).
        Swapped operands leave the bias to :meth:`_row_bias`."""
        last_col = mn_shape[1] - 1
        bias, scale_b = {}, {}
        for i in cutlass.range_constexpr(cute.size(tCcC)):
            coord = cute.idx2crd(i, tCcC.shape)
            pair = (coord[0][2], coord[2])
            if cutlass.const_expr(coord[0][0] == 0 and coord[0][1] == 0 and coord[1] == 0):
                col = col_start + tCcC[i][1]  # even
                if cutlass.const_expr(self.has_bias and not self.swap_ab):
                    bias[pair] = self._load_pair(mBias, col, last_col)
                if cutlass.const_expr(self.scale_mode == "row"):
                    scale_b[pair] = (mScaleB[0, cutlass.min(col, last_col), batch_idx],
                                     mScaleB[0, cutlass.min(col + 1, last_col), batch_idx])
        return bias, scale_b

    @cute.jit
    def _row_bias(self, tCcC, mBias, row_start, mn_shape) -> dict:
        """Swapped operands: this thread's bias values, one per row of the tile (the fragment's
        rows vary with its 2-row and m modes), loaded once ahead of the main loop and converted
        only in the epilogue. Rows past M read the last row's value (never stored)."""
        last_row = mn_shape[0] - 1
        bias = {}
        if cutlass.const_expr(self.has_bias):
            for i in cutlass.range_constexpr(cute.size(tCcC)):
                coord = cute.idx2crd(i, tCcC.shape)
                if cutlass.const_expr(coord[0][0] == 0 and coord[0][2] == 0 and coord[2] == 0):
                    bias[(coord[0][1], coord[1])] = mBias[cutlass.min(row_start + tCcC[i][0], last_row)]
        return bias

    @cute.jit
    def _load_pair(self, mBias, col, last_col):
        """Bias columns ``col`` (even) and ``col + 1``. A 16-bit bias with an even N (every
        output whose rows TMA stores) loads them as one 32-bit word, past N the last pair, split
        only in the epilogue (:meth:`_bias_pair`): splitting here would wait for the load ahead
        of the main loop. An fp32 bias, or an odd N (a single-row output, its own variant),
        loads the clamped columns one by one."""
        if cutlass.const_expr(self.odd_n or self.bias_dtype.width != 16):
            return mBias[cutlass.min(col, last_col)], mBias[cutlass.min(col + 1, last_col)]
        words = cute.make_tensor(cute.recast_ptr(mBias.iterator, dtype=Int32), cute.make_layout(mBias.shape[0] // 2))
        return words[cutlass.min(col, last_col) // 2]

    @cute.jit
    def _bias_pair(self, loaded) -> tuple:
        """The two fp32 bias values of a :meth:`_load_pair` result."""
        if cutlass.const_expr(self.odd_n or self.bias_dtype.width != 16):
            return Float32(loaded[0]), Float32(loaded[1])
        # little-endian: the even column is the low half. Integer ops, not a 2 x 16-bit view:
        # ptxas would split such a view right after the load, ahead of the main loop
        if cutlass.const_expr(self.bias_dtype == cutlass.BFloat16):  # bf16 is fp32's upper half
            return (loaded << 16).bitcast(Float32), (loaded & Int32(-65536)).bitcast(Float32)
        low, high = cutlass.Int16(loaded & Int32(0xFFFF)), cutlass.Int16(loaded >> 16)
        return Float32(low.bitcast(self.bias_dtype)), Float32(high.bitcast(self.bias_dtype))

    @cute.jit
    def _scale_add_bias(self, acc, alpha, tCcC, column_values, mScaleA, row_start, mn_shape, batch_idx):
        """acc = alpha * acc (* scale_a[row] * scale_b[col] for rowwise scales) (+ bias), the
        per-column values from :meth:`_column_values`, times the activation's ``input_scale``
        (folded into alpha and the bias). Rows past M read the last row's values: those outputs
        are never stored."""
        last_row = mn_shape[0] - 1
        loaded_bias, scale_b = column_values
        if cutlass.const_expr(self.swap_ab):  # one value per row
            bias = {row: (Float32(loaded),) for row, loaded in loaded_bias.items()}
        else:
            bias = {pair: self._bias_pair(loaded) for pair, loaded in loaded_bias.items()}
        k = input_scale(self.activation)
        if cutlass.const_expr(k != 1.0):
            alpha = alpha * k
            bias = {key: tuple(b * k for b in values) for key, values in bias.items()}
        for i in cutlass.range_constexpr(cute.size(acc)):
            coord = cute.idx2crd(i, acc.shape)
            pair, odd = (coord[0][2], coord[2]), coord[0][0]
            scale = alpha
            if cutlass.const_expr(self.scale_mode == "row"):
                row = cutlass.min(row_start + tCcC[i][0], last_row)
                scale = alpha * mScaleA[row, 0, batch_idx] * scale_b[pair][odd]
            if cutlass.const_expr(self.has_bias and self.swap_ab):
                acc[i] = acc[i] * scale + bias[(coord[0][1], coord[1])][0]
            elif cutlass.const_expr(self.has_bias):
                acc[i] = acc[i] * scale + bias[pair][odd]
            else:
                acc[i] = acc[i] * scale

    @cute.jit
    def _store_direct(self, acc, tCcC, mC_mnl, row_start, col_start, batch_idx, row_end=None):
        """fp32 (or swapped 16-bit) out: each thread stores its accumulator values, predicated
        on the M/N tails (``row_end``: a grouped tile's group end instead of M)."""
        num_rows, num_cols = mC_mnl.shape[0], mC_mnl.shape[1]
        if cutlass.const_expr(row_end is not None):
            num_rows = row_end
        for i in cutlass.range_constexpr(cute.size(acc)):
            row = row_start + tCcC[i][0]
            col = col_start + tCcC[i][1]
            if row < num_rows and col < num_cols:
                if cutlass.const_expr(self.out_dtype.width == 32):
                    mC_mnl[row, col, batch_idx] = acc[i]
                else:
                    mC_mnl[row, col, batch_idx] = acc[i].to(self.out_dtype)


    @cute.jit
    def _store_gated(self, acc, tCcC, mC_mnl, row_start, col_start, row_end):
        """A gate/up tile with interleaved columns (gate even, up odd: the two values of each of
        this thread's column pairs) through the gated activation; output column ``c / 2`` of
        each even ``c``, stored predicated on the group's rows and C's columns."""
        activation, alpha, limit, _ = self.gated
        num_cols = mC_mnl.shape[1]
        for i in cutlass.range_constexpr(cute.size(acc)):
            coord = cute.idx2crd(i, acc.shape)
            if cutlass.const_expr(coord[0][0] == 0):  # the even column of a pair; i + 1 is its odd one
                row = row_start + tCcC[i][0]
                col = (col_start + tCcC[i][1]) // 2
                if row < row_end and col < num_cols:
                    value = gated_activation(acc[i], acc[i + 1], activation, alpha, limit)
                    mC_mnl[row, col, 0] = value.to(self.out_dtype)
