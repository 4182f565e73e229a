"""What the serving tests share (CPU and GPU): a continuous-batching step on a paged cache with its
pages shuffled, and an independent float64 attention of each sequence to check it against."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch


@dataclass
class Step:
    q: torch.Tensor  # (total_q, H_q, D)
    k_cache: torch.Tensor  # (num_pages, page_size, H_kv, D)
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 (B + 1,)
    seqused_k: torch.Tensor  # int32 (B,)
    page_table: torch.Tensor  # int32 (B, pages per sequence), pages shuffled over the pool
    max_seqlen_q: int
    max_seqlen_k: int


def make_step(query_lengths, key_lengths, page_size, heads=(4, 2), head_dim=64, dtype=torch.float64,
              device="cpu", seed=0, spare_pages=3) -> Step:
    """Sequence b: query_lengths[b] queries (1: a decode row) against key_lengths[b] keys; the
    pool has ``spare_pages`` pages no sequence uses, and each table row pages past its keys."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = max(1, max(-(-n // page_size) for n in key_lengths) + 1)
    batch = len(query_lengths)
    num_pages = batch * per_seq + spare_pages
    h_q, h_kv = heads

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    q = rand(sum(query_lengths), h_q, head_dim)
    k_cache, v_cache = rand(num_pages, page_size, h_kv, head_dim), rand(num_pages, page_size, h_kv, head_dim)
    table = torch.randperm(num_pages, generator=gen)[:batch * per_seq].view(batch, per_seq)
    cu = torch.tensor([0, *itertools.accumulate(query_lengths)], dtype=torch.int32)
    return Step(q, k_cache, v_cache, cu.to(device), torch.tensor(key_lengths, dtype=torch.int32, device=device),
                table.int().to(device), max(query_lengths), max(key_lengths))


def expected(step: Step, causal=False, window=(-1, -1), softcap=0.0, scale=None, sink=None, seqused_q=None):
    """out (total_q, H_q, D) and lse (H_q, total_q) in float64, sequence by sequence from the
    definition: query i of S real ones sees key j of L when ``i + L - S - left <= j <= i + L - S
    + right`` (bottom-right; causal: right = 0); rows past seqused_q are 0 with lse -inf."""
    q, k_cache, v_cache = (t.double().cpu() for t in (step.q, step.k_cache, step.v_cache))
    scale = scale or 1 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    cu, lengths, table = step.cu_seqlens_q.tolist(), step.seqused_k.tolist(), step.page_table.cpu().long()
    page_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for b, length in enumerate(lengths):
        rows = cu[b + 1] - cu[b] if seqused_q is None else int(seqused_q[b])
        keys = torch.arange(length)
        cache_rows = table[b][keys // page_size] * page_size + keys % page_size
        k = k_cache.reshape(-1, *k_cache.shape[2:])[cache_rows].repeat_interleave(group, 1)
        v = v_cache.reshape(-1, *v_cache.shape[2:])[cache_rows].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b] + rows], k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i, j = torch.arange(rows)[:, None] + length - rows, torch.arange(length)[None]
        left, right = window
        right = 0 if causal else right
        visible = torch.ones(rows, length, dtype=torch.bool)
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
        s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, -1)
        if sink is not None:
            row_lse = torch.logaddexp(row_lse, sink.double().cpu()[:, None])
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[cu[b]:cu[b] + rows] = torch.einsum("hqk,khd->qhd", p, v)
        lse[:, cu[b]:cu[b] + rows] = row_lse
    return out, lse
