"""``cute::scaled_gemm``: FP8 matmul with per-tensor, rowwise or blockwise scales, a fused bias and
activation (semantics: ``torch_cute_ops.reference.scaled_gemm``), with a fake function.

Operands are K-major, as FP8 tensor cores read them and as torch._scaled_mm requires: a (M, K)
row-major, b (K, N) column-major (``w.t()`` of a row-major (N, K) weight; the quantizers of
``torch_cute_ops.fp8`` return b that way). Anything else is a named error on every device.

On Hopper the persistent sm90 GEMM kernel runs it (``kernels/sm90/gemm.py``: scales in the
epilogue, or per 128-wide k-tile for blockwise ones); layouts it cannot take (K not a multiple
of 16, misaligned pointers) and other GPUs take the reference path, counted and logged once as a
fallback (``TORCH_CUTE_OPS_STRICT=1`` raises instead). Not differentiable itself (its inputs are
already quantized): FP8 training quantizes inside an autograd function and calls the op for each
GEMM, the backward's dA = dC B^T and dB = A^T dC being scaled matmuls of the transposed operands;
``torch_cute_ops.fp8.linear`` is that function for a linear layer.
"""

from __future__ import annotations

import torch

from ..reference import scaled_gemm as reference
from ..reference.gemm import ACTIVATIONS
from ..runtime.gemm import operand_strides, pointer_reason
from ..runtime.unfilled import empty_output
from . import checks, fallback
from .gemm import LayoutPlan, plan_layout
from .schemas import lib, qualname, register_impl

FP8_DTYPES = reference.FP8_DTYPES
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIAS_DTYPES = OUTPUT_DTYPES


def _expected_scales(a, b) -> str:
    lead = "".join(f"{d}, " for d in a.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    kb, nb = -(-k // reference.BLOCK), -(-n // reference.BLOCK)
    return (f"one element each (per tensor), ({lead}{m}, 1) and ({lead}1, {n}) (rowwise), or ({lead}{m}, {kb}) "
            f"and ({lead}{kb}, {nb}) (blockwise, 1 x 128 and 128 x 128)")


def _require_k_major(name: str, t: torch.Tensor, layout: str) -> None:
    if t.shape[-1 if name == "a" else -2] <= 1 or t.numel() == 0:
        return  # K <= 1 or no elements: every layout is K-major
    shape3 = (1, *t.shape[-2:])
    stride3 = (0, *t.stride()[-2:])
    _, cols_major = operand_strides(shape3, stride3, t.element_size())
    if cols_major != (name == "a"):
        raise ValueError(f"{name}: FP8 matmul needs K-major operands (FP8 tensor cores read K-major shared memory): "
                         f"{layout}, got shape {tuple(t.shape)} with strides {t.stride()}")


def _validate(a, b, scale_a, scale_b, bias, out_dtype, activation) -> tuple[tuple[int, ...], torch.dtype, str]:
    """Raise on invalid inputs; return the output shape and dtype and the scale mode."""
    checks.require_rank("a", a, (2, 3), "(M, K) or (L, M, K)")
    checks.require_rank("b", b, (a.dim(),), "(K, N)" if a.dim() == 2 else "(L, K, N) like a")
    checks.require_dtype("a", a, FP8_DTYPES)
    checks.require_dtype("b", b, FP8_DTYPES)
    checks.require_dtype("scale_a", scale_a, (torch.float32,))
    checks.require_dtype("scale_b", scale_b, (torch.float32,))
    checks.require_same_device([("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("bias", bias)])
    checks.require_dim("b", b, -2, a.shape[-1], "K, the last dim of a")
    if a.dim() == 3:
        checks.require_dim("b", b, 0, a.shape[0], "L, the batch of a")
    _require_k_major("a", a, "a (M, K) must be row-major")
    _require_k_major("b", b, "b (K, N) must be column-major, e.g. w.t() of a row-major (N, K) weight")
    mode = reference.scale_mode(a, b, scale_a, scale_b)
    if mode is None:
        raise ValueError(f"scale_a, scale_b: expected fp32 scales of {_expected_scales(a, b)}; got "
                         f"{tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    if mode == "block" and a.shape[-1] % reference.BLOCK:
        raise ValueError(f"a: blockwise scales need K a multiple of {reference.BLOCK}, got shape {tuple(a.shape)}")
    n = b.shape[-1]
    if bias is not None:
        checks.require_dtype("bias", bias, BIAS_DTYPES)
    checks.require_epilogue(bias, n, activation, ACTIVATIONS)
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUTPUT_DTYPES}, got {out_dtype}")
    return (*a.shape[:-1], n), out_dtype, mode


_plans: dict[tuple, LayoutPlan] = {}


def _make_plan(key, a, b, scale_a, scale_b, bias, out_dtype, activation) -> LayoutPlan:
    shape, out_dtype, mode = _validate(a, b, scale_a, scale_b, bias, out_dtype, activation)
    plan = plan_layout(_plans, key, shape, out_dtype, a, b, bias, activation, b_dtype=b.dtype,
                       bias_dtype=None if bias is None else bias.dtype, scale_mode=mode)
    if plan.reason is not None:
        plan.reason = f"{plan.reason} ({mode} scales)"
    return plan


def scaled_gemm_impl(a, b, scale_a, scale_b, bias=None, out_dtype=None, activation=None):
    key = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device, scale_a.shape,
           scale_a.dtype, scale_a.device, scale_b.shape, scale_b.dtype, scale_b.device,
           None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device), out_dtype, activation)
    plan = _plans.get(key) or _make_plan(key, a, b, scale_a, scale_b, bias, out_dtype, activation)
    reason = plan.reason
    if plan.launch is not None:
        reason = pointer_reason(a, b, bias)
        if reason is None:
            out = empty_output(plan.shape, plan.out_dtype, a.device)
            plan.launch(a, b, scale_a, scale_b, bias, out)
            return out
    if reason is not None:
        fallback.note("scaled_gemm", reason)
    return reference.scaled_gemm(a, b, scale_a, scale_b, bias, plan.out_dtype, activation)


register_impl("scaled_gemm", scaled_gemm_impl)


@torch.library.register_fake(qualname("scaled_gemm"), lib=lib)
def _scaled_gemm_fake(a, b, scale_a, scale_b, bias=None, out_dtype=None, activation=None):
    shape, out_dtype, _ = _validate(a, b, scale_a, scale_b, bias, out_dtype, activation)
    return a.new_empty(shape, dtype=out_dtype)


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad):
    raise RuntimeError("scaled_mm is not differentiable: quantize inside your own autograd function and call "
                       "scaled_mm for the backward's GEMMs (dA = dC B^T, dB = A^T dC) with the scales of the "
                       "transposed operands, as torch_cute_ops.fp8.linear does for a linear layer")


torch.library.register_autograd(qualname("scaled_gemm"), _backward, setup_context=_setup_context, lib=lib)
