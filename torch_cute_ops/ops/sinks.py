"""Attention sinks (gpt-oss's ``sinks``, FlashAttention-4's ``learnable_sink``): one learned logit per
query head that joins every row's softmax denominator and attends to nothing.

A sink is a key whose score is ``sink[h]`` and whose value is zero, so it merges into a finished
attention row exactly as one split-KV partial merges into another, through the row's
log-sum-exp: ``lse' = logaddexp(lse, sink[h])`` and ``out' = out * exp(lse - lse')``. The kernels
run unchanged; the merge is one elementwise pass over the output.

The backward needs no new kernel either: with ``out'`` and ``lse'`` saved, the attention backward
computes the probabilities ``exp(s - lse')`` that the sink-normalized softmax gave, and
``delta = rowsum(dout * out')`` is that softmax's; the sink's own gradient is
``-sum over rows of exp(sink - lse') * delta``, in float32 (float64 for float64 inputs).
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
    """d loss / d sink from the merged rows: ``-sum exp(sink - lse') * rowsum(dout * out')``."""
    acc = torch.promote_types(dout.dtype, torch.float32)  # float32, or float64 inputs' own
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, S, H) or (total, H)
    delta = delta.transpose(0, 1) if packed else delta.transpose(1, 2)  # lse's layout
    logit, _ = _row_stats(lse.to(acc), sink, 0 if packed else 1)
    weight = torch.exp(logit - lse.to(acc))
    reduce = [d for d in range(lse.dim()) if d != (0 if packed else 1)]
    return -(weight * delta).sum(reduce).to(sink.dtype)


_OPS = {"dense": ("flash_attn_fwd", "flash_attn_bwd"), "packed": ("flash_attn_varlen_fwd", "flash_attn_varlen_bwd")}


class SinkAttention(torch.autograd.Function):
    """Attention through the ``cute`` forward and backward ops with a sink merged into each row:
    ``apply(q, k, v, sink, kind, args, deterministic)``, ``kind`` "dense" (flash_attn_fwd / _bwd)
    or "packed" (the varlen pair), ``args`` the forward op's arguments after q, k, v, which the
    backward op takes in the same order after (dout, q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, kind, args, deterministic):
        fwd, _ = _OPS[kind]
        out, lse = getattr(torch.ops.cute, fwd)(q, k, v, *args, deterministic=deterministic)
        out, lse = merge(out, lse, sink, kind == "packed")
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.kind, ctx.args, ctx.deterministic = kind, args, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        _, bwd = _OPS[ctx.kind]
        dq, dk, dv = getattr(torch.ops.cute, bwd)(dout, q, k, v, out, lse, *ctx.args,
                                                  deterministic=ctx.deterministic)
        dsink = sink_grad(dout, out, lse, sink, ctx.kind == "packed") if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None, None
