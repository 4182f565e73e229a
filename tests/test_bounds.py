"""Values that bound a kernel's memory access are checked before launch, and no cache of
"already checked" or of plans lets a later call skip a check it needs (CPU: the host checks)."""

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops.ops import attention, attention_kvcache, bounds


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("softcap", [float("inf"), float("nan"), -1.0])
def test_a_cached_plan_still_checks_softcap(softcap):
    q, k, v = torch.randn(2, 5, 4, 32), torch.randn(2, 7, 2, 32), torch.randn(2, 7, 2, 32)
    tco.flash_attn_func(q, k, v, softcap=5.0)  # plans this layout with a valid cap
    with pytest.raises(ValueError, match="softcap"):
        tco.flash_attn_func(q, k, v, softcap=softcap)
    cache = torch.randn(2, 9, 2, 32)
    tco.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=4, softcap=5.0)
    with pytest.raises(ValueError, match="softcap"):
        tco.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=4, softcap=softcap)


def test_checked_cu_seqlens_are_checked_again_against_another_packed_length():
    cu_q, cu_k = _i32([0, 4, 10]), _i32([0, 5, 12])
    tco.flash_attn_varlen_func(torch.randn(10, 4, 32), torch.randn(12, 2, 32), torch.randn(12, 2, 32), cu_q, cu_k, 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_k: the last entry"):
        tco.flash_attn_varlen_func(torch.randn(10, 4, 32), torch.randn(9, 2, 32), torch.randn(9, 2, 32), cu_q, cu_k,
                                   6, 7)


@pytest.mark.parametrize("start,end,match", [([0, 0], [99, 7], "key_end"), ([-3, 0], [7, 7], "key_start"),
                                             ([5, 0], [3, 7], "key_start"), ([0, 0], [7, -1], "key_end")])
def test_key_ranges_outside_the_keys_are_named(start, end, match):
    q, k, v = torch.randn(2, 5, 4, 32), torch.randn(2, 7, 2, 32), torch.randn(2, 7, 2, 32)
    with pytest.raises(ValueError, match=match):
        tco.flash_attn_func(q, k, v, key_start=_i32(start), key_end=_i32(end))


def test_a_checked_key_range_written_in_place_is_checked_again():
    q, k, v = torch.randn(2, 5, 4, 32), torch.randn(2, 7, 2, 32), torch.randn(2, 7, 2, 32)
    start, end = _i32([1, 0]), _i32([7, 5])
    out = tco.flash_attn_func(q, k, v, key_start=start, key_end=end)
    assert torch.isfinite(out).all()
    end[0] = 8  # a new version of the same tensor
    with pytest.raises(ValueError, match="key_end"):
        tco.flash_attn_func(q, k, v, key_start=start, key_end=end)
    end[0] = 7
    tco.flash_attn_func(q, k, v, key_start=start, key_end=end)
    with pytest.raises(ValueError, match="key_end"):  # the same values against fewer keys
        tco.flash_attn_func(q, k[:, :6], v[:, :6], key_start=start, key_end=end)


def test_kvcache_index_values_are_checked_against_the_cache():
    q, cache = torch.randn(2, 1, 4, 32), torch.randn(2, 16, 2, 32)
    call = dict(q=q, k_cache=cache, v_cache=cache)
    for lengths in ([3, 17], [-1, 3]):
        with pytest.raises(ValueError, match="cache_seqlens"):
            tco.flash_attn_with_kvcache(**call, cache_seqlens=_i32(lengths))
    with pytest.raises(ValueError, match="cache_leftpad"):
        tco.flash_attn_with_kvcache(**call, cache_seqlens=_i32([3, 16]), cache_leftpad=_i32([4, 0]))
    with pytest.raises(ValueError, match="cache_batch_idx"):
        tco.flash_attn_with_kvcache(**call, cache_seqlens=_i32([3, 16]), cache_batch_idx=_i32([0, 2]))
    pages = torch.randn(4, 8, 2, 32)
    with pytest.raises(ValueError, match="page_table"):
        tco.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=_i32([3, 16]), page_table=_i32([[0, 1], [2, 4]]))
    for length in (2**40, -1, 17):
        with pytest.raises(ValueError, match="cache_seqlens"):
            tco.flash_attn_with_kvcache(**call, cache_seqlens=length)


