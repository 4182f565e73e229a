"""``cute::flash_attn_varlen_fwd`` / ``_bwd``: packed sequences (FlashAttention's varlen), with autograd.

q is (total_q, H_q, D), k and v (total_k, H_kv, D); sequence ``b`` owns rows
``cu_seqlens[b]:cu_seqlens[b + 1]`` of each (int32, shape (B + 1,)). Every sequence is attended as
its own batch entry: causal and windows align per sequence, lengths may be 0, and q and k
lengths may differ per sequence. lse is (H_q, total_q). ``max_seqlen_q``/``max_seqlen_k`` bound
the lengths (they size the kernels' grids) and are SymInts: new lengths never recompile.

The contents of cu_seqlens are checked (starts at 0, non-decreasing, ends at the totals, no
sequence longer than its max_seqlen) in eager mode, once per cu_seqlens tensor and version:
the check reads the tensor back, so it is skipped while a CUDA graph is captured and under
tracing, where the values do not exist yet. ``learnable_sink`` and ``dsink`` as in ops/attention.py.
"""

from __future__ import annotations

import torch

from ..reference import attention as reference
from ..runtime.attention import kernel_band, pointer_reason, softcap_kind
from ..runtime.lasting import PerTensor
from ..runtime.tma import tma_reason
from ..runtime.unfilled import written_in_full
from . import bounds, checks, dispatch, fallback, sinks
from .attention import (ZERO_SCALE, _remember, _validate_softcap, empty_grads, layout_key, positive_scale,
                        validate_qkv_common, validate_scale)
from .schemas import lib, qualname, register_impl

_LAYOUT = "(total_seqlen, heads, head_dim)"


def _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    checks.require_rank("q", q, (3,), _LAYOUT)
    validate_qkv_common(q, k, v, _LAYOUT)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise ValueError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name}: expected shape (batch + 1,), got {tuple(cu.shape)}")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} entries (batch + 1, as in "
                         f"cu_seqlens_q), got {cu_seqlens_k.shape[0]}")
    checks.require_same_device([("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                                ("cu_seqlens_k", cu_seqlens_k)])
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value < 0:
            raise ValueError(f"{name}: expected a length >= 0, got {value}")


# per cu_seqlens tensor and version, and the packed length the check read: its longest sequence
_longest = PerTensor()


def _can_read_values(*tensors) -> bool:
    if any(type(t) is not torch.Tensor for t in tensors) or torch.compiler.is_compiling():
        return False
    return not (tensors[0].is_cuda and torch.cuda.is_current_stream_capturing())


def _read_seqlens(name: str, cu: torch.Tensor, total: int) -> int:
    """The contents of one cu_seqlens against the packed length (a read-back); its longest sequence."""
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name}: must be non-decreasing (sequence lengths >= 0), got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}: the last entry ({values[-1]}) must equal the packed length ({total})")
    return max(lengths, default=0)


def _check_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, max_name: str) -> None:
    """The contents of one cu_seqlens (read back once per tensor version and packed length)."""
    longest = _longest.get(cu, total, lambda: _read_seqlens(name, cu, total))
    if longest > max_seqlen:
        raise ValueError(f"{max_name}: {max_seqlen} is shorter than the longest sequence ({longest})")


def _check_contents(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    if _can_read_values(cu_seqlens_q, cu_seqlens_k):
        _check_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        _check_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")


# ---------------------------------------------------------------------------------- forward

def _fwd_outputs_like(q):
    total, heads, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((heads, total), dtype=reference.compute_dtype(q.dtype)))


_fwd_plans: dict[tuple, object] = {}


def _make_fwd_plan(key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, local, softcap,
                   sink=None):
    """Validate (raises on invalid input) and decide the kernel for one layout and band kind, once."""
    _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _validate_softcap(softcap)
    if sink is not None:
        sinks.validate_sink(sink, q, 1)
    plan = "cpu"
    if q.is_cuda:
        host = dispatch.kernel_for("flash_attn_varlen_fwd", q.device)
        plan = host if isinstance(host, str) else host.plan_fwd(
            q, k, v, causal, local=local, softcap=softcap, rows="packed", sink=sink is not None)
    return _remember(_fwd_plans, key, plan)


