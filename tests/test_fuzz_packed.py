"""Property-based fuzzing of packed and cached attention: flash_attn_varlen_func (with its backward),
``torch.ops.cute.flash_attn_varlen_fwd`` / ``_bwd`` directly, flash_attn_with_kvcache and
``torch.ops.cute.flash_attn_kvcache`` (fuzz_support says what every call must do)."""

from __future__ import annotations

import pytest
import torch

from fuzz_support import (DEVICES, FLOAT_DTYPES, INVALID_SCALES, INVALID_WINDOWS, Case, assert_close_norm,
                          assert_matches, attention64, attention_grad_atol, attention_options, attention_tolerance,
                          differentiable, expect, fuzz_property, generator, grad_tolerance, head_dims, index_tensor,
                          layouts, lse_tolerance, make, max_score, op_bound, scale_of, seeds, seqlens)
from hypothesis import strategies as st

import torch_cute_ops as tco


def cu_seqlens(lengths, device, strided: bool = False) -> torch.Tensor:
    return index_tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], device, strided)


def check_out_lse(name, q, k, v, scale, softcap, out, lse, ref_out, ref_lse, device):
    smax = max_score(q, k, scale, softcap)
    assert out.dtype == q.dtype and out.shape == q.shape, f"{name}: out {out.dtype} {tuple(out.shape)}"
    assert_matches(f"{name} out", out, ref_out, *attention_tolerance(q.dtype, device, v, smax, softcap))
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32), f"{name}: lse dtype"
    assert_matches(f"{name} lse", lse, ref_lse, *lse_tolerance(q.dtype, device, ref_lse, smax, softcap))


# ----------------------------------------------------------------------------------------- varlen

VARLEN_MUTATIONS = {  # mutation -> the argument names its error may cite
    "cu dtype": ("cu_seqlens_q",), "cu rank": ("cu_seqlens_k",), "cu empty": ("cu_seqlens_q",),
    "cu count": ("cu_seqlens_k",), "cu start": ("cu_seqlens_q",), "cu order": ("cu_seqlens_k",),
    "cu end": ("cu_seqlens_q",), "max short": ("max_seqlen_q",), "max negative": ("max_seqlen_k",),
    "q rank": ("q",), "k head_dim": ("k",), "v total": ("v",), "heads": ("k",), "dtype": ("q",),
    "cu device": ("cu_seqlens_k",),
}


