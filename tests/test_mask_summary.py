"""The host-side summaries the masked kernels read (CPU): the block summary of an attn_mask, its
live block ranges, and the bit-packed copy of a bool mask that the kernels load per row."""

import pytest
import torch

from torch_cute_ops.runtime.attention_mask import (
    BLOCK_BITS,
    BLOCK_EMPTY,
    BLOCK_FULL,
    BLOCK_PARTIAL,
    bwd_mask_summary,
    live_ranges,
    mask_bits,
    mask_blocks,
)


def _unpack(bits: torch.Tensor) -> torch.Tensor:
    """int32 words -> bool keys, bit i of word w = key 32 w + i."""
    shifts = torch.arange(32, dtype=torch.int64)
    return ((bits.to(torch.int64)[..., None] >> shifts) & 1).flatten(-2).bool()


@pytest.mark.parametrize("shape,seqlens,tiles", [
    ((2, 1, 77, 203), (77, 203), (64, 32)),
    ((100, 260), (100, 260), (128, 128)),  # 2-D, broadcast over batch and heads
    ((1, 3, 5, 33), (5, 33), (128, 96)),
])
def test_bits_hold_the_mask_and_zero_padding(shape, seqlens, tiles):
    gen = torch.Generator().manual_seed(sum(shape))
    mask = torch.rand(shape, generator=gen) > 0.3
    s_q, s_k = seqlens
    bits = mask_bits(mask, s_q, s_k, *tiles)
    tile_m, tile_n = tiles
    rows, keys = -(-s_q // tile_m) * tile_m, -(-s_k // tile_n) * tile_n
    assert bits.dtype == torch.int32 and bits.shape[-2] == rows and bits.shape[-1] * 32 >= keys
    assert bits.is_contiguous() and bits.stride(-2) % 4 == 0, "rows must stay 16-byte aligned"
    keys_visible = _unpack(bits)
    full = mask[(None,) * (4 - mask.dim())]
    assert torch.equal(keys_visible[..., :s_q, :s_k], full.expand(*full.shape[:2], s_q, s_k))
    assert not keys_visible[..., s_q:, :].any() and not keys_visible[..., s_k:].any()


def test_bits_of_a_strided_broadcast_mask():
    """A transposed, head-broadcast view packs like its contiguous copy."""
    gen = torch.Generator().manual_seed(3)
    base = torch.rand(2, 1, 70, 50, generator=gen) > 0.5
    view = base.transpose(-1, -2).expand(2, 4, 50, 70)
    assert torch.equal(mask_bits(view, 50, 70, 64, 64), mask_bits(view.contiguous(), 50, 70, 64, 64))


@pytest.mark.parametrize("keys_in_rows", [True, False])
def test_backward_bits_follow_its_score_columns(keys_in_rows):
    """The backward reads a bool mask packed along its scores' columns: queries where it computes
    S transposed (rows are keys), keys otherwise; padding reads as hidden either way."""
    gen = torch.Generator().manual_seed(5)
    s_q, s_k, tiles = 77, 150, (64, 128) if keys_in_rows else (64, 64)
    mask = torch.rand(2, 1, 1, s_k, generator=gen) > 0.3  # key padding, broadcast over queries
    mask = mask & (torch.rand(s_q, s_k, generator=gen) > 0.2)
    bits = bwd_mask_summary(mask, s_q, s_k, tiles, 1, keys_in_rows)[2]
    visible = _unpack(bits)
    rows, cols = (s_k, s_q) if keys_in_rows else (s_q, s_k)
    expected = mask.transpose(-1, -2) if keys_in_rows else mask
    assert visible.shape[-2] == -(-rows // tiles[1 if keys_in_rows else 0]) * tiles[1 if keys_in_rows else 0]
    assert torch.equal(visible[..., :rows, :cols], expected)
    assert not visible[..., rows:, :].any() and not visible[..., cols:].any()
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # its zeros are the bits
    assert torch.equal(bwd_mask_summary(additive, s_q, s_k, tiles, 1, keys_in_rows)[2], bits)


def test_blocks_and_ranges_classify_every_block():
    s_q, s_k, tile_m, tile_n = 300, 260, 128, 128
    i = torch.arange(s_q)[:, None]
    j = torch.arange(s_k)[None, :]
    mask = (j <= i - 40)[None, None]  # causal with an offset: empty, partial and full blocks
    blocks = mask_blocks(mask, s_q, s_k, tile_m, tile_n)[0, 0]
    for m in range(blocks.shape[0]):
        for n in range(blocks.shape[1]):
            tile = mask[0, 0, m * tile_m:(m + 1) * tile_m, n * tile_n:(n + 1) * tile_n]
            expected = BLOCK_EMPTY if not tile.any() else BLOCK_FULL if tile.all() else BLOCK_PARTIAL
            assert blocks[m, n] == expected, (m, n)
    ranges = live_ranges(blocks)
    for m in range(blocks.shape[0]):
        live = [n for n in range(blocks.shape[1]) if blocks[m, n] != BLOCK_EMPTY]
        assert tuple(ranges[m].tolist()) == ((live[0], live[-1] + 1) if live else (0, 0))


def test_additive_blocks_are_full_only_where_the_bias_is_zero_and_bits_where_it_is_zero_or_hidden():
    bias = torch.zeros(1, 1, 128, 256)
    bias[..., :, 200] = 0.5
    bias[..., 5:, 130:140] = float("-inf")
    blocks = mask_blocks(bias, 128, 256, 128, 128)[0, 0]
    assert blocks.tolist() == [[BLOCK_FULL, BLOCK_PARTIAL]]
    hidden = torch.full((1, 1, 128, 256), float("-inf"))
    hidden[..., :, :128] = 0
    assert mask_blocks(hidden, 128, 256, 128, 128)[0, 0].tolist() == [[BLOCK_FULL, BLOCK_EMPTY]]
    hidden[..., 7, 3] = float("-inf")  # only 0 and hidden values: its bits say all
    hidden[..., 9, 200] = 0
    assert mask_blocks(hidden, 128, 256, 128, 128)[0, 0].tolist() == [[BLOCK_BITS, BLOCK_BITS]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowest_values_are_skipped_where_the_row_sees_another_key(dtype):
    """Masks hiding keys with torch.finfo(dtype).min: blocks of only that value are empty (their
    weight is exactly 0 next to any other key), unless a row of the query block has nothing else
    (PyTorch attends to its lowest values then, so the kernels must see them)."""
    lowest = torch.finfo(dtype).min
    mask = torch.zeros(1, 1, 256, 256, dtype=dtype)
    mask[..., :128, 128:] = lowest  # query block 0 never sees key block 1
    mask[..., 128:, 128:] = lowest
    mask[..., 200, :] = lowest  # ... but row 200 of query block 1 sees nothing else
    mask[..., 192:, 0] = float("-inf")
    blocks = mask_blocks(mask, 256, 256, 128, 128)[0, 0]
    assert blocks.tolist() == [[BLOCK_FULL, BLOCK_EMPTY], [BLOCK_PARTIAL, BLOCK_PARTIAL]]
    mask[..., 200, :] = float("-inf")  # a row of -inf only: nothing to attend to
    blocks = mask_blocks(mask, 256, 256, 128, 128)[0, 0]
    assert blocks.tolist() == [[BLOCK_FULL, BLOCK_EMPTY], [BLOCK_BITS, BLOCK_EMPTY]]


def test_dq_turns_count_the_higher_key_blocks_that_visit_each_query_block():
    """The deterministic backward's turn of key block n at query block m, for masks: how many key
    blocks above n have m in their [first, past-last) range; checked against a direct count on
    random ranges (empty ones included) with broadcast batch and head dims."""
    from torch_cute_ops.runtime.attention_mask import dq_turns

    torch.manual_seed(0)
    m_blocks = 13
    start = torch.randint(0, m_blocks + 1, (2, 1, 9), dtype=torch.int32)
    end = torch.minimum(start + torch.randint(0, 6, start.shape, dtype=torch.int32), torch.tensor(m_blocks))
    ranges = torch.stack([start, end], dim=-1)
    turns = dq_turns(ranges, m_blocks)
    assert turns.dtype == torch.int32 and turns.shape == (2, 1, 9, m_blocks)
    for b in range(2):
        for n in range(9):
            for m in range(m_blocks):
                higher = sum(int(start[b, 0, j] <= m < end[b, 0, j]) for j in range(n + 1, 9))
                assert turns[b, 0, n, m] == higher, (b, n, m)


def test_walks_in_step_tells_full_and_padded_masks_from_staggered_ones():
    """The deterministic backward interleaves heads at launch only where every live key block of
    a (batch, kv head) visits the same query blocks: a full mask with key padding per sequence
    is in step (its padded key blocks do not walk), a causal one is not, a mask with nothing
    live is."""
    from torch_cute_ops.runtime.attention_mask import live_ranges, mask_blocks, walks_in_step

    torch.manual_seed(0)
    s, tiles = 640, (128, 128)
    full = torch.ones(2, 1, s, s, dtype=torch.bool)
    full[0, ..., 300:] = False  # key padding of the first sequence
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(2, 1, s, s)
    rand = torch.rand(2, 1, s, s) > 0.5
    nothing = torch.zeros(2, 1, s, s, dtype=torch.bool)
    for mask, expected in ((full, True), (causal, False), (rand, True), (nothing, True)):
        ranges = live_ranges(mask_blocks(mask, s, s, *tiles).transpose(-1, -2))
        assert walks_in_step(ranges) is expected
    staggered_in_one_entry = full.clone()
    staggered_in_one_entry[1] = causal[1]
    ranges = live_ranges(mask_blocks(staggered_in_one_entry, s, s, *tiles).transpose(-1, -2))
    assert walks_in_step(ranges) is False
