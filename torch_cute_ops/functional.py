"""The public functions: thin, trace-friendly wrappers over ``torch.ops.cute``."""

from __future__ import annotations

import math

import torch

from .ops import attention as _attention
from .ops import attention_kvcache as _attention_kvcache
from .ops import attention_paged as _attention_paged
from .ops import attention_varlen as _attention_varlen
from .ops import gemm as _gemm
from .ops import grouped_gemm as _grouped_gemm
from .ops import checks
from .ops import scaled_gemm as _scaled_gemm
from .ops import scaled_grouped_gemm as _scaled_grouped_gemm
from .ops import bounds
from .ops import sinks as _sinks
from .ops.direct import dispatcher_free


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
         activation: str | None = None, out_dtype: torch.dtype | None = None,
         alpha: float = 1.0) -> torch.Tensor:
    """``activation(alpha * (a @ b) + bias)`` in one kernel; a (M, K) or (L, M, K), b (K, N)
    or (L, K, N).

    ``activation`` is None, "relu", "gelu_tanh" or "silu"; ``out_dtype`` defaults to a's dtype;
    ``alpha`` a finite number.
    """
    if not torch.compiler.is_compiling():  # traced, alpha may be symbolic: a value no guard should read
        alpha = float(alpha)
        if not math.isfinite(alpha):
            raise ValueError(f"alpha: expected a finite number, got {alpha}")
    if dispatcher_free(a, b, bias):
        return _gemm.gemm_impl(a, b, bias, activation, out_dtype, alpha)
    return torch.ops.cute.gemm(a, b, bias, activation, out_dtype, alpha)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              activation: str | None = None) -> torch.Tensor:
    """FP8 matmul ``activation(dequant(a) @ dequant(b) + bias)``: a (M, K) / (L, M, K) and b (K, N) /
    (L, K, N) in float8_e4m3fn or float8_e5m2, fp32 scales per tensor (one element each), per row
    of a and column of b ((M, 1), (1, N)) or per block (a: (M, K / 128), b: (K / 128, N / 128)).
    Both operands K-major: a row-major, b column-major (``w.t()`` of a row-major (N, K) weight).
    See :mod:`torch_cute_ops.fp8` for the quantizers and the differentiable ``fp8.linear``; this
    function itself is not differentiable."""
    if dispatcher_free(a, b, scale_a, scale_b, bias):
        return _scaled_gemm.scaled_gemm_impl(a, b, scale_a, scale_b, bias, out_dtype, activation)
    return torch.ops.cute.scaled_gemm(a, b, scale_a, scale_b, bias, out_dtype, activation)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
               activation: str | None = None, gate_up_layout: str = "concat", alpha: float = 1.702,
               limit: float = 7.0) -> torch.Tensor:
    """``torch.nn.functional.grouped_mm``'s semantics (a Mixture-of-Experts layer's expert GEMMs):

    * 2D x 3D: mat_a (M, K) rows grouped by ``offs`` (int32 (G,), cumulative group ends: group g
      owns rows ``offs[g - 1]:offs[g]``), mat_b (G, K, N) (e.g. ``w.transpose(-2, -1)`` of a
      (G, N, K) weight) -> (M, N);
    * 3D x 3D: batched, no offs -> (G, M, N);
    * 2D x 2D: mat_a (M, K) and mat_b (K, N), K grouped by offs -> (G, M, N) (a weight gradient);
    * 3D x 2D: mat_a (G, M, K), mat_b (K, N), N grouped by offs -> (M, N) (column-major).

    Groups of any size, zero included; rows (columns) past ``offs[-1]`` come out zero. ``bias``
    (G, N): group g's row added to its outputs (forms with a 3-D mat_b). Differentiable; the
    backward runs the same op. ``offs`` is checked (0 <= offs <= the grouped extent,
    non-decreasing) without a host sync: on a GPU a violation is a device-side assertion.

    ``activation`` (2D x 3D, a fused gate/up projection): mat_b's N columns hold gate and up,
    ``gate_up_layout="concat"`` ([gate | up], Qwen3 / Mixtral) or ``"interleaved"`` (gpt-oss:
    gate at even columns, up at odd ones); returns N / 2 columns. ``"swiglu"``: silu(gate) * up;
    ``"swiglu_oai"`` (gpt-oss): gate clamped above at ``limit``, up to [-limit, limit], (up + 1) *
    gate * sigmoid(alpha * gate). Applied to the fp32 accumulator; differentiable (the backward
    recomputes the pre-activation).
    """
    if activation is not None:
        if bias is not None:
            raise NotImplementedError("bias: not taken together with activation")
        if dispatcher_free(mat_a, mat_b, offs):
            return _grouped_gemm.grouped_mm_swiglu_impl(mat_a, mat_b, offs, activation, gate_up_layout,
                                                        float(alpha), float(limit), out_dtype)
        return torch.ops.cute.grouped_mm_swiglu(mat_a, mat_b, offs, activation, gate_up_layout, float(alpha),
                                                float(limit), out_dtype)
    if dispatcher_free(mat_a, mat_b, offs, bias):
        return _grouped_gemm.grouped_mm_impl(mat_a, mat_b, offs, bias, out_dtype)
    return torch.ops.cute.grouped_mm(mat_a, mat_b, offs, bias, out_dtype)


