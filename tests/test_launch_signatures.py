"""Every attention launch hands its compiled function what the variant was compiled for (CPU).

A compiled TVM-FFI function checks each tensor's rank, static extents and dtype, and each
scalar's kind, at call time: a launch whose argument disagrees (a 1-D placeholder where the
signature has four dimensions) fails every call on the GPU, while CPU tests that stub the
kernel pass. Here each launch path runs with the kernel stubbed on CPU tensors, and its
arguments are compared, one by one, with the fake arguments the variant is compiled with.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("cutlass")

from torch_cute_ops.kernels import build  # noqa: E402
from torch_cute_ops.runtime import attention as flash_host  # noqa: E402

_DTYPES = {"BFloat16": torch.bfloat16, "Float16": torch.float16, "Float32": torch.float32,
           "Int32": torch.int32, "Int8": torch.int8, "Uint8": torch.uint8}


@pytest.fixture
def launches(monkeypatch):
    """Each stubbed launch's (spec, args); the launch plans' device helpers on the CPU."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    calls = []
    monkeypatch.setattr(flash_host, "get_compiled",
                        lambda spec: lambda *args: calls.append((spec, args)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(flash_host, "num_sms", lambda index: 132)
    for name in ("zeros", "empty"):  # the placeholders are made for "cuda": make them here
        make = getattr(torch, name)
        monkeypatch.setattr(torch, name, functools.partial(_on_cpu, make))
    for name in ("_unused_counter", "_mask_placeholders", "_split_placeholders"):
        monkeypatch.setattr(flash_host, name, getattr(flash_host, name).__wrapped__)
    return calls


def _on_cpu(make, *args, device=None, **kwargs):
    return make(*args, **kwargs)


def _check_agreement(spec, args):
    _, fakes = build(spec)
    fakes = [f for f in fakes if type(f).__name__ != "_FakeStream"]  # the env stream is not passed
    assert len(args) == len(fakes), (spec, len(args), len(fakes))
    for index, (arg, fake) in enumerate(zip(args, fakes)):
        where = f"{spec.family} argument {index}"
        if type(fake).__name__ in ("Int32", "Int64", "int"):
            assert isinstance(arg, int) and not isinstance(arg, bool), (where, arg)
        elif type(fake).__name__ in ("Float32", "float"):
            assert isinstance(arg, float), (where, arg)
        else:
            assert isinstance(arg, torch.Tensor), (where, type(arg))
            assert arg.dim() == len(fake.shape), (where, tuple(arg.shape), fake.shape)
            for dim, extent in enumerate(fake.shape):
                if isinstance(extent, int):
                    assert arg.shape[dim] == extent, (where, tuple(arg.shape), fake.shape)
            assert arg.dtype == _DTYPES[str(fake.element_type)], (where, arg.dtype, fake.element_type)


def _qkv(batch=2, seqlen_q=300, seqlen_k=300, heads=4, kv_heads=4, head_dim=128):
    """Uninitialized: a launch sees shapes, strides and dtypes only, and filling the long caches
    below with random numbers took seconds a test."""
    q = torch.empty(batch, seqlen_q, heads, head_dim, dtype=torch.bfloat16)
    k, v = (torch.empty(batch, seqlen_k, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def _fwd_outputs(q):
    return torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_launches(launches, head_dim, deterministic):
    q, k, v = _qkv(head_dim=head_dim)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    flash_host.plan_bwd(q, k, v, True, deterministic=deterministic)(q, q, k, v, q, lse, *grads, 0.1)
    flash_host.plan_bwd(q, k, v, False, deterministic=deterministic)(q, q, k, v, q, lse, *grads, 0.1)
    flash_host.plan_bwd(q, k, v, False, local=True, softcap=True, deterministic=deterministic)(
        q, q, k, v, q, lse, *grads, 0.1, 100, 0, 30.0)
    key_start, key_end = torch.tensor([0, 7], dtype=torch.int32), torch.tensor([300, 250], dtype=torch.int32)
    flash_host.plan_bwd(q, k, v, True, rows="padded", deterministic=deterministic).padded(
        q, q, k, v, q, lse, key_start, key_end, *grads, 0.1)
    mask = torch.rand(q.shape[0], 1, q.shape[1], k.shape[1]) > 0.3
    flash_host.plan_bwd(q, k, v, False, attn_mask="bool", deterministic=deterministic).masked(
        q, q, k, v, q, lse, mask, *grads, 0.1)
    cu = torch.tensor([0, 100, 600], dtype=torch.int32)
    packed = [t.flatten(0, 1) for t in (q, k, v)]
    flash_host.plan_bwd(*packed, True, rows="packed", deterministic=deterministic).packed(
        packed[0], *packed, packed[0], lse.transpose(0, 1).flatten(1), cu, cu, 500, 500,
        *[torch.empty_like(t) for t in packed], 0.1)
    assert len(launches) == 6
    for spec, args in launches:  # ordered adds only when asked for, at every head dim
        assert spec.get("deterministic", False) == deterministic
        _check_agreement(spec, args)


def test_forward_launches(launches):
    q, k, v = _qkv()
    out, lse = _fwd_outputs(q)
    flash_host.plan_fwd(q, k, v, False)(q, k, v, out, lse, 0.1)
    flash_host.plan_fwd(q, k, v, True)(q, k, v, out, lse, 0.1)
    for cap in (30.0, 100.0):  # bf16 below BOUNDED_SOFTCAP_MAX: no running max; above: the capped variant
        flash_host.plan_fwd(q, k, v, False, local=True, softcap=cap)(q, k, v, out, lse, 0.1, 64, 0, cap)
    key_start, key_end = torch.tensor([0, 7], dtype=torch.int32), torch.tensor([300, 250], dtype=torch.int32)
    flash_host.plan_fwd(q, k, v, True, rows="padded").padded(q, k, v, key_start, key_end, out, lse, 0.1)
    mask = torch.rand(q.shape[0], 1, q.shape[1], k.shape[1]) > 0.3
    flash_host.plan_fwd(q, k, v, False, attn_mask="bool").masked(q, k, v, mask, out, lse, 0.1)
    cu = torch.tensor([0, 100, 600], dtype=torch.int32)
    packed = [t.flatten(0, 1) for t in (q, k, v)]
    flash_host.plan_fwd(*packed, True, rows="packed").packed(
        *packed, cu, cu, 500, 500, torch.empty_like(packed[0]), torch.empty(4, 600), 0.1)
    assert len(launches) == 7
    assert [spec.get("bounded_scores", False) for spec, _ in launches if spec["softcap"]] == [True, False]
    for spec, args in launches:
        _check_agreement(spec, args)


def test_decode_launches(launches):
    """One and four query tokens with grouped kv heads (pack-GQA rows), a long cache (split-KV)."""
    for seqlen_q, seqlen_k in ((1, 300), (4, 300), (1, 32768)):
        q, k, v = _qkv(batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=32, kv_heads=8)
        out, lse = _fwd_outputs(q)
        flash_host.plan_fwd(q, k, v, True)(q, k, v, out, lse, 0.1)
    specs = [spec for spec, _ in launches]
    assert any(spec.get("split_kv") for spec in specs), "no split-KV variant was planned"
    # 4 and 16 (token, head) rows per kv head over a short cache: one consumer warpgroup of 64
    # rows, no ping-pong, 3 K/V stages (D128); 32k keys give each split more blocks: two in turns
    configs = [flash_host.FwdConfig(*spec["config"]) for spec in specs]
    assert [(config.num_wg, config.num_stages) for config in configs][:2] == [(1, 3), (1, 3)]
    assert configs[2].num_wg == 2 and configs[2].pingpong
    for spec, args in launches:
        _check_agreement(spec, args)


@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_kvcache_launches(launches, seqlen_q):
    """A paged cache (64-token pages, shuffled page table), one and four query tokens."""
    q, _, _ = _qkv(batch=2, seqlen_q=seqlen_q, heads=32, kv_heads=8)
    k_cache, v_cache = (torch.randn(40, 64, 8, 128).bfloat16() for _ in range(2))
    page_table = torch.randperm(40, dtype=torch.int32).view(2, 20)
    key_lengths = torch.tensor([1000, 77], dtype=torch.int32)
    config = flash_host.kvcache_config(128, 64)
    rows_view = k_cache.reshape(1, -1, 8, 128)
    plan = flash_host.plan_fwd(q, rows_view, rows_view, True, config, rows="kvcache", keys_per_entry=20 * 64)
    out, lse = _fwd_outputs(q)
    plan.kvcache(q, k_cache, v_cache, key_lengths, page_table, 64, out, lse, 0.1)
    (spec, args), = launches
    assert spec["rows"] == "kvcache"
    _check_agreement(spec, args)


def test_ranged_launches(launches):
    """A contiguous cache with any strides, each entry's keys [start, end): one and four query
    tokens (pack-GQA rows) against one key block, a short cache (split into single blocks) and a
    long one (split-KV)."""
    cases = ((1, 128, False), (4, 128, False), (1, 300, True), (1, 32768, True))
    for seqlen_q, seqlen_k, _ in cases:
        q, k, v = _qkv(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=32, kv_heads=8)
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))  # (B, H_kv, S, D) storage
        out, lse = _fwd_outputs(q)
        start, end = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([seqlen_k, 100], dtype=torch.int32)
        flash_host.plan_fwd(q, k, v, True, rows="ranged").ranged(q, k, v, start, end, out, lse, 0.1)
    specs = [spec for spec, _ in launches]
    assert [spec["rows"] for spec in specs] == ["ranged"] * len(cases)
    assert [spec.get("split_kv", False) for spec in specs] == [split for _, _, split in cases]
    shipped = flash_host.shipped("sm_90a")
    assert all(specs[i] in shipped for i in (0, 2, 3)), "one-token decode over transformers' caches ships"
    for spec, args in launches:
        _check_agreement(spec, args)


def test_gemma2_serving_is_prebuilt(launches, monkeypatch):
    """Gemma 2 served from transformers' caches (D256, softcap 50, global and 4096-key window
    layers): the prompt and one-token decode steps at short and long caches run shipped variants."""
    planned = []
    monkeypatch.setattr(flash_host, "get_compiled", planned.append)
    for batch, seqlen_k in ((1, 1024), (8, 4096), (1, 32768)):
        q, k, v = _qkv(batch=batch, seqlen_q=1, seqlen_k=seqlen_k, heads=16, kv_heads=8, head_dim=256)
        for window_left in (None, 4095):
            causal, local, _, _ = flash_host.kernel_band(True, window_left, None, 1, seqlen_k)
            flash_host.plan_fwd(q, k, v, causal, local=local, softcap=50.0, rows="ranged")
        prompt, _, _ = _qkv(batch=batch, seqlen_q=512, seqlen_k=seqlen_k, heads=16, kv_heads=8, head_dim=256)
        flash_host.plan_fwd(prompt, k, v, True, softcap=50.0, rows="ranged")
    shipped = set(flash_host.shipped("sm_90a"))
    assert len(planned) == 9 and all(spec in shipped for spec in planned), sorted(
        {spec.name for spec in planned if spec not in shipped})


@pytest.mark.parametrize("head_dim", [64, 128])
def test_training_layouts_are_prebuilt(launches, monkeypatch, head_dim):
    """bf16 attention as models train it, causal dense, padded and packed (varlen), and under a
    bool or additive attn_mask, forward and backward, runs shipped variants: a training
    process's first step compiles nothing."""
    planned = []
    monkeypatch.setattr(flash_host, "get_compiled", planned.append)
    q, k, v = _qkv(batch=2, seqlen_q=2048, seqlen_k=2048, heads=16, kv_heads=16, head_dim=head_dim)
    packed = [t.flatten(0, 1) for t in (q, k, v)]
    for rows, qkv in (("dense", (q, k, v)), ("padded", (q, k, v)), ("packed", packed)):
        flash_host.plan_fwd(*qkv, True, rows=rows)
        flash_host.plan_bwd(*qkv, True, rows=rows)
    # the SDPA drop-in with a mask (bool or additive; the mask then carries any causal part)
    for kind in ("bool", "add"):
        flash_host.plan_fwd(q, k, v, False, attn_mask=kind)
        flash_host.plan_bwd(q, k, v, False, attn_mask=kind)
    shipped = set(flash_host.shipped("sm_90a"))
    assert len(planned) == 10 and all(spec in shipped for spec in planned), [
        spec.name for spec in planned if spec not in shipped]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch,heads,kv_heads,capacity", [(1, 32, 8, 1024), (8, 32, 8, 4096), (64, 32, 8, 4096),
                                                            (1, 32, 8, 32768), (4, 16, 16, 2048)])
