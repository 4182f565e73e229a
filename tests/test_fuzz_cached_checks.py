"""Property-based fuzzing of checks that a cache could let through: each property makes a valid call
first (warming every plan and check cache for that layout), then an invalid one that differs only
in a value no cache key holds, which must still raise its named error.

* softcap: inf, nan and negative values after a valid softcap on the same layout;
* cu_seqlens already checked, reused with q or k of another packed length;
* key_start / key_end values outside [0, S_k] or start > end.
"""

from __future__ import annotations

import pytest
import torch

from fuzz_support import DEVICES, FLOAT_DTYPES, expect, fuzz_property, generator, head_dims, make, seeds
from hypothesis import strategies as st

import torch_cute_ops as tco

INVALID_SOFTCAPS = [float("inf"), float("nan"), -1.0, -float("inf"), -1e-3]


@st.composite
def dense_qkv(draw, device, min_len: int = 0):
    gen = generator(draw(seeds()))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    b, s_q, s_k = draw(st.integers(1, 2)), draw(st.integers(min_len, 6)), draw(st.integers(min_len, 6))
    h_kv, group, d = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(head_dims(device))
    return tuple(make(shape, dtype, device, gen) for shape in
                 ([b, s_q, h_kv * group, d], [b, s_k, h_kv, d], [b, s_k, h_kv, d]))


def softcap_calls(device, kind, qkv, draw):
    """call(softcap) for one entry point on one layout."""
    q, k, v = qkv
    if kind == "flash_attn_func":
        causal = draw(st.booleans())
        return lambda cap: tco.flash_attn_func(q, k, v, causal=causal, softcap=cap)
    if kind == "cute.flash_attn_bwd":
        out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.5, False)
        return lambda cap: torch.ops.cute.flash_attn_bwd(out, q, k, v, out, lse, 0.5, False, None, None, cap)
    if kind == "flash_attn_varlen_func":
        b, s_q, h, d = q.shape
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=device) * s_q
        cu_k = torch.arange(b + 1, dtype=torch.int32, device=device) * k.shape[1]
        packed = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, s_q, k.shape[1])
        return lambda cap: tco.flash_attn_varlen_func(*packed, softcap=cap)
    return lambda cap: tco.flash_attn_with_kvcache(q, k, v, cache_seqlens=k.shape[1], softcap=cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["flash_attn_func", "cute.flash_attn_bwd", "flash_attn_varlen_func",
                                  "flash_attn_with_kvcache"])
@fuzz_property(20)
def test_softcap_is_checked_on_a_warm_layout(device, kind, data):
    call = softcap_calls(device, kind, data.draw(dense_qkv(device)), data.draw)
    valid = data.draw(st.sampled_from([5.0, 0.5, 30.0]))
    invalid = data.draw(st.sampled_from(INVALID_SOFTCAPS))
    expect(lambda: call(valid), None, f"{kind} softcap={valid}")
    expect(lambda: call(invalid), ("softcap",), f"{kind} softcap={invalid} after softcap={valid}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("public", [True, False], ids=["flash_attn_varlen_func", "cute.flash_attn_varlen_fwd"])
@fuzz_property(30)
def test_checked_cu_seqlens_are_rechecked_for_another_packed_length(device, public, data):
    gen = generator(data.draw(seeds()))
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    h, d = data.draw(st.integers(1, 2)), data.draw(head_dims(device))
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))

    def call(total_q, total_k):
        q, k, v = (make([n, h, d], dtype, device, gen) for n in (total_q, total_k, total_k))
        if public:
            return tco.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest)
        return torch.ops.cute.flash_attn_varlen_fwd(q, k, v, cu, cu, longest, longest, 0.5, False)

    expect(lambda: call(total, total), None, f"lengths {lengths}")
    grow = data.draw(st.sampled_from(["q", "k"]))
    extra = data.draw(st.integers(1, 3))
    shapes = (total + extra, total) if grow == "q" else (total, total + extra)
    expect(lambda: call(*shapes), (f"cu_seqlens_{grow}",), f"lengths {lengths}, then {grow} of {total + extra} rows")


@st.composite
def bad_key_range(draw, batch: int, s_k: int):
    """key_start, key_end with one entry outside 0 <= start <= end <= S_k."""
    ends = [draw(st.integers(0, s_k)) for _ in range(batch)]
    starts = [draw(st.integers(0, end)) for end in ends]
    b = draw(st.integers(0, batch - 1))
    how = draw(st.sampled_from(["end past S_k", "negative start", "negative end", "start past end"]))
    if how == "end past S_k":
        ends[b] = s_k + draw(st.sampled_from([1, 2, 99]))
    elif how == "negative start":
        starts[b] = -draw(st.sampled_from([1, 3]))
    elif how == "negative end":
        starts[b], ends[b] = -5, -draw(st.sampled_from([1, 3]))
    else:
        starts[b], ends[b] = s_k, draw(st.integers(0, max(s_k - 1, 0)))
        if ends[b] >= starts[b]:
            starts[b] = ends[b] + 1
    return starts, ends, how


# CPU only: a GPU checks index values on the device (a device-side assertion, no host sync)
@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize("kind", ["flash_attn_func", "cute.flash_attn_fwd", "cute.flash_attn_bwd"])
@fuzz_property(30)
def test_key_range_values_are_checked(device, kind, data):
    q, k, v = data.draw(dense_qkv(device))
    starts, ends, how = data.draw(bad_key_range(q.shape[0], k.shape[1]))
    key_start, key_end = (torch.tensor(x, dtype=torch.int32, device=device) for x in (starts, ends))
    ok_start = torch.zeros_like(key_start)
    ok_end = torch.full_like(key_end, k.shape[1])
    if kind == "flash_attn_func":
        def call(start, end):
            return tco.flash_attn_func(q, k, v, key_start=start, key_end=end)
    elif kind == "cute.flash_attn_fwd":
        def call(start, end):
            return torch.ops.cute.flash_attn_fwd(q, k, v, 0.5, False, None, None, 0.0, start, end)
    else:
        out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.5, False, None, None, 0.0, ok_start, ok_end)

        def call(start, end):
            return torch.ops.cute.flash_attn_bwd(out, q, k, v, out, lse, 0.5, False, None, None, 0.0, start, end)
    expect(lambda: call(ok_start, ok_end), None, f"{kind} valid key range")
    expect(lambda: call(key_start, key_end), ("key_start", "key_end"),
           f"{kind} {how}: key_start {starts} key_end {ends}, S_k {k.shape[1]}")