def flash_attn_varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_left=None, window_right=None, softcap=0.0, learnable_sink=None, *,
                               deterministic=False):
    # ``deterministic`` selects the backward's variant only (autograd carries it there)
    if q.dim() != 3 or k.dim() != 3 or min(max_seqlen_q, max_seqlen_k) < 0:
        _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)  # the named error
    validate_scale(softmax_scale)
    if softcap != 0.0:  # a value, not part of the plan's key: checked on every call
        _validate_softcap(softcap)
    if softmax_scale <= 0.0 and q.is_cuda:
        q, softmax_scale = positive_scale(q, softmax_scale)
    band_causal, local, left, right = kernel_band(causal, window_left, window_right, max_seqlen_q, max_seqlen_k)
    key = (*layout_key(q, k, v, cu_seqlens_q, cu_seqlens_k, learnable_sink), band_causal, local,
           softcap_kind(softcap, q.dtype))
    plan = _fwd_plans.get(key, False)
    if plan is False:
        plan = _make_fwd_plan(key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, band_causal,
                              local, softcap, learnable_sink)
    _check_contents(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if plan is not None and not isinstance(plan, str):
        reason = pointer_reason(("q", q), ("k", k), ("v", v))
        if reason is None:
            out, lse = written_in_full(_fwd_outputs_like, q)
            plan.packed(q, k, v, bounds.dense(cu_seqlens_q), bounds.dense(cu_seqlens_k), int(max_seqlen_q),
                        int(max_seqlen_k), out, lse, softmax_scale, left, right, softcap,
                        sink=None if learnable_sink is None else sinks.for_kernels(learnable_sink))
            return out, lse
        plan = reason
    if plan is None:  # nothing to compute
        return _fwd_outputs_like(q)
    if plan != "cpu":
        fallback.note("flash_attn_varlen_fwd", plan)
    out, lse = reference.flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                               window_left, window_right, softcap)
    return (out, lse) if learnable_sink is None else sinks.merge(out, lse, learnable_sink, packed=True)


register_impl("flash_attn_varlen_fwd", flash_attn_varlen_fwd_impl)


@torch.library.register_fake(qualname("flash_attn_varlen_fwd"), lib=lib)
def _flash_attn_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                causal, window_left=None, window_right=None, softcap=0.0, learnable_sink=None, *,
                                deterministic=False):
    _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _validate_softcap(softcap)
    if learnable_sink is not None:
        sinks.validate_sink(learnable_sink, q, 1)
    return _fwd_outputs_like(q)


_SINK_INPUT = 12  # learnable_sink's place among flash_attn_varlen_fwd's inputs


def _fwd_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, *rest = inputs
    ctx.deterministic = keyword_only_inputs["deterministic"]
    out, lse = output
    band, sink = tuple(rest[:3]), (rest[3] if len(rest) > 3 else None)
    ctx.max_seqlens, ctx.softmax_scale, ctx.causal, ctx.band = (max_q, max_k), softmax_scale, causal, band
    ctx.num_inputs = len(inputs)
    ctx.sink_grad = sink is not None and ctx.needs_input_grad[_SINK_INPUT]
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, *((sink,) if ctx.sink_grad else ()))
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, *sink = ctx.saved_tensors
    sink = sink[0] if sink else None
    band = ctx.band + (None, None, 0.0)[len(ctx.band):]
    dsink = None if sink is None else sinks.zero_grad_like(sink, lse)
    dq, dk, dv = torch.ops.cute.flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens,
                                                      ctx.softmax_scale, ctx.causal, *band, sink, dsink,
                                                      deterministic=ctx.deterministic)
    grads = [dq, dk, dv] + [None] * (ctx.num_inputs - 3)
    if sink is not None:
        grads[_SINK_INPUT] = dsink.to(sink.dtype)
    return tuple(grads)


torch.library.register_autograd(qualname("flash_attn_varlen_fwd"), _fwd_backward,
                                setup_context=_fwd_setup_context, lib=lib)


# --------------------------------------------------------------------------------- backward

