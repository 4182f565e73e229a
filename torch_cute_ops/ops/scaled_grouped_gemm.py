"""``cute::scaled_grouped_mm``: a Mixture-of-Experts layer's FP8 expert GEMMs, 2D x 3D with rowwise
scales (``torch._scaled_grouped_mm``'s layout): a (M, K) float8_e4m3fn row-major with scale_a (M,),
b (G, K, N) K-major (``w.transpose(-2, -1)`` of a (G, N, K) weight) with scale_b (G, N), rows of a
grouped by ``offs`` as in ``grouped_mm``; out bf16 by default. On Hopper the rows-grouped sm90
kernel runs it with the scales in its epilogue; elsewhere the reference (dequantized, fp32).
Not differentiable (its inputs are already quantized)."""

from __future__ import annotations

import math

import torch

from ..reference import grouped_gemm as reference
from ..runtime.gemm import pointer_reason
from ..runtime.unfilled import empty_output
from . import checks, fallback
from .grouped_gemm import _MAX_PLANS, _host_plan, _layout_key, check_offs
from .scaled_gemm import _require_k_major
from .schemas import lib, qualname, register_impl

FP8_DTYPES = (torch.float8_e4m3fn,)
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _validate(a, b, scale_a, scale_b, offs, out_dtype):
    checks.require_rank("mat_a", a, (2, 3), "(M, K)")
    checks.require_rank("mat_b", b, (2, 3), "(G, K, N)")
    if (a.dim(), b.dim()) != (2, 3):
        raise NotImplementedError(f"mat_a, mat_b: scaled_grouped_mm takes the 2D x 3D form, got {a.dim()}D x "
                                  f"{b.dim()}D")
    checks.require_dtype("mat_a", a, FP8_DTYPES)
    checks.require_dtype("mat_b", b, FP8_DTYPES)
    checks.require_dtype("scale_a", scale_a, (torch.float32,))
    checks.require_dtype("scale_b", scale_b, (torch.float32,))
    checks.require_same_device([("mat_a", a), ("mat_b", b), ("scale_a", scale_a), ("scale_b", scale_b),
                                ("offs", offs)])
    checks.require_dim("mat_b", b, 1, a.shape[1], "K, the last dim of mat_a")
    if offs is None:
        raise ValueError("offs: expected an int32 tensor (G,) of group ends")
    checks.require_dtype("offs", offs, (torch.int32,))
    checks.require_rank("offs", offs, (1,), "(G,) of cumulative group ends")
    checks.require_dim("offs", offs, 0, b.shape[0], "G, the groups of mat_b")
    if tuple(scale_a.shape) != (a.shape[0],):
        raise ValueError(f"scale_a: expected shape ({a.shape[0]},) (one scale per row of mat_a), "
                         f"got {tuple(scale_a.shape)}")
    if tuple(scale_b.shape) != (b.shape[0], b.shape[2]):
        raise ValueError(f"scale_b: expected shape ({b.shape[0]}, {b.shape[2]}) (per group and column of mat_b), "
                         f"got {tuple(scale_b.shape)}")
    _require_k_major("a", a, "mat_a (M, K) row-major")
    _require_k_major("b", b, "mat_b (G, K, N) column-major, e.g. w.transpose(-2, -1) of a (G, N, K) weight")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUTPUT_DTYPES}, got {out_dtype}")
    return (a.shape[0], b.shape[2]), out_dtype


_plans: dict[tuple, tuple] = {}


def scaled_grouped_mm_impl(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None):
    key = (_layout_key(mat_a, mat_b, offs, None, out_dtype), scale_a.shape, scale_a.stride(), scale_b.shape,
           scale_b.stride())
    plan = _plans.get(key)
    if plan is None:
        shape, resolved = _validate(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)
        launch = reason = None
        if math.prod(shape) > 0 and offs.shape[0] > 0 and mat_a.shape[1] > 0:
            launch, reason = _host_plan("grouped_mm", mat_a, mat_b, "rows", resolved, offs.shape[0],
                                        scale_mode="row")
        plan = (shape, resolved, launch, reason)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    shape, resolved, launch, reason = plan
    check_offs(offs, mat_a.shape[0], "the rows of mat_a")
    if launch is not None:
        reason = pointer_reason(mat_a, mat_b, None)
        if reason is None:
            out = empty_output(shape, resolved, mat_a.device)
            scales = (scale_a.view(-1, 1), scale_b.unsqueeze(1))  # (M, 1), (G, 1, N): the kernel's rowwise layout
            launch(mat_a, mat_b, offs, out, scales)
            return out
    if reason is not None:
        fallback.note("scaled_grouped_mm", reason)
    return reference.scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, resolved)


register_impl("scaled_grouped_mm", scaled_grouped_mm_impl)


@torch.library.register_fake(qualname("scaled_grouped_mm"), lib=lib)
def _scaled_grouped_mm_fake(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None):
    shape, out_dtype = _validate(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)
    return mat_a.new_empty(shape, dtype=out_dtype)