def test_a_bound_involving_another_tensor_is_keyed_on_that_tensor_too():
    """``key_start <= key_end``: a start checked against one end is checked again against another."""
    start = _i32([2, 2])
    bounds.check_within("key_start", start, 0, _i32([5, 5]), "key_end")
    with pytest.raises(ValueError, match="key_start"):
        bounds.check_within("key_start", start, 0, _i32([5, 1]), "key_end")


def test_a_growing_cache_reuses_its_plan_for_a_key_tile():
    """Decode against a cache that grows by a key a call: one plan per 16 keys, not per call."""
    q = torch.randn(1, 1, 8, 64)
    cache = torch.randn(1, 8, 200, 64).transpose(1, 2)  # transformers' (B, H, S, D) storage
    before = len(attention._fwd_plans)
    for keys in range(129, 161):
        tco.flash_attn_func(q, cache[:, :keys], cache[:, :keys], causal=True)
    assert len(attention._fwd_plans) - before <= 3
    before = len(attention_kvcache._plans)
    for keys in range(129, 161):
        tco.flash_attn_with_kvcache(q, cache[:, :keys], cache[:, :keys], cache_seqlens=keys - 3, causal=True)
    assert len(attention_kvcache._plans) - before <= 3


def test_a_plan_keyed_on_key_tiles_still_checks_a_mask_against_the_exact_key_count():
    q, k = torch.randn(1, 2, 2, 32), torch.randn(1, 7, 2, 32)
    mask = torch.ones(1, 1, 2, 7, dtype=torch.bool)
    torch.ops.cute.flash_attn_fwd(q, k, k, 0.2, False, None, None, 0.0, None, None, mask)
    with pytest.raises(ValueError, match="attn_mask"):
        torch.ops.cute.flash_attn_fwd(q, torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32), 0.2, False, None, None,
                                      0.0, None, None, mask)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_the_ops_check_softmax_scale_on_every_call(scale):
    q = torch.randn(1, 3, 2, 16)
    torch.ops.cute.flash_attn_fwd(q, q, q, 0.25, False)  # plans the layout
    with pytest.raises(ValueError, match="softmax_scale"):
        torch.ops.cute.flash_attn_fwd(q, q, q, scale, False)


def test_strided_index_tensors_reach_the_kernels_contiguous():
    lengths = torch.arange(8, dtype=torch.int32)[::2]
    assert not lengths.is_contiguous() and bounds.dense(lengths).is_contiguous()
    assert bounds.dense(lengths).tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("shapes", [((1, 1, 0, 64), (1, 1, 1, 64)), ((1, 0, 2, 64), (1, 5, 2, 64)),
                                    ((1, 3, 2, 64), (1, 0, 2, 64)), ((0, 3, 2, 64), (0, 3, 2, 64))])
def test_backward_never_plans_a_launch_without_rows_heads_or_keys(monkeypatch, shapes):
    """A backward with no query heads (q (1, 1, 0, 64) against one kv head passes the GQA check)
    once reached the kernel with an empty grid (CUDA invalid value); no rows, heads or keys
    means no launch."""
    from torch_cute_ops.runtime import attention as host

    monkeypatch.setattr(host, "get_compiled", lambda spec: spec)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q_shape, k_shape = shapes
    q, k = torch.randn(q_shape).half(), torch.randn(k_shape).half()
    assert isinstance(host.plan_bwd(q, k, k, False), str)
    assert isinstance(host.plan_bwd(q.flatten(0, 1), k.flatten(0, 1), k.flatten(0, 1), False, rows="packed"), str)
