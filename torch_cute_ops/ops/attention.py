"""``cute::flash_attn_fwd`` / ``cute::flash_attn_bwd`` in the (B, S, H, D) layout, with autograd.

Semantics (GQA, bottom-right causal, windows, softcap, empty rows, lse, padded entries) are those
of ``torch_cute_ops.reference.attention``. The window bounds are SymInts (None: unbounded), so a
window that depends on sequence lengths (PyTorch's top-left causal) never specializes a graph.
``key_start``/``key_end`` (int32, (B,)) make a padded batch: entry b's real keys are
``[key_start[b], key_end[b])``, so padding on either side costs no mask and no copy.
``attn_mask`` is PyTorch's (bool, True = attend, or additive in q's dtype; broadcastable to
(B, H_q, S_q, S_k), never materialized); it is not differentiated. The kernels serve it alone
(no causal, window, softcap or key range beside it) and skip the key blocks it leaves empty.
``learnable_sink`` ((H_q,), differentiable) adds a sink to every row's denominator (ops/sinks.py); the
backward op adds its gradient to ``dsink`` when given one.
"""

from __future__ import annotations

import torch

from ..reference import attention as reference
from ..runtime.attention import kernel_band, pointer_reason, softcap_kind
from ..runtime.tma import tma_reason
from ..runtime.unfilled import written_in_full
from . import bounds, checks, dispatch, fallback, sinks
from .schemas import lib, qualname, register_impl

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


def validate_qkv_common(q, k, v, layout: str, names: tuple[str, str] = ("k", "v")) -> None:
    """What every attention layout asks of q, k, v (q's rank checked by the caller): k and v of
    q's rank, one dtype and device, v shaped like k, equal head dims, whole GQA groups. The
    sequence, heads and head_dim are the last three axes. ``names``: the arguments k and v are."""
    k_name, v_name = names
    for name, t in ((k_name, k), (v_name, v)):
        checks.require_rank(name, t, (q.dim(),), layout)
    checks.require_dtype("q", q, INPUT_DTYPES)
    checks.require_same_dtype(k_name, k, "q", q)
    checks.require_same_dtype(v_name, v, "q", q)
    checks.require_same_device([("q", q), (k_name, k), (v_name, v)])
    seq, heads, dim = q.dim() - 3, q.dim() - 2, q.dim() - 1
    heads_q, head_dim = q.shape[heads], q.shape[dim]
    checks.require_dim(k_name, k, dim, head_dim, "head_dim, as in q")
    checks.require_dim(v_name, v, seq, k.shape[seq], f"seqlen_k, as in {k_name}")
    checks.require_dim(v_name, v, heads, k.shape[heads], f"kv heads, as in {k_name}")
    checks.require_dim(v_name, v, dim, head_dim, "head_dim, as in q (a different v head dim is not supported)")
    if k.shape[heads] == 0 or heads_q % k.shape[heads]:
        raise ValueError(f"{k_name}: the number of kv heads ({k.shape[heads]}) must divide the number of "
                         f"query heads ({heads_q}) (GQA/MQA)")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")


def _validate_qkv(q, k, v) -> None:
    layout = "(batch, seqlen, heads, head_dim)"
    checks.require_rank("q", q, (4,), layout)
    validate_qkv_common(q, k, v, layout)
    checks.require_dim("k", k, 0, q.shape[0], "batch, as in q")
    checks.require_dim("v", v, 0, q.shape[0], "batch, as in q")


def _validate_key_range(q, key_start, key_end) -> None:
    if (key_start is None) != (key_end is None):
        raise ValueError("key_start, key_end: give both (a padded batch) or neither")
    if key_start is None:
        return
    for name, t in (("key_start", key_start), ("key_end", key_end)):
        if t.dtype != torch.int32 or t.shape != (q.shape[0],):
            raise ValueError(f"{name}: expected an int32 tensor of shape ({q.shape[0]},) (batch), "
                             f"got {t.dtype} {tuple(t.shape)}")
    checks.require_same_device([("q", q), ("key_start", key_start), ("key_end", key_end)])


