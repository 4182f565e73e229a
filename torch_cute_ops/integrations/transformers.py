"""``attn_implementation="cute"`` for Hugging Face ``transformers`` models.

    import torch_cute_ops.integrations.transformers  # registers "cute"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cute")

Importing this module registers an attention function with transformers' ``AttentionInterface``
and a mask function with its ``AttentionMaskInterface``. The mask function, like
FlashAttention's, materializes nothing: it hands the attention the 2-D padding mask when there
is padding to honour, else None. The attention function then serves

* causal (and bidirectional) layers with no padding on the kernels, without a mask, through
  ``flash_attn_func`` (GQA natively: no ``repeat_kv`` copies);
* sliding-window layers (Mistral, Qwen2, Gemma 2/3, gpt-oss) with their window, and Gemma 2's
  logit soft-capping, on the same kernels;
* decode and chunked prefill against a KV cache (S_q < S_k): causal is aligned bottom-right, as
  the models need;
* padded batches, attention dropout in training, and ``output_attentions`` on PyTorch's masked
  path, counted and logged once as fallbacks (``TORCH_CUTE_OPS_STRICT=1`` raises instead).

Under ``torch.compile(fullgraph=True)`` the unpadded path stays in the graph: the mask function
never inspects mask values while tracing (a provided 2-D mask is passed on as is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..functional import flash_attn_func
from ..ops import fallback

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("torch_cute_ops.integrations.transformers needs transformers>=4.56 "
                      "(pip install 'torch-cute-ops[transformers]')") from err

NAME = "cute"


def cute_mask(batch_size, cache_position, kv_length, kv_offset=0, mask_function=None, attention_mask=None,
              **kwargs):
    """The 2-D (batch, kv_length) padding mask when some key is padding, else None."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None
    return attention_mask


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' sliding window W (a query sees itself and the W - 1 keys before it) as
    FlashAttention's (left, right)."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _masked_fallback(query, key, value, padding_mask, scaling, causal, window, softcap, dropout):
    """PyTorch's masked attention on (B, H, S, D) inputs: the padding mask, causal (bottom-right)
    and the window as one boolean mask; softcap in plain torch when present."""
    batch, heads, s_q, _ = query.shape
    s_k = key.shape[-2]
    i = torch.arange(s_q, device=query.device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=query.device)[None, :]
    visible = torch.ones(s_q, s_k, dtype=torch.bool, device=query.device)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    mask = visible[None, None]
    if padding_mask is not None:
        mask = mask & padding_mask[:, None, None, -s_k:].bool()
    groups = heads // key.shape[1]
    if softcap:
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, k.transpose(-1, -2)).float() * scaling
        scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        probs = F.dropout(probs, p=dropout, training=dropout > 0)
        return torch.matmul(probs.to(v.dtype), v)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          enable_gqa=groups > 1)


def cute_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function contract: query (B, H_q, S_q, D), key/value (B, H_kv, S_k, D)
    in; (attn_output (B, S_q, H_q, D), None) out."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = _window(sliding_window, causal)
    softcap = float(softcap) if softcap else 0.0
    if not module.training:
        dropout = 0.0
    reason = None
    if attention_mask is not None:
        reason = "padded batch (the varlen path is not wired in yet)" if attention_mask.dim() == 2 else \
            "a materialized 4-D mask"
    elif dropout > 0.0:
        reason = "attention dropout"
    elif kwargs.get("output_attentions"):
        reason = "output_attentions"
    if reason is None:
        out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap)
        return out, None
    fallback.note("transformers attention", reason)
    if attention_mask is not None and attention_mask.dim() == 4:  # a custom mask: honour it as given
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask[..., :key.shape[-2]],
                                             dropout_p=dropout, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = _masked_fallback(query, key, value, attention_mask, scaling, causal, window, softcap, dropout)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cute_attention_forward)
AttentionMaskInterface.register(NAME, cute_mask)