def test_one_token_decode_from_a_paged_cache_is_prebuilt(launches, batch, heads, kv_heads, capacity, head_dim):
    """A one-token decode step against a paged cache (256-token pages, as the kvcache op plans it)
    runs a shipped variant, whatever the batch, capacity, GQA group, split or head dim."""
    q, _, _ = _qkv(batch=batch, seqlen_q=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    pages_per_entry = capacity // 256
    k_cache = torch.empty(batch * pages_per_entry, 256, kv_heads, head_dim, dtype=torch.bfloat16)
    page_table = torch.arange(batch * pages_per_entry, dtype=torch.int32).view(batch, pages_per_entry)
    key_lengths = torch.full((batch,), capacity, dtype=torch.int32)
    rows_view = k_cache.reshape(1, -1, kv_heads, head_dim)
    config = flash_host.kvcache_config(head_dim, 256)
    plan = flash_host.plan_fwd(q, rows_view, rows_view, False, config, rows="kvcache", keys_per_entry=capacity)
    out, lse = _fwd_outputs(q)
    plan.kvcache(q, k_cache, k_cache, key_lengths, page_table, 256, out, lse, 0.1)
    ((spec, args),) = launches
    assert spec in flash_host.shipped("sm_90a"), spec
    _check_agreement(spec, args)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch,heads,kv_heads,seqlen_k", [(1, 32, 8, 1024), (8, 32, 8, 4096), (64, 32, 8, 4096),
                                                           (1, 32, 8, 32768), (4, 16, 16, 2048), (2, 64, 8, 8192)])
