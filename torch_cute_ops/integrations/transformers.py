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
  the models need; with padding, or a static (preallocated) cache whose unwritten slots must stay
  hidden, each row's keys are the run of real written ones, given as a 2-D mask and attended
  through ``flash_attn_with_kvcache`` (its length and ``cache_leftpad``: pack-GQA and split-KV
  decoding, no mask materialized);
* padded batches (left or right padding: one run of real tokens per row) on the same kernels,
  each entry bounded by its first and one-past-last real key (``flash_attn_func``'s
  ``key_start``/``key_end``): no mask is materialized, no token is copied, padding costs nothing;
* masks with holes (more than one run of real tokens in a row: packed documents) and custom 4-D
  masks as the materialized mask that transformers builds, on the kernels' attn_mask path
  (``scaled_dot_product_attention``: key blocks the mask hides are skipped);
* with soft-capping such a mask, attention dropout in training, and ``output_attentions`` on
  PyTorch's masked path, counted and logged once as fallbacks (``TORCH_CUTE_OPS_STRICT=1``
  raises instead).

Under ``torch.compile(fullgraph=True)`` everything above stays in the graph: the key ranges are
computed from the 2-D mask with tensor ops, and the mask function never inspects mask values
while tracing (it cannot see holes there: a compiled model must pad on one side, as tokenizers
and collators do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..functional import flash_attn_func, flash_attn_with_kvcache
from ..ops import bounds, fallback
from ..runtime.lasting import PerTensor
from ..sdpa import scaled_dot_product_attention

SUPPORTED = ((4, 56), (5, 0))  # transformers versions: [first, past-last), as pyproject's extra says

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("torch_cute_ops.integrations.transformers needs transformers>=4.56,<5 "
                      "(pip install 'torch-cute-ops[transformers]')") from err


def _check_version(version: str) -> None:
    """A clear error outside the tested range (transformers 5 changed the mask functions' contract)."""
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    if not SUPPORTED[0] <= major_minor < SUPPORTED[1]:
        raise ImportError(f"torch_cute_ops.integrations.transformers supports transformers>=4.56,<5; found "
                          f"{version} (pip install 'torch-cute-ops[transformers]')")


_check_version(transformers.__version__)

NAME = "cute"


def _unwritten_keys(cache_position, kv_length: int, kv_offset: int, attention_mask) -> bool:
    """Whether the keys extend past the last query's position: a static (preallocated) cache,
    whose slots beyond the tokens written so far are not keys yet. Shapes tell when the 2-D mask
    is given (it covers the tokens so far); without it, eager mode reads the last position."""
    if attention_mask is not None:
        return attention_mask.shape[-1] < kv_length
    if cache_position.shape[0] == kv_length:
        return False
    if torch.compiler.is_compiling():
        return True  # cannot tell: materialize, which is right either way
    return int(cache_position[-1]) + 1 - kv_offset < kv_length


def cute_mask(batch_size, cache_position, kv_length, kv_offset=0, mask_function=None, attention_mask=None,
              **kwargs):
    """The 2-D (batch, kv_length) mask of real keys when some key may be padding or (a static cache)
    not written yet, else None; a mask with holes is materialized (4-D, by transformers' SDPA
    mask) for the kernels' attn_mask path. Eager decoding reads the mask back once, at the
    prompt (:class:`_MaskVerdicts`)."""
    def materialized():
        from transformers.masking_utils import sdpa_mask

        # never None: our causal is aligned bottom-right, SDPA's skipped mask means top-left
        return sdpa_mask(batch_size=batch_size, cache_position=cache_position, kv_length=kv_length,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         **(kwargs | {"allow_is_causal_skip": False}))

    unwritten = _unwritten_keys(cache_position, kv_length, kv_offset, attention_mask)
    if attention_mask is None:
        return written_keys(batch_size, cache_position, kv_length, kv_offset, None) if unwritten else None
    if not unwritten:
        attention_mask = attention_mask[:, -kv_length:]
    if torch.compiler.is_compiling():  # no values to read: a compiled model pads on one side
        return written_keys(batch_size, cache_position, kv_length, kv_offset, attention_mask) if unwritten \
            else attention_mask
    verdict = _verdicts.get(attention_mask, cache_position.shape[0])
    if verdict == "holes":
        return materialized()
    if unwritten:
        return written_keys(batch_size, cache_position, kv_length, kv_offset, attention_mask)
    return None if verdict == "no padding" else attention_mask


def _runs(real: torch.Tensor) -> torch.Tensor:
    """The runs of real tokens in each row of a 2-D bool mask."""
    return real[:, :1].sum(1) + (real[:, 1:] & ~real[:, :-1]).sum(1)


class _MaskVerdicts:
    """What an eager forward's 2-D padding mask holds: "no padding", "one run" (of real tokens per
    row: the kernels' key ranges) or "holes" (materialized), read back from the GPU once per
    prompt rather than once per decode step.

    A forward whose mask is the previous one's continuation (same batch and device, as many keys
    more as it has new tokens: a decode step of ``generate()``) inherits its verdict without a
    read-back, provided the previous mask ended every row with a real token, so that real tokens
    appended keep one run per row ("one run" then: a step's own padding is still honoured through
    the key ranges). The GPU checks that assumption on each such step, with no host sync: a mask
    that gained a hole there (a hand-written decoding loop handing over masks with holes) stops
    the stream with a device-side assertion instead of being attended wrongly. A prompt whose
    rows end in padding (right padding) has its decode steps read back each time, and so has every
    forward on the CPU (a read-back there costs nothing)."""

    def __init__(self):
        self._last: dict[tuple, tuple[int, str | None]] = {}  # (batch, device) -> (keys, verdict carried on)

    @staticmethod
    def carries(mask: torch.Tensor) -> bool:
        """Whether a continuation inherits its verdict (where a read-back costs a sync)."""
        return mask.is_cuda

    def get(self, mask: torch.Tensor, new_tokens: int) -> str:
        batch, keys = mask.shape
        where = (batch, mask.device)
        last = self._last.get(where)
        real = mask.bool()
        if self.carries(mask) and last is not None and last[1] is not None and last[0] + new_tokens == keys:
            torch._assert_async((_runs(real) <= 1).all(), "attention_mask: a decoding step's 2-D mask gained "
                                "a hole (more than one run of real tokens in a row)")
            self._last[where] = (keys, last[1])
            return last[1]
        everything, one_run, ends_real = torch.stack([real.all(), (_runs(real) <= 1).all(),
                                                      real[:, -1].all()]).tolist()  # one sync
        verdict = "no padding" if everything else ("one run" if one_run else "holes")
        self._last[where] = (keys, "one run" if one_run and ends_real else None)
        return verdict


_verdicts = _MaskVerdicts()


def written_keys(batch_size: int, cache_position, kv_length: int, kv_offset: int, attention_mask):
    """bool (batch, kv_length): the cache slots holding a real token so far. Slot ``j`` holds position
    ``kv_offset + j``; positions past the last query's are not written (a static cache), and the
    2-D padding mask (one column per position so far) hides padding. Tensor ops only: traceable."""
    positions = torch.arange(kv_length, device=cache_position.device) + kv_offset
    real = (positions <= cache_position[-1])[None].expand(batch_size, kv_length)
    if attention_mask is not None:
        seen = attention_mask.shape[-1]
        padding = attention_mask.bool().to(cache_position.device)[:, positions.clamp(max=seen - 1)]
        real = real & padding & (positions < seen)
    return real


def key_range(padding_mask: torch.Tensor, kv_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_start, key_end), int32 (batch,): the run of real keys in each row of a 2-D padding
    mask (tensor ops only: no host sync, traceable)."""
    real = padding_mask[:, -kv_length:].bool()
    count = real.sum(1, dtype=torch.int32)
    start = (real.cumsum(1) == 0).sum(1, dtype=torch.int32)  # the padding before the run
    return start, start + count


# the layers of a forward share one mask tensor, so they share its key ranges, and the kvcache
# op's eager check of their values (a read-back) runs once per forward instead of once per layer
_key_ranges = PerTensor()


def shared_key_range(padding_mask: torch.Tensor, kv_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`key_range`, computed once per mask tensor, version and kv_length (eager), and recorded
    as within bounds (``0 <= start <= end <= kv_length`` by construction), so the ops need not
    check them again."""
    if torch.compiler.is_compiling():
        return key_range(padding_mask, kv_length)

    def make():
        start, end = key_range(padding_mask, kv_length)
        bounds.mark_within(end, 0, kv_length)
        bounds.mark_within(start, 0, end)
        return start, end
    return _key_ranges.get(padding_mask, kv_length, make)


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' sliding window W (a query sees itself and the W - 1 keys before it) as
    FlashAttention's (left, right)."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _masked_fallback(query, key, value, attention_mask, scaling, causal, window, softcap, dropout, sink=None):
    """PyTorch's masked attention on (B, H, S, D) inputs: a 2-D padding mask with causal
    (bottom-right) and the window as one boolean mask, or a 4-D mask as given; softcap and sinks
    (a score column that attends to nothing) in plain torch when present."""
    batch, heads, s_q, _ = query.shape
    s_k = key.shape[-2]
    if attention_mask is not None and attention_mask.dim() == 4:  # a custom mask: honoured as given
        mask = attention_mask[..., :s_k]
    else:
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
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, -s_k:].bool()
    groups = heads // key.shape[1]
    if softcap or sink is not None:
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, k.transpose(-1, -2)).float() * scaling
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if sink is not None:
            scores = torch.cat([scores, sink.float().view(1, -1, 1, 1).expand(batch, heads, s_q, 1)], -1)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :s_k]
        probs = F.dropout(probs, p=dropout, training=dropout > 0)
        return torch.matmul(probs.to(v.dtype), v)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          enable_gqa=groups > 1)


