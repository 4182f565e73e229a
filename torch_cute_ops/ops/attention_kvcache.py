"""``cute::flash_attn_kvcache``: attention against a KV cache, appending new keys in place.

q is (B, S_q, H_q, D). The cache is contiguous, (B_cache, capacity, H_kv, D) with entry b in
row ``cache_batch_idx[b]`` (default b), or paged, (num_pages, page_size, H_kv, D) with entry b's
key j in page ``page_table[b, j // page_size]``. New keys k, v (B, S_new, H_kv, D), when given,
are written into the cache at positions ``cache_seqlens[b] ..`` first (the op mutates k_cache
and v_cache, declared in its schema, so compiled graphs and CUDA graphs keep the write); then q
attends to the entry's first ``cache_seqlens[b] + S_new`` keys, causal and windows aligned
bottom-right to them (q's last row is the newest key). ``cache_leftpad`` (int32, (B,)), with a
contiguous cache, starts entry b's keys at that position instead of 0 (a left-padded batch: the
padding stays in the cache, unattended). Not differentiable (inference).

Kernels: a paged cache, or a contiguous one with cache_batch_idx, is read through its page table
(a contiguous cache is one page per entry); a contiguous cache otherwise as (B, capacity, H_kv, D)
with any strides (transformers' (B, H_kv, capacity, D) caches, transposed), each entry's keys
``[cache_leftpad[b], length)`` (the kernels' "ranged" rows). ``learnable_sink`` ((H_q,)) adds a sink to
every row's denominator, in the kernels (ops/sinks.py).

The values of cache_seqlens, cache_leftpad, cache_batch_idx and page_table bound the kernels' loads
and the append's stores: they are checked against the cache before the launch, on the device
where they live and without a host sync (``ops.bounds``), once per version of those tensors (a
model's layers share one check per step) and in every CUDA-graph replay.
"""

from __future__ import annotations

import torch

from ..reference import attention as reference
from ..runtime.attention import kernel_band, pointer_reason, softcap_kind
from ..runtime.lasting import lasting
from . import bounds, checks, dispatch, fallback, sinks
from .attention import (_remember, _validate_softcap, keys_key, layout_key, positive_scale, validate_qkv_common,
                        validate_scale)
from .attention_paged import unverified_reason
from .schemas import lib, qualname, register_impl

_LAYOUT = "(batch, seqlen, heads, head_dim)"


def _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cache_leftpad=None) -> None:
    checks.require_rank("q", q, (4,), _LAYOUT)
    validate_qkv_common(q, k_cache, v_cache, _LAYOUT, ("k_cache", "v_cache"))
    batch = q.shape[0]
    if (k is None) != (v is None):
        raise ValueError("k, v: give both (new keys to append) or neither")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            checks.require_same_dtype(name, t, "q", q)
            expected = (batch, k.shape[1], k_cache.shape[2], q.shape[3])
            if t.dim() != 4 or tuple(t.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected} (batch, new tokens, kv heads, head_dim), "
                                 f"got {tuple(t.shape)}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):  # the new keys are written in place
            if t.numel() and any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
                raise ValueError(f"{name}: an expanded view (stride 0) cannot take new keys in place, got "
                                 f"strides {t.stride()}")
    named = [("cache_seqlens", cache_seqlens, (batch,)), ("cache_batch_idx", cache_batch_idx, (batch,)),
             ("cache_leftpad", cache_leftpad, (batch,))]
    if page_table is not None:
        named.append(("page_table", page_table, (batch, page_table.shape[-1] if page_table.dim() else 0)))
    for name, t, shape in named:
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != shape):
            raise ValueError(f"{name}: expected an int32 tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    if page_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: not supported with page_table (the page table maps entries)")
    if page_table is not None and cache_leftpad is not None:
        raise ValueError("cache_leftpad: not supported with page_table (a paged cache's entries start at key 0)")
    checks.require_same_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                                ("cache_batch_idx", cache_batch_idx), ("page_table", page_table),
                                ("cache_leftpad", cache_leftpad)])


def _capacity(k_cache, page_table) -> int:
    return k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])


