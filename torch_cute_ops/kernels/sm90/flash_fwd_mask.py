"""The scores' masks of the Hopper attention forward (flash_fwd.py), composed per query tile:
the band and the key tail (``mask_scores``), softcap before them, and PyTorch's attn_mask, read
from its bits (a bool mask, an additive mask's blocks of only 0 and hidden values) or from its
values (an additive mask's other partial blocks). Each is one callable on a block of scores,
given the block's first key."""

from __future__ import annotations

from functools import partial

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.mask import apply_attn_mask, apply_mask_words, apply_softcap, load_mask_words, mask_scores
from ..common.seqlen import SeqBounds


def _capped_mask(mask, cap_scale, acc_s, **kwargs):
    """Soft-capping goes before the mask: masked scores must stay -inf."""
    apply_softcap(acc_s, cap_scale)
    mask(acc_s, **kwargs)


def _user_mask(mask, user_mask_fn, acc_s, col_start, words=None, **kwargs):
    """PyTorch's attn_mask values on this block (a bool mask's ``words`` when prefetched), then
    the band and seqlen masks."""
    if words is None:
        user_mask_fn(acc_s, col_start=col_start)
    else:
        user_mask_fn(acc_s, col_start=col_start, words=words)
    mask(acc_s, col_start=col_start, **kwargs)


def _bool_mask(load_words, tScS, t0ScS, acc_s, col_start, words=None):
    """A bit-packed bool attn_mask on this block; its words are loaded here unless prefetched."""
    if words is None:
        words = load_words(col_start=col_start)
    apply_mask_words(acc_s, tScS, t0ScS, words)


class ScoreMasks:
    """:meth:`tile_mask`, as a method of the forward kernel (``FlashFwdSm90``, whose tile shape,
    band, softcap and attn_mask kind it reads)."""

    @cute.jit
    def tile_mask(self, tScS, t0ScS, m_block, head, batch, bounds: SeqBounds, window_left: Int32,
                  window_right: Int32, cap_scale: Float32, user_mask, inv_scale: Float32):
        """The score mask of one tile (its band, key tail, softcap, attn_mask) as one callable, the
        loader of the attn_mask's bit-packed words (a bool mask's, an additive mask's zeros; None
        without one) and, for an additive mask, the mask of its ``BLOCK_BITS`` blocks, which reads
        those words instead of the values (else None). ``user_mask``: (mMask, mMaskBits)."""
        mMask, mMaskBits = user_mask
        mask = partial(mask_scores, tScS=tScS, t0ScS=t0ScS, row_start=m_block * self.tile_m,
                       seqlen_q=bounds.seqlen_q, seqlen_k=bounds.seqlen_k, local=self.local, left=window_left,
                       right=window_right, rows_per_query=self.rows_per_query)
        if const_expr(self.softcap):
            mask = partial(_capped_mask, mask, cap_scale)
        load_words, bits_mask = None, None
        if const_expr(self.attn_mask != "none"):
            mBits = mMask if const_expr(self.attn_mask == "bool") else mMaskBits
            load_words = partial(load_mask_words, mBits[batch, head, None, None], tScS,
                                 m_block * self.tile_m, tile_n=self.tile_n)
            bits_mask = partial(_user_mask, mask, partial(_bool_mask, load_words, tScS, t0ScS))
        if const_expr(self.attn_mask == "bool"):
            mask, bits_mask = bits_mask, None
        if const_expr(self.attn_mask == "add"):
            values = partial(apply_attn_mask, tScS=tScS, mMask=mMask[batch, head, None, None],
                             row_start=m_block * self.tile_m, seqlen_q=bounds.seqlen_q,
                             seqlen_k=bounds.seqlen_k, additive=True, inv_scale=inv_scale)
            mask = partial(_user_mask, mask, values)
        return mask, load_words, bits_mask
