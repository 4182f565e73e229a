"""``cute::flash_attn_kvcache``: attention against a KV cache, appending new keys in place.

q is (B, S_q, H_q, D). The cache is contiguous, (B_cache, capacity, H_kv, D) with entry b in
row ``cache_batch_idx[b]`` (default b), or paged, (num_pages, page_size, H_kv, D) with entry b's
key j in page ``page_table[b, j // page_size]``. New keys k, v (B, S_new, H_kv, D), when given,
are written into the cache at positions ``cache_seqlens[b] ..`` first (the op mutates k_cache
and v_cache, declared in its schema, so compiled graphs and CUDA graphs keep the write); then q
attends to the entry's first ``cache_seqlens[b] + S_new`` keys, causal and windows aligned
bottom-right to them (q's last row is the newest key). Not differentiable (inference).

The contents of cache_seqlens, cache_batch_idx and page_table are checked against the cache in
eager mode, once per version of those tensors (a read-back: a model's layers share one check per
step), skipped during CUDA-graph capture and under tracing.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..reference import attention as reference
from ..runtime.attention import kernel_band, pointer_reason, softcap_kind
from . import checks, dispatch, fallback
from .attention import _remember, _validate_softcap, validate_qkv_common
from .schemas import lib, qualname, register_impl

_LAYOUT = "(batch, seqlen, heads, head_dim)"


def _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table) -> None:
    checks.require_rank("q", q, (4,), _LAYOUT)
    validate_qkv_common(q, k_cache, v_cache, _LAYOUT)
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
    named = [("cache_seqlens", cache_seqlens, (batch,)), ("cache_batch_idx", cache_batch_idx, (batch,))]
    if page_table is not None:
        named.append(("page_table", page_table, (batch, page_table.shape[-1] if page_table.dim() else 0)))
    for name, t, shape in named:
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != shape):
            raise ValueError(f"{name}: expected an int32 tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    if page_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: not supported with page_table (the page table maps entries)")
    checks.require_same_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                                ("cache_batch_idx", cache_batch_idx), ("page_table", page_table)])


def _capacity(k_cache, page_table) -> int:
    return k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])


# (ids of the index tensors, new tokens, capacity) -> (weak references, versions) already checked
_checked: dict[tuple, tuple] = {}


def _check_values(q, k_cache, k, cache_seqlens, cache_batch_idx, page_table) -> None:
    """The index tensors' contents against the cache (eager only: one read-back per version)."""
    tensors = [t for t in (cache_seqlens, cache_batch_idx, page_table) if t is not None]
    if torch.compiler.is_compiling() or any(type(t) is not torch.Tensor for t in tensors) or (
            q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    new = 0 if k is None else k.shape[1]
    key = (*(id(t) for t in tensors), new, tuple(k_cache.shape))
    seen = _checked.get(key)
    if (seen is not None and all(r() is t for r, t in zip(seen[0], tensors))
            and seen[1] == [t._version for t in tensors]):
        return
    bounds = [(cache_seqlens.min(), cache_seqlens.max() + new)]
    if cache_batch_idx is not None:
        bounds.append((cache_batch_idx.min(), cache_batch_idx.max()))
    if page_table is not None and page_table.numel():
        bounds.append((page_table.min(), page_table.max()))
    values = torch.stack([torch.stack(pair) for pair in bounds]).tolist()
    capacity = _capacity(k_cache, page_table)
    if values[0][0] < 0 or values[0][1] > capacity:
        raise ValueError(f"cache_seqlens: with {new} new tokens the lengths reach {values[0][1]}, past the "
                         f"cache's capacity of {capacity} per entry (or are negative)")
    limit = k_cache.shape[0]
    for name, (low, high) in zip([n for n, t in (("cache_batch_idx", cache_batch_idx), ("page_table", page_table))
                                  if t is not None and t.numel()], values[1:]):
        if low < 0 or high >= limit:
            raise ValueError(f"{name}: entries must index the cache's first dim [0, {limit}), got [{low}, {high}]")
    if len(_checked) >= 256:
        _checked.clear()
    _checked[key] = ([weakref.ref(t) for t in tensors], [t._version for t in tensors])


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
               softcap):
    """Each entry's keys gathered through its page table, then the dense reference."""
    page_size = k_cache.shape[1]
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    outs, lses = [], []
    for b, length in enumerate(key_lengths.tolist()):
        keys = torch.arange(length, device=q.device)
        rows = page_table[b].long()[keys // page_size] * page_size + keys % page_size
        out, lse = reference.flash_attn_fwd(q[b:b + 1], flat_k[rows][None], flat_v[rows][None], softmax_scale,
                                            causal, window_left, window_right, softcap)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@functools.lru_cache(maxsize=64)
def _identity_pages(batch: int, device: torch.device) -> torch.Tensor:
    """Entry b's one page is cache row b (made once per batch size and device)."""
    return torch.arange(batch, device=device, dtype=torch.int32)[:, None]


def _outputs_like(q):
    b, s, h, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, s), dtype=reference.compute_dtype(q.dtype)))