def cute_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention-function contract: query (B, H_q, S_q, D), key/value (B, H_kv, S_k, D)
    in; (attn_output (B, S_q, H_q, D), None) out. ``s_aux``: gpt-oss's per-head sinks."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = _window(sliding_window, causal)
    softcap = float(softcap) if softcap else 0.0
    if not module.training:
        dropout = 0.0
    reason = None
    if dropout > 0.0:
        reason = "attention dropout"
    elif kwargs.get("output_attentions"):
        reason = "output_attentions"
    elif attention_mask is not None and attention_mask.dim() != 2:
        if softcap or s_aux is not None:
            reason = "a materialized 4-D mask (a padding mask with holes, or a custom mask) with softcap or sinks"
        else:  # it holds the causal band and the window already
            out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask[..., :key.shape[-2]],
                                               scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
            return out.transpose(1, 2), None
    if reason is None:
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        common = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap, learnable_sink=s_aux)
        if attention_mask is None:
            return flash_attn_func(q, k, v, **common), None
        start, end = shared_key_range(attention_mask, key.shape[-2])  # each row's run of real keys
        if q.shape[1] < k.shape[1] and not (torch.is_grad_enabled() and query.requires_grad):
            # against a cache: queries end at the row's last real key, wherever the slots end
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=end, cache_leftpad=start, **common), None
        return flash_attn_func(q, k, v, key_start=start, key_end=end, **common), None
    fallback.note("transformers attention", reason)
    out = _masked_fallback(query, key, value, attention_mask, scaling, causal, window, softcap, dropout, s_aux)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cute_attention_forward)
AttentionMaskInterface.register(NAME, cute_mask)
