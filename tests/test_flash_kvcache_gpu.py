"""flash_attn_with_kvcache on the Hopper kernels: appends in place, ragged cache lengths, paged
caches with shuffled page tables, GQA, windows, softcap, lse; CUDA-graph capture of a decode step
replayed with new lengths; torch.compile keeps the cache write. Against a float32 reference of
the same rounded inputs."""

import pytest
import torch

from attention_checks import HOPPER, close

import torch_cute_ops as tco
from torch_cute_ops.reference.attention import flash_attn_fwd as ref_fwd

pytestmark = HOPPER


_close = close


def _paged(cache, page_size, gen):
    """The same cache as shuffled pages: (pages, page_size, H, D) and the (B, pages per entry) table."""
    b, cap, h, d = cache[0].shape
    per_entry = cap // page_size
    order = torch.randperm(b * per_entry, device="cuda", generator=gen)
    table = order.view(b, per_entry).int()
    paged = []
    for c in cache:
        pages = torch.empty(b * per_entry, page_size, h, d, dtype=c.dtype, device="cuda")
        pages[table.long().flatten()] = c.reshape(b * per_entry, page_size, h, d)
        paged.append(pages)
    return paged, table


def _reference(q, k_cache, v_cache, lengths, causal, window, softcap):
    outs, lses = [], []
    left = None if window[0] < 0 else window[0]
    for b, n in enumerate(lengths):
        o, l = ref_fwd(q[b:b + 1].float(), k_cache[b:b + 1, :n].float(), v_cache[b:b + 1, :n].float(),
                       q.shape[-1] ** -0.5, causal, left, None, softcap)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


# (batch, seqlen_q, heads_q, heads_kv, capacity, page_size or None, causal, window_left, softcap)
CASES = [
    (4, 1, 32, 8, 2048, None, True, -1, 0.0),
    (4, 1, 32, 8, 2048, 256, True, -1, 0.0),
    (3, 4, 16, 4, 1024, 64, True, -1, 0.0),
    (2, 16, 8, 8, 1024, 128, True, 100, 0.0),
    (3, 1, 8, 1, 512, 128, False, -1, 30.0),
    (2, 7, 8, 2, 640, None, True, 200, 20.0),
    (2, 9, 64, 8, 1024, None, True, -1, 0.0),  # 72 (token, head) rows: two slabs, the second partly real
    (2, 16, 32, 2, 512, 64, True, -1, 0.0),  # 256 rows: two query blocks
]


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}-sq{c[1]}-h{c[2]}/{c[3]}-cap{c[4]}-page{c[5]}-w{c[7]}-cap{c[8]:g}"
                                             for c in CASES])
def test_append_then_attend(case):
    batch, s_q, h_q, h_kv, cap, page, causal, left, softcap = case
    gen = torch.Generator(device="cuda").manual_seed(cap + s_q)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).bfloat16()  # noqa: E731
    k_cache, v_cache = rand(batch, cap, h_kv, 128), rand(batch, cap, h_kv, 128)
    q, k, v = rand(batch, s_q, h_q, 128), rand(batch, s_q, h_kv, 128), rand(batch, s_q, h_kv, 128)
    lengths = [0, cap - s_q, 1, 257][:batch]  # ragged: empty, full, short, odd
    lengths[0] = 0
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        expected_k[b, n:n + s_q], expected_v[b, n:n + s_q] = k[b], v[b]
    window = (left, 0 if causal else -1)
    if page is None:
        caches, table = (k_cache, v_cache), None
    else:
        caches, table = _paged((k_cache, v_cache), page, gen)
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=cache_seqlens, page_table=table,
                                           causal=causal, window_size=window, softcap=softcap, return_lse=True)
    assert not tco.fallback_counts(), tco.fallback_counts()
    if table is None:
        assert torch.equal(caches[0], expected_k) and torch.equal(caches[1], expected_v), "append"
    else:
        assert torch.equal(caches[0][table.long()].flatten(1, 2), expected_k), "paged append"
    ref_out, ref_lse = _reference(q, expected_k, expected_v, [n + s_q for n in lengths], causal, window, softcap)
    _close("out", out, ref_out)
    _close("lse", lse, ref_lse, 1e-3)