_plans: dict[tuple, object] = {}


def _make_plan(key, q, k_cache, v_cache, page_table, causal, local, softcap):
    _validate_softcap(softcap)
    plan = "cpu"
    if q.is_cuda:
        host = dispatch.kernel_for("flash_attn_kvcache", q.device)
        if isinstance(host, str):
            plan = host
        elif any(cache.stride(0) != cache.shape[1] * cache.stride(1) for cache in (k_cache, v_cache)):
            plan = "k_cache/v_cache: the first two dims must be mergeable (rows of a (pages * page_size) view)"
        else:
            config = host.kvcache_config(q.shape[-1], None if page_table is None else k_cache.shape[1])
            rows_view = k_cache.reshape(1, -1, *k_cache.shape[2:])
            plan = config if isinstance(config, str) else host.plan_fwd(
                q, rows_view, rows_view, causal, config, local=local, softcap=softcap, rows="kvcache",
                keys_per_entry=_capacity(k_cache, page_table))
    return _remember(_plans, key, plan)


def flash_attn_kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                            causal, window_left=None, window_right=None, softcap=0.0):
    capacity = _capacity(k_cache, page_table)
    band_causal, local, left, right = kernel_band(causal, window_left, window_right, q.shape[1], capacity)
    key = tuple((t.shape, t.stride(), t.dtype, t.device) if t is not None else None
                for t in (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table))
    key += (band_causal, local, softcap_kind(softcap, q.dtype))
    plan = _plans.get(key, False)
    if plan is False:
        _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table)
        plan = _make_plan(key, q, k_cache, v_cache, page_table, band_causal, local, softcap)
    _check_values(q, k_cache, k, cache_seqlens, cache_batch_idx, page_table)
    if k is not None:
        _append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table)
    key_lengths = cache_seqlens if k is None else cache_seqlens + k.shape[1]
    if page_table is None:  # a contiguous cache: one page (of the whole capacity) per entry
        page_table = _identity_pages(q.shape[0], q.device) if cache_batch_idx is None else cache_batch_idx[:, None]
    if plan is None:
        return _outputs_like(q)
    if not isinstance(plan, str):
        reason = pointer_reason(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
        if reason is None:
            out, lse = _outputs_like(q)
            plan.kvcache(q, k_cache, v_cache, key_lengths, page_table, k_cache.shape[1], out, lse, softmax_scale,
                         left, right, softcap)
            return out, lse
        plan = reason
    if plan != "cpu":
        fallback.note("flash_attn_kvcache", plan)
    return _reference(q, k_cache, v_cache, key_lengths, page_table, softmax_scale, causal, window_left,
                      window_right, softcap)


register_impl("flash_attn_kvcache", flash_attn_kvcache_impl)


@torch.library.register_fake(qualname("flash_attn_kvcache"), lib=lib)
def _flash_attn_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                             causal, window_left=None, window_right=None, softcap=0.0):
    _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table)
    _validate_softcap(softcap)
    return _outputs_like(q)
