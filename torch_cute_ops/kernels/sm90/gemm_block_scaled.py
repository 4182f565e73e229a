"""The sm90 GEMM's main loops under FP8 blockwise scales (a mixin of :class:`.gemm.Sm90Gemm`).

Blockwise scales (1 x 128 blocks of A, 128 x 128 of B) are applied per k-tile: each k-tile's
WGMMA batch accumulates from zero into a k-tile fragment, which is then promoted into the
running accumulator, ``acc += acc_k * scale_a[row] * scale_b[block]`` (one FFMA per value), so
the tensor cores' reduced-precision FP8 accumulation never spans more than 128 of K. The tensor
cores should not wait for a promotion; two schedules see to that:

* two fragments (tiles of 64 or 128 columns, inside one scale block of B): a warpgroup's
  k-tiles take turns between them, one promoted while the next one's batch runs;
* one fragment (128 x 192 tiles: 96 + 96 fp32 registers per thread leave no room for a
  second): the warpgroup waits for its batch before promoting it, and the tile's two
  warpgroups take turns issuing their batches (two named barriers), so one's batch runs while
  the other promotes. A 192-column tile straddles two scale blocks of B, starting on one or
  halfway through it; each column group takes its own block's scale.

The wider tile is about shared memory: per k-tile a warpgroup's WGMMAs read its A rows and all
of B's columns, and TMA writes both; at the FP8 tensor rate a 128 x 128 tile needs 160 B/clk
of the SM's 128, a 128 x 192 tile 138 (bench/NOTES.md).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

SCALE_BLOCK = 128  # the K (and B's N) extent of one blockwise scale
# named barriers of the one-fragment schedule's turns (ids 3 and 4; the cooperative
# epilogue and the stream-K fixup use 1)
_TURN_BARRIER = 3


class BlockScaledMainloop:
    """Main-loop methods for blockwise scales; they read the tile shape and config from the
    kernel object."""

    def _block_fragments(self) -> int:
        """k-tile fragments per warpgroup: two while they fit beside the accumulator."""
        return 2 if self.tile_shape_mnk[1] <= SCALE_BLOCK else 1

    @cute.jit
    def _start_turns(self, wg):
        """The one-fragment schedule's turn barriers of warpgroup ``wg`` of the tile, (mine, the
        other's), once per kernel: warpgroup 1 hands the first turn to warpgroup 0."""
        my_turn = pipeline.NamedBarrier(barrier_id=_TURN_BARRIER + wg, num_threads=self.tile_threads)
        other_turn = pipeline.NamedBarrier(barrier_id=_TURN_BARRIER + 1 - wg, num_threads=self.tile_threads)
        if wg == 1:
            other_turn.arrive()
        return my_turn, other_turn

    @cute.jit
    def _mainloop_block_scaled(self, ab_pipeline, tiled_mma, acc, acc_k_tiles, turns, tCrA, tCrB, read_state,
                               num_k_tiles, mScaleA, mScaleB, tCcC, row_start, col_start, mn_shape, batch_idx,
                               k_begin):
        """acc = sum over k-tiles of (A_k @ B_k) * scale_a[row, k] * scale_b[k, col // 128], over
        ``num_k_tiles`` k-tiles from ``k_begin`` (a stream-K segment's; 0 otherwise)."""
        scale_args = self._scale_addresses(mScaleA, mScaleB, tCcC, acc, row_start, col_start, mn_shape, batch_idx,
                                           k_begin)
        if cutlass.const_expr(self._block_fragments() == 2):
            read_state = self._mainloop_two_fragments(ab_pipeline, tiled_mma, acc, acc_k_tiles, tCrA, tCrB,
                                                      read_state, num_k_tiles, scale_args)
        else:
            read_state = self._mainloop_one_fragment(ab_pipeline, tiled_mma, acc, acc_k_tiles[0], turns, tCrA, tCrB,
                                                     read_state, num_k_tiles, scale_args, col_start)
        return read_state

    @cute.jit
    def _scale_addresses(self, mScaleA, mScaleB, tCcC, acc, row_start, col_start, mn_shape, batch_idx, k_begin):
        """Byte addresses of this thread's scales (its rows' scale_a, then scale_b's blocks under
        the tile's columns) and the k strides that step them per k-tile, (scale_a's, scale_b's):
        the loop does one 64-bit add per load instead of the full index arithmetic (which had the
        consumers issue-bound, bench/NOTES.md)."""
        # The wgmma C fragment of a thread holds values ((2 cols, 2 rows, n/8 col groups), m, 1):
        # its rows, and the tile's scale blocks of B, are the same for every k-tile.
        frag_rows = cute.size(acc, mode=[1]) * 2
        col_blocks = -(-self.tile_shape_mnk[1] // SCALE_BLOCK)
        last_row = mn_shape[0] - 1
        rows = cute.make_rmem_tensor((frag_rows,), Int32)
        for r in cutlass.range_constexpr(frag_rows):
            rows[r] = cutlass.min(row_start + tCcC[((0, r % 2, 0), r // 2, 0)][0], last_row)
        col_block = col_start // SCALE_BLOCK
        scale_addr = cute.make_rmem_tensor((frag_rows + col_blocks,), Int64)
        k_strides = tuple(Int64(stride) * (Float32.width // 8)
                          for stride in (mScaleA.layout.stride[1], mScaleB.layout.stride[0]))
        for r in cutlass.range_constexpr(frag_rows):
            scale_addr[r] = mScaleA[rows[r], None, batch_idx].iterator.toint()
        for b in cutlass.range_constexpr(col_blocks):
            # (a tile's last block may lie past N: it scales only columns that are not stored)
            block = col_block if b == 0 else cutlass.min(col_block + b, mScaleB.shape[1] - 1)
            scale_addr[frag_rows + b] = mScaleB[None, block, batch_idx].iterator.toint()
        if cutlass.const_expr(self.stream_k):
            for i in cutlass.range_constexpr(frag_rows + col_blocks):
                scale_addr[i] = scale_addr[i] + Int64(k_begin) * k_strides[0 if i < frag_rows else 1]
        return scale_addr, k_strides, frag_rows

    @cute.jit
    def _mainloop_two_fragments(self, ab_pipeline, tiled_mma, acc, acc_k_tiles, tCrA, tCrB, read_state, num_k_tiles,
                                scale_args):
        """Each k-tile's batch accumulates from zero into one of two k-tile accumulators, taking
        turns, and is promoted into ``acc`` while the next k-tile's batch runs. A k-tile's scales
        are loaded when its batch is issued, a k-tile before the promotion that uses them (loaded
        at the top of their own k-tile, ptxas had placed their product between the WGMMAs, whose
        issue then waited for an L2 trip: bench/NOTES.md)."""
        # per k-tile accumulator: its scales, in the order of scale_addr
        even, odd = acc_k_tiles
        even_scales = cute.make_rmem_tensor(scale_args[0].shape, Float32)
        odd_scales = cute.make_rmem_tensor(scale_args[0].shape, Float32)
        acc.fill(0.0)
        release_state = read_state.clone()
        self._issue_scaled_k_tile(ab_pipeline, tiled_mma, even, even_scales, tCrA, tCrB, read_state, scale_args)
        read_state.advance()
        # k-tiles 1, 2, then 3, 4, ...: odd ones into `odd`, even ones into `even`
        for pair in cutlass.range((num_k_tiles - 1) // 2, unroll=1):
            for issued, issued_scales, done, done_scales in ((odd, odd_scales, even, even_scales),
                                                             (even, even_scales, odd, odd_scales)):
                self._issue_scaled_k_tile(ab_pipeline, tiled_mma, issued, issued_scales, tCrA, tCrB, read_state,
                                          scale_args)
                read_state.advance()
                warpgroup.wait_group(1)  # the previous k-tile's batch is done, this one runs
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                self._promote(acc, done, done_scales)
        if (num_k_tiles - 1) % 2 == 1:  # one more, odd k-tile
            self._issue_scaled_k_tile(ab_pipeline, tiled_mma, odd, odd_scales, tCrA, tCrB, read_state, scale_args)
            read_state.advance()
            warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            self._promote(acc, even, even_scales)
            warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            self._promote(acc, odd, odd_scales)
        else:
            warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            self._promote(acc, even, even_scales)
        return read_state

    @cute.jit
    def _mainloop_one_fragment(self, ab_pipeline, tiled_mma, acc, acc_k, turns, tCrA, tCrB, read_state, num_k_tiles,
                               scale_args, col_start):
        """Per k-tile: wait for this warpgroup's turn, issue the batch into ``acc_k`` (from zero),
        hand the turn over (the other warpgroup's batch queues behind this one), load the next
        k-tile's scales, wait for the batch and promote it while the other's runs. The first
        scale block of B covers the tile's first 128 columns if the tile starts on a block, else
        64. (Handing the turn over only once the batch is done serializes the two warpgroups'
        batches with a gap between them: -10%, bench/NOTES.md.)"""
        my_turn, other_turn = turns
        scales = cute.make_rmem_tensor(scale_args[0].shape, Float32)
        next_scales = cute.make_rmem_tensor(scale_args[0].shape, Float32)
        self._load_scales(scales, scale_args)
        starts_on_block = col_start % SCALE_BLOCK == 0
        acc.fill(0.0)
        for k_tile in cutlass.range(num_k_tiles, unroll=1):
            my_turn.arrive_and_wait()
            ab_pipeline.consumer_wait(read_state)
            self._mma_k_tile(tiled_mma, acc_k, tCrA, tCrB, read_state.index, zero_init=True)
            other_turn.arrive()
            self._load_scales(next_scales, scale_args, k_tile + 1 < num_k_tiles)
            warpgroup.wait_group(0)
            ab_pipeline.consumer_release(read_state)
            read_state.advance()
            # (the two splits unrolled: the column groups' blocks are then compile-time)
            if starts_on_block:
                self._promote(acc, acc_k, scales, first_block_groups=SCALE_BLOCK // 8)
            else:
                self._promote(acc, acc_k, scales, first_block_groups=SCALE_BLOCK // 16)
            scales.store(next_scales.load())
        return read_state

    @cute.jit
    def _load_scales(self, scales, scale_args, in_range=None):
        """Load a k-tile's scales into ``scales`` and step their addresses to the next k-tile.
        ``in_range`` false (a look-ahead past the last k-tile) reloads the previous k-tile's
        instead: the load stays unconditional (under a branch, ptxas moved the uniform scale_b
        into a uniform register right after its load, waiting there for the L2 round trip)."""
        scale_addr, k_strides, frag_rows = scale_args
        for i in cutlass.range_constexpr(cute.size(scales)):
            addr, step = scale_addr[i], k_strides[0 if i < frag_rows else 1]
            if cutlass.const_expr(in_range is not None):
                addr = cutlass.select_(in_range, addr, addr - step)
            ptr = cute.make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4)
            scales[i] = cute.arch.load(ptr, Float32)
            scale_addr[i] = addr + step

    @cute.jit
    def _issue_scaled_k_tile(self, ab_pipeline, tiled_mma, acc_k, scales, tCrA, tCrB, read_state, scale_args):
        """Load the next k-tile's scales into ``scales`` and issue its batch into ``acc_k`` (from
        zero) once its stage is full."""
        self._load_scales(scales, scale_args)
        ab_pipeline.consumer_wait(read_state)
        self._mma_k_tile(tiled_mma, acc_k, tCrA, tCrB, read_state.index, zero_init=True)

    @cute.jit
    def _promote(self, acc, acc_k, scales, first_block_groups: cutlass.Constexpr = None):
        """acc += acc_k * scale_a[row] * scale_b[block] (one retired k-tile's partial sums).
        ``scales``: the thread's rows' scale_a, then scale_b of each block under the tile; with
        two blocks, the first ``first_block_groups`` 8-column groups take the first one."""
        col_blocks = 1 if first_block_groups is None else 2
        frag_rows = cute.size(scales) - col_blocks
        row_scale = cute.make_rmem_tensor((col_blocks * frag_rows,), Float32)
        for b in cutlass.range_constexpr(col_blocks):
            for r in cutlass.range_constexpr(frag_rows):
                row_scale[b * frag_rows + r] = scales[r] * scales[frag_rows + b]
        for i in cutlass.range_constexpr(cute.size(acc)):
            coord = cute.idx2crd(i, acc.shape)
            block = 0 if col_blocks == 1 or coord[0][2] < first_block_groups else 1
            acc[i] = acc[i] + acc_k[i] * row_scale[block * frag_rows + coord[0][1] + 2 * coord[1]]
