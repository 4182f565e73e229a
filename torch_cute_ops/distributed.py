"""DTensor sharding rules for the ``cute`` ops: sharded inputs keep the kernels, no redistribution.

    import torch_cute_ops.distributed  # registers the rules (imports torch.distributed.tensor)

Kept out of ``import torch_cute_ops`` (the distributed stack costs import time). Each rule lists
the placements an op accepts on one mesh dim; DTensor expands them over the mesh and picks the
cheapest, so inputs already placed as below run the op on their local shards without a
collective:

* ``gemm`` (a @ b): rows of a (``Shard(M)``, output rows), columns of b (column-parallel,
  ``Shard(N)``, bias sharded with them), the contraction dim (row-parallel: a ``Shard(K)``, b
  ``Shard(K)``, output ``Partial`` -- only without bias and activation, which do not distribute
  over a sum), and the batch of a batched GEMM;
* ``scaled_gemm`` (FP8): rows of a with their scales (every mode), columns of b with theirs
  (per-tensor and rowwise scales), the contraction dim (``Partial``; per-tensor and rowwise
  scales, which K does not index; no bias or activation), and the batch;
* ``flash_attn_fwd`` / ``_bwd``: the batch, or the heads (query and kv heads together: each rank
  keeps whole GQA groups when both head counts divide by the mesh size), with key ranges and
  attn_mask following their batch / head dims (broadcast dims stay replicated);
* ``flash_attn_varlen_fwd`` / ``_bwd``: the heads (cu_seqlens replicated; packing does not split
  by batch);
* everything replicated.

* ``flash_attn_kvcache``: the heads (q, the caches, new k/v; cache_seqlens, cache_batch_idx,
  page_table and cache_leftpad replicated), or the batch (contiguous caches without
  cache_batch_idx; cache_seqlens and cache_leftpad sharded with it). The op
  appends into its caches in place, so a rule is offered only for the placement the caches
  already have: a cache is never redistributed (that would append into a temporary copy), and
  caches placed otherwise are a ValueError rather than a lost append.

Context parallelism (:func:`context_parallel_attention`): a long sequence split over the ranks,
each holding a head and a tail chunk (:func:`shard_sequence`), K and V all-gathered, the local
attention on the kernels.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

cute = torch.ops.cute


def _is_tensor(arg) -> bool:
    return hasattr(arg, "placements") and hasattr(arg, "shape")


def _placements(args, chosen: dict) -> list:
    """Input placements for every positional arg: ``chosen[i]`` for tensor i, Replicate for other
    tensors, None for non-tensors."""
    return [chosen.get(i, Replicate()) if _is_tensor(arg) else None for i, arg in enumerate(args)]


def _dim_or_replicate(arg, dim: int):
    """Shard a broadcastable operand (attn_mask) along ``dim`` unless that dim is broadcast."""
    if not _is_tensor(arg) or arg.shape[dim] == 1:
        return Replicate()
    return Shard(dim)


def _all_replicated(args, outputs: int):
    return [Replicate()] * outputs, _placements(args, {})


# ---------------------------------------------------------------------------------------- gemm

@register_sharding(cute.gemm.default)
def _gemm_sharding(*args, **kwargs):
    a = args[0]
    bias = args[2] if len(args) > 2 else None
    activation = args[3] if len(args) > 3 else kwargs.get("activation")
    batched = len(a.shape) == 3
    m_dim, k_dim_a = (1, 2) if batched else (0, 1)
    k_dim_b, n_dim = (1, 2) if batched else (0, 1)
    n_out = len(a.shape) - 1
    strategies = [_all_replicated(args, 1)]
    strategies.append(([Shard(m_dim)], _placements(args, {0: Shard(m_dim)})))            # rows
    strategies.append(([Shard(n_out)], _placements(args, {1: Shard(n_dim), 2: Shard(0)})))  # column-parallel
    if bias is None and activation is None:                                                # row-parallel
        strategies.append(([Partial()], _placements(args, {0: Shard(k_dim_a), 1: Shard(k_dim_b)})))
    if batched:
        strategies.append(([Shard(0)], _placements(args, {0: Shard(0), 1: Shard(0)})))
    return strategies


@register_sharding(cute.scaled_gemm.default)
def _scaled_gemm_sharding(*args, **kwargs):
    # (a, b, scale_a, scale_b, bias, out_dtype, activation); scales per tensor (one element), per
    # row / column ([L,] M, 1) / ([L,] 1, N), or per block ([L,] M, K/128) / ([L,] K/128, N/128)
    a, b, scale_a, scale_b = args[:4]
    bias = args[4] if len(args) > 4 else kwargs.get("bias")
    activation = args[6] if len(args) > 6 else kwargs.get("activation")
    batched = len(a.shape) == 3
    m_dim, k_dim_a = (1, 2) if batched else (0, 1)
    k_dim_b, n_dim = (1, 2) if batched else (0, 1)
    per_tensor = scale_a.shape.numel() == 1
    blockwise = not per_tensor and scale_a.shape[-1] != 1
    strategies = [_all_replicated(args, 1)]
    rows_scale = Replicate() if per_tensor else Shard(m_dim)
    strategies.append(([Shard(m_dim)], _placements(args, {0: Shard(m_dim), 2: rows_scale})))
    if not blockwise:
        cols_scale = Replicate() if per_tensor else Shard(n_dim)
        strategies.append(([Shard(len(a.shape) - 1)],
                           _placements(args, {1: Shard(n_dim), 3: cols_scale, 4: Shard(0)})))
        if bias is None and activation is None:
            strategies.append(([Partial()], _placements(args, {0: Shard(k_dim_a), 1: Shard(k_dim_b)})))
    if batched:
        strategies.append(([Shard(0)], _placements(
            args, {0: Shard(0), 1: Shard(0), 2: Replicate() if per_tensor else Shard(0),
                   3: Replicate() if per_tensor else Shard(0)})))
    return strategies


# ----------------------------------------------------------------------------------- attention
# flash_attn_fwd(q, k, v, scale, causal, window_left, window_right, softcap, key_start, key_end,
# attn_mask); q/k/v (B, S, H, D), lse (B, H, S), key ranges (B,), attn_mask (..., H, S_q, S_k)

def _dense_attention_strategies(args, tensor_dims: dict, outputs: list, mask_index: int):
    """Batch and head strategies for the (B, S, H, D) attention ops. ``tensor_dims`` maps an arg
    index to its (batch dim, head dim), None where it has none (key ranges have no head dim: they
    stay replicated when heads are sharded); ``outputs`` the same for the results. The attn_mask
    at ``mask_index`` follows its batch / head dim unless that dim is broadcast."""
    strategies = [_all_replicated(args, len(outputs))]
    for which in (0, 1):  # 0: batch, 1: heads
        chosen = {i: Shard(dims[which]) if dims[which] is not None else Replicate()
                  for i, dims in tensor_dims.items() if i < len(args)}
        if mask_index < len(args) and _is_tensor(args[mask_index]):
            mask = args[mask_index]
            mask_dim = len(mask.shape) - 4 + which  # its batch or head dim, counted from the right
            chosen[mask_index] = _dim_or_replicate(mask, mask_dim) if mask_dim >= 0 else Replicate()
        strategies.append(([Shard(dims[which]) for dims in outputs], _placements(args, chosen)))
    return strategies


@register_sharding(cute.flash_attn_fwd.default)
def _flash_attn_fwd_sharding(*args, **kwargs):  # kwargs: deterministic
    dims = {0: (0, 2), 1: (0, 2), 2: (0, 2), 8: (0, None), 9: (0, None)}  # q, k, v, key_start, key_end
    return _dense_attention_strategies(args, dims, [(0, 2), (0, 1)], mask_index=10)


@register_sharding(cute.flash_attn_bwd.default)
def _flash_attn_bwd_sharding(*args, **kwargs):
    # (dout, q, k, v, out, lse, scale, causal, window_left, window_right, softcap, key_start, key_end, attn_mask)
    dims = {0: (0, 2), 1: (0, 2), 2: (0, 2), 3: (0, 2), 4: (0, 2), 5: (0, 1), 11: (0, None), 12: (0, None)}
    return _dense_attention_strategies(args, dims, [(0, 2), (0, 2), (0, 2)], mask_index=13)


@register_sharding(cute.flash_attn_varlen_fwd.default)
def _flash_attn_varlen_fwd_sharding(*args, **kwargs):
    # q, k, v (total, H, D), cu_seqlens replicated; out (total, H, D), lse (H, total)
    heads = ([Shard(1), Shard(0)], _placements(args, {0: Shard(1), 1: Shard(1), 2: Shard(1)}))
    return [_all_replicated(args, 2), heads]


@register_sharding(cute.flash_attn_varlen_bwd.default)
def _flash_attn_varlen_bwd_sharding(*args, **kwargs):
    # dout, q, k, v, out (total, H, D), lse (H, total), cu_seqlens replicated
    chosen = {i: Shard(1) for i in range(5)}
    chosen[5] = Shard(0)
    return [_all_replicated(args, 3), ([Shard(1)] * 3, _placements(args, chosen))]


# ----------------------------------------------------------------------------------- kv cache
# flash_attn_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, scale,
# causal, window_left, window_right, softcap, cache_leftpad) -> (out, lse); q / k / v (B, S, H, D), caches
# (B_cache, S_cache, H_kv, D) or paged (pages, page_size, H_kv, D); out (B, S_q, H, D), lse (B, H, S_q)

@register_sharding(cute.flash_attn_kvcache.default)
def _flash_attn_kvcache_sharding(*args):
    k_cache, v_cache = args[1], args[2]
    placement = tuple(k_cache.placements)
    strategies = []
    if all(p == Replicate() for p in placement):
        strategies.append(_all_replicated(args, 2))
    if all(p == Shard(2) for p in placement):
        heads = {0: Shard(2), 1: Shard(2), 2: Shard(2), 3: Shard(2), 4: Shard(2)}
        strategies.append(([Shard(2), Shard(1)], _placements(args, heads)))
    indexed = any(_is_tensor(args[i]) for i in (6, 7) if i < len(args))  # cache_batch_idx, page_table
    if all(p == Shard(0) for p in placement) and not indexed:
        batch = {0: Shard(0), 1: Shard(0), 2: Shard(0), 3: Shard(0), 4: Shard(0), 5: Shard(0), 13: Shard(0)}
        strategies.append(([Shard(0), Shard(0)], _placements(args, batch)))
    if not strategies or tuple(v_cache.placements) != placement:
        raise ValueError(
            "k_cache, v_cache: flash_attn_kvcache appends into its caches in place, so they must already be "
            "placed as it runs: both Replicate, both Shard(2) (heads), or both Shard(0) (batch, contiguous caches "
            f"without cache_batch_idx / page_table); got {k_cache.placements} and {v_cache.placements}")
    return strategies


# ------------------------------------------------------------------------ context parallelism

def _chunks(world: int, rank: int) -> tuple[int, int]:
    """The two of ``2 * world`` equal sequence chunks rank ``rank`` holds: its head and its tail
    (``rank`` and ``2 * world - 1 - rank``), so that every rank's causal work is the same."""
    return rank, 2 * world - 1 - rank