def _check_values(k_cache, k, cache_seqlens, cache_batch_idx, page_table, cache_leftpad=None) -> None:
    """The index tensors' values against the cache: they bound the kernels' loads and the append's
    stores (ops.bounds: on the device where they live, no host sync; once per version)."""
    new = 0 if k is None else k.shape[1]
    capacity = _capacity(k_cache, page_table)
    # Inside CUDA graphs only what a kernel reads without the TMA is checked: a paged entry's length
    # bounds the page-table columns its kernel reads; lengths of a contiguous cache, left pads,
    # pages and cache rows only place TMA loads of the cache, which read zeros out of range
    # (ops.bounds), and the append's index_put_ bounds its own stores.
    paged = page_table is not None or cache_batch_idx is not None
    bounds.check_within("cache_seqlens", cache_seqlens, 0, capacity - new,
                        f"{capacity - new} (the cache's capacity of {capacity} keys per entry less {new} new tokens)",
                        in_graphs=paged)
    if cache_leftpad is not None:
        bounds.check_within("cache_leftpad", cache_leftpad, 0, cache_seqlens,
                            f"its entry's length (cache_seqlens plus {new} new tokens)", offset=new, in_graphs=False)
    limit = k_cache.shape[0] - 1
    for name, t in (("cache_batch_idx", cache_batch_idx), ("page_table", page_table)):
        if t is not None and t.numel():
            bounds.check_within(name, t, 0, limit, f"{limit} (the cache's first dim less one)", in_graphs=False)


def _append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table) -> None:
    """Write the new keys at positions cache_seqlens[b] + t of each entry (in place, no sync)."""
    batch, new = k.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(new, device=k.device)
    if page_table is None:
        rows = torch.arange(batch, device=k.device) if cache_batch_idx is None else cache_batch_idx.long()
        index = (rows[:, None].expand(batch, new), pos)
    else:
        page_size = k_cache.shape[1]
        index = (page_table.long().gather(1, pos // page_size), pos % page_size)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def _reference(q, k_cache, v_cache, key_lengths, page_table, softmax_scale, causal, window_left, window_right,
               softcap, key_start=None):
    """Each entry's keys [key_start[b], key_lengths[b]) gathered through its page table, then the
    dense reference."""
    page_size = k_cache.shape[1]
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    starts = [0] * q.shape[0] if key_start is None else key_start.tolist()
    outs, lses = [], []
    for b, (start, length) in enumerate(zip(starts, key_lengths.tolist())):
        keys = torch.arange(start, max(length, start), device=q.device)
        rows = page_table[b].long()[keys // page_size] * page_size + keys % page_size
        out, lse = reference.flash_attn_fwd(q[b:b + 1], flat_k[rows][None], flat_v[rows][None], softmax_scale,
                                            causal, window_left, window_right, softcap)
        outs.append(out)
        lses.append(lse)
    if not outs:  # an empty batch
        return _outputs_like(q)
    return torch.cat(outs), torch.cat(lses)


@lasting
def _zero_starts(device_index: int, batch: int) -> torch.Tensor:
    """Every entry's keys start at 0 (the ranged rows' key_start without cache_leftpad)."""
    return torch.zeros(batch, dtype=torch.int32, device=torch.device("cuda", device_index))


def _pages_of(q, page_table, cache_batch_idx) -> torch.Tensor:
    """The page table the paged kernel and the reference read: a contiguous cache is one page (of
    the whole capacity) per entry, cache row b or cache_batch_idx[b] (the kernels read a
    contiguous cache without cache_batch_idx directly: only the reference needs its table)."""
    if page_table is not None:
        return page_table
    if cache_batch_idx is None:
        return torch.arange(q.shape[0], device=q.device, dtype=torch.int32)[:, None]
    return cache_batch_idx[:, None]


def _outputs_like(q):
    b, s, h, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, s), dtype=reference.compute_dtype(q.dtype)))


_plans: dict[tuple, object] = {}  # by what planning reads (a growing cache: its key tiles)
_exact_plans: dict[tuple, object] = {}  # the same plans by the exact layout: the cheaper key to build


def _mergeable(cache) -> bool:
    """The cache's first two dims merge into rows of a (pages * page_size) view."""
    return cache.stride(0) == cache.shape[1] * cache.stride(1)


def _make_plan(key, q, k_cache, v_cache, page_table, cache_batch_idx, cache_leftpad, causal, local, softcap,
               sink=False):
    """("ranged" or "paged", launch), a reason no kernel covers the call, or None (nothing to do)."""
    plan = "cpu"
    if q.is_cuda:
        host = dispatch.kernel_for("flash_attn_kvcache", q.device)
        # a contiguous cache without cache_batch_idx: entry b is cache row b, read with its own strides
        # (H100, clean graph replays: 0.5-2% faster than one page per entry through a table)
        ranged = page_table is None and cache_batch_idx is None
        if isinstance(host, str):
            plan = host
        elif ranged:
            plan = host.plan_fwd(q, k_cache, v_cache, causal, local=local, softcap=softcap, rows="ranged", sink=sink)
        elif cache_leftpad is not None:
            plan = "cache_leftpad: with cache_batch_idx only on the reference path"
        elif not (_mergeable(k_cache) and _mergeable(v_cache)):
            plan = ("k_cache/v_cache: the first two dims must be mergeable (rows of a (pages * page_size) view) "
                    "with page_table or cache_batch_idx")
        else:
            page_size = None if page_table is None else k_cache.shape[1]
            config = host.kvcache_config(q.shape[-1], page_size)
            if host.kvcache_page_rows(page_size) and not isinstance(config, str):
                config = unverified_reason("flash_attn_kvcache") or config  # pages of 16 or 32
            rows_view = k_cache.reshape(1, -1, *k_cache.shape[2:])
            plan = config if isinstance(config, str) else host.plan_fwd(
                q, rows_view, rows_view, causal, config, local=local, softcap=softcap, rows="kvcache",
                keys_per_entry=_capacity(k_cache, page_table), sink=sink,
                page_rows=host.kvcache_page_rows(page_size))
        if plan is not None and not isinstance(plan, str):
            plan = ("ranged" if ranged else "paged", plan)
    return _remember(_plans, key, plan)