def scaled_grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8 e4m3 expert GEMMs with rowwise scales, ``torch._scaled_grouped_mm``'s 2D x 3D form: mat_a
    (M, K) row-major with scale_a (M,), mat_b (G, K, N) K-major (``w.transpose(-2, -1)``) with
    scale_b (G, N), rows grouped by ``offs`` as in :func:`grouped_mm`; bf16 out by default. Not
    differentiable."""
    if dispatcher_free(mat_a, mat_b, scale_a, scale_b, offs):
        return _scaled_grouped_gemm.scaled_grouped_mm_impl(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)
    return torch.ops.cute.scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)


def grouped_mm_masked(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """DeepGEMM's masked grouped layout (decoding under CUDA graphs): a (G, capacity, K), b (G, K, N),
    ``counts`` int32 (G,) on the device: group g's first ``counts[g]`` rows are real. Returns
    (G, capacity, N); rows past a group's count are unspecified (the kernel skips their tiles).
    No host sync. Not differentiable."""
    if dispatcher_free(a, b, counts):
        return _grouped_gemm.grouped_mm_masked_impl(a, b, counts, out_dtype)
    return torch.ops.cute.grouped_mm_masked(a, b, counts, out_dtype)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``torch.nn.functional.linear``: ``input @ weight.T + bias``."""
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-d tensor (out_features, in_features), got shape {tuple(weight.shape)}")
    if input.dim() == 0:
        raise ValueError("input: expected at least 1 dimension, got a scalar")
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input: expected last dim {weight.shape[1]} (in_features of weight), "
                         f"got shape {tuple(input.shape)}")
    lead = input.shape[:-1]
    flat = input.reshape(lead.numel(), input.shape[-1])  # a view whenever the leading dims allow it
    try:
        if dispatcher_free(input, weight, bias):
            out = _gemm.gemm_impl(flat, weight.t(), bias)  # weight.t(): K-major B, no copy
        else:
            out = torch.ops.cute.gemm(flat, weight.t(), bias, None, None)
    except (TypeError, ValueError):
        _check_linear_operands(input, weight, bias)  # the op's error names a and b: name linear's arguments
        raise
    return out.view(*lead, weight.shape[0])


