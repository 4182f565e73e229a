"""Attention sinks (gpt-oss's ``sinks``, FlashAttention-4's ``learnable_sink``): one learned logit per
query head that joins every row's softmax denominator and attends to nothing.

The kernels take the sinks themselves (a compiled flag): the forward's softmax finalize adds
``exp(sink[h])`` to each row's denominator, its max taken over the sink too (split-KV: the combine
does), so lse includes the sink and O is written once; the backward's preprocess, which forms
``delta = rowsum(dout * out)`` per row, also sums ``-exp(sink - lse) * delta`` per head into the
sink's gradient. The main backward kernel needs nothing: with the sink-inclusive lse its
probabilities ``exp(s - lse)`` are the sink-normalized softmax's.

This module is the path for what the kernels do not cover (CPU, float32/float64, fallbacks) and
the reference they are tested against. A sink is a key whose score is ``sink[h]`` and whose value
is zero, so it merges into a finished row exactly as one split-KV partial merges into another,
through the row's log-sum-exp: ``lse' = logaddexp(lse, sink[h])`` and ``out' = out * exp(lse - lse')``
(:func:`merge`); the backward then runs on ``out'`` and ``lse'``, and the sink's own gradient is
``-sum over rows of exp(sink - lse') * delta`` (:func:`sink_grad`).
"""

from __future__ import annotations

import torch

from . import checks


def validate_sink(sink, q: torch.Tensor, heads_dim: int) -> None:
    """``sink``: float32 / bf16 / fp16, shape (heads_q,), on q's device."""
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink: expected a tensor of shape ({q.shape[heads_dim]},), "
                        f"got {type(sink).__name__}")
    checks.require_dtype("learnable_sink", sink, (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    if sink.shape != (q.shape[heads_dim],):
        raise ValueError(f"learnable_sink: expected shape ({q.shape[heads_dim]},) (one logit per query head), got "
                         f"{tuple(sink.shape)}")
    checks.require_same_device([("q", q), ("learnable_sink", sink)])


def _row_stats(lse: torch.Tensor, sink: torch.Tensor, heads_dim_of_lse: int):
    """The sink as lse's shape sees it (broadcast along its heads dim) and the merged lse."""
    shape = [1] * lse.dim()
    shape[heads_dim_of_lse] = -1
    logit = sink.to(lse.dtype).view(shape)
    return logit, torch.logaddexp(lse, logit)


def _to_out(rowwise: torch.Tensor, out: torch.Tensor, packed: bool) -> torch.Tensor:
    """A per-row factor from lse's layout ((B, H, S) or (H, total)) to out's ((B, S, H, 1) or (total, H, 1))."""
    return (rowwise.transpose(0, 1) if packed else rowwise.transpose(1, 2)).unsqueeze(-1)


def merge(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, packed: bool = False):
    """(out', lse'): the rows of a finished attention with the sink in their denominators."""
    logit, merged = _row_stats(lse, sink, 0 if packed else 1)
    scale = torch.exp(lse - merged)  # 0 where the row saw no key (lse = -inf)
    return (out * _to_out(scale, out, packed).to(out.dtype)), merged


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor,
              packed: bool = False) -> torch.Tensor:
    """d loss / d sink from the merged rows: ``-sum exp(sink - lse') * rowsum(dout * out')``, in
    float32 (float64 for float64 inputs)."""
    acc = torch.promote_types(dout.dtype, torch.float32)  # float32, or float64 inputs' own
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, S, H) or (total, H)
    delta = delta.transpose(0, 1) if packed else delta.transpose(1, 2)  # lse's layout
    logit, _ = _row_stats(lse.to(acc), sink, 0 if packed else 1)
    weight = torch.exp(logit - lse.to(acc))
    reduce = [d for d in range(lse.dim()) if d != (0 if packed else 1)]
    return -(weight * delta).sum(reduce)


def for_kernels(sink: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them: float32, contiguous (a copy only when they are not)."""
    return sink if sink.dtype == torch.float32 and sink.is_contiguous() else sink.float().contiguous()


def fused_grad(dsink, deterministic: bool) -> bool:
    """Whether the backward kernel forms the sinks' gradient: asked for, and not in deterministic
    mode, where its CTAs' fp32 sums would land in any order (:func:`add_grad` forms it there)."""
    return dsink is not None and not deterministic


def bwd_kernel_args(sink, dsink, deterministic: bool) -> dict:
    """The backward launch's sink arguments (:func:`fused_grad`): the sinks and the gradient."""
    return {"sink": for_kernels(sink), "dsink": dsink} if fused_grad(dsink, deterministic) else {}


def add_grad(dsink, sink, dout, out, lse, packed: bool = False) -> None:
    """``dsink += `` the sinks' gradient by two reductions over dout and out (where no kernel adds it)."""
    if dsink is not None:
        dsink += sink_grad(dout, out, lse, sink, packed)


def validate_sink_grad(dsink, sink, lse: torch.Tensor, heads: int) -> None:
    """``dsink`` (the backward ops' gradient to add to): given only with ``learnable_sink``, a
    contiguous (heads,) tensor of lse's dtype on its device."""
    if dsink is None:
        return
    if sink is None:
        raise ValueError("dsink: given without learnable_sink (the sinks' gradient needs the sinks)")
    if dsink.dtype != lse.dtype or dsink.shape != (heads,) or not dsink.is_contiguous():
        raise ValueError(f"dsink: expected a contiguous {lse.dtype} tensor of shape ({heads},) (lse's dtype, one "
                         f"value per query head), got {dsink.dtype} {tuple(dsink.shape)}")
    checks.require_same_device([("lse", lse), ("dsink", dsink)])


def zero_grad_like(sink: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A zeroed gradient for the backward ops to add the sinks' gradient to (lse's dtype)."""
    return torch.zeros(sink.shape, dtype=lse.dtype, device=sink.device)