def test_one_token_decode_from_a_contiguous_cache_is_prebuilt(launches, batch, heads, kv_heads, seqlen_k, head_dim):
    """A one-token decode step against a contiguous cache (the ranged rows, as the kvcache op
    plans it: causal, keys from 0) runs a shipped variant: a serving process's first decode step
    compiles nothing, whatever the batch, cache length, GQA group, split or head dim (64, 128)."""
    q, k, v = _qkv(batch=batch, seqlen_q=1, seqlen_k=seqlen_k, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    band_causal, local, _, _ = flash_host.kernel_band(True, None, None, 1, seqlen_k)
    out, lse = _fwd_outputs(q)
    start, end = torch.zeros(batch, dtype=torch.int32), torch.full((batch,), seqlen_k, dtype=torch.int32)
    flash_host.plan_fwd(q, k, v, band_causal, local=local, rows="ranged").ranged(q, k, v, start, end, out, lse, 0.1)
    ((spec, args),) = launches
    assert spec in flash_host.shipped("sm_90a"), spec
    _check_agreement(spec, args)


def test_sink_launches(launches):
    """Sink variants (dense, packed, one-token pack-GQA decode whole and split, paged) take the sinks
    as lse's shape with the heads' stride alone; the backward takes the sinks and their gradient."""
    sink = torch.arange(32, dtype=torch.float32)
    q, k, v = _qkv(heads=32, kv_heads=8)
    out, lse = _fwd_outputs(q)
    flash_host.plan_fwd(q, k, v, True, sink=True)(q, k, v, out, lse, 0.1, sink=sink)
    cu = torch.tensor([0, 100, 600], dtype=torch.int32)
    packed = [t.flatten(0, 1) for t in (q, k, v)]
    flash_host.plan_fwd(*packed, True, rows="packed", sink=True).packed(
        *packed, cu, cu, 500, 500, torch.empty_like(packed[0]), torch.empty(32, 600), 0.1, sink=sink)
    for batch in (64, 1):  # one-token decode: pack-GQA rows, whole and (a lone entry) split
        q1, k1, v1 = _qkv(batch=batch, seqlen_q=1, seqlen_k=1024, heads=32, kv_heads=8)
        out1, lse1 = _fwd_outputs(q1)
        flash_host.plan_fwd(q1, k1, v1, True, sink=True)(q1, k1, v1, out1, lse1, 0.1, sink=sink)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    flash_host.plan_bwd(q, k, v, True, sink=True)(q, q, k, v, q, lse, *grads, 0.1, sink=sink, dsink=torch.zeros(32))
    specs = [spec for spec, _ in launches]
    assert all(spec.get("sink") for spec in specs) and specs[3].get("split_kv") and not specs[2].get("split_kv")
    sink_args = [args[-1] for _, args in launches[:4]]
    assert [a.stride() for a in sink_args] == [(0, 1, 0), (0, 1, 0), (0, 4, 1), (0, 4, 1)]
    # each row reads its own head's sink: (b, h_kv, j) of one-token decode is query head 4 h_kv + j
    assert sink_args[2][0, 1, 2] == 6 and sink_args[0][1, 5, 7] == 5
    assert launches[4][1][-2] is sink
    for spec, args in launches:
        _check_agreement(spec, args)
    assert flash_host.fwd_spec("bf16", 64, True).get("sink") is None  # the plain variants keep their names


@pytest.mark.parametrize("page_size", [16, 64])
def test_packed_paged_launches(launches, page_size):
    """Packed queries (decode rows and a prefill chunk) against a paged cache, through the op:
    cu_seqlens_q, and seqused_k, seqused_q and the page table in one int32 tensor."""
    from torch_cute_ops.ops import attention_paged

    q = torch.empty(9, 32, 128, dtype=torch.bfloat16)
    k_cache = torch.empty(40, page_size, 8, 128, dtype=torch.bfloat16)
    page_table = torch.randperm(40, dtype=torch.int32)[:36].view(3, 12)
    cu_seqlens_q = torch.tensor([0, 1, 2, 9], dtype=torch.int32)
    seqused_k = torch.tensor([100, 0, 7], dtype=torch.int32)
    config = flash_host.kvcache_config(128, page_size)
    rows_view = k_cache.reshape(-1, 8, 128)
    plan = flash_host.plan_fwd(q, rows_view, rows_view, True, config, rows="packed_paged",
                               page_rows=flash_host.kvcache_page_rows(page_size))
    out, lse = torch.empty_like(q), torch.empty(32, 9)
    info = attention_paged.key_info(cu_seqlens_q, None, seqused_k, page_table, (plan.group, plan.tiles[0]))
    plan.packed_paged(q, k_cache, k_cache, cu_seqlens_q, info, 7, out, lse, 0.1)
    (spec, args), = launches
    assert spec["rows"] == "packed_paged" and spec.get("page_rows", 0) == (16 if page_size == 16 else 0)
    assert spec["rows_per_query"] == 4 and spec["causal"], "pack-GQA rows, the causal band per token"
    assert plan.tiles[0] == 64, "one warpgroup"
    # (token, head) rows: 4, 4 and 28 rows of 64-row blocks -> first blocks 0, 1, 2, 3
    expected = [seqused_k, torch.tensor([1, 1, 7], dtype=torch.int32), page_table.flatten(),
                torch.tensor([0, 1, 2, 3], dtype=torch.int32)]
    assert torch.equal(info, torch.cat(expected))
    _check_agreement(spec, args)


def test_small_page_kvcache_launches(launches):
    """flash_attn_with_kvcache's decode on 16-token pages: a box per page, pack-GQA rows."""
    q, _, _ = _qkv(batch=2, seqlen_q=1, heads=32, kv_heads=8)
    k_cache = torch.empty(160, 16, 8, 128, dtype=torch.bfloat16)
    page_table = torch.randperm(160, dtype=torch.int32).view(2, 80)
    rows_view = k_cache.reshape(1, -1, 8, 128)
    plan = flash_host.plan_fwd(q, rows_view, rows_view, True, flash_host.kvcache_config(128, 16), rows="kvcache",
                               keys_per_entry=80 * 16, page_rows=flash_host.kvcache_page_rows(16))
    out, lse = _fwd_outputs(q)
    plan.kvcache(q, k_cache, k_cache, torch.tensor([1000, 77], dtype=torch.int32), page_table, 16, out, lse, 0.1)
    (spec, args), = launches
    assert spec["page_rows"] == 16
    _check_agreement(spec, args)