def _check_linear_operands(input, weight, bias) -> None:
    checks.require_dtype("input", input, _gemm.INPUT_DTYPES)
    checks.require_same_dtype("weight", weight, "input", input)
    if bias is not None:
        checks.require_same_dtype("bias", bias, "input", input)
    checks.require_same_device([("input", input), ("weight", weight), ("bias", bias)])


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    return_lse: bool = False, *, key_start: torch.Tensor | None = None,
                    key_end: torch.Tensor | None = None, deterministic: bool = False,
                    learnable_sink: torch.Tensor | None = None):
    """Attention over (batch, seqlen, heads, head_dim) tensors, FlashAttention's API.

    GQA/MQA when k and v have fewer heads than q. ``causal`` is aligned bottom-right when
    seqlen_q != seqlen_k. ``window_size=(left, right)`` lets query i see key j iff
    ``i + S_k - S_q - left <= j <= i + S_k - S_q + right`` (-1: unbounded; causal is
    right = 0). ``softcap > 0`` caps each scaled score at ``softcap * tanh(s / softcap)``. With
    ``return_lse`` also returns the float32 log-sum-exp (batch, heads, seqlen_q).

    ``key_start``/``key_end`` (an extension; int32, shape (batch,)) make a padded batch: entry b's
    real keys are ``key_start[b] <= j < key_end[b]``, its queries aligned with the keys
    bottom-right; query rows outside the range give 0 (padding on either side, no copies).

    ``deterministic=True`` makes the backward's dQ bitwise reproducible run to run (its key
    blocks added in a fixed order, at some cost; dK and dV always are), as
    ``torch.use_deterministic_algorithms(True)`` does for every call.

    ``learnable_sink`` (shape (heads,), FlashAttention-4's name, gpt-oss's ``sinks``): a logit per
    query head added to every row's softmax denominator (a key that attends to nothing);
    differentiable, and the returned lse includes it.
    """
    softmax_scale = _softmax_scale(softmax_scale, q)
    left, right = _window_bounds(window_size)
    args = (q, k, v, softmax_scale, bool(causal), left, right, float(softcap))
    if key_start is not None or key_end is not None or learnable_sink is not None:
        args += (key_start, key_end)
    if learnable_sink is not None:
        _sinks.validate_sink(learnable_sink, q, 2)  # named here: a list or an int tensor never reaches the op
        args += (None, learnable_sink)
    if dispatcher_free(q, k, v, key_start, key_end, learnable_sink):
        out, lse = _attention.flash_attn_fwd_impl(*args)
    else:
        out, lse = torch.ops.cute.flash_attn_fwd(*args, deterministic=bool(deterministic))
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False,
                           *, deterministic: bool = False, learnable_sink: torch.Tensor | None = None,
                           seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                           page_table: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                           num_splits: int = 0, out: torch.Tensor | None = None, **engine_args):
    """Attention over packed sequences, FlashAttention's varlen API.

    q is (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim); sequence ``b`` owns
    rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, shape (batch + 1,), starting at 0) and is
    attended on its own: ``causal`` and ``window_size`` align per sequence exactly as in
    :func:`flash_attn_func`, lengths may be 0 and may differ between q and k. ``max_seqlen_q`` /
    ``max_seqlen_k`` are at least the longest lengths. With ``return_lse`` also returns the
    float32 log-sum-exp, shape (heads, total_q). ``deterministic`` and ``learnable_sink`` as in
    :func:`flash_attn_func`.

    A paged KV cache (a serving step, decode rows and prefill chunks in one launch):
    ``page_table`` (or ``block_table``, vLLM's name; int32 (batch, pages per sequence)) makes
    k and v the cache, (num_pages, page_size, kv_heads, head_dim); sequence b's keys are its first
    ``seqused_k[b]`` (int32 (batch,); or the lengths in ``cu_seqlens_k``) through its pages, and
    only the first ``seqused_q[b]`` of its query rows are real (default: all; the others get 0).
    Queries align bottom-right to their sequence's keys. Not differentiable. Also accepted, as
    FlashAttention defines them: ``out`` (the result is written there), ``num_splits`` and
    ``scheduler_metadata`` (hints: the kernels choose their own schedule), ``s_aux`` (vLLM's
    name of ``learnable_sink``), ``return_softmax_lse`` (``return_lse``), ``fa_version``
    (ignored), ``q_descale`` / ``k_descale`` / ``v_descale`` (apply to FP8 inputs only, as in
    FlashAttention: ignored with 16-bit ones), ``alibi_slopes=None``, ``dropout_p=0.0``.
    """
    learnable_sink, return_lse = _engine_arguments(engine_args, q, k, learnable_sink, return_lse, num_splits)
    page_table = _one_of("page_table", page_table, "block_table", block_table)
    softmax_scale = _softmax_scale(softmax_scale, q)
    left, right = _window_bounds(window_size)
    if page_table is not None or seqused_q is not None or seqused_k is not None:
        if page_table is None:
            raise NotImplementedError("seqused_q/seqused_k: supported with a paged cache (page_table) only")
        if seqused_k is None and cu_seqlens_k is not None:
            seqused_k = bounds.lengths_of(cu_seqlens_k)
        out_, lse = _paged(q, k, v, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q, softmax_scale,
                           bool(causal), left, right, float(softcap), learnable_sink)
        return _give(out_, lse, out, return_lse)
    if cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError("cu_seqlens_k, max_seqlen_q, max_seqlen_k: required without a page_table")
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, bool(causal),
            left, right, float(softcap))
    if learnable_sink is not None:
        _sinks.validate_sink(learnable_sink, q, 1)
        args += (learnable_sink,)
    if dispatcher_free(q, k, v, cu_seqlens_q, cu_seqlens_k, learnable_sink):
        out_, lse = _attention_varlen.flash_attn_varlen_fwd_impl(*args)
    else:
        out_, lse = torch.ops.cute.flash_attn_varlen_fwd(*args, deterministic=bool(deterministic))
    return _give(out_, lse, out, return_lse)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None,
                            cache_batch_idx: torch.Tensor | None = None,
                            page_table: torch.Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            return_lse: bool = False, cache_leftpad: torch.Tensor | None = None,
                            learnable_sink: torch.Tensor | None = None, *,
                            cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k_new: torch.Tensor | None = None,
                            max_seqlen_q: int | None = None, num_splits: int = 0, out: torch.Tensor | None = None,
                            **engine_args):
    """Attention against a KV cache, FlashAttention's API (inference: not differentiable).

    q is (batch, seqlen_q, heads, head_dim). The cache is (batch_cache, capacity, kv_heads,
    head_dim), entry b in row ``cache_batch_idx[b]`` (default b), or paged, (num_pages,
    page_size, kv_heads, head_dim) with ``page_table`` (batch, pages per entry) int32; page sizes
    that are multiples of 64 run on the kernels. ``k``/``v`` (batch, seqlen_new, kv_heads,
    head_dim), when given, are written into the cache in place at positions
    ``cache_seqlens[b]`` onwards before attending. q then sees each entry's first
    ``cache_seqlens[b] + seqlen_new`` keys (int32 tensor (batch,) or an int; None: the whole
    capacity), with ``causal`` and ``window_size`` aligned bottom-right to them.
    ``cache_leftpad`` (int32 (batch,), contiguous caches): entry b's keys start at that position
    (a left-padded batch), not 0. A contiguous cache may have any strides (a transposed
    (batch, kv_heads, capacity, head_dim) cache, as transformers keeps it, runs on the kernels).
    ``learnable_sink`` as in :func:`flash_attn_func` (the lse returned includes it).

    Packed queries (a serving step: decode rows and prefill chunks together, one launch):
    ``cu_seqlens_q`` (int32 (batch + 1,)) makes q (total_q, heads, head_dim), sequence b's
    queries its rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``, with ``max_seqlen_q`` at least
    the longest; new keys k, v are then packed too, (total_new, kv_heads, head_dim) with
    ``cu_seqlens_k_new``. The other engine arguments as in :func:`flash_attn_varlen_func`
    (``sinks``: SGLang's name of ``learnable_sink``).
    """
    learnable_sink, return_lse = _engine_arguments(engine_args, q, k_cache, learnable_sink, return_lse, num_splits)
    softmax_scale = _softmax_scale(softmax_scale, q)
    left, right = _window_bounds(window_size)
    if cu_seqlens_q is not None:
        out_, lse = _packed_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                                    cache_leftpad, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale,
                                    bool(causal), left, right, float(softcap), learnable_sink)
        return _give(out_, lse, out, return_lse)
    if cu_seqlens_k_new is not None:
        raise ValueError("cu_seqlens_k_new: packed new keys need packed queries (cu_seqlens_q)")
    if learnable_sink is not None:
        _sinks.validate_sink(learnable_sink, q, 2)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = _uniform_lengths(q, k_cache, v_cache, k, v, cache_batch_idx, page_table, cache_leftpad,
                                         cache_seqlens)
    args = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale, bool(causal),
            left, right, float(softcap), cache_leftpad)
    if learnable_sink is not None:
        args += (learnable_sink,)
    if dispatcher_free(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cache_leftpad,
                       learnable_sink):
        out_, lse = _attention_kvcache.flash_attn_kvcache_impl(*args)
    else:
        out_, lse = torch.ops.cute.flash_attn_kvcache(*args)
    return _give(out_, lse, out, return_lse)


