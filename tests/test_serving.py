"""Serving engines' calls on the CPU (the reference path): packed queries against a paged cache in
one call (decode rows and prefill chunks together), vLLM's and SGLang's exact argument lists, and
bad index values named before anything runs. Against an independent float64 attention."""

import pytest
import torch

from serving_cases import expected, make_step

import torch_cute_ops as tco
from torch_cute_ops.ops import bounds

# decode rows (1 query), prefill chunks, a sequence with no keys yet, one with no queries
QUERY_LENGTHS = [1, 1, 7, 1, 20, 0, 1]
KEY_LENGTHS = [5, 40, 7, 0, 33, 9, 1]


def _close(ours, ref, tol=1e-9):
    assert not torch.isnan(ours).any()
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite].double(), ref[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("page_size", [16, 32, 64, 256])
@pytest.mark.parametrize("band", ["none", "causal", "window", "softcap"])
def test_varlen_paged_mixed_batch(page_size, band):
    step = make_step(QUERY_LENGTHS, KEY_LENGTHS, page_size)
    causal, window, softcap = band == "causal", (6, 0) if band == "window" else (-1, -1), \
        3.0 if band == "softcap" else 0.0
    out, lse = tco.flash_attn_varlen_func(step.q, step.k_cache, step.v_cache, step.cu_seqlens_q,
                                          max_seqlen_q=step.max_seqlen_q, max_seqlen_k=step.max_seqlen_k,
                                          seqused_k=step.seqused_k, page_table=step.page_table, causal=causal,
                                          window_size=window, softcap=softcap, return_lse=True)
    ref_out, ref_lse = expected(step, causal, window, softcap)
    _close(out, ref_out)
    _close(lse, ref_lse)


def test_seqused_q_leaves_the_rest_zero():
    step = make_step([3, 5, 1], [10, 12, 4], 16)
    seqused_q = torch.tensor([2, 5, 0], dtype=torch.int32)
    out, lse = tco.flash_attn_varlen_func(step.q, step.k_cache, step.v_cache, step.cu_seqlens_q, None, 5,
                                          seqused_q=seqused_q, seqused_k=step.seqused_k,
                                          block_table=step.page_table, causal=True, return_lse=True)
    ref_out, ref_lse = expected(step, causal=True, seqused_q=seqused_q)
    _close(out, ref_out)
    _close(lse, ref_lse)
    assert out[2].abs().sum() == 0 and torch.isinf(lse[:, 2]).all()  # sequence 0's third row is not real


def test_seqused_k_from_cu_seqlens_k():
    """With a page table and no seqused_k, cu_seqlens_k's lengths are the key counts (FlashAttention)."""
    step = make_step([1, 4], [9, 30], 16)
    cu_k = torch.tensor([0, 9, 39], dtype=torch.int32)
    out = tco.flash_attn_varlen_func(step.q, step.k_cache, step.v_cache, step.cu_seqlens_q, cu_k, 4, 30,
                                     page_table=step.page_table, causal=True)
    _close(out, expected(step, causal=True)[0])


def test_vllm_argument_list():
    """vLLM's FlashAttention backend call, argument for argument (descales given with a 16-bit
    cache: FlashAttention ignores them), into its preallocated output, sinks as s_aux."""
    step = make_step(QUERY_LENGTHS, KEY_LENGTHS, 16)
    output = torch.full_like(step.q, float("nan"))
    sinks = torch.randn(step.q.shape[1], dtype=torch.float64)
    descale_shape = (step.cu_seqlens_q.shape[0] - 1, step.k_cache.shape[2])
    scale = torch.ones(1, dtype=torch.float32)
    result = tco.flash_attn_varlen_func(
        q=step.q, k=step.k_cache, v=step.v_cache, out=output, cu_seqlens_q=step.cu_seqlens_q,
        max_seqlen_q=step.max_seqlen_q, seqused_k=step.seqused_k, max_seqlen_k=step.max_seqlen_k,
        softmax_scale=0.1, causal=True, alibi_slopes=None, window_size=[-1, -1], block_table=step.page_table,
        softcap=0.0, scheduler_metadata=None, fa_version=3, q_descale=scale.expand(descale_shape),
        k_descale=scale.expand(descale_shape), v_descale=scale.expand(descale_shape), num_splits=0, s_aux=sinks)
    assert result is output
    _close(output, expected(step, causal=True, scale=0.1, sink=sinks)[0])


def test_sglang_argument_list():
    """SGLang's flash_attn_with_kvcache call: packed q, a paged cache, cu_seqlens_k_new without
    new keys (nothing appended), lse returned."""
    step = make_step(QUERY_LENGTHS, KEY_LENGTHS, 32)
    cu_k = torch.tensor([0, *torch.tensor(KEY_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    out, lse, *rest = tco.flash_attn_with_kvcache(
        q=step.q, k_cache=step.k_cache, v_cache=step.v_cache, page_table=step.page_table,
        cache_seqlens=step.seqused_k, cu_seqlens_q=step.cu_seqlens_q, cu_seqlens_k_new=cu_k,
        max_seqlen_q=step.max_seqlen_q, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
        k_descale=None, v_descale=None, return_softmax_lse=True, num_splits=0)
    assert not rest
    ref_out, ref_lse = expected(step, causal=True)
    _close(out, ref_out)
    _close(lse, ref_lse)


@pytest.mark.parametrize("contiguous", [False, True])
def test_kvcache_packed_appends_new_keys(contiguous):
    """Packed new keys are written at each sequence's cache_seqlens onwards, then attended."""
    new = [1, 3, 0, 2]
    before = [4, 0, 6, 17]
    step = make_step([1, 3, 1, 2], [b + n for b, n in zip(before, new)], 16 if not contiguous else 32,
                     spare_pages=0 if contiguous else 3)
    if contiguous:  # one page per entry, in table order: a (batch, capacity, H, D) cache
        step.page_table = torch.arange(4, dtype=torch.int32)[:, None]
        step.k_cache, step.v_cache = step.k_cache[:4], step.v_cache[:4]
    target_k, target_v = step.k_cache.clone(), step.v_cache.clone()
    cu_new = torch.tensor([0, 1, 4, 4, 6], dtype=torch.int32)
    k_new, v_new = torch.randn(6, *step.k_cache.shape[2:], dtype=torch.float64), \
        torch.randn(6, *step.k_cache.shape[2:], dtype=torch.float64)
    page_size = step.k_cache.shape[1]
    for b in range(4):  # the append, by hand
        for t in range(new[b]):
            pos = before[b] + t
            page = step.page_table[b, pos // page_size]
            target_k[page, pos % page_size] = k_new[cu_new[b] + t]
            target_v[page, pos % page_size] = v_new[cu_new[b] + t]
    out = tco.flash_attn_with_kvcache(step.q, step.k_cache, step.v_cache, k_new, v_new,
                                      cache_seqlens=torch.tensor(before, dtype=torch.int32),
                                      page_table=None if contiguous else step.page_table, causal=True,
                                      cu_seqlens_q=step.cu_seqlens_q, cu_seqlens_k_new=cu_new,
                                      max_seqlen_q=step.max_seqlen_q)
    assert torch.equal(step.k_cache, target_k) and torch.equal(step.v_cache, target_v)
    _close(out, expected(step, causal=True)[0])


def _call(step, **changes):
    args = dict(max_seqlen_q=step.max_seqlen_q, seqused_k=step.seqused_k, page_table=step.page_table)
    args.update(changes)
    cu = args.pop("cu_seqlens_q", step.cu_seqlens_q)
    return tco.flash_attn_varlen_func(step.q, step.k_cache, step.v_cache, cu, **args)


@pytest.mark.parametrize("change, match", [
    (lambda s: {"page_table": s.page_table.clone().fill_(s.k_cache.shape[0])}, "page_table: every value"),
    (lambda s: {"page_table": s.page_table.clone().fill_(-1)}, "page_table: every value"),
    (lambda s: {"seqused_k": s.seqused_k.clone().fill_(s.page_table.shape[1] * 16 + 1)}, "seqused_k: every value"),
    (lambda s: {"seqused_k": s.seqused_k.clone().fill_(-1)}, "seqused_k: every value"),
    (lambda s: {"cu_seqlens_q": torch.tensor([0, 2, 1, 3], dtype=torch.int32)}, "cu_seqlens_q: must start at 0"),
    (lambda s: {"cu_seqlens_q": torch.tensor([1, 2, 3, 3], dtype=torch.int32)}, "cu_seqlens_q: must start at 0"),
    (lambda s: {"cu_seqlens_q": torch.tensor([0, 1, 2, 4], dtype=torch.int32)}, "end at most at 3"),
    (lambda s: {"max_seqlen_q": 0}, "max_seqlen_q = 0"),
    (lambda s: {"seqused_q": torch.tensor([2, 1, 1], dtype=torch.int32)}, "seqused_q: every value"),
])
def test_bad_values_named(change, match):
    step = make_step([1, 1, 1], [3, 20, 0], 16)
    with pytest.raises(ValueError, match=match):
        _call(step, **change(step))


@pytest.mark.parametrize("change, error, match", [
    ({"page_table": torch.zeros(2, 2, dtype=torch.int32)}, ValueError, r"page_table: expected an int32 tensor of "
                                                                       r"shape \(3, pages"),
    ({"page_table": torch.zeros(3, 2, dtype=torch.int64)}, ValueError, "page_table: expected an int32"),
    ({"seqused_k": torch.zeros(3, dtype=torch.int64)}, ValueError, "seqused_k: expected an int32"),
    ({"seqused_k": None}, ValueError, "seqused_k: required"),
    ({"max_seqlen_q": None}, ValueError, "max_seqlen_q: required"),
    ({"alibi_slopes": torch.zeros(4)}, NotImplementedError, "alibi_slopes"),
    ({"dropout_p": 0.1}, NotImplementedError, "dropout_p"),
    ({"num_splits": -1}, ValueError, "num_splits"),
    ({"rotary_cos": None}, TypeError, "rotary_cos"),
    ({"block_table": torch.zeros(3, 2, dtype=torch.int32)}, ValueError, "page_table, block_table: give one"),
    ({"out": torch.zeros(3, 4, 32, dtype=torch.float64)}, ValueError, "out: expected"),
])
def test_bad_arguments_named(change, error, match):
    step = make_step([1, 1, 1], [3, 20, 0], 16)
    with pytest.raises(error, match=match):
        _call(step, **change)


def test_fp8_descale_not_implemented():
    step = make_step([1], [3], 16, dtype=torch.bfloat16)
    k8 = step.k_cache.to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="k_descale"):
        tco.flash_attn_varlen_func(step.q, k8, k8, step.cu_seqlens_q, max_seqlen_q=1, seqused_k=step.seqused_k,
                                   page_table=step.page_table, k_descale=torch.ones(1, 1))


def test_seqused_without_page_table_not_implemented():
    step = make_step([1], [3], 16)
    with pytest.raises(NotImplementedError, match="seqused"):
        tco.flash_attn_varlen_func(step.q, step.q, step.q, step.cu_seqlens_q, step.cu_seqlens_q, 1, 1,
                                   seqused_k=step.seqused_k)


def test_bad_append_named():
    step = make_step([1, 2], [3, 4], 16)
    k_new = torch.zeros(3, *step.k_cache.shape[2:], dtype=torch.float64)
    common = dict(cache_seqlens=torch.tensor([2, 2], dtype=torch.int32), page_table=step.page_table,
                  cu_seqlens_q=step.cu_seqlens_q, max_seqlen_q=2)
    with pytest.raises(ValueError, match="cu_seqlens_k_new: required"):
        tco.flash_attn_with_kvcache(step.q, step.k_cache, step.v_cache, k_new, k_new, **common)
    full = torch.tensor([2, step.page_table.shape[1] * 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens: every value plus its new tokens"):
        tco.flash_attn_with_kvcache(step.q, step.k_cache, step.v_cache, k_new, k_new,
                                    cu_seqlens_k_new=torch.tensor([0, 1, 3], dtype=torch.int32),
                                    **{**common, "cache_seqlens": full})


def test_values_checked_once_per_version():
    """A step's layers share one check of its index tensors; an in-place edit is checked again."""
    step = make_step([1, 2], [3, 4], 16)
    _call(step)
    assert bounds.was_checked(step.cu_seqlens_q, ("cu_seqlens", 3, step.max_seqlen_q))
    step.seqused_k[0] = 10_000
    with pytest.raises(ValueError, match="seqused_k"):
        _call(step)


def test_opcheck_paged_op():
    """The paged op's schema, fake function and dispatch agree (torch.library.opcheck)."""
    step = make_step([1, 3, 0], [5, 40, 2], 16)
    torch.library.opcheck(torch.ops.cute.flash_attn_varlen_paged.default,
                          (step.q, step.k_cache, step.v_cache, step.cu_seqlens_q, None, step.seqused_k,
                           step.page_table, 3, 0.125, True))
    torch.library.opcheck(torch.ops.cute.flash_attn_varlen_paged.default,
                          (step.q, step.k_cache, step.v_cache, step.cu_seqlens_q, torch.tensor([1, 2, 0]).int(),
                           step.seqused_k, step.page_table, 3, 0.125, False, 4, 0, 2.0))


def test_compiled_serving_step_matches_eager():
    step = make_step([1, 3, 2], [5, 40, 20], 16)

    def call(q, cu, used, table):
        return tco.flash_attn_varlen_func(q, step.k_cache, step.v_cache, cu, max_seqlen_q=3, seqused_k=used,
                                          block_table=table, causal=True)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(step.q, step.cu_seqlens_q, step.seqused_k, step.page_table),
                               call(step.q, step.cu_seqlens_q, step.seqused_k, step.page_table))


@pytest.mark.parametrize("opt_in", [False, True])
def test_serving_kernels_are_opt_in_until_run_on_a_gpu(monkeypatch, opt_in):
    """The packed-paged op and a 16-token-page decode plan the named fallback by default and the
    kernel with TORCH_CUTE_OPS_SERVING_KERNELS=1 (the kernels are compiled, not yet run)."""
    from torch_cute_ops.ops import attention_kvcache, attention_paged
    from torch_cute_ops.runtime import attention as host

    monkeypatch.setattr(host, "get_compiled", lambda spec: spec)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(host, "num_sms", lambda index: 132)
    monkeypatch.setattr(host, "_unused_counter", lambda index: torch.empty(1, dtype=torch.int32))
    monkeypatch.setattr(attention_paged.dispatch, "kernel_for", lambda op, device: host)
    monkeypatch.setattr(attention_kvcache.dispatch, "kernel_for", lambda op, device: host)
    if opt_in:
        monkeypatch.setenv(attention_paged.SERVING_KERNELS_ENV, "1")
    else:
        monkeypatch.delenv(attention_paged.SERVING_KERNELS_ENV, raising=False)
    q = torch.empty(9, 32, 128, dtype=torch.bfloat16)
    k_cache = torch.empty(40, 16, 8, 128, dtype=torch.bfloat16)
    page_table = torch.zeros(3, 12, dtype=torch.int32)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    paged = attention_paged._make_plan(("paged", opt_in), q, k_cache, k_cache, page_table, True, False, 0.0)
    q1 = torch.empty(3, 1, 32, 128, dtype=torch.bfloat16)
    decode = attention_kvcache._make_plan(("decode", opt_in), q1, k_cache, k_cache, page_table, None, None, True,
                                          False, 0.0)
    for plan in (paged, decode):
        if opt_in:
            assert not isinstance(plan, str), plan
        else:
            assert isinstance(plan, str) and "not yet verified on a GPU" in plan and "SERVING_KERNELS=1" in plan
