"""``cute::flash_attn_varlen_paged``: packed queries against a paged KV cache, one launch.

A serving engine's step: decode rows (one query each) and chunks of prefills (many) in one
packed q (total_q, H_q, D), sequence ``b`` owning rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``
(int32 (B + 1,)), of which the first ``seqused_q[b]`` are real (default: all). Its keys are the
first ``seqused_k[b]`` (int32 (B,)) keys of a KV cache of pages, k_cache and v_cache
(num_pages, page_size, H_kv, D), entry b's key j in page ``page_table[b, j // page_size]``
(int32 (B, pages per entry)). Causal and windows align each sequence's real queries bottom-right
to its keys (the last real query sees the newest key), FlashAttention's semantics. out is
(total_q, H_q, D), lse (H_q, total_q) float32; rows past a sequence's seqused_q get 0 and lse -inf;
rows past ``cu_seqlens_q[-1]`` (a padded batch) belong to no sequence and are not written, as in
FlashAttention. Not differentiable (inference).

Every value that bounds a kernel's memory access is checked before the launch, on the device
where it lives and without a host sync (``ops.bounds``; on the host for CPU tensors, with a named
ValueError), and inside CUDA graphs in every replay: cu_seqlens_q (from 0, non-decreasing, ending
at most at total_q, no sequence longer than max_seqlen_q: they place the plain stores of out),
seqused_q (within each sequence), seqused_k (within the pages of a row of page_table: they bound
the page-table reads). Page indices only place TMA loads of the cache (zeros past its end):
checked eagerly, not in graphs.
"""

from __future__ import annotations

import os

import torch

from ..reference import attention as reference
from ..runtime.attention import kernel_band, pointer_reason, softcap_kind
from . import bounds, checks, dispatch, fallback
from .attention import _remember, _validate_softcap, layout_key, positive_scale, validate_qkv_common, validate_scale
from .schemas import lib, qualname, register_impl

_LAYOUT = "(total_q, heads, head_dim) for q, (num_pages, page_size, kv_heads, head_dim) for the caches"


def validate(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q) -> None:
    """Shapes, dtypes and devices (the values are checked by :func:`check_values`)."""
    checks.require_rank("q", q, (3,), _LAYOUT)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.require_rank(name, t, (4,), _LAYOUT)
    validate_qkv_common(q.unsqueeze(0), k_cache, v_cache, _LAYOUT, ("k_cache", "v_cache"))
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q: expected an int32 tensor of shape (batch + 1,), got {cu_seqlens_q.dtype} "
                         f"{tuple(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    if page_table is None or page_table.dtype != torch.int32 or page_table.dim() != 2 or \
            page_table.shape[0] != batch:
        got = "None" if page_table is None else f"{page_table.dtype} {tuple(page_table.shape)}"
        raise ValueError(f"page_table: expected an int32 tensor of shape ({batch}, pages per sequence), got {got}")
    for name, t in (("seqused_k", seqused_k), ("seqused_q", seqused_q)):
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (batch,)):
            raise ValueError(f"{name}: expected an int32 tensor of shape ({batch},), got {t.dtype} {tuple(t.shape)}")
    if seqused_k is None:
        raise ValueError("seqused_k: required with a paged cache (each sequence's key count)")
    if max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q: expected a length >= 0, got {max_seqlen_q}")
    checks.require_same_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cu_seqlens_q", cu_seqlens_q),
                                ("seqused_q", seqused_q), ("seqused_k", seqused_k), ("page_table", page_table)])


def _capacity(k_cache, page_table) -> int:
    return k_cache.shape[1] * page_table.shape[1]


def check_values(q, k_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q) -> None:
    """The index values against q and the cache (ops.bounds: no host sync, once per version)."""
    bounds.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    if seqused_q is not None:
        bounds.check_within("seqused_q", seqused_q, 0, bounds.lengths_of(cu_seqlens_q),
                            "its sequence's length in cu_seqlens_q")
    capacity = _capacity(k_cache, page_table)
    bounds.check_within("seqused_k", seqused_k, 0, capacity,
                        f"{capacity} (pages per sequence {page_table.shape[1]} x page_size {k_cache.shape[1]})")
    if page_table.numel():
        limit = k_cache.shape[0] - 1
        bounds.check_within("page_table", page_table, 0, limit, f"{limit} (the cache's page count less one)",
                            in_graphs=False)