# (batch, seqlen_q, heads_q, heads_kv, capacity, causal, window_left, softcap, head_dim)
RANGED = [
    (3, 1, 32, 8, 2048, True, -1, 0.0, 128),
    (2, 4, 16, 4, 1024, True, -1, 0.0, 128),
    (2, 1, 32, 8, 16384, True, -1, 0.0, 128),  # split-KV
    (3, 7, 8, 2, 640, True, 100, 20.0, 128),
    (2, 1, 8, 8, 512, False, -1, 0.0, 128),
    (3, 1, 32, 8, 2048, True, -1, 0.0, 64),  # the shipped D64 decode variants (small GQA models)
    (2, 1, 32, 8, 16384, True, -1, 0.0, 64),
    (2, 1, 16, 8, 4096, True, -1, 50.0, 256),  # Gemma 2's decode: D256, softcap 50, global ...
    (2, 1, 16, 8, 16384, True, 4095, 50.0, 256),  # ... and sliding-window layers
]


@pytest.mark.parametrize("case", RANGED, ids=[f"b{c[0]}-sq{c[1]}-h{c[2]}/{c[3]}-cap{c[4]}-w{c[6]}-cap{c[7]:g}-d{c[8]}"
                                              for c in RANGED])
def test_left_padded_heads_major_cache(case):
    """transformers' cache layout, (B, H_kv, capacity, D) storage seen as (B, capacity, H_kv, D), with
    cache_leftpad: each entry attends to keys [leftpad, length + new) on the kernels (ranged rows)."""
    batch, s_q, h_q, h_kv, cap, causal, left, softcap, d = case
    gen = torch.Generator(device="cuda").manual_seed(cap + 7 * s_q)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).bfloat16()  # noqa: E731
    k_cache, v_cache = (rand(batch, h_kv, cap, d).transpose(1, 2) for _ in range(2))
    q, k, v = rand(batch, s_q, h_q, d), rand(batch, s_q, h_kv, d), rand(batch, s_q, h_kv, d)
    lengths = [cap - s_q, 300, 1][:batch]
    starts = [0, 123, 1][:batch]
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    leftpad = torch.tensor(starts, dtype=torch.int32, device="cuda")
    window = (left, 0 if causal else -1)
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                           cache_leftpad=leftpad, causal=causal, window_size=window,
                                           softcap=softcap, return_lse=True)
    assert not tco.fallback_counts(), tco.fallback_counts()
    outs, lses = [], []
    for b, (start, n) in enumerate(zip(starts, lengths)):
        assert torch.equal(k_cache[b, n:n + s_q], k[b]), "append"
        o, l = _reference(q[b:b + 1], k_cache[b:b + 1, start:], v_cache[b:b + 1, start:], [n + s_q - start], causal,
                          window, softcap)
        outs.append(o)
        lses.append(l)
    _close("out", out, torch.cat(outs))
    _close("lse", lse, torch.cat(lses), 1e-3)


def test_poisoned_outputs_are_written():
    from torch_cute_ops.runtime import attention as flash_host

    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(3, 2, 16, 128, device="cuda", generator=gen).bfloat16()
    k_cache = torch.randn(3, 700, 4, 128, device="cuda", generator=gen).bfloat16()
    lengths = torch.tensor([0, 5, 700], dtype=torch.int32, device="cuda")
    table = torch.arange(3, dtype=torch.int32, device="cuda")[:, None]
    plan = flash_host.plan_fwd(q, k_cache.reshape(1, -1, 4, 128), k_cache.reshape(1, -1, 4, 128), True,
                               flash_host.kvcache_config(128, None), rows="kvcache")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((3, 16, 2), float("nan"), device="cuda")
    plan.kvcache(q, k_cache, k_cache, lengths, table, 700, out, lse, 128 ** -0.5)
    torch.cuda.synchronize()
    ref_out, ref_lse = _reference(q, k_cache, k_cache, [0, 5, 700], True, (-1, 0), 0.0)
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all(), "an empty cache attends to nothing"
    _close("out", out[1:], ref_out[1:])