@st.composite
def varlen_cases(draw, device, public: bool):
    gen = generator(draw(seeds()))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    batch = draw(st.integers(0, 3))
    lengths_q = [draw(seqlens(device)) for _ in range(batch)]
    lengths_k = [draw(seqlens(device)) for _ in range(batch)]
    h_kv, group, d = draw(st.integers(1, 2)), draw(st.integers(0, 3)), draw(head_dims(device))
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q_shape, k_shape, v_shape = [total_q, h_kv * group, d], [total_k, h_kv, d], [total_k, h_kv, d]
    cu_q, cu_k = (cu_seqlens(n, device, draw(st.booleans())) for n in (lengths_q, lengths_k))
    max_q = max(lengths_q, default=0) + draw(st.integers(0, 2))
    max_k = max(lengths_k, default=0) + draw(st.integers(0, 2))
    options = draw(attention_options(public))
    q_dtype = dtype
    mutation = draw(st.sampled_from(list(VARLEN_MUTATIONS) + (["window", "softmax_scale"] if public else []))) \
        if draw(st.booleans()) else None
    error = VARLEN_MUTATIONS.get(mutation)
    extra = {}
    if mutation == "cu dtype":
        cu_q = cu_q.long()
    elif mutation == "cu rank":
        cu_k = cu_k[None]
    elif mutation == "cu empty":
        cu_q = cu_q[:0]
    elif mutation == "cu count":
        cu_k = torch.cat([cu_k, cu_k[-1:]])
    elif mutation == "cu start":
        cu_q = cu_q + 1
        q_shape[0] += 1
    elif mutation == "cu order" and batch >= 2:
        cu_k = cu_k.clone()
        cu_k[1] = cu_k[2] + 1
    elif mutation == "cu end":
        q_shape[0] += 1
    elif mutation == "max short" and max(lengths_q, default=0):
        max_q = max(lengths_q) - 1
    elif mutation == "max negative":
        max_k = -1
    elif mutation == "q rank":
        q_shape = [1, *q_shape]
    elif mutation == "k head_dim":
        k_shape[-1] = d + 1
    elif mutation == "v total":
        v_shape[0] = total_k + 1
    elif mutation == "heads":
        k_shape[1] = v_shape[1] = 2
        q_shape[1] = 2 * group + 1
    elif mutation == "dtype":
        q_dtype = torch.int32
    elif mutation == "cu device":
        cu_k = cu_k.to("meta")
    elif mutation == "window":
        extra["window_size"], error = draw(st.sampled_from(INVALID_WINDOWS)), ("window_size",)
    elif mutation == "softmax_scale":
        options["softmax_scale"], _ = draw(st.sampled_from(INVALID_SCALES))
        error = ("softmax_scale",)
    elif mutation is not None:
        mutation, error = None, None  # not applicable to these lengths
    tensors = dict(q=make(q_shape, q_dtype, device, gen, draw(layouts(len(q_shape)))),
                   k=make(k_shape, q_dtype, device, gen, draw(layouts(3))),
                   v=make(v_shape, q_dtype, device, gen, draw(layouts(3))),
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    note = f"{mutation or 'valid'} {dtype} lengths q{lengths_q} k{lengths_k} h{q_shape[1:]} {options}"
    return Case({**tensors, **options, **extra}, error, note)


def varlen_reference(kw, public: bool, leaves=None):
    """Each packed sequence through the dense float64 reference."""
    q, k, v = leaves or (kw["q"], kw["k"], kw["v"])
    bound = op_bound if public else (lambda x: x)
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    outs, lses = [q.new_zeros((0, *q.shape[1:]), dtype=torch.float64, device="cpu")], \
        [torch.zeros(q.shape[1], 0, dtype=torch.float64)]
    for b in range(len(cq) - 1):
        o, l = attention64(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                           scale_of(kw, q.shape[-1]), kw["causal"], bound(kw["left"]), bound(kw["right"]),
                           kw["softcap"])
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def varlen_grads_match(name, kw, grads, dout, public, device):
    leaves = [t.detach().to("cpu", torch.float64).requires_grad_(True) for t in (kw["q"], kw["k"], kw["v"])]
    ref, _ = varlen_reference(kw, public, leaves)
    if ref.requires_grad:
        ref.backward(dout.to("cpu", torch.float64))
    atol = attention_grad_atol(kw["q"], kw["k"], kw["v"], dout, scale_of(kw, kw["q"].shape[-1]))
    for label, ours, theirs in zip("qkv", grads, leaves):
        expected = theirs.grad if theirs.grad is not None else torch.zeros_like(theirs)
        assert_close_norm(f"{name} d{label}", ours, expected, grad_tolerance(kw["q"].dtype, device, kw["softcap"]),
                          atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("public", [True, False], ids=["flash_attn_varlen_func", "cute.flash_attn_varlen"])
@fuzz_property(50)
def test_varlen(device, public, data):
    """Public: the forward and (sometimes) autograd's backward. The ops: the forward, then the
    backward op on its out and lse."""
    case = data.draw(varlen_cases(device, public))
    kw = case.kwargs
    grad = public and data.draw(st.booleans()) and differentiable(kw["q"], kw["k"], kw["v"])
    if grad:
        kw.update({name: kw[name].detach().requires_grad_(True) for name in "qkv"})
    packed = (kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"],
              kw["max_seqlen_k"])
    if public:
        window = kw.get("window_size", (kw["left"], kw["right"]))
        call = lambda: tco.flash_attn_varlen_func(*packed, kw["softmax_scale"], kw["causal"], window, kw["softcap"],
                                                  True, deterministic=data.draw(st.booleans()))
    else:
        call = lambda: torch.ops.cute.flash_attn_varlen_fwd(*packed, kw["softmax_scale"], kw["causal"], kw["left"],
                                                            kw["right"], kw["softcap"])
    result = expect(call, case.error, case.note)
    if case.error:
        return
    out, lse = result
    ref_out, ref_lse = varlen_reference(kw, public)
    check_out_lse(f"varlen {case.note}", kw["q"], kw["k"], kw["v"], scale_of(kw, kw["q"].shape[-1]), kw["softcap"],
                  out, lse, ref_out, ref_lse, device)
    dout = torch.randn(out.shape, generator=generator(5), dtype=torch.float64).to(out)
    if grad:
        out.backward(dout)
        varlen_grads_match(f"varlen {case.note}", kw, [kw[n].grad for n in "qkv"], dout, public, device)
    elif not public:
        grads = expect(lambda: torch.ops.cute.flash_attn_varlen_bwd(dout, *packed[:3], out, lse, *packed[3:],
                                                                    kw["softmax_scale"], kw["causal"], kw["left"],
                                                                    kw["right"], kw["softcap"]),
                       None, f"backward of {case.note}")
        varlen_grads_match(f"cute.flash_attn_varlen_bwd {case.note}", kw, grads, dout, public, device)


# ---------------------------------------------------------------------------------------- kvcache

KVCACHE_MUTATIONS = {  # mutation -> the argument names its error may cite
    "seqlens past": ("cache_seqlens",), "seqlens negative": ("cache_seqlens",), "seqlens dtype": ("cache_seqlens",),
    "seqlens int big": ("cache_seqlens",), "seqlens int negative": ("cache_seqlens",),
    "seqlens type": ("cache_seqlens",), "page_table rank": ("page_table",), "page_table range": ("page_table",),
    "page_table dtype": ("page_table",), "batch_idx range": ("cache_batch_idx",),
    "batch_idx and pages": ("cache_batch_idx",), "leftpad and pages": ("cache_leftpad",),
    "leftpad past": ("cache_leftpad",), "leftpad negative": ("cache_leftpad",), "k only": ("k", "v"),
    "k shape": ("k",), "k dtype": ("k",), "q rank": ("q",), "cache rank": ("k_cache",),
    "v_cache head_dim": ("v_cache",), "expanded cache": ("k_cache", "v_cache"),
}


# index values a GPU checks on the device, without a host sync: a device-side assertion that ends
# the process's CUDA context, so the GPU runs leave them to the CPU ones
DEVICE_CHECKED = ("seqlens past", "seqlens negative", "page_table range", "batch_idx range", "leftpad past",
                  "leftpad negative")


@st.composite
def kvcache_cases(draw, device, public: bool):
    gen = generator(draw(seeds()))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    batch, s_q = draw(st.integers(0, 3)), draw(st.integers(0, 4))
    h_kv, group, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(head_dims(device))
    paged = draw(st.booleans())
    new = draw(st.integers(0, 3)) if draw(st.booleans()) else None
    if paged:
        page_size = draw(st.sampled_from([1, 2, 4] if device == "cpu" else [1, 64, 128]))
        pages = draw(st.integers(0, 3))
        capacity, rows = page_size * pages, batch * pages + draw(st.integers(0, 2))
        order = torch.randperm(rows, generator=gen)[:batch * pages]  # distinct pages: appends never collide
        page_table = index_tensor(order.tolist(), device, draw(st.booleans()), shape=(batch, pages))
        cache_shape, batch_idx, leftpad = [rows, page_size, h_kv, d], None, None
    else:
        capacity = draw(st.integers(0, 10) if device == "cpu" else st.sampled_from([0, 5, 64, 200]))
        rows = batch + draw(st.integers(0, 2))
        cache_shape, page_table = [rows, capacity, h_kv, d], None
        batch_idx = index_tensor(torch.randperm(rows, generator=gen)[:batch].tolist(), device, draw(st.booleans())) \
            if draw(st.booleans()) else None
    new = min(new, capacity) if new is not None else None
    appended = new or 0
    lengths = [draw(st.integers(0, capacity - appended)) for _ in range(batch)]
    seqlens_kind = draw(st.sampled_from(["tensor", "int", "none"] if public else ["tensor"]))
    if seqlens_kind == "int":
        lengths = [lengths[0]] * batch if batch else []
        cache_seqlens = lengths[0] if batch else draw(st.integers(0, capacity - appended))
    elif seqlens_kind == "none":
        lengths = [capacity - appended] * batch
        cache_seqlens = None
    else:
        cache_seqlens = index_tensor(lengths, device, draw(st.booleans()))
    if not paged:
        leftpad = index_tensor([draw(st.integers(0, n + appended)) for n in lengths], device, draw(st.booleans())) \
            if draw(st.booleans()) else None
    options = draw(attention_options(public))
    cache_layout = draw(layouts(4, expanded=new is None))
    q_shape, new_shape, v_cache_shape = [batch, s_q, h_kv * group, d], [batch, appended, h_kv, d], list(cache_shape)
    new_dtype, v_new = dtype, new is not None
    mutation = draw(st.sampled_from(list(KVCACHE_MUTATIONS) + (["window", "softmax_scale"] if public else [])))\
        if draw(st.booleans()) else None
    error = KVCACHE_MUTATIONS.get(mutation)
    extra = {}
    if mutation in DEVICE_CHECKED and device != "cpu":
        mutation, error = None, None
    if mutation == "seqlens past" and batch:
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        cache_seqlens[-1] = capacity - appended + 1
    elif mutation == "seqlens negative" and batch:
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        cache_seqlens[0] = -1
    elif mutation == "seqlens dtype":
        cache_seqlens = torch.tensor(lengths, dtype=torch.int64, device=device)
    elif mutation in ("seqlens int big", "seqlens int negative", "seqlens type") and public:
        cache_seqlens = {"seqlens int big": 2**40, "seqlens int negative": -3, "seqlens type": 2.0}[mutation]
    elif mutation == "page_table rank" and paged:
        page_table = page_table.flatten()
    elif mutation == "page_table range" and paged and page_table.numel():
        page_table = page_table.clone()
        page_table.view(-1)[0] = rows
    elif mutation == "page_table dtype" and paged:
        page_table = page_table.long()
    elif mutation == "batch_idx range" and not paged and batch:
        batch_idx = torch.full((batch,), rows, dtype=torch.int32, device=device)
    elif mutation == "batch_idx and pages" and paged:
        batch_idx = torch.zeros(batch, dtype=torch.int32, device=device)
    elif mutation == "leftpad and pages" and paged:
        leftpad = torch.zeros(batch, dtype=torch.int32, device=device)
    elif mutation == "leftpad past" and not paged and batch:
        leftpad = torch.tensor(lengths, dtype=torch.int32, device=device) + appended + 1
    elif mutation == "leftpad negative" and not paged and batch:
        leftpad = torch.full((batch,), -1, dtype=torch.int32, device=device)
    elif mutation == "k only" and new is not None:
        v_new = False
    elif mutation == "k shape" and new is not None:
        new_shape[-1] = d + 1
    elif mutation == "k dtype" and new is not None:
        new_dtype = draw(st.sampled_from([t for t in FLOAT_DTYPES if t != dtype]))
    elif mutation == "q rank":
        q_shape = q_shape[1:]
    elif mutation == "cache rank":
        cache_shape = v_cache_shape = cache_shape[1:]
    elif mutation == "v_cache head_dim":
        v_cache_shape[-1] = d + 1
    elif mutation == "expanded cache" and new is not None and cache_shape[0] > 1 and batch:
        cache_layout = ("expanded", 0)
    elif mutation == "window" and public:
        extra["window_size"] = draw(st.sampled_from(INVALID_WINDOWS))
        error = ("window_size",)
    elif mutation == "softmax_scale" and public:
        options["softmax_scale"], _ = draw(st.sampled_from(INVALID_SCALES))
        error = ("softmax_scale",)
    elif mutation is not None:
        mutation, error = None, None  # not applicable to this cache
    kv_layout = cache_layout if len(cache_shape) == 4 else ("contiguous",)
    tensors = dict(q=make(q_shape, dtype, device, gen, draw(layouts(len(q_shape)))),
                   k_cache=make(cache_shape, dtype, device, gen, kv_layout),
                   v_cache=make(v_cache_shape, dtype, device, gen, kv_layout),
                   k=None if new is None else make(new_shape, new_dtype, device, gen, draw(layouts(4))),
                   v=make(new_shape, new_dtype, device, gen) if v_new else None,
                   cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx, page_table=page_table,
                   cache_leftpad=leftpad)
    note = (f"{mutation or 'valid'} {dtype} {'paged' if paged else 'contiguous'} cache{cache_shape} q{q_shape} "
            f"new {new} lengths {seqlens_kind} {lengths} {options}")
    return Case({**tensors, **options, **extra}, error, note), lengths


def kvcache_reference(kw, lengths):
    """The caches after the append and each entry's attention (float64)."""
    k_cache, v_cache = kw["k_cache"].to("cpu", torch.float64), kw["v_cache"].to("cpu", torch.float64)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    q, page_table, batch_idx, leftpad = kw["q"], kw["page_table"], kw["cache_batch_idx"], kw["cache_leftpad"]
    page_size = k_cache.shape[1]
    new = 0 if kw["k"] is None else kw["k"].shape[1]

    def slot(b, j):  # (cache row, position in it) of entry b's key j
        if page_table is not None:
            return int(page_table[b, j // page_size]), j % page_size
        return (b if batch_idx is None else int(batch_idx[b])), j

    outs, lses = [], []
    for b, length in enumerate(lengths):
        for t in range(new):
            row, pos = slot(b, length + t)
            k_cache[row, pos], v_cache[row, pos] = kw["k"][b, t].double().cpu(), kw["v"][b, t].double().cpu()
    for b, length in enumerate(lengths):
        start = 0 if leftpad is None else int(leftpad[b])
        keys = [slot(b, j) for j in range(start, length + new)]
        gathered = [torch.stack([c[row, pos] for row, pos in keys]) if keys else c.new_zeros((0, *c.shape[2:]))
                    for c in (k_cache, v_cache)]
        out, lse = attention64(q[b:b + 1], gathered[0][None], gathered[1][None], scale_of(kw, q.shape[-1]),
                               kw["causal"], op_bound(kw["left"]) if kw["public"] else kw["left"],
                               op_bound(kw["right"]) if kw["public"] else kw["right"], kw["softcap"])
        outs.append(out)
        lses.append(lse)
    b, s, h, d = q.shape
    out = torch.cat(outs) if outs else torch.zeros(0, s, h, d, dtype=torch.float64)
    lse = torch.cat(lses) if lses else torch.zeros(0, h, s, dtype=torch.float64)
    return out, lse, k_cache, v_cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("public", [True, False], ids=["flash_attn_with_kvcache", "cute.flash_attn_kvcache"])
@fuzz_property(50)
def test_kvcache(device, public, data):
    """The appended keys land in the cache (and nothing else changes) and the attention matches."""
    case, lengths = data.draw(kvcache_cases(device, public))
    kw = case.kwargs
    kw["public"] = public
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "page_table")
    if case.error is None:
        expected = kvcache_reference(kw, lengths)
    if public:
        window = kw.get("window_size", (kw["left"], kw["right"]))
        call = lambda: tco.flash_attn_with_kvcache(*(kw[n] for n in names), kw["softmax_scale"], kw["causal"],
                                                   window, kw["softcap"], True, kw["cache_leftpad"])
    else:
        call = lambda: torch.ops.cute.flash_attn_kvcache(*(kw[n] for n in names), kw["softmax_scale"], kw["causal"],
                                                         kw["left"], kw["right"], kw["softcap"], kw["cache_leftpad"])
    result = expect(call, case.error, case.note)
    if case.error:
        return
    out, lse, k_cache, v_cache = expected
    assert torch.equal(kw["k_cache"].to("cpu", torch.float64), k_cache), f"k_cache after the append: {case.note}"
    assert torch.equal(kw["v_cache"].to("cpu", torch.float64), v_cache), f"v_cache after the append: {case.note}"
    check_out_lse(f"kvcache {case.note}", kw["q"], kw["k_cache"], kw["v_cache"], scale_of(kw, kw["q"].shape[-1]),
                  kw["softcap"], *result, out, lse, device)
