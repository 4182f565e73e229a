"""Plain-PyTorch attention forward and backward in the (B, S, H, D) layout of the kernels.

Semantics shared with every attention kernel:

* GQA/MQA: query head ``h`` reads kv head ``h // (H_q // H_kv)``.
* ``causal`` is aligned bottom-right, as FlashAttention does: query ``i`` attends key ``j``
  iff ``j <= i + (S_k - S_q)``. With S_q == S_k this is the usual lower triangle.
* A window ``(window_left, window_right)`` (None: unbounded on that side) lets query ``i``
  see key ``j`` iff ``i + S_k - S_q - window_left <= j <= i + S_k - S_q + window_right``;
  ``causal`` is ``window_right = 0`` (the smaller bound wins when both are given). Any
  integers are allowed: PyTorch's top-left causal is ``window_right = S_q - S_k``.
* ``softcap > 0`` replaces each scaled score ``s`` by ``softcap * tanh(s / softcap)`` before
  the softmax (FlashAttention's soft-capping, Gemma 2's logits), with its gradient.
* A query row that attends to nothing (S_k < S_q under causal, or outside every window) has
  output 0 and ``lse = -inf``; its gradients are 0.
* A padded batch (``key_start``/``key_end``, int32 (B,)): entry ``b``'s real keys are
  ``[key_start[b], key_end[b])``; query ``i`` sits at key position ``i + S_k - S_q`` and is real
  iff that position is in the range. Keys outside it are never seen, and query rows that are
  not real have output 0, ``lse = -inf`` and zero gradients.
* ``attn_mask`` (PyTorch's, broadcastable to (B, H_q, S_q, S_k)): bool (True = attend) or
  additive float, added to the scaled (capped) scores; it combines with every rule above.
* ``lse`` is the natural-log log-sum-exp of the scaled scores, shape (B, H_q, S_q), float32
  (float64 when the inputs are float64, so that gradcheck can verify the backward).

The reference materialises the S_q x S_k score matrix: it is for checking and for the
cases no kernel covers, not for speed.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device) -> torch.Tensor:
    """True where query i may attend key j (bottom-right aligned)."""
    return band_mask(seqlen_q, seqlen_k, device, None, 0)


def band_mask(seqlen_q: int, seqlen_k: int, device: torch.device, window_left, window_right) -> torch.Tensor | None:
    """True where query i may attend key j under a (left, right) window; None: everywhere."""
    if window_left is None and window_right is None:
        return None
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right is not None:
        visible &= j <= i + window_right
    if window_left is not None:
        visible &= j >= i - window_left
    return visible


def band(causal: bool, window_left, window_right):
    """The (left, right) bounds of causal plus a window, None where unbounded."""
    if causal:
        window_right = 0 if window_right is None else min(window_right, 0)
    return window_left, window_right


def _expand_kv(t: torch.Tensor, num_heads_q: int) -> torch.Tensor:
    """(B, S, H_kv, D) -> (B, S, H_q, D) as an indexed view-like gather (reference only)."""
    group = num_heads_q // t.shape[2]
    return t if group == 1 else t.repeat_interleave(group, dim=2)


def _reduce_kv(grad: torch.Tensor, num_heads_kv: int) -> torch.Tensor:
    """Sum the gradients of the query heads that share each kv head."""
    b, s, h, d = grad.shape
    return grad.view(b, s, num_heads_kv, h // num_heads_kv, d).sum(dim=3)


def key_range_mask(seqlen_q: int, seqlen_k: int, key_start, key_end) -> torch.Tensor:
    """(B, 1, S_q, S_k): True where both key j and query i of entry b are real (a padded batch)."""
    j = torch.arange(seqlen_k, device=key_start.device)
    i = torch.arange(seqlen_q, device=key_start.device) + (seqlen_k - seqlen_q)
    start, end = key_start[:, None].long(), key_end[:, None].long()
    keys = (j >= start) & (j < end)
    queries = (i >= start) & (i < end)
    return (queries[:, :, None] & keys[:, None, :])[:, None]


def _scores(q, k, softmax_scale, causal, window_left, window_right, softcap, key_start=None, key_end=None,
            attn_mask=None):
    """Masked (soft-capped) scaled scores (B, H_q, S_q, S_k), and d(capped)/d(scaled) or None."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    dcap = None
    if softcap:
        capped = torch.tanh(scores / softcap)
        dcap = 1 - capped * capped
        scores = softcap * capped
    visible = band_mask(q.shape[1], k.shape[1], q.device, *band(causal, window_left, window_right))
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if key_start is not None:
        scores = scores.masked_fill(~key_range_mask(q.shape[1], k.shape[1], key_start, key_end), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    return scores, dcap


def _probabilities(q, k, softmax_scale, causal, lse=None, window_left=None, window_right=None, softcap=0.0,
                   key_start=None, key_end=None, attn_mask=None):
    """Scaled scores' softmax P (B, H_q, S_q, S_k) in the compute dtype, lse, and the softcap's
    derivative (None without one)."""
    scores, dcap = _scores(q, k, softmax_scale, causal, window_left, window_right, softcap, key_start, key_end,
                           attn_mask)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    # rows with no key have lse = -inf: subtract 0 there so P is exp(-inf) = 0, not NaN
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse[..., None]), lse, dcap