def _validate_attn_mask(q, k, attn_mask) -> None:
    if attn_mask is None:
        return
    batch, s_q, heads, _ = q.shape
    full = (batch, heads, s_q, k.shape[1])
    if attn_mask.dim() > 4 or any(m not in (1, f) for m, f in zip(attn_mask.shape[::-1], full[::-1])):
        raise ValueError(f"attn_mask: expected a shape broadcastable to {full} (batch, heads_q, seqlen_q, "
                         f"seqlen_k), got {tuple(attn_mask.shape)}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise ValueError(f"attn_mask: expected dtype torch.bool or {q.dtype} (q's), got {attn_mask.dtype}")
    checks.require_same_device([("q", q), ("attn_mask", attn_mask)])


def validate_scale(softmax_scale) -> None:
    """A finite softmax_scale (a NaN or infinite one makes every row NaN): checked on every call."""
    if not -float("inf") < softmax_scale < float("inf"):
        raise ValueError(f"softmax_scale: expected a finite number, got {softmax_scale}")


# The kernels keep raw scores and their row max and mask with -inf, so they need a positive scale:
# a negative one turns the max into a min and masked scores into +inf, a zero one masked scores into
# NaN (0 * -inf). softmax(c q.k) = softmax(|c| (-q).k) covers c < 0; c = 0 runs as 2^-100, which
# leaves every finite score's exponent at 0 in fp32 (|s| < 2^70) and a masked one at -inf.
ZERO_SCALE = 2.0**-100


def positive_scale(q, softmax_scale) -> tuple:
    """(q, scale) for the kernels: ``softmax_scale`` if positive, else as the comment above says."""
    if softmax_scale > 0.0:
        return q, softmax_scale
    return (q, ZERO_SCALE) if softmax_scale == 0.0 else (torch.neg(q), -softmax_scale)


def _validate_softcap(softcap) -> None:
    if not softcap >= 0.0 or softcap == float("inf"):
        raise ValueError(f"softcap: expected a finite value >= 0 (0 = off), got {softcap}")


_MAX_PLANS = 4096


def empty_grads(q, k, v) -> tuple:
    """dq, dk, dv for a backward kernel to write: contiguous, shaped like q, k, v."""
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _remember(plans: dict, key, plan):
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def _qkv_key(q, k, v):
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device)


KEY_QUANTUM = 16  # every key tile (64, 80, 112, 128 keys) is a multiple of it


def keys_key(t, seq_dim: int = 1):
    """What a plan reads of a key or value tensor whose sequence grows (a decode cache): the
    sizes but the key count, which enters only as whole multiples of KEY_QUANTUM (a plan's tiles,
    splits and short-sequence choice change only at multiples of a key tile) and against 2^31;
    the strides as the TMA sees them (unit stride on the last dim, the others modulo 16 bytes).
    A cache that grows by a key a step keeps its plan for KEY_QUANTUM steps."""
    shape, stride = t.shape, t.stride()
    keys = shape[seq_dim]
    per_16_bytes = max(1, 16 // t.element_size())
    return (shape[:seq_dim], -(-keys // KEY_QUANTUM), keys >= 2**31, shape[seq_dim + 1:], stride[-1] == 1,
            tuple(s % per_16_bytes for s in stride), t.dtype, t.device)


def _decode_qkv_key(q, k, v):
    """:func:`_qkv_key` with k and v as :func:`keys_key` sees them (their key counts equal or not)."""
    return (q.shape, q.stride(), q.dtype, q.device, keys_key(k), keys_key(v), k.shape[1] == v.shape[1])


def check_key_range(key_start, key_end, seqlen_k: int) -> None:
    """``0 <= key_start[b] <= key_end[b] <= seqlen_k``: they bound the kernel's key loads
    (ops.bounds: once per version of the pair and key count)."""
    bounds.check_within("key_end", key_end, 0, seqlen_k, f"seqlen_k = {seqlen_k}", in_graphs=False)
    bounds.check_within("key_start", key_start, 0, key_end, "key_end of its entry", in_graphs=False)


# ---------------------------------------------------------------------------------- forward

def _fwd_outputs_like(q):
    b, s, h, _ = q.shape
    lse_dtype = reference.compute_dtype(q.dtype)
    # empty_like: the C++ fast path (new_empty parses a size list: ~1 us more per call)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, s), dtype=lse_dtype))


_fwd_plans: dict[tuple, object] = {}  # by what planning reads (a growing cache: its key tiles)
_fwd_exact: dict[tuple, object] = {}  # the same plans by the exact layout: the cheaper key to build


def _masked_reason(causal, local, softcap, key_start, attn_mask) -> str | None:
    if attn_mask is not None and (causal or local or softcap or key_start is not None):
        return "attn_mask together with causal, a window, softcap or key ranges (give one mask)"
    return None


def _make_fwd_plan(key, q, k, v, causal, local, softcap, key_start, key_end, attn_mask, sink=None):
    """Validate (raises on invalid input) and decide the kernel for one layout and band kind,
    once: a launch, None when there is nothing to compute, or the reason no kernel covers it."""
    _validate_qkv(q, k, v)
    _validate_key_range(q, key_start, key_end)
    _validate_attn_mask(q, k, attn_mask)
    if sink is not None:
        sinks.validate_sink(sink, q, 2)
    plan = "cpu"
    if q.is_cuda:
        host = dispatch.kernel_for("flash_attn_fwd", q.device)
        rows = "dense" if key_start is None else "padded"
        plan = host if isinstance(host, str) else (
            _masked_reason(causal, local, softcap, key_start, attn_mask)
            or host.plan_fwd(q, k, v, causal, local=local, softcap=softcap, rows=rows,
                             attn_mask=host.mask_kind(attn_mask), sink=sink is not None))
    return _remember(_fwd_plans, key, plan)


def _optional_key(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def layout_key(*tensors) -> tuple:
    """What a plan reads of each tensor (None for one not given): shape, strides, dtype, device."""
    return tuple(_optional_key(t) for t in tensors)


def flash_attn_fwd_impl(q, k, v, softmax_scale, causal, window_left=None, window_right=None, softcap=0.0,
                        key_start=None, key_end=None, attn_mask=None, learnable_sink=None, *, deterministic=False):
    # ``deterministic`` selects the backward's variant only (autograd carries it there)
    if q.dim() != 4 or k.dim() != 4:
        _validate_qkv(q, k, v)  # the named error
    validate_scale(softmax_scale)
    if softcap != 0.0:  # a value, not part of the plan's key: checked on every call
        _validate_softcap(softcap)
    if softmax_scale <= 0.0 and q.is_cuda:
        q, softmax_scale = positive_scale(q, softmax_scale)
    band_causal, local, left, right = kernel_band(causal, window_left, window_right, q.shape[1], k.shape[1])
    padded = key_start is not None
    flags = (band_causal, local, softcap_kind(softcap, q.dtype), _optional_key(key_start), _optional_key(key_end),
             _optional_key(attn_mask), _optional_key(learnable_sink))
    exact = (*_qkv_key(q, k, v), *flags)
    plan = _fwd_exact.get(exact, False)
    if plan is False:
        # a mask's shape is checked against the key count: its plans stay keyed on the exact layout
        key = (*_decode_qkv_key(q, k, v), *flags) if attn_mask is None else exact
        plan = _fwd_plans.get(key, False)
        if plan is False:
            plan = _make_fwd_plan(key, q, k, v, band_causal, local, softcap, key_start, key_end, attn_mask,
                                  learnable_sink)
        _remember(_fwd_exact, exact, plan)
    if padded:
        check_key_range(key_start, key_end, k.shape[1])
    if plan is not None and not isinstance(plan, str):
        reason = pointer_reason(("q", q), ("k", k), ("v", v))
        if reason is None:
            out, lse = written_in_full(_fwd_outputs_like, q)
            sink = None if learnable_sink is None else sinks.for_kernels(learnable_sink)
            if padded:
                plan.padded(q, k, v, bounds.dense(key_start), bounds.dense(key_end), out, lse, softmax_scale, left,
                            right, softcap, sink=sink)
            elif attn_mask is not None:
                plan.masked(q, k, v, attn_mask, out, lse, softmax_scale, sink=sink)
            else:
                plan(q, k, v, out, lse, softmax_scale, left, right, softcap, sink=sink)
            return out, lse
        plan = reason
    if plan is None:
        return _fwd_outputs_like(q)
    if plan != "cpu":
        fallback.note("flash_attn_fwd", plan)
    out, lse = reference.flash_attn_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                        key_start, key_end, attn_mask)
    return (out, lse) if learnable_sink is None else sinks.merge(out, lse, learnable_sink)


register_impl("flash_attn_fwd", flash_attn_fwd_impl)


@torch.library.register_fake(qualname("flash_attn_fwd"), lib=lib)
def _flash_attn_fwd_fake(q, k, v, softmax_scale, causal, window_left=None, window_right=None, softcap=0.0,
                         key_start=None, key_end=None, attn_mask=None, learnable_sink=None, *, deterministic=False):
    _validate_qkv(q, k, v)
    _validate_softcap(softcap)
    _validate_key_range(q, key_start, key_end)
    _validate_attn_mask(q, k, attn_mask)
    if learnable_sink is not None:
        sinks.validate_sink(learnable_sink, q, 2)
    return _fwd_outputs_like(q)


_SINK_INPUT = 11  # learnable_sink's place among flash_attn_fwd's inputs


def _fwd_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, softmax_scale, causal, *rest = inputs
    ctx.deterministic = keyword_only_inputs["deterministic"]
    band, extras = tuple(rest[:3]), tuple(rest[3:6])  # extras: key_start, key_end, attn_mask as given
    sink = rest[6] if len(rest) > 6 else None
    out, lse = output
    ctx.softmax_scale, ctx.causal, ctx.band = softmax_scale, causal, band
    ctx.num_inputs = len(inputs)
    ctx.sink_grad = sink is not None and ctx.needs_input_grad[_SINK_INPUT]
    ctx.save_for_backward(q, k, v, out, lse, *extras, *((sink,) if ctx.sink_grad else ()))
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, *extras = ctx.saved_tensors
    sink = extras.pop() if ctx.sink_grad else None
    extras += [None] * (3 - len(extras))
    # the sinks' gradient is added to a zeroed one (the probabilities need no sink: lse holds it)
    dsink = None if sink is None else sinks.zero_grad_like(sink, lse)
    dq, dk, dv = torch.ops.cute.flash_attn_bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, *ctx.band,
                                               *extras, sink, dsink, deterministic=ctx.deterministic)
    grads = [dq, dk, dv] + [None] * (ctx.num_inputs - 3)
    if sink is not None:
        grads[_SINK_INPUT] = dsink.to(sink.dtype)
    return tuple(grads)


torch.library.register_autograd(qualname("flash_attn_fwd"), _fwd_backward,
                                setup_context=_fwd_setup_context, lib=lib)


# --------------------------------------------------------------------------------- backward

def _validate_bwd(dout, q, k, v, out, lse) -> None:
    _validate_qkv(q, k, v)
    for name, t in (("dout", dout), ("out", out)):
        checks.require_same_dtype(name, t, "q", q)
        if t.shape != q.shape:
            raise ValueError(f"{name}: expected shape {tuple(q.shape)} (the shape of q), got {tuple(t.shape)}")
    b, s, h, _ = q.shape
    if lse.shape != (b, h, s):
        raise ValueError(f"lse: expected shape {(b, h, s)} (batch, heads_q, seqlen_q), got {tuple(lse.shape)}")
    checks.require_dtype("lse", lse, (reference.compute_dtype(q.dtype),))
    checks.require_same_device([("q", q), ("dout", dout), ("out", out), ("lse", lse)])


_bwd_plans: dict[tuple, object] = {}


def _make_bwd_plan(key, dout, q, k, v, out, lse, causal, local, softcap, key_start, key_end, attn_mask, sink=None,
                   dsink=None):
    _validate_bwd(dout, q, k, v, out, lse)
    _validate_key_range(q, key_start, key_end)
    _validate_attn_mask(q, k, attn_mask)
    if sink is not None:
        sinks.validate_sink(sink, q, 2)
    sinks.validate_sink_grad(dsink, sink, lse, q.shape[2])
    plan = "cpu"
    if q.is_cuda:
        host = dispatch.kernel_for("flash_attn_bwd", q.device)
        rows = "dense" if key_start is None else "padded"
        plan = host if isinstance(host, str) else (
            tma_reason("dout", dout, (3,), check_pointer=False)
            or tma_reason("out", out, (3,), check_pointer=False)
            or _masked_reason(causal, local, softcap, key_start, attn_mask)
            or host.plan_bwd(q, k, v, causal, local, softcap != 0.0, rows=rows, attn_mask=host.mask_kind(attn_mask),
                             deterministic=key[-1], sink=sinks.fused_grad(dsink, key[-1])))
    return _remember(_bwd_plans, key, plan)


def _flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale, causal, window_left=None, window_right=None,
                    softcap=0.0, key_start=None, key_end=None, attn_mask=None, learnable_sink=None, dsink=None, *,
                    deterministic=False):
    # the backward's autograd hands over whatever layout the loss produced
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    if q.dim() != 4 or k.dim() != 4:
        _validate_bwd(dout, q, k, v, out, lse)  # the named error
    validate_scale(softmax_scale)
    if softcap != 0.0:
        _validate_softcap(softcap)
    if softmax_scale < 0.0 and q.is_cuda:  # d/dq of (-q) is -1
        dq, dk, dv = _flash_attn_bwd(dout, torch.neg(q), k, v, out, lse, -softmax_scale, causal, window_left,
                                     window_right, softcap, key_start, key_end, attn_mask, learnable_sink, dsink,
                                     deterministic=deterministic)
        return torch.neg(dq), dk, dv
    if softmax_scale == 0.0 and q.is_cuda:
        softmax_scale = ZERO_SCALE
    band_causal, local, left, right = kernel_band(causal, window_left, window_right, q.shape[1], k.shape[1])
    key = (*_qkv_key(q, k, v), dout.shape, dout.stride(), dout.dtype, out.shape, out.stride(), out.dtype,
           lse.shape, lse.dtype, lse.device, band_causal, local, softcap != 0.0,
           _optional_key(key_start), _optional_key(key_end), _optional_key(attn_mask), _optional_key(learnable_sink),
           _optional_key(dsink), deterministic or torch.are_deterministic_algorithms_enabled())
    plan = _bwd_plans.get(key) or _make_bwd_plan(key, dout, q, k, v, out, lse, band_causal, local, softcap,
                                                 key_start, key_end, attn_mask, learnable_sink, dsink)
    if key_start is not None:
        check_key_range(key_start, key_end, k.shape[1])
    if not isinstance(plan, str):
        reason = pointer_reason(("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
        if reason is None:
            dq, dk, dv = written_in_full(empty_grads, q, k, v)
            sink = sinks.bwd_kernel_args(learnable_sink, dsink, key[-1])
            if key_start is not None:
                plan.padded(dout, q, k, v, out, lse.contiguous(), bounds.dense(key_start), bounds.dense(key_end), dq,
                            dk, dv, softmax_scale, left, right, softcap, **sink)
            elif attn_mask is not None:
                plan.masked(dout, q, k, v, out, lse.contiguous(), attn_mask, dq, dk, dv, softmax_scale, **sink)
            else:
                plan(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, softmax_scale, left, right, softcap, **sink)
            if not sink:  # deterministic: not in the kernel
                sinks.add_grad(dsink, learnable_sink, dout, out, lse)
            return dq, dk, dv
        plan = reason
    if plan != "cpu":
        fallback.note("flash_attn_bwd", plan)
    sinks.add_grad(dsink, learnable_sink, dout, out, lse)
    return reference.flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                                    softcap, key_start, key_end, attn_mask)


register_impl("flash_attn_bwd", _flash_attn_bwd)


@torch.library.register_fake(qualname("flash_attn_bwd"), lib=lib)
def _flash_attn_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left=None, window_right=None,
                         softcap=0.0, key_start=None, key_end=None, attn_mask=None, learnable_sink=None, dsink=None, *,
                         deterministic=False):
    _validate_bwd(dout, q, k, v, out, lse)
    _validate_softcap(softcap)
    _validate_key_range(q, key_start, key_end)
    _validate_attn_mask(q, k, attn_mask)
    sinks.validate_sink_grad(dsink, learnable_sink, lse, q.shape[2])
    return tuple(t.new_empty(t.shape) for t in (q, k, v))