# serving engines' keyword arguments besides the named ones (vLLM's and SGLang's calls), checked by
# _engine_arguments: hints, aliases, and what only FP8, ALiBi or dropout would read
_ENGINE_ARGS = ("scheduler_metadata", "fa_version", "q_descale", "k_descale", "v_descale", "pack_gqa",
                        "sm_margin", "return_softmax_lse", "s_aux", "sinks", "alibi_slopes", "dropout_p",
                        "return_attn_probs", "deterministic")


def _engine_arguments(args: dict, q, k_cache, learnable_sink, return_lse, num_splits):
    """Serving engines' extra arguments (vLLM's, SGLang's): (learnable_sink, return_lse) after
    their aliases; the hints accepted; what would change the result and is not supported named."""
    if not args and num_splits.__class__ is int and num_splits >= 0:  # a plain call: nothing to check
        return learnable_sink, bool(return_lse)
    unknown = sorted(set(args) - set(_ENGINE_ARGS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: chosen by the kernels), got {num_splits!r}")
    for name in ("q_descale", "k_descale", "v_descale"):  # FlashAttention applies them to FP8 inputs only
        if args.get(name) is not None and (q.element_size() == 1 or k_cache.element_size() == 1):
            raise NotImplementedError(f"{name}: FP8 inputs (and their descales) are not supported")
    if args.get("alibi_slopes") is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not supported")
    if args.get("dropout_p", 0.0) != 0.0:
        raise NotImplementedError(f"dropout_p: only 0.0 (no dropout) is supported, got {args['dropout_p']}")
    if args.get("return_attn_probs"):
        raise NotImplementedError("return_attn_probs: attention probabilities are not returned")
    for alias in ("s_aux", "sinks"):
        learnable_sink = _one_of("learnable_sink", learnable_sink, alias, args.get(alias))
    return learnable_sink, bool(return_lse or args.get("return_softmax_lse", False))


def _one_of(name: str, value, alias: str, alias_value):
    if value is not None and alias_value is not None:
        raise ValueError(f"{name}, {alias}: give one (they are the same argument)")
    return value if value is not None else alias_value


def _give(result, lse, out, return_lse: bool):
    """The result, written into ``out`` when given (FlashAttention's preallocated output)."""
    if out is not None:
        if out.shape != result.shape or out.dtype != result.dtype or out.device != result.device:
            raise ValueError(f"out: expected a {result.dtype} tensor of shape {tuple(result.shape)} on "
                             f"{result.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        result = out.copy_(result)
    return (result, lse) if return_lse else result


def _paged(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q, softmax_scale,
           causal, left, right, softcap, learnable_sink):
    """Packed queries against a paged cache (``cute::flash_attn_varlen_paged``), the sink merged."""
    if max_seqlen_q is None:
        raise ValueError("max_seqlen_q: required with packed queries (the longest sequence; it sizes the grid)")
    if learnable_sink is not None:
        _sinks.validate_sink(learnable_sink, q, 1)
    args = (q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table, max_seqlen_q, softmax_scale, causal,
            left, right, softcap)
    if dispatcher_free(q, k_cache, v_cache, cu_seqlens_q, seqused_q, seqused_k, page_table):
        out, lse = _attention_paged.flash_attn_varlen_paged_impl(*args)
    else:
        out, lse = torch.ops.cute.flash_attn_varlen_paged(*args)
    if learnable_sink is not None:
        out, lse = _sinks.merge(out, lse, learnable_sink, packed=True)
    return out, lse


def _packed_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cache_leftpad,
                    cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal, left, right, softcap,
                    learnable_sink):
    """flash_attn_with_kvcache with packed queries: new keys appended, then the paged op (a
    contiguous cache is one page per entry)."""
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad: not supported with packed queries (cu_seqlens_q)")
    if page_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: not supported with page_table (the page table maps entries)")
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q.dim() == 1 else -1
    if page_table is None:
        if k_cache.dim() != 4:
            checks.require_rank("k_cache", k_cache, (4,), "(batch_cache, capacity, kv_heads, head_dim)")
        rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(
            batch, dtype=torch.int32, device=q.device)
        page_table = rows.reshape(-1, 1)  # one page, the whole capacity, per entry
    if not isinstance(cache_seqlens, torch.Tensor):
        raise ValueError("cache_seqlens: expected an int32 tensor (batch,) with packed queries")
    seqused_k = cache_seqlens
    if k is not None or v is not None:
        seqused_k = _attention_paged.append_packed(k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_k_new,
                                                   page_table)
    return _paged(q, k_cache, v_cache, cu_seqlens_q, None, seqused_k, page_table, max_seqlen_q, softmax_scale,
                  causal, left, right, softcap, learnable_sink)


def _softmax_scale(softmax_scale, q: torch.Tensor) -> float:
    """The scale given (a finite number) or 1 / sqrt(head_dim). A q without a head dim gets 1.0
    here: the op's validation then names what is wrong with q."""
    if softmax_scale is None:
        head_dim = q.shape[-1] if q.dim() else 0
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    try:
        softmax_scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale: expected a float or None, got {softmax_scale!r}") from None
    if not torch.compiler.is_compiling() and not math.isfinite(softmax_scale):  # traced: maybe symbolic
        raise ValueError(f"softmax_scale: expected a finite number, got {softmax_scale}")
    return softmax_scale


def _uniform_lengths(q, k_cache, v_cache, k, v, cache_batch_idx, page_table, cache_leftpad, length) -> torch.Tensor:
    """One cache length for every entry (None: the capacity less the new tokens), checked here on
    the host and made into the int32 (batch,) tensor the op takes, recorded as checked."""
    if q.dim() != 4 or k_cache.dim() != 4 or (k is not None and k.dim() != 4) or (
            page_table is not None and page_table.dim() != 2):
        # the sizes below do not exist: the op's validation names the argument
        _attention_kvcache._validate(q, k_cache, v_cache, k, v, None, cache_batch_idx, page_table, cache_leftpad)
    if length is not None and (not isinstance(length, int) or isinstance(length, bool)):
        raise TypeError(f"cache_seqlens: expected an int32 tensor (batch,), an int or None, got {length!r}")
    capacity = k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])
    new = 0 if k is None else k.shape[1]
    if length is None:
        length = capacity - new
    if not 0 <= length <= capacity - new:
        raise ValueError(f"cache_seqlens: expected a length in [0, {capacity - new}] (the cache's capacity of "
                         f"{capacity} keys per entry less {new} new tokens), got {length}")
    lengths = torch.full((q.shape[0],), length, dtype=torch.int32, device=q.device)
    bounds.mark_within(lengths, 0, capacity - new)
    return lengths


def _window_bounds(window_size) -> tuple[int | None, int | None]:
    """FlashAttention's (left, right), -1 meaning unbounded, as the op's bounds (None: unbounded)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair (left, right), got {window_size!r}") from None
    for name, value in (("left", left), ("right", right)):
        if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool) or value < -1:
            raise ValueError(f"window_size: {name} must be an int >= -1 (-1: unbounded), got {value!r}")
    return (None if left == -1 else left), (None if right == -1 else right)
