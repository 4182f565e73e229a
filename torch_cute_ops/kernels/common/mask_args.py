"""The attn_mask arguments every attention variant takes (read only by masked variants).

* ``mask``: PyTorch's attn_mask as a (B, H_q, S_q, S_k) view with any strides (broadcast dims
  stride 0, nothing materialized); bool masks as uint8, additive ones in the inputs' dtype.
  The kernels read a bool mask bit-packed instead: int32 (B, H_q, rows, words), bit ``i`` of
  word ``w`` is key ``32 w + i``, rows and words padded to whole tiles, words contiguous and
  rows 16-byte aligned (one vector load per row and block); the backward's, where it computes
  S transposed, is packed the other way (rows are keys, bits queries);
* ``bits``: an additive mask's zeros, packed like a bool mask's: read in its ``BLOCK_BITS``
  blocks (only 0 and hidden values), whose values then cost one load per row, not per score;
* ``blocks``: its block summary at the kernel's (tile_m, tile_n), int8 ``BLOCK_*`` per
  (batch, head, query block, key block);
* ``ranges``: int32 (first, past-last) live block per row of the summary: the key blocks of a
  query block (forward), the query blocks of a key block for a kv head's GQA group (backward).

Unmasked variants get placeholders there (one element; for ``bits`` one 16-byte row).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

MASK_KINDS = ("none", "bool", "add")


def _any_strides(elem, last: int | None = None, align: int = 1):
    shape = tuple(cute.sym_int32() for _ in range(3)) + ((cute.sym_int32(),) if last is None else (last,))
    stride = tuple(cute.sym_int64() for _ in range(4))
    return cute.runtime.make_fake_tensor(elem, shape, stride, assumed_align=align)


def _bit_rows():
    shape = tuple(cute.sym_int32() for _ in range(4))
    stride = (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(divisibility=4), 1)
    return cute.runtime.make_fake_tensor(cutlass.Int32, shape, stride, assumed_align=16)


def mask_fakes(kind: str, dtype) -> tuple:
    """Fake (mask, bits, blocks, ranges) for a variant whose attn_mask is ``kind`` (a bool one
    bit-packed as the mask itself, ``bits`` then unread)."""
    assert kind in MASK_KINDS, kind
    if kind == "bool":
        mask = _bit_rows()
    else:
        elem = dtype if kind == "add" else cutlass.Uint8
        mask = _any_strides(elem, align=elem.width // 8)
    return mask, _bit_rows(), _any_strides(cutlass.Int8), _any_strides(cutlass.Int32, last=2, align=4)
