"""flash_attn_with_kvcache in the op layer on the CPU: append semantics, paged = contiguous,
fake function and opcheck (the op declares its cache mutation), named errors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_cute_ops as tco


def _setup(batch=3, s_q=2, h_q=4, h_kv=2, cap=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return (rand(batch, s_q, h_q, 16), rand(batch, cap, h_kv, 16), rand(batch, cap, h_kv, 16),
            rand(batch, s_q, h_kv, 16), rand(batch, s_q, h_kv, 16))


def test_append_in_place_then_attend_to_each_entrys_keys():
    q, k_cache, v_cache, k, v = _setup()
    before = k_cache.clone()
    lengths = torch.tensor([0, 7, 30], dtype=torch.int32)
    out = tco.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[b, n:n + 2], k[b]) and torch.equal(k_cache[b, :n], before[b, :n])
        dense = tco.flash_attn_func(q[b:b + 1], k_cache[b:b + 1, :n + 2], v_cache[b:b + 1, :n + 2], causal=True)
        torch.testing.assert_close(out[b], dense[0])


def test_int_lengths_and_cache_batch_idx():
    q, k_cache, v_cache, _, _ = _setup()
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    out = tco.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=9, cache_batch_idx=idx)
    for b in range(3):
        dense = tco.flash_attn_func(q[b:b + 1], k_cache[idx[b]:idx[b] + 1, :9], v_cache[idx[b]:idx[b] + 1, :9])
        torch.testing.assert_close(out[b], dense[0])


def test_leftpad_starts_each_entrys_keys_and_follows_any_cache_strides():
    """cache_leftpad: entry b attends to keys [leftpad[b], length) (padding stays in the cache), the
    queries aligned bottom-right to the length; a transposed (B, H_kv, S, D) cache is the same."""
    q, k_cache, v_cache, k, v = _setup()
    heads_major = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache)]
    lengths = torch.tensor([3, 7, 28], dtype=torch.int32)
    leftpad = torch.tensor([0, 4, 9], dtype=torch.int32)
    outs = [tco.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lengths, cache_leftpad=leftpad,
                                        causal=True, window_size=(6, 0))
            for caches in ((k_cache, v_cache), heads_major)]
    assert torch.equal(heads_major[0], k_cache), "the append honours the cache's strides"
    for b, (start, n) in enumerate(zip(leftpad.tolist(), lengths.tolist())):
        keys = slice(start, n + 2)
        dense = tco.flash_attn_func(q[b:b + 1], k_cache[b:b + 1, keys], v_cache[b:b + 1, keys], causal=True,
                                    window_size=(6, 0))
        for out in outs:
            torch.testing.assert_close(out[b], dense[0])


def test_fake_and_opcheck():
    q, k_cache, v_cache, k, v = _setup()
    lengths = torch.tensor([1, 2, 3], dtype=torch.int32)
    args = (q, k_cache, v_cache, k, v, lengths, None, None, 0.25, True)
    real = torch.ops.cute.flash_attn_kvcache(*(t.clone() if isinstance(t, torch.Tensor) else t for t in args))
    with FakeTensorMode() as mode:
        fake = torch.ops.cute.flash_attn_kvcache(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                                   for t in args))
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype) == (r.shape, r.dtype)
    torch.library.opcheck(torch.ops.cute.flash_attn_kvcache.default, args)
    leftpad = torch.tensor([1, 0, 2], dtype=torch.int32)
    torch.library.opcheck(torch.ops.cute.flash_attn_kvcache.default, args, {"cache_leftpad": leftpad})


@pytest.mark.parametrize("change,match", [
    (dict(cache_seqlens=torch.tensor([0, 7, 31], dtype=torch.int32)), r"cache_seqlens: every value must lie in \[0, 30 \(the cache's capacity of 32"),
    (dict(cache_seqlens=torch.tensor([0, 7, 30])), "cache_seqlens: expected an int32 tensor"),
    (dict(k=None), "k, v: give both"),
    (dict(cache_batch_idx=torch.tensor([0, 1, 3], dtype=torch.int32)), r"cache_batch_idx: every value must lie in \[0, 2 .*got \[3\]"),
    (dict(k=torch.randn(3, 2, 4, 16, dtype=torch.float64)), "k: expected shape"),
    (dict(cache_leftpad=torch.tensor([0, 10, 0], dtype=torch.int32)), r"cache_leftpad: every value must lie in \[0, its entry's length.*got \[10\]"),
    (dict(cache_leftpad=torch.tensor([-1, 0, 0], dtype=torch.int32)), r"cache_leftpad: every value must lie in \[0, .*got \[-1\]"),
    (dict(cache_leftpad=torch.tensor([0, 1, 0])), "cache_leftpad: expected an int32 tensor"),
    (dict(cache_leftpad=torch.zeros(3, dtype=torch.int32), page_table=torch.zeros(3, 1, dtype=torch.int32)),
     "cache_leftpad: not supported with page_table"),
])
def test_named_errors(change, match):
    q, k_cache, v_cache, k, v = _setup()
    call = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                cache_seqlens=torch.tensor([0, 7, 30], dtype=torch.int32))
    call.update(change)
    with pytest.raises(ValueError, match=match):
        tco.flash_attn_with_kvcache(**call)


@pytest.mark.parametrize("tiles,key_blocks", [(8, 256), (64, 32), (32, 256), (1, 8), (3, 1000), (66, 64), (8, 8),
                                               (8, 32), (16, 8), (32, 8), (8, 4), (8, 1), (2, 500)])
def test_split_kv_fills_one_wave(tiles, key_blocks):
    """Split-KV never leaves (tile, split) pairs for a second wave and gives every split a key
    block; it splits only tiles that fill at most a quarter of the SMs, into a full wave of
    splits of >= 4 blocks where the keys allow, else into about half a wave of shorter ones."""
    from torch_cute_ops.runtime.attention import MAX_SPLITS, num_splits_for

    sms = 132
    splits = num_splits_for(tiles, key_blocks, sms)
    assert 1 <= splits <= MAX_SPLITS == 32
    assert tiles * splits <= sms or splits == 1
    assert splits <= key_blocks
    full_wave = min(sms // tiles, 32)
    if 4 * tiles > sms or key_blocks < 2:
        assert splits == 1
    elif key_blocks >= 4 * full_wave:
        assert splits == full_wave  # long keys: as many splits as one wave holds
    else:
        assert splits == min(key_blocks, sms // 2 // tiles)  # short keys: about half a wave
        assert tiles * splits <= sms // 2


def test_split_counts_of_the_decode_shapes_measured():
    """The split counts the H100 measurements chose (GQA 32/8, 128-key blocks): B1 x 1k 8
    splits of one block, B1 x 4k 8 of four, B1 x 32k 16, B4 x 1k 2, B8 x 4k none."""
    from torch_cute_ops.runtime.attention import num_splits_for

    assert [num_splits_for(tiles, blocks, 132) for tiles, blocks in
            [(8, 8), (8, 32), (8, 256), (32, 8), (64, 32), (8, 4)]] == [8, 8, 16, 2, 1, 4]


def test_captured_launches_take_distinct_slots_of_a_zeroed_slab(monkeypatch):
    """While a graph is captured, each dynamic-schedule launch gets its own counter (and a stream-K
    GEMM its own flags): words of the slab an eager call zeroed (no memset in the graph), never
    ones handed out before; an eager call renews the slab once half of it is handed out, keeping
    the old one alive."""
    from torch_cute_ops.runtime import scratch as rt

    index = 7  # a device no test uses: the slab here is a CPU stand-in
    slab = torch.zeros(rt.CAPTURE_COUNTERS_PER_SLAB, dtype=torch.int32)
    monkeypatch.setitem(rt._capture_slabs, index, [slab, 0])
    slots = [rt._capture_words(torch.device("cuda", index), 1) for _ in range(3)]
    assert [s.data_ptr() for s in slots] == [slab.data_ptr() + 4 * i for i in range(3)]
    assert all(s.shape == (1,) and s.item() == 0 for s in slots)
    flags = rt._capture_words(torch.device("cuda", index), 132)
    assert flags.data_ptr() == slab.data_ptr() + 4 * 3 and flags.shape == (132,)
    assert rt._capture_slabs[index][1] == 3 + 132
    monkeypatch.setattr(rt, "_retired_slabs", [])
    rt._capture_slabs[index][1] = rt.CAPTURE_COUNTERS_PER_SLAB // 2 + 1
    made = []
    monkeypatch.setattr(rt.torch, "zeros", lambda *a, **k: made.append(k["device"]) or slab.clone())
    rt._ready_capture_slab(index)
    assert made == [torch.device("cuda", index)] and rt._retired_slabs == [slab]
    assert rt._capture_slabs[index][1] == 0 and rt._capture_slabs[index][0] is not slab