def _planning_key(exact: tuple, k_cache, v_cache, page_table, cache_batch_idx) -> tuple:
    """What validation and planning read of the tensors. A contiguous cache read directly (no page
    table, no cache_batch_idx: transformers' caches, which grow by a key a step) enters by
    :func:`keys_key`, so the cache's growth does not make a new plan per step."""
    if page_table is not None or cache_batch_idx is not None:
        return exact
    return (exact[0], keys_key(k_cache), keys_key(v_cache), k_cache.shape[1] == v_cache.shape[1], *exact[3:])


def flash_attn_kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                            causal, window_left=None, window_right=None, softcap=0.0, cache_leftpad=None,
                            learnable_sink=None):
    validate_scale(softmax_scale)
    if softcap != 0.0:  # a value, not part of the plan's key: checked on every call
        _validate_softcap(softcap)
    if softmax_scale <= 0.0 and q.is_cuda:
        q, softmax_scale = positive_scale(q, softmax_scale)
    if q.dim() != 4 or k_cache.dim() != 4 or (page_table is not None and page_table.dim() != 2):
        # the named error, before the sizes below are read
        _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cache_leftpad)
    capacity = _capacity(k_cache, page_table)
    band_causal, local, left, right = kernel_band(causal, window_left, window_right, q.shape[1], capacity)
    exact = (*layout_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cache_leftpad,
                         learnable_sink), band_causal, local, softcap_kind(softcap, q.dtype))
    plan = _exact_plans.get(exact, False)
    if plan is False:
        key = _planning_key(exact, k_cache, v_cache, page_table, cache_batch_idx)
        plan = _plans.get(key, False)
        if plan is False:
            _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cache_leftpad)
            if learnable_sink is not None:
                sinks.validate_sink(learnable_sink, q, 2)
            plan = _make_plan(key, q, k_cache, v_cache, page_table, cache_batch_idx, cache_leftpad, band_causal,
                              local, softcap, learnable_sink is not None)
        _remember(_exact_plans, exact, plan)
    _check_values(k_cache, k, cache_seqlens, cache_batch_idx, page_table, cache_leftpad)
    if k is not None:
        _append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table)
    key_lengths = cache_seqlens if k is None else cache_seqlens + k.shape[1]
    if plan is None:
        return _outputs_like(q)
    if not isinstance(plan, str):
        reason = pointer_reason(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
        if reason is None:
            rows, launch = plan
            out, lse = _outputs_like(q)
            sink = None if learnable_sink is None else sinks.for_kernels(learnable_sink)
            if rows == "ranged":
                key_start = _zero_starts(q.device.index, q.shape[0]) if cache_leftpad is None else cache_leftpad
                launch.ranged(q, k_cache, v_cache, bounds.dense(key_start), bounds.dense(key_lengths), out, lse,
                              softmax_scale, left, right, softcap, sink=sink)
            else:
                pages = bounds.dense(_pages_of(q, page_table, cache_batch_idx))
                launch.kvcache(q, k_cache, v_cache, bounds.dense(key_lengths), pages, k_cache.shape[1], out, lse,
                               softmax_scale, left, right, softcap, sink=sink)
            return out, lse
        plan = reason
    if plan != "cpu":
        fallback.note("flash_attn_kvcache", plan)
    out, lse = _reference(q, k_cache, v_cache, key_lengths, _pages_of(q, page_table, cache_batch_idx), softmax_scale,
                          causal, window_left, window_right, softcap, cache_leftpad)
    return (out, lse) if learnable_sink is None else sinks.merge(out, lse, learnable_sink)


register_impl("flash_attn_kvcache", flash_attn_kvcache_impl)


@torch.library.register_fake(qualname("flash_attn_kvcache"), lib=lib)
def _flash_attn_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                             causal, window_left=None, window_right=None, softcap=0.0, cache_leftpad=None,
                             learnable_sink=None):
    _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cache_leftpad)
    _validate_softcap(softcap)
    if learnable_sink is not None:
        sinks.validate_sink(learnable_sink, q, 2)
    return _outputs_like(q)
