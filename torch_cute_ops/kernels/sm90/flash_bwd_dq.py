"""dQ of the Hopper attention backward (flash_bwd.py): each MMA warpgroup's hand-over of its
dQ tiles to a writer warp, the writer's adds into the fp32 accumulator, their order, and the walk
over query blocks that the producer, the MMA warpgroups and the writers share.

A warpgroup stores each dQ tile to its smem buffer in accumulator order and arrives on a named
barrier; its writer warp adds the tile to the (B, H, query block, warpgroup, tile) accumulator
with one 1-D bulk reduce-add (``cp.reduce.async.bulk``) and hands the buffer back on a second
barrier once the add has read it.

Order: the adds of the CTAs of different key blocks into one tile are not ordered, so dQ is not
bitwise reproducible run to run (fp32 sums, then rounded to bf16/fp16). The ``deterministic``
variants fix the order: a writer adds its tile only once every higher key block that visits the
tile has added its own (an int32 count per accumulator tile, acquired and released at GPU
scope). Their grid runs the key blocks backwards (CTA x takes key block N - 1 - x): a CTA only
waits on CTAs launched before it, so the waits always end, and under a causal mask a key block
reaches each query block after the higher blocks (which start on the diagonal, later in the
sequence) have added theirs: in key order, the first key block would hold every other one back
by its whole loop.

Walk: each key block visits the query blocks [m_block_min, m_block_max) of each query head of
its GQA group in turn. Without a causal mask, a window or an attn_mask, all of a head's key
blocks visit the same query blocks: walked in step, their adds would pile into one dQ tile at a
time (unordered), or queue behind each other, one add per key block (ordered). Key block n
starts at query block n mod M instead (``rotate``). Ordered, a tile's adds then go in the order
the walks reach it, which waits on key blocks launched after the waiter: only where a head has
at most ``DQ_ROTATED_KEY_BLOCKS`` key blocks (launched together, and resident together once that
many CTAs fit on the GPU) do the ordered walks rotate; longer ones keep the plain walk.

Launch order of ordered walks in step (``interleave_heads``): key block n waits for key block
n + 1 at every tile, one link (its add's completion, the release, the acquire) behind it, so a
head's chain absorbs one new key block per link. Launched head after head, the CTAs that replace
finished ones (a few per link, one per head in flight) would all join one head's chain and queue
there. The host's ``dq_interleave`` (about the resident CTAs over a head's key blocks; 1 where
an attn_mask staggers the walks, ``runtime.attention_mask.walks_in_step``) heads take turns
instead: key block N - 1 of each, then N - 2 of each, and so on, one group of heads after the
other, so every wait is still on a CTA launched earlier.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.bulk import bulk_reduce_add_f32, wait_for_value
from ..common.mask import key_blocks_reaching
from ..common.seqlen import SeqBounds

# named barriers, + MMA warpgroup index; the warpgroup and its dQ writer warp (128 + 32 threads)
BAR_DQ_FULL = 2  # the warpgroup's dQ tile is in smem
BAR_DQ_EMPTY = 4  # the writer's reduce-add has finished reading it
DQ_BAR_THREADS = 128 + 32
# ordered adds over rotated walks: the most key blocks per head (CTAs that must be resident together)
DQ_ROTATED_KEY_BLOCKS = 16


@cute.jit
def hand_dq_to_writer(tdQrdQ: cute.Tensor, tdQsdQ: cute.Tensor, wg_idx: Int32):
    """An MMA warpgroup's dQ tile (registers) -> its smem buffer, once the writer warp has
    read the previous one, then over to the writer."""
    cute.arch.barrier(barrier_id=BAR_DQ_EMPTY + wg_idx, number_of_threads=DQ_BAR_THREADS)
    cute.autovec_copy(tdQrdQ, tdQsdQ)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL + wg_idx, number_of_threads=DQ_BAR_THREADS)


class DqAccumulation:
    """The writer warps and the walk, as methods of the backward kernel (``FlashBwdSm90``, whose
    tile shape, masks and ``deterministic`` / ``rotate`` flags they read)."""

    @cute.jit
    def _launch_coords(self, dq_interleave: Int32) -> tuple:
        """This CTA's (key block, kv head, batch entry): the grid's, but for ordered adds the key
        blocks backwards and, where their walks are in step, ``dq_interleave`` heads taking turns
        (see the module docstring; rotated walks keep their heads' key blocks together)."""
        n_block, kv_head, batch = cute.arch.block_idx()
        num_n, num_heads, num_entries = cute.arch.grid_dim()
        if const_expr(self.interleave_heads):
            group_heads = cutlass.max(dq_interleave, 1)
            if const_expr(self.rotate):
                group_heads = cutlass.select_(num_n <= DQ_ROTATED_KEY_BLOCKS, 1, group_heads)
            launch = n_block + num_n * (kv_head + num_heads * batch)
            group = launch // (num_n * group_heads)
            first_head = group * group_heads
            heads_here = cutlass.min(group_heads, num_heads * num_entries - first_head)
            in_group = launch - first_head * num_n
            n_block = in_group // heads_here
            head = first_head + in_group - n_block * heads_here
            batch = head // num_heads
            kv_head = head - batch * num_heads
        if const_expr(self.deterministic):
            n_block = num_n - 1 - n_block
        return n_block, kv_head, batch

    def _first_query_block(self, n_block: Int32, m_block_min: Int32, m_block_max: Int32,
                           bounds: SeqBounds) -> Int32:
        """Where this key block's walk over each head's query blocks starts (see ``rotate``)."""
        m_first = m_block_min
        if const_expr(self.rotate):
            m_first = m_block_min + n_block % cutlass.max(m_block_max - m_block_min, 1)
            if const_expr(self.deterministic):  # ordered: only as many key blocks as fit at once
                long = cute.ceil_div(bounds.seqlen_k, self.tile_n) > DQ_ROTATED_KEY_BLOCKS
                m_first = cutlass.select_(long, m_block_min, m_first)
        return m_first

    @cute.jit
    def _write_dq(self, mdQacc, dq_order, sdQ, wg, n_block, kv_head, batch, group, m_block_min, m_block_max,
                  bounds: SeqBounds, window_left, window_right):
        """Writer warp of MMA warpgroup ``wg``: adds each of its dQ tiles to the fp32
        accumulator with one 1-D bulk reduce-add, off the warpgroup's critical path
        (deterministic variants: from the last key block down, see :meth:`_dq_turn`)."""
        mDqOrder, mDqTurns = dq_order
        cute.arch.griddepcontrol_wait()  # the preprocess zeroes the accumulator
        if const_expr(self.deterministic and self.masked):  # this key block's turns, one per query block
            mDqTurns = mDqTurns[batch, kv_head, n_block, None]
        src = sdQ[None, wg].iterator.toint()
        num_m = m_block_max - m_block_min
        num_blocks = group * num_m
        if num_blocks > 0:  # (no arrival left pending at exit)
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + wg,
                                     number_of_threads=DQ_BAR_THREADS)
        m_first = self._first_query_block(n_block, m_block_min, m_block_max, bounds)
        head, m_block = kv_head * group, m_first
        for block in cutlass.range(num_blocks, unroll=1):
            row0, entry = bounds.padded_index(m_block * self.tile_m, batch)
            tile_idx = (entry, head, row0 // self.tile_m, wg)
            dst = mdQacc[(*tile_idx, None)].iterator.toint()
            if const_expr(self.deterministic):
                # worked out and polled while the warpgroup computes the tile: even when the turn
                # has already come, the acquire load's round trip would delay the smem hand-back
                turn = self._dq_turn(n_block, m_block, m_block_min, m_block_max, kv_head, batch, bounds,
                                     window_left, window_right, mDqTurns)
                count = mDqOrder.iterator + cute.crd2idx(tile_idx, mDqOrder.layout)
                if cute.arch.lane_idx() == 0:
                    wait_for_value(count, turn)
            cute.arch.barrier(barrier_id=BAR_DQ_FULL + wg, number_of_threads=DQ_BAR_THREADS)
            if cute.arch.lane_idx() == 0:
                if const_expr(self.deterministic):
                    cute.arch.fence_proxy("async.global")
                bulk_reduce_add_f32(dst, src, self.dq_chunk * Float32.width // 8)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(self.deterministic) or block + 1 < num_blocks:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            # the smem tile is read: the warpgroup may refill it while the add completes
            if block + 1 < num_blocks:
                cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + wg,
                                         number_of_threads=DQ_BAR_THREADS)
            if const_expr(self.deterministic):
                if cute.arch.lane_idx() == 0:
                    # the add must be performed before the next key block's may start
                    cute.arch.cp_async_bulk_wait_group(0)
                    cute.arch.fence_proxy("async.global")
                    cute.arch.red(count, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
            head, m_block = next_query_block(head, m_block, m_first, m_block_min, m_block_max)
        if cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _dq_turn(self, n_block, m_block, m_block_min, m_block_max, kv_head, batch, bounds: SeqBounds,
                 window_left, window_right, mDqTurns) -> Int32:
        """How many key blocks of this sequence add to query block ``m_block``'s dQ tile before
        this one: its turn. Rotated walks: see :meth:`_rotated_turn`. Otherwise the higher key
        blocks that visit it. Causal and windows: a closed form (``key_blocks_reaching``; a loop
        over the key blocks would outlast the tile at long lengths). Masks: the host's table
        (``runtime.attention_mask.dq_turns``), counted from the same ranges the CTAs loop over,
        so the count always comes."""
        n_blocks = cute.ceil_div(bounds.seqlen_k, self.tile_n)
        turn = n_blocks - 1 - n_block
        if const_expr(self.masked):  # (mDqTurns: this key block's row of the table)
            turn = mDqTurns[m_block]
        elif const_expr(self.causal or self.local):
            reaching = key_blocks_reaching(m_block, bounds.seqlen_q, bounds.seqlen_k, window_right, self.tile_m,
                                           self.tile_n, self.causal)
            turn = cutlass.min(n_blocks, reaching) - 1 - n_block
        elif const_expr(self.rotate):
            # heads of more key blocks walk in step (the turn above). The loop's count says so, not
            # an `if` around the call: lowered to a select, its loop ran for every head (a 64-step
            # loop per tile at S4k D256, +30% deterministic time).
            rotated = n_blocks <= DQ_ROTATED_KEY_BLOCKS
            rotated_turn = self._rotated_turn(n_block, m_block - m_block_min, m_block_max - m_block_min,
                                              cutlass.select_(rotated, n_blocks, 0))
            turn = cutlass.select_(rotated, rotated_turn, turn)
        return turn

    @cute.jit
    def _rotated_turn(self, n_block, m_local, num_m, n_blocks) -> Int32:
        """The turn of key block ``n_block`` at its walk's query block ``m_local`` (from the first
        of the range) when key block n walks all ``num_m`` of them from block n mod num_m: the
        key blocks whose walks reach the tile at an earlier step (at the same step, the higher
        key block first)."""
        turn = Int32(0)
        my_step = (m_local + num_m - n_block % num_m) % num_m
        step = m_local  # key block 0's, then one less per key block
        for other in cutlass.range(n_blocks, unroll=1):
            earlier = (step < my_step) | ((step == my_step) & (other > n_block))
            turn += cutlass.select_(earlier, 1, 0)
            step = cutlass.select_(step == 0, num_m - 1, step - 1)
        return turn


@cute.jit
def next_query_block(head: Int32, m_block: Int32, m_first: Int32, m_block_min: Int32, m_block_max: Int32) -> tuple:
    """The (query head, query block) after this one in a key block's walk over its GQA group:
    blocks [m_block_min, m_block_max) of each head in turn, from ``m_first`` round to the block
    before it. Stepped, not divided out of a flat index: a runtime integer division costs ~20
    instructions per iteration."""
    wrap = m_block + 1 == m_block_max
    m_next = cutlass.select_(wrap, m_block_min, m_block + 1)
    return head + cutlass.select_(m_next == m_first, 1, 0), m_next