def shard_sequence(x: torch.Tensor, group=None, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a full (batch, seqlen, ...) tensor for :func:`context_parallel_attention`:
    its head and tail chunks of ``2 * world`` equal chunks, concatenated (seqlen must divide)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[seq_dim] % (2 * world):
        raise ValueError(f"x: the sequence ({x.shape[seq_dim]}) must split into {2 * world} equal chunks")
    chunks = x.chunk(2 * world, dim=seq_dim)
    return torch.cat([chunks[c] for c in _chunks(world, rank)], dim=seq_dim)


def unshard_sequence(local: torch.Tensor, group=None, seq_dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's :func:`shard_sequence` part (differentiable)."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    world = dist.get_world_size(group)
    # one gathered tensor, rank-major along seq_dim; its backward reduce-scatters the gradient
    gathered = all_gather_tensor_autograd(local.contiguous(), seq_dim, group or dist.group.WORLD)
    parts = gathered.chunk(world, dim=seq_dim)
    placed = [None] * (2 * world)
    for rank, part in enumerate(parts):
        head, tail = part.chunk(2, dim=seq_dim)
        placed[_chunks(world, rank)[0]], placed[_chunks(world, rank)[1]] = head, tail
    return torch.cat(placed, dim=seq_dim)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                               causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    """Attention over a sequence split across the ranks of ``group``: q, k, v are this rank's
    :func:`shard_sequence` parts, (batch, 2 * chunk, heads, head_dim); returns this rank's part
    of the output, as the unsplit ``flash_attn_func(q, k, v, causal=causal)`` would give it.

    K and V are all-gathered (their gradients reduce-scattered back by autograd), and each of the
    rank's two query chunks attends, on the kernels, to the keys up to its own end (causal aligned
    bottom-right) or to all of them; with causal load balancing every rank does the same work.
    Forward and backward; the backward's dK and dV of the gathered keys flow back to their ranks.
    """
    import torch.distributed as dist

    from .functional import flash_attn_func

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if q.shape[1] % 2 or q.shape[1] != k.shape[1]:
        raise ValueError(f"q: expected this rank's head and tail chunks of one length (an even seqlen equal to "
                         f"k's), got {q.shape[1]} and {k.shape[1]}")
    chunk = q.shape[1] // 2
    full_k, full_v = (unshard_sequence(t, group) for t in (k, v))
    outs = []
    for piece, index in zip(q.split(chunk, dim=1), _chunks(world, rank)):
        end = (index + 1) * chunk if causal else full_k.shape[1]
        outs.append(flash_attn_func(piece, full_k[:, :end], full_v[:, :end], softmax_scale=softmax_scale,
                                    causal=causal))
    return torch.cat(outs, dim=1)