def flash_attn_fwd(q, k, v, softmax_scale: float, causal: bool, window_left=None, window_right=None,
                   softcap: float = 0.0, key_start=None, key_end=None, attn_mask=None):
    acc = compute_dtype(q.dtype)
    hq = q.shape[2]
    qf, kf, vf = q.to(acc), _expand_kv(k.to(acc), hq), _expand_kv(v.to(acc), hq)
    p, lse, _ = _probabilities(qf, kf, softmax_scale, causal, None, window_left, window_right, softcap,
                               key_start, key_end, attn_mask)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, window_left=None,
                   window_right=None, softcap: float = 0.0, key_start=None, key_end=None, attn_mask=None):
    acc = compute_dtype(q.dtype)
    hq, hkv = q.shape[2], k.shape[2]
    qf, kf, vf = q.to(acc), _expand_kv(k.to(acc), hq), _expand_kv(v.to(acc), hq)
    dof, of = dout.to(acc), out.to(acc)
    p, _, dcap = _probabilities(qf, kf, softmax_scale, causal, lse.to(acc), window_left, window_right, softcap,
                                key_start, key_end, attn_mask)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
    delta = (dof * of).sum(-1).transpose(1, 2)  # D = rowsum(dO * O), (B, H_q, S_q)
    ds = p * (dp - delta[..., None])
    if dcap is not None:  # through softcap * tanh(s / softcap)
        ds = ds * dcap
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * softmax_scale
    grads = (dq.to(q.dtype), _reduce_kv(dk, hkv).to(k.dtype), _reduce_kv(dv, hkv).to(v.dtype))
    return tuple(g.contiguous() for g in grads)


# --------------------------------------------------------------------------------- varlen

def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(q rows, k rows) slices of each packed sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale: float, causal: bool,
                          window_left=None, window_right=None, softcap: float = 0.0):
    """Packed sequences: q (total_q, H_q, D), k and v (total_k, H_kv, D), sequence ``b`` owning
    rows ``cu[b]:cu[b + 1]``; each is attended as its own batch entry (causal and windows aligned
    per sequence). Returns out (total_q, H_q, D) and lse (H_q, total_q)."""
    out = q.new_zeros(q.shape)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype(q.dtype), device=q.device)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start:
            continue
        o, l = flash_attn_fwd(q[None, rows_q], k[None, rows_k], v[None, rows_k], softmax_scale, causal,
                              window_left, window_right, softcap)
        out[rows_q], lse[:, rows_q] = o[0], l[0]
    return out, lse


def flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale: float,
                          causal: bool, window_left=None, window_right=None, softcap: float = 0.0):
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        grads = flash_attn_bwd(dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k],
                               out[None, rows_q], lse[None, :, rows_q], softmax_scale, causal, window_left,
                               window_right, softcap)
        dq[rows_q], dk[rows_k], dv[rows_k] = grads[0][0], grads[1][0], grads[2][0]
    return dq, dk, dv
