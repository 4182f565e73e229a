"""The attention band, shared by the forward, the backward and decode: which key blocks a
query block visits, and which scores of a visited block are masked.

* :class:`KeyRange`: which key blocks a query block visits (causal is bottom-right aligned:
  query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``; a local window bounds the
  band on both sides) and which of them need a mask; :func:`query_block_range` /
  :func:`key_blocks_reaching`: its transpose, which query blocks a key block visits (the
  backward's loop) and how many key blocks reach a query block;
* :func:`mask_scores`: -inf outside the causal or local band and past ``seqlen_k``;
* :func:`apply_attn_mask`: PyTorch's ``attn_mask`` (bool or additive) on the key blocks that
  its block summary marks partial (:data:`BLOCK_FULL` blocks need none, empty ones are
  skipped); a bool mask is read bit-packed instead (:func:`load_mask_words`,
  :func:`apply_mask_words`): one vector load per row and block, issued under the GEMMs;
* :func:`apply_softcap`: logit soft-capping, before the mask (masked scores stay -inf).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .dsl_state import DslState
from .flash_common import acc_as_rows_cols


# ---------------------------------------------------------------------------
# which key blocks a query block visits
# ---------------------------------------------------------------------------


class KeyRange(DslState):
    """Key-block bounds of one (query block, batch) pair; plain DSL integers.

    Visible keys are a band per query row ``i``: with ``offset = seqlen_k - seqlen_q``,
    causal (bottom-right aligned) sees ``j <= i + offset``; a local window (``local``,
    FlashAttention's ``(left, right)``, both finite here) sees
    ``i + offset - left <= j <= i + offset + right``.

    ``[n_block_min, n_block_max)``: the key blocks with any visible key (empty when
    ``n_block_max <= n_block_min``); they are never loaded outside it. Blocks at or past
    ``n_block_min_masked`` cross the band's right edge, blocks below
    ``n_block_min_unmasked`` its left edge: only those need a mask.
    """

    dynamic_fields = ("n_block_min", "n_block_max", "n_block_min_masked", "n_block_min_unmasked")

    def __init__(self, tile_m: int, tile_n: int, causal: bool, m_block, seqlen_q, seqlen_k,
                 local: bool = False, left=None, right=None, rows_per_query: int = 1):
        n_blocks_k = (seqlen_k + tile_n - 1) // tile_n
        self.n_block_min = Int32(0)
        self.n_block_max = n_blocks_k
        self.n_block_min_masked = n_blocks_k
        self.n_block_min_unmasked = Int32(0)
        if const_expr(causal or local):
            first_row = m_block * tile_m
            last_row = cutlass.min((m_block + 1) * tile_m, seqlen_q) - 1
            if const_expr(rows_per_query > 1):  # rows are (token, head) pairs: the band is per token
                seqlen_q, first_row, last_row = (seqlen_q // rows_per_query, first_row // rows_per_query,
                                                 last_row // rows_per_query)
            offset = seqlen_k - seqlen_q
            right_edge = offset if const_expr(causal) else offset + right
            # keys visible to the last row of the block, and to its first row
            last_row_keys = last_row + right_edge + 1
            first_row_keys = first_row + right_edge + 1
            self.n_block_max = cutlass.min(
                n_blocks_k, (cutlass.max(last_row_keys, 0) + tile_n - 1) // tile_n
            )
            self.n_block_min_masked = cutlass.min(
                self.n_block_max, cutlass.max(first_row_keys, 0) // tile_n
            )
            if const_expr(local):
                # the first key the first row sees, and the first the last row sees
                first_key_first_row = first_row + offset - left
                first_key_last_row = last_row + offset - left
                self.n_block_min = cutlass.max(first_key_first_row, 0) // tile_n
                self.n_block_min_unmasked = (cutlass.max(first_key_last_row, 0) + tile_n - 1) // tile_n


@cute.jit
def query_block_range(n_block: Int32, seqlen_q, seqlen_k, left: Int32, right: Int32, tile_m: cutlass.Constexpr[int],
                      tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool],
                      local: cutlass.Constexpr[bool]):
    """``(m_block_min, m_block_max)``: the query blocks with a row that sees a key of key block
    ``n_block`` (the band of :class:`KeyRange`, transposed); empty (max == min) when no query
    sees these keys. Both ends grow with ``n_block``."""
    m_block_max = cute.ceil_div(seqlen_q, tile_m)
    m_block_min = Int32(0)
    offset = seqlen_k - seqlen_q
    if const_expr(causal or local):
        right = Int32(0) if const_expr(causal) else right
        first_row = n_block * tile_n - offset - right
        m_block_min = cutlass.max(first_row, 0) // tile_m
    if const_expr(local):
        last_key = cutlass.min((n_block + 1) * tile_n, seqlen_k) - 1
        rows_end = last_key - offset + left + 1  # one past the last row that sees it
        m_block_max = cutlass.min(m_block_max, (cutlass.max(rows_end, 0) + tile_m - 1) // tile_m)
        m_block_max = cutlass.max(m_block_max, m_block_min)
    return m_block_min, m_block_max


@cute.jit
def key_blocks_reaching(m_block: Int32, seqlen_q, seqlen_k, right: Int32, tile_m: cutlass.Constexpr[int],
                        tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool]):
    """Causal or local bands: one past the last key block whose :func:`query_block_range`
    holds query block ``m_block`` (not capped at the key blocks that exist). Since both ends of
    that range grow with the key block, the key blocks reaching a query block are one run: key
    block j reaches it iff its first row ``j * tile_n - offset - right`` lies before the query
    block's end."""
    right = Int32(0) if const_expr(causal) else right
    end = (m_block + 1) * tile_m + seqlen_k - seqlen_q + right
    return cute.ceil_div(cutlass.max(end, 0), tile_n)


@cute.jit
def mask_scores(
    acc_s: cute.Tensor,
    tScS: cute.Tensor,
    t0ScS: cute.Tensor,
    row_start: Int32,
    col_start: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
    mask_seqlen: cutlass.Constexpr[bool],
    keys_in_rows: cutlass.Constexpr[bool] = False,
    local: cutlass.Constexpr[bool] = False,
    left: Int32 = None,
    right: Int32 = None,
    rows_per_query: cutlass.Constexpr[int] = 1,
):
    """Set scores outside the visible band (see :class:`KeyRange`) to -inf, in place.

    ``row_start``/``col_start``: the query row and key column of the fragment's
    tile origin. ``tScS``/``t0ScS``: (row, col) coordinates within the tile of this
    thread's and of thread 0's accumulator, both in :func:`acc_as_rows_cols` form.
    Columns are compared through thread 0's coordinates (compile-time constants)
    against limits shifted by this thread's column offset: one or two compares per
    score. ``keys_in_rows``: the fragment holds S^T (rows are keys, columns queries);
    the origins keep their meaning (``row_start`` is still the first query).
    ``local``: the band of a (left, right) window; ``causal`` is right = 0, no left edge.
    ``rows_per_query`` > 1 (forward): each query token is that many consecutive rows.
    """
    acc = acc_as_rows_cols(acc_s)
    col_offset = tScS[0, 0][1]
    offset = seqlen_k - (seqlen_q // rows_per_query if const_expr(rows_per_query > 1) else seqlen_q)
    hidden = Int32(1 << 30)  # past every column: the whole row is masked
    if const_expr(keys_in_rows):
        # key j is visible to the queries i in [j - offset - right, j - offset + left]
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            key = col_start + tScS[r, 0][0]
            first_col = Int32(-1)
            last_col = hidden
            if const_expr(causal):
                first_col = key - offset - row_start - col_offset
            if const_expr(local):
                first_col = key - offset - right - row_start - col_offset
                last_col = key - offset + left - row_start - col_offset
            if const_expr(mask_seqlen):
                first_col = cutlass.select_(key < seqlen_k, first_col, hidden)
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                col = t0ScS[0, c][1]
                acc[r, c] = acc[r, c] if col >= first_col else -Float32.inf
                if const_expr(local):
                    acc[r, c] = acc[r, c] if col <= last_col else -Float32.inf
    else:
        seqlen_limit = seqlen_k - col_start - col_offset
        if const_expr(not causal and not local):
            if const_expr(mask_seqlen):
                for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                    keep = t0ScS[0, c][1] < seqlen_limit
                    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
                        acc[r, c] = acc[r, c] if keep else -Float32.inf
        else:
            # query row i sees keys j <= i + offset (+ right), and (local) j >= i + offset - left
            right_edge = offset if const_expr(causal) else offset + right
            diag = row_start + 1 + right_edge - col_start - col_offset
            for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
                limit = diag + tScS[r, 0][0]
                if const_expr(rows_per_query > 1):
                    limit = diag - row_start + (row_start + tScS[r, 0][0]) // rows_per_query
                first = limit - 1 - right - left if const_expr(local) else None  # i + offset - left
                if const_expr(mask_seqlen):
                    limit = cutlass.min(limit, seqlen_limit)
                if const_expr(local):
                    for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                        col = t0ScS[0, c][1]
                        acc[r, c] = acc[r, c] if col < limit else -Float32.inf
                        acc[r, c] = acc[r, c] if col >= first else -Float32.inf
                else:
                    for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                        acc[r, c] = acc[r, c] if t0ScS[0, c][1] < limit else -Float32.inf


# a key block's status in an attn_mask's block summary (runtime.attention_mask.mask_blocks);
# BLOCK_BITS: an additive mask's block of only 0 and hidden values, read from its bits
BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, BLOCK_BITS = 0, 1, 2, 3


@cute.jit
def apply_attn_mask(acc_s: cute.Tensor, tScS: cute.Tensor, mMask: cute.Tensor, row_start: Int32,
                    col_start: Int32, seqlen_q: Int32, seqlen_k: Int32, additive: cutlass.Constexpr[bool],
                    inv_scale: Float32, keys_in_rows: cutlass.Constexpr[bool] = False):
    """PyTorch's attn_mask on one block of scores, in place. ``mMask``: this (batch, head)'s
    (S_q, S_k) view (any strides, broadcast dims stride 0). A bool mask (as uint8) sets -inf
    where it is 0; an additive one adds ``mask / softmax_scale`` to the unscaled score, i.e.
    ``mask`` to the scaled one. Scores outside (S_q, S_k) are left to the seqlen mask."""
    acc = acc_as_rows_cols(acc_s)
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            row = row_start + tScS[r, c][0]
            key = col_start + tScS[r, c][1]
            if const_expr(keys_in_rows):
                row = row_start + tScS[r, c][1]
                key = col_start + tScS[r, c][0]
            if (row < seqlen_q) & (key < seqlen_k):
                if const_expr(additive):
                    acc[r, c] = acc[r, c] + mMask[row, key].to(Float32) * inv_scale
                else:
                    acc[r, c] = acc[r, c] if mMask[row, key] != 0 else -Float32.inf


@cute.jit
def load_mask_words(mBits: cute.Tensor, tScS: cute.Tensor, row_start: Int32, col_start: Int32,
                    tile_n: cutlass.Constexpr[int]) -> cute.Tensor:
    """A bit-packed bool mask's words for this thread's rows over one key block: (rows, tile_n /
    32) Int32, one vector load per row. ``mBits``: this (batch, head)'s (rows, words) view, bit
    ``i`` of word ``w`` is key ``32 w + i``, padded to whole tiles with zero bits, so no bounds
    check is needed and keys past ``seqlen_k`` read as hidden. Issued before the QK GEMM is
    waited on, its latency hides under the tensor cores."""
    num_rows = cute.size(tScS, mode=[0])
    per_row = tile_n // 32
    words = cute.make_rmem_tensor(cute.make_layout((num_rows, per_row), stride=(per_row, 1)), Int32)
    for r in cutlass.range_constexpr(num_rows):
        row_words = cute.local_tile(mBits[row_start + tScS[r, 0][0], None], (per_row,), (col_start // tile_n,))
        # rows are 16-byte aligned (mask_args), blocks as their size allows; the DSL cannot see
        # it through the indexing
        aligned = cute.make_ptr(Int32, row_words.iterator.toint(), cute.AddressSpace.gmem,
                                assumed_align=math.gcd(16, 4 * per_row))
        cute.autovec_copy(cute.make_tensor(aligned, row_words.layout), words[r, None])
    return words


@cute.jit
def apply_mask_words(acc_s: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor, words: cute.Tensor):
    """A bool attn_mask from :func:`load_mask_words` on one block of scores: -inf where the bit is
    0. A thread's columns are thread 0's plus an offset below 8 (WGMMA accumulator layout), so
    one shift per word aligns them and every bit index is static; where warpgroups split the
    columns, a 32-column multiple more, and the words start at the thread's own columns."""
    acc = acc_as_rows_cols(acc_s)
    lane_cols = (tScS[0, 0][1] - t0ScS[0, 0][1]) & 31
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        aligned = cute.make_rmem_tensor(cute.size(words, mode=[1]), Int32)
        for w in cutlass.range_constexpr(cute.size(words, mode=[1])):
            aligned[w] = words[r, w] >> lane_cols
        for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            col = t0ScS[r, c][1]
            visible = (aligned[col // 32] >> (col % 32)) & 1
            acc[r, c] = acc[r, c] if visible != 0 else -Float32.inf


@cute.jit
def apply_softcap(acc_s: cute.Tensor, scale: Float32):
    """Soft-capping in place: ``acc <- tanh(acc * scale)`` with ``scale = softmax_scale /
    softcap``; the softmax then takes ``softcap`` as its scale, so that the scores it sees are
    ``softcap * tanh(softmax_scale * s / softcap)``."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        acc_s[i] = cute.math.tanh(acc_s[i] * scale, fastmath=True)
