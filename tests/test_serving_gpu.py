"""Serving steps on the Hopper kernels: packed decode rows and prefill chunks against a paged cache in
one launch (pages shuffled, page 16/32/64/256), vLLM's and SGLang's calls, CUDA-graph capture
replayed across batches of other lengths, and no host sync. Against float64 attention of the same
bf16 inputs; outputs poisoned with NaN first (deterministic mode fills fresh tensors with NaN),
and no fallback allowed (strict mode)."""

import pytest
import torch

from attention_checks import HOPPER, close
from serving_cases import expected, make_step
from test_gpu_decode_sync import no_sync

import torch_cute_ops as tco

pytestmark = HOPPER

QUERY_LENGTHS = [1, 1, 130, 1, 0, 1, 64, 1]
KEY_LENGTHS = [700, 1, 300, 0, 90, 4000, 64, 129]


@pytest.fixture(autouse=True)
def serving_kernels(monkeypatch):
    """The packed-paged and small-page kernels are opt-in until this file has passed on a GPU."""
    from torch_cute_ops.ops import attention_kvcache, attention_paged

    monkeypatch.setenv(attention_paged.SERVING_KERNELS_ENV, "1")
    for plans in (attention_paged._plans, attention_kvcache._plans, attention_kvcache._exact_plans):
        plans.clear()


@pytest.fixture
def strict_and_poisoned(monkeypatch, deterministic):
    monkeypatch.setenv("TORCH_CUTE_OPS_STRICT", "1")  # a fallback raises
    deterministic()  # torch.empty fills with NaN: rows a kernel misses stay NaN


def _step(page_size, head_dim, heads=(8, 2), seed=0, **kw):
    return make_step(QUERY_LENGTHS, KEY_LENGTHS, page_size, heads, head_dim, torch.bfloat16, "cuda", seed, **kw)


@pytest.mark.parametrize("page_size", [16, 32, 64, 256])
@pytest.mark.parametrize("head_dim, band", [(128, "causal"), (64, "window_softcap"), (64, "sink")])
def test_mixed_step_matches_float64(strict_and_poisoned, page_size, head_dim, band):
    step = _step(page_size, head_dim)
    causal = band != "sink"
    window, softcap = ((100, 0), 20.0) if band == "window_softcap" else ((-1, -1), 0.0)
    sink = torch.randn(8, device="cuda") if band == "sink" else None
    out, lse = tco.flash_attn_varlen_func(step.q, step.k_cache, step.v_cache, step.cu_seqlens_q,
                                          max_seqlen_q=step.max_seqlen_q, max_seqlen_k=step.max_seqlen_k,
                                          seqused_k=step.seqused_k, page_table=step.page_table, causal=causal,
                                          window_size=window, softcap=softcap, learnable_sink=sink, return_lse=True)
    ref_out, ref_lse = expected(step, causal, window, softcap, sink=sink)
    close("out", out, ref_out.cuda())
    close("lse", lse, ref_lse.cuda(), 1e-3)


def test_vllm_call_into_its_output(strict_and_poisoned):
    step = _step(16, 128)
    output = torch.full_like(step.q, float("nan"))
    descale = torch.ones(1, device="cuda").expand(len(QUERY_LENGTHS), 2)
    tco.flash_attn_varlen_func(
        q=step.q, k=step.k_cache, v=step.v_cache, out=output, cu_seqlens_q=step.cu_seqlens_q,
        max_seqlen_q=step.max_seqlen_q, seqused_k=step.seqused_k, max_seqlen_k=step.max_seqlen_k,
        softmax_scale=128 ** -0.5, causal=True, alibi_slopes=None, window_size=(-1, -1),
        block_table=step.page_table, softcap=0.0, scheduler_metadata=None, fa_version=3, q_descale=descale,
        k_descale=descale, v_descale=descale, num_splits=0, s_aux=None)
    close("out", output, expected(step, causal=True)[0].cuda())


