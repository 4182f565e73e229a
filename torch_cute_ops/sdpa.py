"""A drop-in ``torch.nn.functional.scaled_dot_product_attention`` and the switch that routes to it.

``scaled_dot_product_attention`` has PyTorch's signature and semantics: (..., H, S, D) inputs,
``is_causal`` aligned top-left as PyTorch defines it (a window bound on the kernels' band when
seqlen_q != seqlen_k), ``scale``, ``enable_gqa``. The cases the attention op covers go to
``torch.ops.cute.flash_attn_fwd`` (through a free transpose to the (B, S, H, D) layout), an
``attn_mask`` (bool or additive in the query's dtype, any broadcastable shape) included;
everything else -- a mask that requires grad, dropout, a value head dim that differs from the
query's, a device with no attention kernel -- is counted as a fallback and handed to PyTorch's
own implementation, which also raises PyTorch's errors for invalid input.

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
from .ops import dispatch, fallback
from .ops.direct import dispatcher_free

_torch_sdpa = F.scaled_dot_product_attention
_routes: dict[tuple, str | None] = {}
_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_HEAD_DIM = 256


@fallback.constant_result
def _device_has_kernel(device: torch.device) -> bool:
    return not isinstance(dispatch.kernel_for("flash_attn_fwd", device), str)


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
        return "batch or key/value shapes differ (left to PyTorch's broadcasting and errors)"
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        return "value head dim differs from the query's"
    if not 0 < query.shape[-1] <= _MAX_HEAD_DIM:
        return f"head dim {query.shape[-1]} > {_MAX_HEAD_DIM}"
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
                 dropout_p, is_causal, enable_gqa)
        if attn_mask is not None:
            route += (attn_mask.shape, attn_mask.dtype, attn_mask.requires_grad)
        reason = _routes.get(route, False)
        if reason is False:
            reason = _reason_for_torch(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
            if len(_routes) >= 4096:
                _routes.clear()
            _routes[route] = reason
    else:
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
