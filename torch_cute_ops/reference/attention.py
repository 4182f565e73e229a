"""Plain-PyTorch attention forward and backward in the (B, S, H, D) layout of the kernels.

Semantics shared with every attention kernel:

* GQA/MQA: query head ``h`` reads kv head ``h // (H_q // H_kv)``.
* ``causal`` is aligned bottom-right, as FlashAttention does: query ``i`` attends key ``j``
  iff ``j <= i + (S_k - S_q)``. With S_q == S_k this is the usual lower triangle.
* A query row that attends to nothing (S_k < S_q under causal) has output 0 and
  ``lse = -inf``; its gradients are 0.
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
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _expand_kv(t: torch.Tensor, num_heads_q: int) -> torch.Tensor:
    """(B, S, H_kv, D) -> (B, S, H_q, D) as an indexed view-like gather (reference only)."""
    group = num_heads_q // t.shape[2]
    return t if group == 1 else t.repeat_interleave(group, dim=2)


def _reduce_kv(grad: torch.Tensor, num_heads_kv: int) -> torch.Tensor:
    """Sum the gradients of the query heads that share each kv head."""
    b, s, h, d = grad.shape
    return grad.view(b, s, num_heads_kv, h // num_heads_kv, d).sum(dim=3)


def _probabilities(q, k, softmax_scale, causal, lse=None):
    """Scaled scores' softmax P (B, H_q, S_q, S_k) in the compute dtype, and lse."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    # rows with no key have lse = -inf: subtract 0 there so P is exp(-inf) = 0, not NaN
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse[..., None]), lse


def flash_attn_fwd(q, k, v, softmax_scale: float, causal: bool):
    acc = compute_dtype(q.dtype)
    hq = q.shape[2]
    qf, kf, vf = q.to(acc), _expand_kv(k.to(acc), hq), _expand_kv(v.to(acc), hq)
    p, lse = _probabilities(qf, kf, softmax_scale, causal)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale: float, causal: bool):
    acc = compute_dtype(q.dtype)
    hq, hkv = q.shape[2], k.shape[2]
    qf, kf, vf = q.to(acc), _expand_kv(k.to(acc), hq), _expand_kv(v.to(acc), hq)
    dof, of = dout.to(acc), out.to(acc)
    p, _ = _probabilities(qf, kf, softmax_scale, causal, lse.to(acc))
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
    delta = (dof * of).sum(-1).transpose(1, 2)  # D = rowsum(dO * O), (B, H_q, S_q)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * softmax_scale
    grads = (dq.to(q.dtype), _reduce_kv(dk, hkv).to(k.dtype), _reduce_kv(dv, hkv).to(v.dtype))
    return tuple(g.contiguous() for g in grads)
