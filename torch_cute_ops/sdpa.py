"""A drop-in ``torch.nn.functional.scaled_dot_product_attention`` and the switch that routes to it.

``scaled_dot_product_attention`` has PyTorch's signature and semantics: (..., H, S, D) inputs,
``is_causal`` aligned top-left as PyTorch defines it (a window bound on the kernels' band when
seqlen_q != seqlen_k), ``scale``, ``enable_gqa``. The cases the attention op covers go to
``torch.ops.cute.flash_attn_fwd`` (through a free transpose to the (B, S, H, D) layout), an
``attn_mask`` (bool or additive in the query's dtype, any broadcastable shape) included;
everything else -- a mask that requires grad, dropout, a value head dim that differs from the
query's, a device with no attention kernel -- is counted as a fallback and handed to PyTorch's
own implementation. Input that PyTorch rejects (mixed dtypes or devices, unequal query and key
head dims, batch dims that do not broadcast, a GQA head count that does not divide, a mask that
does not broadcast to the scores) raises a ValueError or TypeError naming the argument first,
also in strict mode (an invalid input is not a missing kernel).

``sdpa_override()`` (a context manager) and ``enable_sdpa_override()`` / ``disable_sdpa_override()``
replace ``torch.nn.functional.scaled_dot_product_attention`` so that unchanged models (which call
it through the module attribute, as ``transformers`` does) use this one. Switch it before
``torch.compile`` traces the model.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from .ops import attention as _attention
from .ops import checks, dispatch, fallback
from .ops.direct import dispatcher_free

_torch_sdpa = F.scaled_dot_product_attention
_routes: dict[tuple, str | None] = {}
_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_HEAD_DIM = 256


@fallback.constant_result
def _device_has_kernel(device: torch.device) -> bool:
    return not isinstance(dispatch.kernel_for("flash_attn_fwd", device), str)


def _check_inputs(query, key, value, attn_mask, dropout_p, enable_gqa) -> None:
    """Raise, naming the argument, on input that PyTorch's implementation rejects as well."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 2:
            raise ValueError(f"{name}: expected a tensor (..., seqlen, head_dim), got shape {tuple(t.shape)}")
    checks.require_dtype("query", query, _OP_DTYPES)
    checks.require_same_dtype("key", key, "query", query)
    checks.require_same_dtype("value", value, "query", query)
    checks.require_same_device([("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)])
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key: expected head dim {query.shape[-1]} (the query's), got shape {tuple(key.shape)}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"value: expected seqlen {key.shape[-2]} (the key's), got shape {tuple(value.shape)}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1], got {dropout_p}")
    lead_k, lead_v = key.shape[:-2], value.shape[:-2]
    if enable_gqa and min(query.dim(), key.dim(), value.dim()) >= 3:
        heads = query.shape[-3]
        for name, t in (("key", key), ("value", value)):
            if t.shape[-3] == 0 or heads % t.shape[-3]:
                raise ValueError(f"{name}: with enable_gqa its heads ({t.shape[-3]}) must divide the query's "
                                 f"({heads})")
        lead_k, lead_v = (*lead_k[:-1], heads), (*lead_v[:-1], heads)
    try:
        lead = torch.broadcast_shapes(query.shape[:-2], lead_k, lead_v)
    except RuntimeError:
        raise ValueError(f"key, value: batch and head dims {tuple(lead_k)}, {tuple(lead_v)} do not broadcast with "
                         f"the query's {tuple(query.shape[:-2])}") from None
    if attn_mask is not None:
        scores = (*lead, query.shape[-2], key.shape[-2])
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise TypeError(f"attn_mask: expected dtype torch.bool, torch.float32 or the query's ({query.dtype}), "
                            f"got {attn_mask.dtype}")
        if attn_mask.dim() > len(scores) or any(m not in (1, f) for m, f in zip(attn_mask.shape[::-1], scores[::-1])):
            raise ValueError(f"attn_mask: expected a shape that broadcasts to the scores {scores}, "
                             f"got {tuple(attn_mask.shape)}")


def _reason_for_torch(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> str | None:
    """Why this call goes to PyTorch's implementation, or None when the cute op covers it."""
    if attn_mask is not None:
        if is_causal:
            return "attn_mask with is_causal (PyTorch's error)"
        if attn_mask.requires_grad:
            return "attn_mask requires grad (the kernels do not differentiate it)"
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            return f"attn_mask dtype {attn_mask.dtype} is neither bool nor the query's"
        full = (query.shape[0], query.shape[1], query.shape[-2], key.shape[-2])
        if attn_mask.dim() > 4 or any(m not in (1, f) for m, f in zip(attn_mask.shape[::-1], full[::-1])):
            return "attn_mask does not broadcast to (batch, heads, seqlen_q, seqlen_k)"
    if dropout_p > 0.0:
        return "dropout is not supported by the kernels"
    if not (query.dim() == key.dim() == value.dim() == 4):
        return "only 4-d (batch, heads, seqlen, head_dim) inputs are routed to the kernels"
    if query.dtype not in _OP_DTYPES or not (query.dtype == key.dtype == value.dtype):
        return f"dtype {query.dtype} is not supported by the kernels"
    if not (query.shape[0] == key.shape[0] == value.shape[0]) or key.shape[:3] != value.shape[:3]:
        return "batch or key/value shapes differ (left to PyTorch's broadcasting)"
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        return "value head dim differs from the query's"
    if not 0 < query.shape[-1] <= _MAX_HEAD_DIM:
        return f"head dim {query.shape[-1]} is not in [1, {_MAX_HEAD_DIM}]"
    if key.shape[1] == 0:
        return "no heads"
    if query.shape[1] != key.shape[1] and (not enable_gqa or query.shape[1] % key.shape[1]):
        return "query and key head counts differ without a valid enable_gqa"
    if query.is_cuda and not _device_has_kernel(query.device):
        return "no attention kernel for this GPU"
    return None


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, served by the cute kernels where they apply."""
    if not torch.compiler.is_compiling():
        # eager calls decide once per layout (the checks cost more than the kernel's launch)
        route = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device,
                 key.device, value.device, dropout_p, is_causal, enable_gqa)
        if attn_mask is not None:
            route += (attn_mask.shape, attn_mask.dtype, attn_mask.requires_grad, attn_mask.device)
        reason = _routes.get(route, False)
        if reason is False:
            _check_inputs(query, key, value, attn_mask, dropout_p, enable_gqa)
            reason = _reason_for_torch(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
            if len(_routes) >= 4096:
                _routes.clear()
            _routes[route] = reason
    else:
        _check_inputs(query, key, value, attn_mask, dropout_p, enable_gqa)
        reason = _reason_for_torch(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        fallback.note("scaled_dot_product_attention", reason)
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    # PyTorch aligns is_causal top-left (key j <= query i): the kernels' band with its right
    # edge at S_q - S_k relative to their bottom-right diagonal, equal to causal when S_q == S_k
    causal = bool(is_causal) and query.shape[-2] == key.shape[-2]
    right = query.shape[-2] - key.shape[-2] if is_causal and not causal else None
    args = (q, k, v, float(scale), causal, None, right)
    if attn_mask is not None:
        args += (0.0, None, None, attn_mask)
    if dispatcher_free(q, k, v, attn_mask):
        out, _ = _attention.flash_attn_fwd_impl(*args)
    else:
        out, _ = torch.ops.cute.flash_attn_fwd(*args)
    return out.transpose(1, 2)



def enable_sdpa_override() -> None:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through the cute kernels."""
    F.scaled_dot_product_attention = scaled_dot_product_attention


def disable_sdpa_override() -> None:
    """Restore PyTorch's own ``scaled_dot_product_attention``."""
    F.scaled_dot_product_attention = _torch_sdpa


def sdpa_override_enabled() -> bool:
    return F.scaled_dot_product_attention is scaled_dot_product_attention


@contextlib.contextmanager
def sdpa_override():
    """Within the block, models' SDPA calls run on the cute kernels; the previous state returns after."""
    was_enabled = sdpa_override_enabled()
    enable_sdpa_override()
    try:
        yield
    finally:
        if not was_enabled:
            disable_sdpa_override()
