"""Host side shared by the GEMM families (sm90, sm100): operand views, coverage, launch.

The op layer hands over a (L, M, K), b (L, K, N) and out (L, M, N) torch tensors. Each
arch supplies a ``plan(ab, out, a_k_major, b_k_major, has_bias, activation, m, n, k, batch,
device_index, config) -> (compiled_fn, max_clusters)`` (cached per problem), and
:func:`launch` does the rest; its compiled function takes ``(a, b, [bias,] out,
max_clusters)`` and reads the stream from the TVM-FFI env stream (the current torch stream).
"""

from __future__ import annotations

import functools

import torch

from .activation import ACTIVATIONS
from .tma import TMA_ALIGN_BYTES, tma_reason

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
INPUT_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _aligned(extent: int, element_size: int) -> int:
    per_16b = TMA_ALIGN_BYTES // element_size
    return max(-(-extent // per_16b) * per_16b, per_16b)


@functools.lru_cache(maxsize=4096)
def _operand_strides(shape, stride, element_size):
    """(TMA-friendly strides for an (L, R, C) operand, C-is-contiguous); see operand_view."""
    batch, rows, cols = shape
    s_batch, s_rows, s_cols = stride
    if cols > 1 and s_cols == 1:
        cols_major = True
    elif rows > 1 and s_rows == 1:
        cols_major = False
    else:  # no size>1 dim with stride 1: a size-1 dim can play the contiguous one
        cols_major = cols == 1 or rows != 1
    if cols_major:
        s_cols = 1 if cols == 1 else s_cols
        s_rows = _aligned(cols, element_size) if rows == 1 else s_rows
    else:
        s_rows = 1
        s_cols = _aligned(rows, element_size) if cols == 1 else s_cols
    if batch == 1:
        s_batch = _aligned(rows * cols, element_size)
    return (s_batch, s_rows, s_cols), cols_major


def operand_view(t: torch.Tensor):
    """(L, R, C) torch operand -> (same-shape view with TMA-friendly strides, C-is-contiguous).

    For a (L, M, K), C-contiguous means K-major; for b (L, K, N) it means N-major. A
    size-1 dim carries no stride information, so the majorness comes from a dim of
    size > 1 with stride 1, and size-1 dims get aligned strides (a free as_strided
    view; the values are never used for addressing) so the TMA accepts them.
    """
    strides, cols_major = _operand_strides(t.shape, t.stride(), t.element_size())
    return (t if strides == t.stride() else t.as_strided(t.shape, strides)), cols_major


def out_view(out: torch.Tensor) -> torch.Tensor:
    """out (L, M, N) row-major, with aligned strides on size-1 dims (see operand_view)."""
    batch, rows, cols = out.shape
    size = out.element_size()
    strides = (_aligned(rows * cols, size) if batch == 1 else out.stride(0),
               _aligned(cols, size) if rows == 1 else out.stride(1), 1)
    return out if strides == out.stride() else out.as_strided(out.shape, strides)


def unsupported_reason(kernel: str, a, b, bias, activation, out_dtype) -> str | None:
    """Why a TMA GEMM kernel named ``kernel`` does not cover the case, or None. Launches nothing.

    Everything but the data pointers depends only on dtypes, shapes and strides, so that part
    is decided once per layout and cached: this runs on every eager call.
    """
    bias_layout = None if bias is None else (bias.dtype, bias.shape, bias.stride())
    reason = _layout_reason(kernel, a.dtype, a.shape, a.stride(), b.dtype, b.shape, b.stride(), bias_layout,
                            activation, out_dtype)
    if reason:
        return reason
    for name, t in (("a", a), ("b", b), ("bias", bias)):
        if t is not None and t.data_ptr() % TMA_ALIGN_BYTES:
            return f"{name}: data pointer is not {TMA_ALIGN_BYTES}-byte aligned (storage offset {t.storage_offset()})"
    return None


@functools.lru_cache(maxsize=4096)
def _layout_reason(kernel, a_dtype, a_shape, a_stride, b_dtype, b_shape, b_stride, bias_layout, activation,
                   out_dtype) -> str | None:
    if a_dtype not in INPUT_DTYPES:
        return f"{kernel}: inputs must be bf16 or fp16, got {a_dtype}"
    if b_dtype != a_dtype or (bias_layout is not None and bias_layout[0] != a_dtype):
        return f"{kernel}: a, b and bias must share one dtype"
    out_dtype = a_dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        return f"{kernel}: out dtype must be bf16, fp16 or fp32, got {out_dtype}"
    if activation is not None and activation not in ACTIVATIONS:
        return f"{kernel}: activation {activation!r} is not one of {ACTIVATIONS}"
    if len(a_shape) != 3 or len(b_shape) != 3:
        return f"{kernel}: expects (L, M, K) and (L, K, N) operands"
    batch, m, k = a_shape
    n = b_shape[2]
    if k == 0:
        return f"{kernel}: K == 0 (the TMA needs non-empty operands)"
    for name, dtype, shape, stride in (("a", a_dtype, a_shape, a_stride), ("b", b_dtype, b_shape, b_stride)):
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        view, cols_major = operand_view(meta)
        reason = tma_reason(name, view, (2 if cols_major else 1,))
        if reason:
            return reason
    out_bytes = out_dtype.itemsize
    if m > 1 and (n * out_bytes) % TMA_ALIGN_BYTES or batch > 1 and (m * n * out_bytes) % TMA_ALIGN_BYTES:
        return f"out: rows of N={n} {out_dtype} elements are not a multiple of 16 bytes (TMA store)"
    if bias_layout is not None:
        _, bias_shape, bias_stride = bias_layout
        if len(bias_shape) != 1 or bias_stride[0] != 1 and bias_shape[0] > 1:
            return "bias: must be a contiguous (N,) vector"
    if max(batch, m, n, k) >= 2**31:
        return f"{kernel}: sizes must fit in int32"
    return None


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(plan, a, b, bias, activation, out, alpha=1.0, config=None) -> None:
    """out[l] = act(alpha * a[l] @ b[l] + bias) on the current stream; ``config`` overrides the
    heuristic."""
    if out.numel() == 0:
        return
    a_view, a_k_major = operand_view(a)
    b_view, b_n_major = operand_view(b)
    batch, m, k = a.shape
    n = out.shape[2]
    device_index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    fn, max_clusters = plan(DTYPE_NAMES[a.dtype], DTYPE_NAMES[out.dtype], a_k_major, not b_n_major,
                            bias is not None, activation, m, n, k, batch, device_index, config)
    if bias is None:
        fn(a_view, b_view, out_view(out), float(alpha), max_clusters)
    else:
        fn(a_view, b_view, bias, out_view(out), float(alpha), max_clusters)