def _validate_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for name, t in (("dout", dout), ("out", out)):
        checks.require_same_dtype(name, t, "q", q)
        if t.shape != q.shape:
            raise ValueError(f"{name}: expected shape {tuple(q.shape)} (the shape of q), got {tuple(t.shape)}")
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse: expected shape {(q.shape[1], q.shape[0])} (heads_q, total_q), got {tuple(lse.shape)}")
    checks.require_dtype("lse", lse, (reference.compute_dtype(q.dtype),))
    checks.require_same_device([("q", q), ("dout", dout), ("out", out), ("lse", lse)])


_bwd_plans: dict[tuple, object] = {}


def _make_bwd_plan(key, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                   local, softcap, sink=None, dsink=None):
    _validate_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _validate_softcap(softcap)
    if sink is not None:
        sinks.validate_sink(sink, q, 1)
    sinks.validate_sink_grad(dsink, sink, lse, q.shape[1])
    plan = "cpu"
    if q.is_cuda:
        host = dispatch.kernel_for("flash_attn_varlen_bwd", q.device)
        plan = host if isinstance(host, str) else (
            tma_reason("dout", dout, (2,), check_pointer=False)
            or tma_reason("out", out, (2,), check_pointer=False)
            or host.plan_bwd(q, k, v, causal, local, softcap != 0.0, rows="packed", deterministic=key[-1],
                             sink=sinks.fused_grad(dsink, key[-1])))
    return _remember(_bwd_plans, key, plan)


def _flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_left=None, window_right=None, softcap=0.0,
                           learnable_sink=None, dsink=None, *, deterministic=False):
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    if q.dim() != 3 or k.dim() != 3 or min(max_seqlen_q, max_seqlen_k) < 0:
        _validate_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    validate_scale(softmax_scale)
    if softcap != 0.0:
        _validate_softcap(softcap)
    if softmax_scale < 0.0 and q.is_cuda:  # d/dq of (-q) is -1
        dq, dk, dv = _flash_attn_varlen_bwd(dout, torch.neg(q), k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, -softmax_scale, causal, window_left,
                                            window_right, softcap, learnable_sink, dsink,
                                            deterministic=deterministic)
        return torch.neg(dq), dk, dv
    if softmax_scale == 0.0 and q.is_cuda:
        softmax_scale = ZERO_SCALE
    band_causal, local, left, right = kernel_band(causal, window_left, window_right, max_seqlen_q, max_seqlen_k)
    key = (*layout_key(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, learnable_sink, dsink), band_causal, local,
           softcap != 0.0, deterministic or torch.are_deterministic_algorithms_enabled())
    plan = _bwd_plans.get(key) or _make_bwd_plan(key, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                 max_seqlen_q, max_seqlen_k, band_causal, local, softcap,
                                                 learnable_sink, dsink)
    _check_contents(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)  # a direct call's too
    if not isinstance(plan, str):
        reason = pointer_reason(("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
        if reason is None:
            dq, dk, dv = written_in_full(empty_grads, q, k, v)
            sink = sinks.bwd_kernel_args(learnable_sink, dsink, key[-1])
            plan.packed(dout, q, k, v, out, lse.contiguous(), bounds.dense(cu_seqlens_q), bounds.dense(cu_seqlens_k),
                        int(max_seqlen_q), int(max_seqlen_k), dq, dk, dv, softmax_scale, left, right, softcap, **sink)
            if not sink:  # deterministic: not in the kernel
                sinks.add_grad(dsink, learnable_sink, dout, out, lse, packed=True)
            return dq, dk, dv
        plan = reason
    if plan != "cpu":
        fallback.note("flash_attn_varlen_bwd", plan)
    sinks.add_grad(dsink, learnable_sink, dout, out, lse, packed=True)
    return reference.flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                           causal, window_left, window_right, softcap)


register_impl("flash_attn_varlen_bwd", _flash_attn_varlen_bwd)


@torch.library.register_fake(qualname("flash_attn_varlen_bwd"), lib=lib)
def _flash_attn_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, window_left=None, window_right=None, softcap=0.0,
                                learnable_sink=None, dsink=None, *, deterministic=False):
    _validate_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _validate_softcap(softcap)
    sinks.validate_sink_grad(dsink, learnable_sink, lse, q.shape[1])
    return tuple(t.new_empty(t.shape) for t in (q, k, v))