def append_packed(k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_k_new, page_table) -> torch.Tensor:
    """Write packed new keys k, v (total_new, H_kv, D), sequence b's its rows
    ``cu_seqlens_k_new[b]:cu_seqlens_k_new[b + 1]``, into the cache at positions
    ``cache_seqlens[b]`` onwards, through the page table (in place, no sync); the key counts after
    the append (seqused_k)."""
    if k is None or v is None:
        raise ValueError("k, v: give both (new keys to append) or neither")
    if cu_seqlens_k_new is None:
        raise ValueError("cu_seqlens_k_new: required with packed queries and new keys k, v")
    batch = page_table.shape[0]
    for name, t in (("k", k), ("v", v)):
        checks.require_same_dtype(name, t, "k_cache", k_cache)
        expected = (k.shape[0], *k_cache.shape[2:])
        if t.dim() != 3 or tuple(t.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected} (total new tokens, kv heads, head_dim), "
                             f"got {tuple(t.shape)}")
    for name, t, shape in (("cu_seqlens_k_new", cu_seqlens_k_new, (batch + 1,)), ("cache_seqlens", cache_seqlens,
                                                                                  (batch,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected an int32 tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    checks.require_same_device([("k_cache", k_cache), ("k", k), ("v", v), ("cu_seqlens_k_new", cu_seqlens_k_new),
                                ("cache_seqlens", cache_seqlens), ("page_table", page_table)])
    capacity = _capacity(k_cache, page_table)
    bounds.check_cu_seqlens("cu_seqlens_k_new", cu_seqlens_k_new, k.shape[0], capacity, "the cache's capacity")
    seqused_k = cache_seqlens + bounds.lengths_of(cu_seqlens_k_new)
    bounds.require((cache_seqlens >= 0) & (seqused_k <= capacity),
                   f"cache_seqlens: every value plus its new tokens must lie in [0, {capacity}] (the capacity)",
                   cache_seqlens)
    token = torch.arange(k.shape[0], device=k.device)
    entry = torch.searchsorted(cu_seqlens_k_new[1:], token, right=True)
    pos = cache_seqlens.long()[entry] + token - cu_seqlens_k_new.long()[entry]
    page_size = k_cache.shape[1]
    index = (page_table.long()[entry, pos // page_size], pos % page_size)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
    return seqused_k


def reference_paged(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, softmax_scale, causal,
                    window_left=None, window_right=None, softcap=0.0):
    """Each sequence's real queries against its keys gathered through its page table (the dense
    reference per sequence); every other row 0 with lse -inf."""
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=reference.compute_dtype(q.dtype),
                     device=q.device)
    page_size = k_cache.shape[1]
    flat_k, flat_v = k_cache.reshape(-1, *k_cache.shape[2:]), v_cache.reshape(-1, *v_cache.shape[2:])
    starts = cu_seqlens_q.tolist()
    used_q = [b - a for a, b in zip(starts, starts[1:])] if seqused_q is None else seqused_q.tolist()
    for b, (start, rows, keys) in enumerate(zip(starts, used_q, seqused_k.tolist())):
        if rows == 0:
            continue
        key_index = torch.arange(keys, device=q.device)
        cache_rows = page_table[b].long()[key_index // page_size] * page_size + key_index % page_size
        o, l = reference.flash_attn_fwd(q[None, start:start + rows], flat_k[cache_rows][None], flat_v[cache_rows][None],
                                        softmax_scale, causal, window_left, window_right, softcap)
        out[start:start + rows], lse[:, start:start + rows] = o[0], l[0]
    return out, lse


def _outputs_like(q):
    total, heads, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((heads, total), dtype=reference.compute_dtype(q.dtype)))


_plans: dict[tuple, object] = {}

SERVING_KERNELS_ENV = "TORCH_CUTE_OPS_SERVING_KERNELS"


def unverified_reason(kernel: str) -> str | None:
    """The packed-paged rows and the small-page (16, 32) key loads are compiled and their PTX read,
    but have not run on a GPU yet: they serve only where ``TORCH_CUTE_OPS_SERVING_KERNELS=1`` asks
    (read when a layout is first planned); otherwise this is the fallback's reason."""
    if os.environ.get(SERVING_KERNELS_ENV) == "1":
        return None
    return (f"{kernel}: the packed-paged and small-page kernels are compiled but not yet verified on a GPU "
            f"({SERVING_KERNELS_ENV}=1 uses them)")


def _make_plan(key, q, k_cache, v_cache, page_table, causal, local, softcap):
    """The launch, a reason no kernel covers the call, or None (nothing to compute)."""
    plan = "cpu"
    if q.is_cuda:
        host = dispatch.kernel_for("flash_attn_kvcache", q.device)
        if isinstance(host, str):
            plan = host
        elif unverified_reason("flash_attn_varlen_paged"):
            plan = unverified_reason("flash_attn_varlen_paged")
        elif k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1) or \
                v_cache.stride(0) != v_cache.shape[1] * v_cache.stride(1):
            plan = "k_cache/v_cache: the first two dims must be mergeable (rows of a (pages * page_size) view)"
        else:
            # one page per sequence (a contiguous cache): key blocks may run past its end, masked
            page_size = None if page_table.shape[1] == 1 else k_cache.shape[1]
            config = host.kvcache_config(q.shape[-1], page_size)
            rows_view = k_cache.reshape(-1, *k_cache.shape[2:])
            plan = config if isinstance(config, str) else host.plan_fwd(
                q, rows_view, rows_view, causal, config, local=local, softcap=softcap, rows="packed_paged",
                page_rows=host.kvcache_page_rows(page_size))
    return _remember(_plans, key, plan)


_key_info: dict[tuple, torch.Tensor] = {}  # the last step's (seqused_k, seqused_q, pages) by their versions


def key_info(cu_seqlens_q, seqused_q, seqused_k, page_table, query_tile: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """What the kernel reads besides cu_seqlens_q, in one int32 tensor (kernels.common.seqlen,
    "packed_paged"): seqused_k, seqused_q (default: the lengths in cu_seqlens_q), the page table,
    and each sequence's first query block in the list of all sequences' blocks of
    ``query_tile`` = (rows per query, rows per block) (B + 1, the last the total): the kernel
    schedules those blocks, not max_seqlen_q's count for every sequence. The layers of a step
    share one (by the tensors' versions); inside a CUDA graph it is made in the graph, so
    replays read the new values."""
    capturing = seqused_k.is_cuda and torch.cuda.is_current_stream_capturing()
    key = None
    if bounds.readable(seqused_k, seqused_q, page_table) and not capturing:
        key = (bounds.serial(seqused_k), bounds.serial(seqused_q if seqused_q is not None else cu_seqlens_q),
               bounds.serial(page_table), query_tile)
        if key in _key_info:
            return _key_info[key]
    used_q = bounds.lengths_of(cu_seqlens_q) if seqused_q is None else seqused_q
    rows_per_query, rows_per_block = query_tile
    blocks = (used_q * rows_per_query + rows_per_block - 1) // rows_per_block
    first_blocks = torch.cumsum(torch.cat([blocks.new_zeros(1), blocks]), 0, dtype=torch.int32)
    info = torch.cat([seqused_k, used_q, page_table.reshape(-1), first_blocks])
    if key is not None:
        _key_info.clear()
        _key_info[key] = info
    return info


def flash_attn_varlen_paged_impl(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q,
                                 softmax_scale, causal, window_left=None, window_right=None, softcap=0.0):
    validate_scale(softmax_scale)
    if softcap != 0.0:
        _validate_softcap(softcap)
    if softmax_scale <= 0.0 and q.is_cuda:
        q, softmax_scale = positive_scale(q, softmax_scale)
    if q.dim() != 3 or k_cache.dim() != 4 or page_table is None or page_table.dim() != 2:
        validate(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q)
    capacity = _capacity(k_cache, page_table)
    band_causal, local, left, right = kernel_band(causal, window_left, window_right, max_seqlen_q, capacity)
    key = (*layout_key(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table), band_causal, local,
           softcap_kind(softcap, q.dtype))
    plan = _plans.get(key, False)
    if plan is False:
        validate(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q)
        plan = _make_plan(key, q, k_cache, v_cache, page_table, band_causal, local, softcap)
    check_values(q, k_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q)
    if plan is None or cu_seqlens_q.shape[0] == 1:  # nothing to compute, or no sequence
        out, lse = _outputs_like(q)
        return out.zero_(), lse.fill_(float("-inf"))
    if not isinstance(plan, str):
        reason = pointer_reason(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
        if reason is None:
            out, lse = _outputs_like(q)
            if seqused_q is not None:  # rows past a sequence's real queries: the kernel never writes them
                out.zero_()
                lse.fill_(float("-inf"))
            info = key_info(cu_seqlens_q, seqused_q, seqused_k, bounds.dense(page_table),
                            (max(plan.group, 1), plan.tiles[0]))
            plan.packed_paged(q, k_cache, v_cache, bounds.dense(cu_seqlens_q), info, int(max_seqlen_q), out, lse,
                              softmax_scale, left, right, softcap)
            return out, lse
        plan = reason
    if plan != "cpu":
        fallback.note("flash_attn_varlen_paged", plan)
    return reference_paged(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, softmax_scale,
                           causal, window_left, window_right, softcap)


register_impl("flash_attn_varlen_paged", flash_attn_varlen_paged_impl)


@torch.library.register_fake(qualname("flash_attn_varlen_paged"), lib=lib)
def _flash_attn_varlen_paged_fake(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q,
                                  softmax_scale, causal, window_left=None, window_right=None, softcap=0.0):
    validate(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q)
    _validate_softcap(softcap)
    return _outputs_like(q)
