"""The sm90 GEMM's main loops under FP8 blockwise scales (a mixin of :class:`.gemm.Sm90Gemm`).

Blockwise scales (1 x 128 blocks of A, 128 x 128 of B) are applied per k-tile: each k-tile's
WGMMA batch accumulates from zero into a k-tile fragment, which is then promoted into the
running accumulator, ``acc += acc_k * scale_a[row] * scale_b[block]`` (one FFMA per value), so
the tensor cores' reduced-precision FP8 accumulation never spans more than 128 of K. The tensor
cores should not wait for a promotion; three schedules see to that:

* two fragments (tiles of 64 or 128 columns, inside one scale block of B): a warpgroup's
  k-tiles take turns between them, one promoted while the next one's batch runs;
* one fragment (128 x 192 tiles: 96 + 96 fp32 registers per thread leave no room for a
  second): the warpgroup waits for its batch before promoting it, and the tile's two
  warpgroups take turns issuing their batches (two named barriers), so one's batch runs while
  the other promotes. A 192-column tile straddles two scale blocks of B, starting on one or
  halfway through it; each column group takes its own block's scale.
* waves (256 x 128 tiles, DeepGEMM's Hopper schedule): each warpgroup owns 64 rows of each of
  the tile's two 128-row waves; per k-tile it issues, waits for and promotes one wave's batch
  after the other through one 64-register fragment. No turns: while one warpgroup promotes, the
  other's batch runs. Each stage (one barrier wait, one read of the scales) carries 4/3 the
  tensor work of a 128 x 192 tile's and twice a 128 x 128 tile's.

Every schedule waits for its stage by polling the barrier (kernels/common/pipeline_wait.py).

Scales: the producer loads each k-tile's with it, by TMA under the stage's barrier (a box of
scale_a's rows and one of scale_b's blocks, from the tile's first rounded down to 16 bytes),
into slots of the stage; a warpgroup reads its rows and the tile's blocks from there where it
issues the k-tile's batch, before the stage is released. (Loaded by the consumers from global
memory, the scales' latency reached the promotion; staged by a warp of their own under a second
barrier, the consumers waited on that barrier: bench/NOTES.md.)

The wider tile is about shared memory: per k-tile a warpgroup's WGMMAs read its A rows and all
of B's columns, and TMA writes both; at the FP8 tensor rate a 128 x 128 tile needs 160 B/clk
of the SM's 128, a 128 x 192 tile 138 (bench/NOTES.md).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common.pipeline_wait import poll_until_full

SCALE_BLOCK = 128  # the K (and B's N) extent of one blockwise scale
# A scale box's start along its contiguous dim is 16-byte aligned (a box off that boundary
# stopped the kernel on an illegal instruction): boxes start at the tile's first row (block)
# rounded down to 4 fp32 and reach 4 past the tile's end.
_BOX_ALIGN = 16 // 4
# a stage's scale_b slots: the tile's (at most two) blocks after up to 3 of alignment
SCALE_SLOTS_B = 8
# a TMA load's shared-memory destination is 128-byte aligned: each stage's slot starts so
_SLOT_ALIGN = 128 // 4
# named barriers of the one-fragment schedule's turns (ids 3 and 4; the cooperative
# epilogue and the stream-K fixup use 1)
_TURN_BARRIER = 3


class BlockScaledMainloop:
    """Main-loop methods for blockwise scales; they read the tile shape and config from the
    kernel object."""

    def _block_fragments(self) -> int:
        """k-tile fragments per warpgroup: two while they fit beside the accumulator (one a wave's
        rows where the tile has several)."""
        return 2 if self.tile_shape_mnk[1] <= SCALE_BLOCK and self.waves == 1 else 1

    @cute.jit
    def _start_turns(self, wg):
        """The one-fragment schedule's turn barriers of warpgroup ``wg`` of the tile, (mine, the
        other's), once per kernel: warpgroup 1 hands the first turn to warpgroup 0."""
        my_turn = pipeline.NamedBarrier(barrier_id=_TURN_BARRIER + wg, num_threads=self.tile_threads)
        other_turn = pipeline.NamedBarrier(barrier_id=_TURN_BARRIER + 1 - wg, num_threads=self.tile_threads)
        if wg == 1:
            other_turn.arrive()
        return my_turn, other_turn

    # ---- scales: loaded by TMA with each k-tile, into a slot of its A/B stage ------------------
    def _scale_box_a(self) -> int:
        """Rows of a scale_a box: the tile's, after up to 3 of alignment (a TMA box spans at most
        256: a 256-row tile is never moved, so it starts aligned)."""
        return self.tile_shape_mnk[0] + (_BOX_ALIGN if self.shift_rows else 0)

    def _scale_stage_bytes(self) -> int:
        """Bytes a k-tile's scales bring (the stage barrier's count): a box of scale_a and one of
        scale_b."""
        return (self._scale_box_a() + SCALE_SLOTS_B) * 4 if self.scale_mode == "block" else 0

    def _scale_slots(self) -> tuple:
        """fp32 elements of a stage's (scale_a, scale_b) slots, each a multiple of 128 bytes."""
        return tuple(-(-n // _SLOT_ALIGN) * _SLOT_ALIGN for n in (self._scale_box_a(), SCALE_SLOTS_B))

    def _scale_smem_bytes(self) -> int:
        """Shared memory of a stage's scale slots."""
        return sum(self._scale_slots()) * 4 if self.scale_mode == "block" else 0

    def _scale_elems(self) -> tuple:
        """(scale_a, scale_b) fp32 slots over all stages."""
        return tuple(n * self.ab_stages for n in self._scale_slots())

    def _scale_tma_atoms(self, mScaleA, mScaleB):
        """TMA atoms and tensors of scale_a (M, K / 128, L), M contiguous, in boxes of the tile's
        rows (and alignment), and scale_b (K / 128, N / 128, L), N contiguous, in boxes of
        SCALE_SLOTS_B blocks (runtime.gemm.tma_block_scales lays them out so)."""
        load = cpasync.CopyBulkTensorTileG2SOp()
        box_a = self._scale_box_a()
        atom_a, tensor_a = cpasync.make_tiled_tma_atom(load, mScaleA, cute.make_layout((box_a, 1)), (box_a, 1))
        atom_b, tensor_b = cpasync.make_tiled_tma_atom(
            load, mScaleB, cute.make_layout((1, SCALE_SLOTS_B), stride=(SCALE_SLOTS_B, 1)), (1, SCALE_SLOTS_B))
        return atom_a, tensor_a, atom_b, tensor_b

    def _scale_smem(self, storage):
        """(sScaleA (box rows, 1, stages), sScaleB (1, SCALE_SLOTS_B, stages))."""
        box_a, stages = self._scale_box_a(), self.ab_stages
        slot_a, slot_b = self._scale_slots()
        sScaleA = storage.sScaleA.get_tensor(cute.make_layout((box_a, 1, stages), stride=(1, box_a, slot_a)))
        sScaleB = storage.sScaleB.get_tensor(
            cute.make_layout((1, SCALE_SLOTS_B, stages), stride=(SCALE_SLOTS_B, 1, slot_b)))
        return sScaleA, sScaleB

    @cute.jit
    def _scale_k_tiles(self, scale_loads, row_start, col_start, batch_idx):
        """Producer: per k-tile TMA views of a tile's scales, (scale_a's gmem, its smem, scale_b's
        gmem, its smem). scale_a's box starts at the tile's (moved) first row, scale_b's at the
        tile's first block, each rounded down to _BOX_ALIGN (``_scale_offsets``); boxes past M
        or the last block fill with zeros (rows and columns that are never stored)."""
        atom_a, atom_b, mScaleA, mScaleB, (sScaleA, sScaleB) = scale_loads
        row_offset, block_offset = self._scale_offsets(row_start, col_start)
        rows = cute.domain_offset((row_start - row_offset, 0), mScaleA[None, None, batch_idx])
        gScaleA = cute.local_tile(rows, (self._scale_box_a(), 1), (0, None))
        blocks = cute.domain_offset((0, col_start // SCALE_BLOCK - block_offset), mScaleB[None, None, batch_idx])
        gScaleB = cute.local_tile(blocks, (1, SCALE_SLOTS_B), (None, 0))
        one_cta = cute.make_layout(1)
        tSAsSA, tSAgSA = cpasync.tma_partition(atom_a, 0, one_cta, cute.group_modes(sScaleA, 0, 2),
                                               cute.group_modes(gScaleA, 0, 2))
        tSBsSB, tSBgSB = cpasync.tma_partition(atom_b, 0, one_cta, cute.group_modes(sScaleB, 0, 2),
                                               cute.group_modes(gScaleB, 0, 2))
        return tSAgSA, tSAsSA, tSBgSB, tSBsSB

    @cute.jit
    def _copy_scales(self, scale_loads, scale_tiles, k_idx, stage, barrier):
        """Producer: k-tile ``k_idx``'s scales into slot ``stage``, under the stage's barrier."""
        atom_a, atom_b = scale_loads[0], scale_loads[1]
        tSAgSA, tSAsSA, tSBgSB, tSBsSB = scale_tiles
        cute.copy(atom_a, tSAgSA[(None, k_idx)], tSAsSA[(None, stage)], tma_bar_ptr=barrier)
        cute.copy(atom_b, tSBgSB[(None, k_idx)], tSBsSB[(None, stage)], tma_bar_ptr=barrier)

    @cute.jit
    def _scale_offsets(self, row_start, col_start):
        """Where the tile's first row and first block of B sit in their scale boxes (which
        start _BOX_ALIGN-aligned)."""
        return row_start % _BOX_ALIGN, (col_start // SCALE_BLOCK) % _BOX_ALIGN

    @cute.jit
    def _scale_slot_index(self, acc, tCcC, row_start, col_start):
        """Where this thread's scales sit in a stage's slots: (its rows' in scale_a's, the
        tile's first block's in scale_b's). The wgmma C fragment holds values ((2 cols, 2 rows,
        n/8 col groups), m, 1): its rows are the same for every k-tile."""
        row_offset, block_offset = self._scale_offsets(row_start, col_start)
        frag_rows = cute.size(acc, mode=[1]) * 2
        rows = cute.make_rmem_tensor((frag_rows,), Int32)
        for r in cutlass.range_constexpr(frag_rows):
            rows[r] = tCcC[((0, r % 2, 0), r // 2, 0)][0] + row_offset
        return rows, block_offset

    @cute.jit
    def _read_scales(self, k_scales, scale_smem, slot_index, stage):
        """A k-tile's scales from its stage's slots (the stage is full): this thread's rows'
        scale_a, then scale_b of the tile's blocks, into ``k_scales``."""
        sScaleA, sScaleB = scale_smem
        rows, first_block = slot_index
        frag_rows = cute.size(rows)
        for r in cutlass.range_constexpr(frag_rows):
            k_scales[r] = sScaleA[rows[r], 0, stage]
        for b in cutlass.range_constexpr(cute.size(k_scales) - frag_rows):
            k_scales[frag_rows + b] = sScaleB[0, first_block + b, stage]

    @cute.jit
    def _mainloop_block_scaled(self, ab_pipeline, tiled_mma, acc, acc_k_tiles, turns, tCrA, tCrB, read_state,
                               num_k_tiles, scale_smem, tCcC, row_start, col_start):
        """acc = sum over this tile's (or stream-K segment's) ``num_k_tiles`` k-tiles of
        (A_k @ B_k) * scale_a[row, k] * scale_b[k, col // 128]."""
        slot_index = self._scale_slot_index(acc, tCcC, row_start, col_start)
        num_scales = cute.size(slot_index[0]) + -(-self.tile_shape_mnk[1] // SCALE_BLOCK)
        if cutlass.const_expr(self.waves > 1):
            read_state = self._mainloop_waves(ab_pipeline, tiled_mma, acc, acc_k_tiles[0], tCrA, tCrB, read_state,
                                              num_k_tiles, scale_smem, slot_index, num_scales)
        elif cutlass.const_expr(self._block_fragments() == 2):
            read_state = self._mainloop_two_fragments(ab_pipeline, tiled_mma, acc, acc_k_tiles, tCrA, tCrB,
                                                      read_state, num_k_tiles, scale_smem, slot_index, num_scales)
        else:
            read_state = self._mainloop_one_fragment(ab_pipeline, tiled_mma, acc, acc_k_tiles[0], turns, tCrA, tCrB,
                                                     read_state, num_k_tiles, scale_smem, slot_index, num_scales,
                                                     col_start)
        return read_state

    @cute.jit
    def _mainloop_two_fragments(self, ab_pipeline, tiled_mma, acc, acc_k_tiles, tCrA, tCrB, read_state, num_k_tiles,
                                scale_smem, slot_index, num_scales):
        """Each k-tile's batch accumulates from zero into one of two k-tile accumulators, taking
        turns, and is promoted into ``acc`` while the next k-tile's batch runs. A k-tile's scales
        are read from its stage when its batch is issued (the stage is released before the
        promotion)."""
        even, odd = acc_k_tiles
        even_scales = cute.make_rmem_tensor((num_scales,), Float32)
        odd_scales = cute.make_rmem_tensor((num_scales,), Float32)
        acc.fill(0.0)
        release_state = read_state.clone()
        self._issue_scaled_k_tile(ab_pipeline, tiled_mma, even, even_scales, tCrA, tCrB, read_state, scale_smem,
                                  slot_index)
        read_state.advance()
        # k-tiles 1, 2, then 3, 4, ...: odd ones into `odd`, even ones into `even`
        for pair in cutlass.range((num_k_tiles - 1) // 2, unroll=1):
            for issued, issued_scales, done, done_scales in ((odd, odd_scales, even, even_scales),
                                                             (even, even_scales, odd, odd_scales)):
                self._issue_scaled_k_tile(ab_pipeline, tiled_mma, issued, issued_scales, tCrA, tCrB, read_state,
                                          scale_smem, slot_index)
                read_state.advance()
                warpgroup.wait_group(1)  # the previous k-tile's batch is done, this one runs
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                self._promote(acc, done, done_scales)
        if (num_k_tiles - 1) % 2 == 1:  # one more, odd k-tile
            self._issue_scaled_k_tile(ab_pipeline, tiled_mma, odd, odd_scales, tCrA, tCrB, read_state, scale_smem,
                                      slot_index)
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
                               scale_smem, slot_index, num_scales, col_start):
        """Per k-tile: wait for this warpgroup's turn, issue the batch into ``acc_k`` (from zero)
        and read the k-tile's scales, hand the turn over (the other warpgroup's batch queues
        behind this one), wait for the batch and promote it while the other's runs. The first
        scale block of B covers the tile's first 128 columns if the tile starts on a block, else
        64. (Handing the turn over only once the batch is done serializes the two warpgroups'
        batches with a gap between them: -10%, bench/NOTES.md.)"""
        my_turn, other_turn = turns
        scales = cute.make_rmem_tensor((num_scales,), Float32)
        starts_on_block = col_start % SCALE_BLOCK == 0
        acc.fill(0.0)
        for k_tile in cutlass.range(num_k_tiles, unroll=1):
            my_turn.arrive_and_wait()
            self._issue_scaled_k_tile(ab_pipeline, tiled_mma, acc_k, scales, tCrA, tCrB, read_state, scale_smem,
                                      slot_index)
            other_turn.arrive()
            warpgroup.wait_group(0)
            ab_pipeline.consumer_release(read_state)
            read_state.advance()
            # (the two splits unrolled: the column groups' blocks are then compile-time)
            if starts_on_block:
                self._promote(acc, acc_k, scales, first_block_groups=SCALE_BLOCK // 8)
            else:
                self._promote(acc, acc_k, scales, first_block_groups=SCALE_BLOCK // 16)
        return read_state

    @cute.jit
    def _mainloop_waves(self, ab_pipeline, tiled_mma, acc, acc_k, tCrA_waves, tCrB, read_state, num_k_tiles,
                        scale_smem, slot_index, num_scales):
        """Per k-tile, this warpgroup's rows of each wave in turn: issue the wave's batch into
        ``acc_k`` (from zero), wait for it, promote it into the wave's rows of ``acc``. No turns:
        each warpgroup's batches run while the other promotes (DeepGEMM's Hopper schedule; turns
        cost 1-3%, bench/NOTES.md). The stage is released once the last wave's batch has read
        it. Off the path from one batch to the next: the scales are read after the first batch
        is issued, and the next stage's barrier is first tested before the last promotion."""
        scales = cute.make_rmem_tensor((num_scales,), Float32)
        acc.fill(0.0)
        full = ab_pipeline.consumer_try_wait(read_state)
        for k_tile in cutlass.range(num_k_tiles, unroll=1):
            poll_until_full(ab_pipeline, read_state, full)
            for wave in cutlass.range_constexpr(self.waves):
                self._mma_k_tile(tiled_mma, acc_k, tCrA_waves[wave], tCrB, read_state.index, zero_init=True)
                if wave == 0:  # (the scales' latency under the batch, not before its issue)
                    self._read_scales(scales, scale_smem, slot_index, read_state.index)
                warpgroup.wait_group(0)
                if wave == self.waves - 1:
                    ab_pipeline.consumer_release(read_state)
                    read_state.advance()
                    # the next stage's first test, its latency under the last promotion (none
                    # after the tile's last k-tile: that stage may never fill, and a try_wait
                    # holds its result back until the hardware's time limit)
                    if k_tile + 1 < num_k_tiles:
                        full = ab_pipeline.consumer_try_wait(read_state)
                self._promote_wave(acc, acc_k, scales, wave)
        return read_state

    @cute.jit
    def _promote_wave(self, acc, acc_k, scales, wave: cutlass.Constexpr):
        """acc[wave's rows] += acc_k * scale_a[row] * scale_b (one column block: 128-column
        tiles). ``scales``: the thread's rows' scale_a, two per wave, then scale_b."""
        frag_rows = cute.size(scales) - 1
        row_scale = cute.make_rmem_tensor((2,), Float32)
        for half in cutlass.range_constexpr(2):
            row_scale[half] = scales[2 * wave + half] * scales[frag_rows]
        for i in cutlass.range_constexpr(cute.size(acc_k)):
            coord = cute.idx2crd(i, acc_k.shape)
            acc[(coord[0], wave, coord[2])] = acc[(coord[0], wave, coord[2])] + acc_k[i] * row_scale[coord[0][1]]

    @cute.jit
    def _issue_scaled_k_tile(self, ab_pipeline, tiled_mma, acc_k, k_scales, tCrA, tCrB, read_state, scale_smem,
                             slot_index):
        """Once the next k-tile's stage is full: issue its batch into ``acc_k`` (from zero) and
        read its scales into ``k_scales``."""
        poll_until_full(ab_pipeline, read_state)
        self._mma_k_tile(tiled_mma, acc_k, tCrA, tCrB, read_state.index, zero_init=True)
        self._read_scales(k_scales, scale_smem, slot_index, read_state.index)

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
