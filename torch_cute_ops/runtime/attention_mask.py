"""PyTorch's attn_mask as the attention kernels read it: block summaries, bit-packed bool masks,
live key-block ranges and the deterministic backward's dQ turns, each made with torch ops (no
host sync: capturable) and kept per mask tensor (:func:`mask_summary`)."""

from __future__ import annotations

import torch

from .lasting import PerTensor, capturing, outside_graph_pools

BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, BLOCK_BITS = 0, 1, 2, 3  # kernels.common.mask's block statuses


def mask_kind(attn_mask) -> str:
    return "none" if attn_mask is None else "bool" if attn_mask.dtype == torch.bool else "add"


def as_4d(attn_mask: torch.Tensor) -> torch.Tensor:
    """A mask broadcastable to (B, H, S_q, S_k) as a 4-d view (leading size-1 dims added)."""
    return attn_mask[(None,) * (4 - attn_mask.dim())]


def _full_size(attn_mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """The mask as a (B', H', S_q, S_k) view: its own batch and head dims (broadcast ones stay 1)."""
    mask = as_4d(attn_mask)
    return mask.expand(mask.shape[0], mask.shape[1], seqlen_q, seqlen_k)


def _additive_live(mask: torch.Tensor) -> torch.Tensor:
    """The scores an additive mask leaves a weight: not -inf, and not the dtype's lowest value
    (the "hidden" of masks made with ``torch.finfo(dtype).min``: next to any other key of its
    row, its weight exp(lowest + score - max) is exactly 0 in fp32, so a block of them is
    skipped like -inf). A row with no other key keeps its lowest values for the kernels to add:
    PyTorch attends to them then, and so do the kernels where the value stays finite in their
    fp32 scores (fp16's; bf16's overflows to -inf there, a row that sees nothing)."""
    above_lowest = mask > torch.finfo(mask.dtype).min
    blind_rows = ~above_lowest.any(dim=-1, keepdim=True)
    return above_lowest | (blind_rows & (mask != float("-inf")))


def mask_blocks(attn_mask: torch.Tensor, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int) -> torch.Tensor:
    """The block summary of an attn_mask: int8 (B', H', M blocks, N blocks) of BLOCK_EMPTY (no
    visible key), BLOCK_FULL (every key visible, no additive bias), BLOCK_BITS (an additive
    mask's block of only 0 and hidden values: its bits, where it is 0, say all) or BLOCK_PARTIAL,
    with B', H' the mask's own (broadcast dims stay 1). One pass of torch ops over the mask."""
    mask = _full_size(attn_mask, seqlen_q, seqlen_k)
    plain = None
    if mask.dtype == torch.bool:
        live, full = mask, mask
    else:
        live, full = _additive_live(mask), mask == 0
        plain = full | ~live
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    pad = (0, n_blocks * tile_n - seqlen_k, 0, m_blocks * tile_m - seqlen_q)
    shape = (*mask.shape[:2], m_blocks, tile_m, n_blocks, tile_n)

    def per_block(values, padding, reduce):  # padding rows and columns decide nothing
        padded = torch.nn.functional.pad(values.to(torch.uint8), pad, value=padding)
        return getattr(padded.view(shape), reduce)(dim=(3, 5)).bool()

    any_live = per_block(live, 0, "amax")
    blocks = torch.full(any_live.shape, BLOCK_EMPTY, dtype=torch.int8, device=mask.device)
    blocks.masked_fill_(any_live, BLOCK_PARTIAL)
    if plain is not None:
        blocks.masked_fill_(any_live & per_block(plain, 1, "amin"), BLOCK_BITS)
    return blocks.masked_fill_(per_block(full, 1, "amin"), BLOCK_FULL)


def mask_bits(attn_mask: torch.Tensor, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int) -> torch.Tensor:
    """A bool attn_mask bit-packed as the forward reads it: int32 (B', H', rows, words), bit ``i``
    of word ``w`` is key ``32 w + i`` (little-endian bytes), rows and keys padded with zeros to
    whole (tile_m, tile_n) tiles and rows to 16 bytes. An eighth of the mask's bytes, so a
    partial block costs each thread one vector load per row."""
    mask = _full_size(attn_mask, seqlen_q, seqlen_k)
    rows = -(-seqlen_q // tile_m) * tile_m
    keys = -(-(-(-seqlen_k // tile_n) * tile_n) // 128) * 128
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, keys - seqlen_k, 0, rows - seqlen_q))
    weights = torch.bitwise_left_shift(1, torch.arange(8, device=mask.device)).to(torch.uint8)  # no copy: capturable
    packed = (padded.view(*padded.shape[:-1], keys // 8, 8) * weights).sum(dim=-1, dtype=torch.uint8)
    return packed.view(torch.int32)


def dq_turns(ranges: torch.Tensor, m_blocks: int) -> torch.Tensor:
    """int32 (..., key blocks, query blocks): how many higher key blocks visit each query block,
    given each key block's [first, past-last) query blocks (:func:`live_ranges`): a key block's
    turn to add its dQ tile in the deterministic backward, for masks (whose ranges are arbitrary,
    unlike a band's)."""
    index = torch.arange(m_blocks, device=ranges.device, dtype=torch.int32)
    visits = ((ranges[..., :1] <= index) & (index < ranges[..., 1:])).to(torch.int32)
    at_or_above = visits.flip(-2).cumsum(-2, dtype=torch.int32).flip(-2)
    return at_or_above - visits


def walks_in_step(ranges: torch.Tensor) -> bool | None:
    """Whether the live key blocks of each (batch, kv head) all visit the same query blocks
    (given :func:`live_ranges`): a full or padded mask, not a causal one. Only then do the
    deterministic backward's heads take turns at launch (kernels.sm90.flash_bwd_dq); on staggered
    walks that launch order costs time. Reads back to the host (once per mask, the summary being
    kept); None during a CUDA graph capture, which cannot."""
    if capturing():
        return None
    start, end = ranges.unbind(-1)
    live = end > start

    def same(x):
        return torch.where(live, x, x.max()).amin(-1) == torch.where(live, x, x.min()).amax(-1)

    return bool(((~live.any(-1)) | (same(start) & same(end))).all())


def live_ranges(blocks: torch.Tensor) -> torch.Tensor:
    """int32 (..., 2): the first and past-last non-empty block along the last dim ((0, 0) if none)."""
    live = blocks != BLOCK_EMPTY
    index = torch.arange(blocks.shape[-1], device=blocks.device, dtype=torch.int32)
    end = torch.where(live, index + 1, 0).amax(dim=-1)
    start = torch.minimum(torch.where(live, index, blocks.shape[-1]).amin(dim=-1), end)
    return torch.stack([start, end], dim=-1).to(torch.int32)


# (mask, version, key) -> summary: transformers hands every layer the same mask tensor, and the
# backward gets the forward's (the forward's and backward's summaries differ). Summaries are made
# outside CUDA graphs' memory pools and leave with their mask (runtime.lasting).
_summaries = PerTensor()


def mask_summary(attn_mask: torch.Tensor, key: tuple, make):
    """``make()``'s summary of this mask, computed once per mask tensor, version and ``key`` (not
    kept when made during a CUDA graph capture: its contents exist only after a replay)."""
    if capturing():
        return _summaries.get(attn_mask, key, make, keep=False)
    return _summaries.get(attn_mask, key, lambda: outside_graph_pools(attn_mask.device, make))


def kernel_mask(attn_mask, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """The mask as the kernels read it: (B, H_q, S_q, S_k) strided view, bool as uint8."""
    mask = as_4d(attn_mask).expand(batch, heads, seqlen_q, seqlen_k)
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _visible(attn_mask: torch.Tensor) -> torch.Tensor:
    """What the bits say: a bool mask itself, an additive one's zeros (read in its BLOCK_BITS)."""
    return attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0


def fwd_mask_summary(attn_mask, seqlen_q: int, seqlen_k: int, tiles: tuple[int, int]):
    """Blocks, live key-block ranges, and the mask's bits (:func:`_visible`)."""
    blocks = mask_blocks(attn_mask, seqlen_q, seqlen_k, *tiles)
    return blocks, live_ranges(blocks), mask_bits(_visible(attn_mask), seqlen_q, seqlen_k, *tiles)


def bwd_mask_summary(attn_mask, seqlen_q: int, seqlen_k: int, tiles: tuple[int, int], kv_heads: int,
                     keys_in_rows: bool):
    """Blocks at the backward's tiles, per (batch, kv head, key block) the query blocks that any
    head of the GQA group sees, and the mask's bits (:func:`_visible`): packed along the
    backward's score columns, queries where its scores are transposed (``keys_in_rows``: rows
    are keys, bit ``i`` of word ``w`` query ``32 w + i``), else keys as for the forward."""
    blocks = mask_blocks(attn_mask, seqlen_q, seqlen_k, *tiles)
    per_group = blocks
    if blocks.shape[1] > 1:  # the mask differs per head: the union over each group
        b, h, m, n = blocks.shape
        per_group = blocks.view(b, kv_heads, h // kv_heads, m, n).amax(dim=2)
    visible = _visible(attn_mask)
    if keys_in_rows:
        bits = mask_bits(as_4d(visible).transpose(2, 3), seqlen_k, seqlen_q, tiles[1], tiles[0])
    else:
        bits = mask_bits(visible, seqlen_q, seqlen_k, *tiles)
    return blocks, live_ranges(per_group.transpose(2, 3)), bits