def test_cuda_graph_decode_step_replays_with_new_lengths():
    """A decode step (append one token, attend) captured once, replayed as the lengths grow."""
    batch, h_q, h_kv, cap = 4, 32, 8, 1024
    gen = torch.Generator(device="cuda").manual_seed(5)
    k_cache = torch.zeros(batch, cap, h_kv, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q = torch.empty(batch, 1, h_q, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.empty(batch, 1, h_kv, 128, device="cuda", dtype=torch.bfloat16), \
        torch.empty(batch, 1, h_kv, 128, device="cuda", dtype=torch.bfloat16)
    cache_seqlens = torch.tensor([3, 100, 0, 500], dtype=torch.int32, device="cuda")

    def step():
        return tco.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=True)

    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
    step()  # warm-up: plans, compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = step()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        cache_seqlens += 1
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        lengths = (cache_seqlens + 1).tolist()
        for b, n in enumerate(lengths):
            assert torch.equal(k_cache[b, n - 1], k[b, 0]), "the replayed step appended at the new length"
        ref_out, _ = _reference(q, k_cache, v_cache, lengths, True, (-1, 0), 0.0)
        _close("replayed out", out, ref_out)


def _decode_step(batch, s_q, cap, page, gen):
    """(q, cache, lengths, call): a decode step over a random ragged cache, contiguous or paged.
    The caller keeps q, the cache and the lengths alive as long as a graph captured from the call
    (a graph holds device pointers, not tensors)."""
    cache = [torch.randn(batch, cap, 2, 128, device="cuda", generator=gen).bfloat16() for _ in range(2)]
    lengths = torch.randint(1, cap + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    q = torch.randn(batch, s_q, 8, 128, device="cuda", generator=gen).bfloat16()
    kv, table = (cache, None) if page is None else _paged(cache, page, gen)
    call = (lambda: tco.flash_attn_with_kvcache(q, *kv, cache_seqlens=lengths, page_table=table, causal=True))
    return q, cache, lengths, call


def _capture(call, stream):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = call()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def _replay_in_turns(steps, graphs, gen, rounds=2):
    """Each graph replayed in turn with a fresh q and a poisoned output, against the reference."""
    for _ in range(rounds):
        for (q, cache, lengths, _), (graph, out) in zip(steps, graphs):
            q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref_out, _ = _reference(q, *cache, lengths.tolist(), True, (-1, 0), 0.0)
            _close("replayed out", out, ref_out)


def test_captured_steps_take_their_own_zeroed_counters():
    """Two captured decode steps replayed in turns: each captured launch's tile counter is its own
    slot of the slab an eager call zeroed (no memset node in the graph), and every replay finds it
    at zero again; a counter left non-zero would skip tiles (stale outputs, caught below)."""
    from torch_cute_ops.runtime import scratch

    gen = torch.Generator(device="cuda").manual_seed(9)
    steps = [_decode_step(2, 1, 2048, None, gen), _decode_step(3, 4, 1024, 256, gen)]
    for step in steps:
        step[-1]()  # eager warm-up: compiles, and zeroes the slab the captures take counters from
    torch.cuda.synchronize()
    used = scratch._capture_slabs[torch.cuda.current_device()][1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = [_capture(step[-1], stream) for step in steps]
    assert scratch._capture_slabs[torch.cuda.current_device()][1] == used + 2, "one slab slot per captured launch"
    _replay_in_turns(steps, graphs, gen)


def test_graphs_captured_in_serving_order_replay_in_turns():
    """A serving loop's order: for each batch size, make its buffers, run the step eagerly, capture
    it; then replay the graphs in turn. Sizes on both sides of the split-KV and one-warpgroup
    thresholds, contiguous and paged, one and four query tokens."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    stream = torch.cuda.Stream()
    steps, graphs = [], []
    for batch, s_q, cap, page in ((8, 1, 4096, None), (8, 1, 2048, None), (1, 1, 16384, 256), (8, 4, 4096, None),
                                  (5, 1, 512, 64)):
        step = _decode_step(batch, s_q, cap, page, gen)
        step[-1]()
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        graphs.append(_capture(step[-1], stream))
        steps.append(step)
    _replay_in_turns(steps, graphs, gen, rounds=3)


def test_compiled_decode_step_keeps_the_cache_write():
    batch, cap = 2, 512
    k_cache = torch.zeros(batch, cap, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(batch, 1, 8, 128, device="cuda").bfloat16()
    k, v = (torch.randn(batch, 1, 2, 128, device="cuda").bfloat16() for _ in range(2))

    def step(q, k_cache, v_cache, k, v, lengths):
        return tco.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for n in (7, 8, 300):
        lengths = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        out = compiled(q, k_cache, v_cache, k, v, lengths)
        assert torch.equal(k_cache[:, n], k[:, 0]) and torch.equal(v_cache[:, n], v[:, 0])
        ref_out, _ = _reference(q, k_cache, v_cache, [n + 1] * batch, True, (-1, 0), 0.0)
        _close("compiled out", out, ref_out)


@pytest.mark.parametrize("s_q,page,cap,lengths", [
    (1, None, 32768, [32768, 20001]), (1, 256, 32768, [32768, 20001]), (4, None, 32768, [32768, 20001]),
    (3, 64, 32768, [32768, 20001]), (1, None, 65536, [65536, 1, 40001]), (4, 256, 65536, [65536, 1, 40001]),
])
def test_split_kv_on_a_long_cache(s_q, page, cap, lengths):
    """Few tiles against many keys (up to 65536, ragged down to 1): the keys are split over
    CTAs (flash-decoding) and combined; the plan must choose a split here, and the result
    matches the reference."""
    from torch_cute_ops.runtime import attention as flash_host

    # few tiles: B x 8 kv heads (pack-GQA) for one token, B x 16 query heads for several
    batch, h_q, h_kv = len(lengths), 32 if s_q == 1 else 16, 8
    gen = torch.Generator(device="cuda").manual_seed(11 + s_q + cap)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).bfloat16()  # noqa: E731
    k_cache, v_cache = rand(batch, cap, h_kv, 128), rand(batch, cap, h_kv, 128)
    q = rand(batch, s_q, h_q, 128)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    caches, table = ((k_cache, v_cache), None) if page is None else _paged((k_cache, v_cache), page, gen)
    plan = flash_host.plan_fwd(q, k_cache.reshape(1, -1, h_kv, 128), k_cache.reshape(1, -1, h_kv, 128), True,
                               flash_host.kvcache_config(128, page), rows="kvcache", keys_per_entry=cap)
    assert plan.splits > 1, "a long cache with few tiles should split"
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_with_kvcache(q, *caches, cache_seqlens=cache_seqlens, page_table=table, causal=True,
                                           return_lse=True)
    assert not tco.fallback_counts()
    ref_out, ref_lse = _reference(q, k_cache, v_cache, lengths, True, (-1, 0), 0.0)
    _close("out", out, ref_out)
    _close("lse", lse, ref_lse, 1e-3)
    # the dense decode path (flash_attn_func) splits the same way
    dense = tco.flash_attn_func(q[:1], k_cache[:1], v_cache[:1], causal=True)
    _close("dense split", dense, ref_out[:1])


def test_reduce_overhead_compile_of_a_decode_step_and_a_masked_call(monkeypatch):
    """torch.compile(mode="reduce-overhead") warms a function up with the thread's allocations
    routed to its CUDA graph's pool, then checks that nothing but the outputs lives there: the tile
    counters, placeholders, key starts and mask summaries the hosts keep across calls are made
    outside it. A batch size, a stream and a mask the process has not seen make them during the
    warm-up here; warm-up, recording and replays are checked against the reference."""
    from torch_cute_ops.ops import attention_kvcache as kvc
    from torch_cute_ops.runtime import attention_mask, scratch

    kvc._zero_starts.cache_clear()
    from torch_cute_ops.runtime.lasting import PerTensor

    monkeypatch.setattr(scratch, "_zeroed", {})  # the tile counters
    monkeypatch.setattr(attention_mask, "_summaries", PerTensor())
    gen = torch.Generator(device="cuda").manual_seed(17)
    q, cache, lengths, _ = _decode_step(6, 1, 1024, None, gen)
    mq = torch.randn(2, 8, 100, 64, device="cuda", generator=gen).bfloat16()
    mk, mv = (torch.randn(2, 8, 300, 64, device="cuda", generator=gen).bfloat16() for _ in range(2))
    scores = torch.rand(2, 1, 100, 300, device="cuda", generator=gen)
    fixed_mask = scores > 0.3

    def step(q, mq):
        out = tco.flash_attn_with_kvcache(q, *cache, cache_seqlens=lengths, causal=True)
        made_inside = scores > 0.5  # a graph intermediate: summarised during the capture itself
        return (out, tco.scaled_dot_product_attention(mq, mk, mv, attn_mask=fixed_mask),
                tco.scaled_dot_product_attention(mq, mk, mv, attn_mask=made_inside))

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    before = dict(tco.fallback_counts())
    for _ in range(4):
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
        mq.copy_(torch.randn(mq.shape, device="cuda", generator=gen))
        out, *masked = compiled(q, mq)
        torch.cuda.synchronize()
        _close("compiled decode step", out, _reference(q, *cache, lengths.tolist(), True, (-1, 0), 0.0)[0])
        for ours, threshold in zip(masked, (0.3, 0.5)):
            ref = torch.nn.functional.scaled_dot_product_attention(mq.float(), mk.float(), mv.float(),
                                                                   attn_mask=scores > threshold)
            _close(f"compiled masked call ({threshold})", ours, ref)
    assert dict(tco.fallback_counts()) == before, "both calls ran the kernels"