def test_sglang_call_appends_packed_keys(strict_and_poisoned):
    step = _step(64, 128)
    new = torch.tensor([1, 1, 130, 1, 0, 1, 64, 1], dtype=torch.int32)  # every query's key is new
    before = (step.seqused_k.cpu() - new).clamp_min(0)
    new = step.seqused_k.cpu() - before
    cu_new = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0).int()]).cuda()
    k_new = torch.randn(int(new.sum()), 2, 128, device="cuda").bfloat16()
    v_new = torch.randn_like(k_new)
    out, lse = tco.flash_attn_with_kvcache(
        q=step.q, k_cache=step.k_cache, v_cache=step.v_cache, k=k_new, v=v_new, page_table=step.page_table,
        cache_seqlens=before.cuda(), cu_seqlens_q=step.cu_seqlens_q, cu_seqlens_k_new=cu_new,
        max_seqlen_q=step.max_seqlen_q, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
        k_descale=None, v_descale=None, return_softmax_lse=True, num_splits=0)
    ref_out, ref_lse = expected(step, causal=True)  # the cache as the call left it
    close("out", out, ref_out.cuda())
    close("lse", lse, ref_lse.cuda(), 1e-3)


def _load(step, into):
    """Copy a step's index values and cache into the captured buffers (same shapes)."""
    for name in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seqused_k", "page_table"):
        getattr(into, name).copy_(getattr(step, name))


@pytest.mark.parametrize("page_size", [16, 64])
def test_graph_replays_batches_of_other_lengths(strict_and_poisoned, page_size):
    """One capture (fixed shapes and maxima), replayed for two batches whose query and key lengths
    and pages differ (the second pads its queries: rows past cu_seqlens_q[-1] are no sequence's)."""
    def batch(query_lengths, key_lengths, seed):
        return make_step(query_lengths, key_lengths, page_size, (8, 2), 128, torch.bfloat16, "cuda", seed)

    buffers = batch([1, 1, 60, 1, 1], [2047] * 5, 3)
    batches = [batch([1, 1, 60, 1, 1], [900, 3, 60, 2000, 0], 1), batch([30, 1, 1, 1, 31], [31, 1500, 17, 2, 2047], 2)]
    batches[1].cu_seqlens_q[-1] -= 1  # a padded batch: its last row belongs to no sequence
    for b in batches:  # a pool and table of the captured shapes, pages in another order
        b.k_cache, b.v_cache = torch.randn_like(buffers.k_cache), torch.randn_like(buffers.v_cache)
        b.page_table = buffers.page_table[torch.randperm(5, device="cuda")]
    max_q = 64

    def call():
        return tco.flash_attn_varlen_func(buffers.q, buffers.k_cache, buffers.v_cache, buffers.cu_seqlens_q,
                                          max_seqlen_q=max_q, seqused_k=buffers.seqused_k,
                                          page_table=buffers.page_table, causal=True)

    _load(batches[0], buffers)
    call()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = call()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        for batch in batches:
            _load(batch, buffers)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            rows = int(batch.cu_seqlens_q[-1])
            close("replayed out", out[:rows], expected(batch, causal=True)[0][:rows].cuda())


def test_serving_steps_never_sync():
    """After a warm-up, steps with fresh index tensors (new values, checked on the device) run
    without a host synchronization, through both public functions."""
    step = _step(64, 128)
    output = torch.empty_like(step.q)

    def calls(cu, used, table):
        tco.flash_attn_varlen_func(step.q, step.k_cache, step.v_cache, cu, max_seqlen_q=step.max_seqlen_q,
                                   seqused_k=used, block_table=table, causal=True, out=output)
        tco.flash_attn_with_kvcache(step.q, step.k_cache, step.v_cache, cache_seqlens=used, page_table=table,
                                    cu_seqlens_q=cu, max_seqlen_q=step.max_seqlen_q, causal=True)

    calls(step.cu_seqlens_q, step.seqused_k, step.page_table)
    with no_sync():
        for _ in range(3):
            calls(step.cu_seqlens_q.clone(), step.seqused_k.clone(), step.page_table.clone())
    torch.cuda.synchronize()
    close("out", output, expected(step, causal=True)[0].cuda())


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_small_pages_in_kvcache_decode(strict_and_poisoned, page_size, seqlen_q):
    """flash_attn_with_kvcache's decode (pack-GQA rows, split-KV for the long entry) on 16- and
    32-token pages, a box per page."""
    step = make_step([seqlen_q] * 3, [5000, 17, 300], page_size, (8, 2), 128, torch.bfloat16, "cuda", 4)
    q = step.q.view(3, seqlen_q, 8, 128)
    out = tco.flash_attn_with_kvcache(q, step.k_cache, step.v_cache, cache_seqlens=step.seqused_k,
                                      page_table=step.page_table, causal=True)
    close("out", out.view(-1, 8, 128), expected(step, causal=True)[0].cuda())
