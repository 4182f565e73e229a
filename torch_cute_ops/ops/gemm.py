"""``cute::gemm``: C = act(alpha * A @ B + bias), with fake function, CUDA dispatch and autograd.

a is (M, K) or (L, M, K), b is (K, N) or (L, K, N), either row- or column-major: a
transposed view reaches the kernel as it is and selects the kernel's majorness.
"""

from __future__ import annotations

import math

import torch

from ..reference import gemm as reference
from ..runtime.gemm import pointer_reason
from ..runtime.unfilled import empty_output
from . import checks, dispatch, fallback
from .schemas import lib, qualname, register_impl

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
OUTPUT_DTYPES = INPUT_DTYPES
ACTIVATIONS = tuple(reference.ACTIVATIONS)


def _validate(a, b, bias, activation, out_dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """Raise on invalid inputs; return the output shape and dtype."""
    checks.require_rank("a", a, (2, 3), "(M, K) or (L, M, K)")
    checks.require_rank("b", b, (a.dim(),), "(K, N)" if a.dim() == 2 else "(L, K, N) like a")
    checks.require_dtype("a", a, INPUT_DTYPES)
    checks.require_same_dtype("b", b, "a", a)
    checks.require_same_device([("a", a), ("b", b), ("bias", bias)])
    checks.require_dim("b", b, -2, a.shape[-1], "K, the last dim of a")
    if a.dim() == 3:
        checks.require_dim("b", b, 0, a.shape[0], "L, the batch of a")
    n = b.shape[-1]
    if bias is not None:
        checks.require_same_dtype("bias", bias, "a", a)
    checks.require_epilogue(bias, n, activation, ACTIVATIONS)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUTPUT_DTYPES}, got {out_dtype}")
    return (*a.shape[:-1], n), out_dtype


class LayoutPlan:
    """What one operand layout needs per call: the output, and the kernel launch or the
    reason no kernel covers it (None on CPU)."""

    __slots__ = ("shape", "out_dtype", "launch", "reason")

    def __init__(self, shape, out_dtype, launch, reason):
        self.shape, self.out_dtype, self.launch, self.reason = shape, out_dtype, launch, reason


_MAX_PLANS = 4096


def plan_layout(plans: dict, key, shape, out_dtype, a, b, bias, activation, **variant) -> LayoutPlan:
    """Decide (once per layout, after validation) the GEMM kernel launch of an op's call and
    remember it in ``plans`` under ``key``; ``variant`` goes to the host's plan (FP8 scales)."""
    launch = reason = None
    if a.is_cuda:
        host = dispatch.kernel_for("gemm", a.device)
        if isinstance(host, str):
            reason = host
        elif math.prod(shape) > 0:
            bias_layout = None if bias is None else (tuple(bias.shape), bias.stride())
            launch = host.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype, bias_layout,
                               activation, out_dtype, dispatch.device_index(a.device), **variant)
            if isinstance(launch, str):
                launch, reason = None, launch
    plan = LayoutPlan(shape, out_dtype, launch, reason)
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


_plans: dict[tuple, LayoutPlan] = {}


def _make_plan(key, a, b, bias, activation, out_dtype) -> LayoutPlan:
    shape, out_dtype = _validate(a, b, bias, activation, out_dtype)
    return plan_layout(_plans, key, shape, out_dtype, a, b, bias, activation)


def gemm_impl(a, b, bias=None, activation=None, out_dtype=None, alpha=1.0):
    key = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
           None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device), activation, out_dtype)
    plan = _plans.get(key) or _make_plan(key, a, b, bias, activation, out_dtype)
    reason = plan.reason
    if plan.launch is not None:
        reason = pointer_reason(a, b, bias)
        if reason is None:
            out = empty_output(plan.shape, plan.out_dtype, a.device)
            plan.launch(a, b, bias, out, alpha)
            return out
    if reason is not None:
        fallback.note("gemm", reason)
    return reference.gemm(a, b, bias, activation, plan.out_dtype, alpha)


register_impl("gemm", gemm_impl)


@torch.library.register_fake(qualname("gemm"), lib=lib)
def _gemm_fake(a, b, bias=None, activation=None, out_dtype=None, alpha=1.0):
    shape, out_dtype = _validate(a, b, bias, activation, out_dtype)
    return a.new_empty(shape, dtype=out_dtype)


def _setup_context(ctx, inputs, output):
    a, b, bias, activation, _, alpha = inputs
    ctx.activation = activation
    ctx.alpha = alpha
    ctx.save_for_backward(a, b, bias)


def _backward(ctx, grad):
    """dA = alpha dZ @ B^T and dB = alpha A^T @ dZ through the same op (transposed views, no
    copies; alpha rides in the epilogue).

    With an activation, dZ = grad * act'(Z) needs the pre-activation Z = alpha A @ B + bias,
    which is recomputed in fp32 rather than stored: one more GEMM instead of an (M, N) buffer.
    """
    a, b, bias = ctx.saved_tensors
    alpha = ctx.alpha
    if ctx.activation is not None:
        pre = torch.ops.cute.gemm(a, b, bias, None, reference._acc_dtype(a.dtype), alpha)
        grad = reference.activation_backward(ctx.activation, grad.to(pre.dtype), pre)
    grad = grad.to(a.dtype)
    # trailing arguments left at their defaults have no entry in needs_input_grad
    need_a, need_b, need_bias = (*ctx.needs_input_grad, False, False)[:3]
    grad_a = torch.ops.cute.gemm(grad, b.mT, alpha=alpha) if need_a else None
    grad_b = torch.ops.cute.gemm(a.mT, grad, alpha=alpha) if need_b else None
    grad_bias = grad.sum(dim=tuple(range(grad.dim() - 1))) if need_bias and bias is not None else None
    return grad_a, grad_b, grad_bias, None, None, None


torch.library.register_autograd(qualname("gemm"), _backward, setup_context=_setup_context, lib=lib)
