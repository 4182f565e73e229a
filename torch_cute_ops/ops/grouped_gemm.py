"""``cute::grouped_mm`` (``torch._grouped_mm``'s semantics) and ``cute::grouped_mm_masked``
(DeepGEMM's masked layout): validation, fake functions, dispatch and autograd.

Forms of ``grouped_mm`` (see :mod:`torch_cute_ops.reference.grouped_gemm`): 2D x 3D (rows of a
grouped by ``offs``), 3D x 3D (batched: the dense GEMM's batched kernel), 2D x 2D (K grouped,
out (G, M, N)) and 3D x 2D (b's columns grouped), which is the 2D x 3D form of the transposed
problem, out^T = b^T @ a^T, so it returns a column-major (M, N) (the fake function says so too).

``offs`` values bound the kernel's loads, so they are checked before every launch that reads
them (:mod:`.bounds`: on the host for CPU tensors, a queued device-side assertion on a GPU, no
sync): 0 <= offs[g] <= the jagged extent, non-decreasing.

Backward (same op): 2D x 3D: dA = grouped_mm(dY, b^T, offs), dB = grouped_mm(a^T, dY, offs)
(K grouped); 2D x 2D: dA = grouped_mm(dY, b^T, offs) (3D x 2D), dB = grouped_mm(a^T, dY, offs)
(2D x 3D); 3D x 2D: dA = grouped_mm(dY, b^T, offs) (2D x 2D), dB = grouped_mm(a^T, dY, offs)
(3D x 2D); 3D x 3D: batched. The pattern is the dense one: dA = dY @ b^T, dB = a^T @ dY.
"""

from __future__ import annotations

import math

import torch

from ..reference import grouped_gemm as reference
from ..reference.gemm import _acc_dtype
from ..runtime.gemm import pointer_reason
from ..runtime.unfilled import empty_output
from . import bounds, checks, dispatch, fallback
from .gemm import gemm_impl
from .schemas import lib, qualname, register_impl

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
OUTPUT_DTYPES = INPUT_DTYPES

FORMS = {(2, 3): "rows", (3, 3): "batched", (2, 2): "k", (3, 2): "cols"}


def _validate(a, b, offs, bias, out_dtype):
    """Raise on invalid inputs (shapes, dtypes, devices; not offs' values); return (form, output
    shape, out_dtype, the extent offs bounds)."""
    checks.require_rank("mat_a", a, (2, 3), "(M, K) or (G, M, K)")
    checks.require_rank("mat_b", b, (2, 3), "(K, N) or (G, K, N)")
    checks.require_dtype("mat_a", a, INPUT_DTYPES)
    checks.require_same_dtype("mat_b", b, "mat_a", a)
    checks.require_same_device([("mat_a", a), ("mat_b", b), ("offs", offs), ("bias", bias)])
    checks.require_dim("mat_b", b, -2, a.shape[-1], "K, the last dim of mat_a")
    form = FORMS[(a.dim(), b.dim())]
    if form == "batched":
        checks.require_dim("mat_b", b, 0, a.shape[0], "G, the groups of mat_a")
        if offs is not None:
            raise ValueError("offs: expected None for 3D x 3D operands (the groups are the batch)")
        groups, extent = a.shape[0], None
    else:
        if offs is None:
            raise ValueError(f"offs: expected an int32 tensor (G,) of group ends for {a.dim()}D x {b.dim()}D operands")
        checks.require_dtype("offs", offs, (torch.int32,))
        checks.require_rank("offs", offs, (1,), "(G,) of cumulative group ends")
        groups = offs.shape[0]
        if form == "rows":
            checks.require_dim("offs", offs, 0, b.shape[0], "G, the groups of mat_b")
        elif form == "cols":
            checks.require_dim("offs", offs, 0, a.shape[0], "G, the groups of mat_a")
        extent = {"rows": a.shape[0], "k": a.shape[1], "cols": b.shape[1]}[form]
    if bias is not None:
        if b.dim() != 3:
            raise NotImplementedError("bias: only the forms with a 3-D mat_b take a bias (G, N)")
        checks.require_same_dtype("bias", bias, "mat_a", a)
        checks.require_rank("bias", bias, (2,), "(G, N)")
        checks.require_dim("bias", bias, 0, groups, "G, the groups")
        checks.require_dim("bias", bias, 1, b.shape[-1], "N, the last dim of mat_b")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUTPUT_DTYPES}, got {out_dtype}")
    shape = {"rows": (a.shape[0], b.shape[-1]), "batched": (a.shape[0], a.shape[1], b.shape[-1]),
             "k": (groups, a.shape[0], b.shape[1]), "cols": (a.shape[1], b.shape[1])}[form]
    return form, shape, out_dtype, extent


def check_offs(offs: torch.Tensor, extent: int, what: str) -> None:
    """offs' values before a launch reads them: within [0, extent], non-decreasing."""
    bounds.check_within("offs", offs, 0, extent, what)
    bounds.check_nondecreasing("offs", offs)


# ------------------------------------------------------------------------------- plans

class GroupedPlan:
    __slots__ = ("form", "shape", "out_dtype", "extent", "launch", "reason")

    def __init__(self, form, shape, out_dtype, extent, launch, reason):
        self.form, self.shape, self.out_dtype, self.extent = form, shape, out_dtype, extent
        self.launch, self.reason = launch, reason


_MAX_PLANS = 4096
_plans: dict[tuple, GroupedPlan] = {}


def _host_plan(op: str, a, b, form, out_dtype, groups: int, gated=None, scale_mode=None):
    """(launch, reason) of the grouped kernel for this layout."""
    if not a.is_cuda:
        return None, None
    host = dispatch.kernel_for(op, a.device)
    if isinstance(host, str):
        return None, host
    launch = host.plan(form, tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype, out_dtype, groups,
                       dispatch.device_index(a.device), gated=gated, scale_mode=scale_mode)
    return (None, launch) if isinstance(launch, str) else (launch, None)


def _layout_key(a, b, offs, bias, out_dtype):
    return (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype,
            None if offs is None else (offs.shape, offs.dtype, offs.device),
            None if bias is None else (bias.shape, bias.stride(), bias.dtype), out_dtype)


def _plan(a, b, offs, bias, out_dtype) -> GroupedPlan:
    key = _layout_key(a, b, offs, bias, out_dtype)
    plan = _plans.get(key)
    if plan is None:
        form, shape, out_dtype, extent = _validate(a, b, offs, bias, out_dtype)
        launch = reason = None
        # no groups, or no k to reduce: the output is zeros, which the reference makes at no cost
        trivial = form in ("rows", "k") and (offs.shape[0] == 0 or extent == 0 or a.shape[-1] == 0)
        if form in ("rows", "k") and bias is None and math.prod(shape) > 0 and not trivial:
            launch, reason = _host_plan("grouped_mm", a, b, form, out_dtype, offs.shape[0])
        elif bias is not None and a.is_cuda:
            reason = "grouped_mm: no kernel adds a per-group bias yet"
        plan = GroupedPlan(form, shape, out_dtype, extent, launch, reason)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


def grouped_mm_impl(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    plan = _plan(mat_a, mat_b, offs, bias, out_dtype)
    if plan.form == "batched" and bias is None:
        return gemm_impl(mat_a, mat_b, None, None, plan.out_dtype)
    if plan.form == "cols":  # out^T = b^T @ a^T, rows grouped
        return grouped_mm_impl(mat_b.mT, mat_a.mT, offs, None, plan.out_dtype).mT
    if offs is not None:
        check_offs(offs, plan.extent, "the grouped extent of the operands")
    reason = plan.reason
    if plan.launch is not None:
        reason = pointer_reason(mat_a, mat_b, None)
        if reason is None:
            out = empty_output(plan.shape, plan.out_dtype, mat_a.device)
            plan.launch(mat_a, mat_b, offs, out)
            return out
    if reason is not None:
        fallback.note("grouped_mm", reason)
    return reference.grouped_mm(mat_a, mat_b, offs, bias, plan.out_dtype)


register_impl("grouped_mm", grouped_mm_impl)


@torch.library.register_fake(qualname("grouped_mm"), lib=lib)
def _grouped_mm_fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    form, shape, out_dtype, _ = _validate(mat_a, mat_b, offs, bias, out_dtype)
    if form == "cols":
        return mat_a.new_empty((shape[1], shape[0]), dtype=out_dtype).mT
    return mat_a.new_empty(shape, dtype=out_dtype)


def _setup_context(ctx, inputs, output):
    mat_a, mat_b, offs, bias, _ = (*inputs, None, None, None)[:5]
    ctx.has_bias = bias is not None
    ctx.save_for_backward(mat_a, mat_b, offs)


def _bias_grad(grad, offs, groups):
    """Per-group sums of the output rows (2D x 3D: rows grouped; 3D x 3D: per batch)."""
    acc = grad.to(_acc_dtype(grad.dtype))
    if grad.dim() == 3:
        return acc.sum(1)
    rows = torch.arange(grad.shape[0], device=grad.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)  # past offs[-1]: G, dropped below
    sums = acc.new_zeros(groups + 1, grad.shape[1]).index_add_(0, group, acc)
    return sums[:groups]


def _backward(ctx, grad):
    """dA = dY @ b^T and dB = a^T @ dY through the same op (transposed views: each form's
    gradients are the forms listed in the module docstring)."""
    mat_a, mat_b, offs = ctx.saved_tensors
    need_a, need_b, _, need_bias = (*ctx.needs_input_grad, False, False, False)[:4]
    grad = grad.to(mat_a.dtype)
    op = torch.ops.cute.grouped_mm
    grad_a = op(grad, mat_b.mT, offs) if need_a else None
    grad_b = op(mat_a.mT, grad, offs) if need_b else None
    grad_bias = None
    if need_bias and ctx.has_bias:
        grad_bias = _bias_grad(grad, offs, mat_b.shape[0]).to(mat_a.dtype)
    return grad_a, grad_b, None, grad_bias, None


torch.library.register_autograd(qualname("grouped_mm"), _backward, setup_context=_setup_context, lib=lib)


# ----------------------------------------------------------------------- masked layout

def _validate_masked(a, b, counts, out_dtype):
    checks.require_rank("a", a, (3,), "(G, capacity, K)")
    checks.require_rank("b", b, (3,), "(G, K, N)")
    checks.require_dtype("a", a, INPUT_DTYPES)
    checks.require_same_dtype("b", b, "a", a)
    checks.require_same_device([("a", a), ("b", b), ("counts", counts)])
    checks.require_dim("b", b, 0, a.shape[0], "G, the groups of a")
    checks.require_dim("b", b, 1, a.shape[2], "K, the last dim of a")
    checks.require_dtype("counts", counts, (torch.int32,))
    checks.require_rank("counts", counts, (1,), "(G,) rows per group")
    checks.require_dim("counts", counts, 0, a.shape[0], "G, the groups of a")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUTPUT_DTYPES}, got {out_dtype}")
    return (a.shape[0], a.shape[1], b.shape[2]), out_dtype


_masked_plans: dict[tuple, tuple] = {}


def grouped_mm_masked_impl(a, b, counts, out_dtype=None):
    key = _layout_key(a, b, counts, None, out_dtype)
    plan = _masked_plans.get(key)
    if plan is None:
        shape, resolved = _validate_masked(a, b, counts, out_dtype)
        launch = reason = None
        # the groups' rows seen as one (G * capacity, K) operand: a view when the batch stride allows it
        flat_ok = a.shape[0] <= 1 or a.stride(0) == a.shape[1] * a.stride(1)
        if math.prod(shape) > 0 and flat_ok:
            launch, reason = _host_plan("grouped_mm", a.reshape(-1, a.shape[2]), b, "masked", resolved, a.shape[0])
        elif a.is_cuda and not flat_ok:
            reason = "grouped_mm_masked: a's groups are not one (G * capacity, K) view"
        plan = (shape, resolved, launch, reason)
        if len(_masked_plans) >= _MAX_PLANS:
            _masked_plans.clear()
        _masked_plans[key] = plan
    shape, resolved, launch, reason = plan
    bounds.check_within("counts", counts, 0, a.shape[1], "the capacity, dim 1 of a")
    if launch is not None:
        reason = pointer_reason(a, b, None)
        if reason is None:
            out = torch.empty(shape, dtype=resolved, device=a.device)  # rows past the counts stay unwritten
            launch(a.reshape(-1, a.shape[2]), b, counts, out.view(-1, shape[2]))
            return out
    if reason is not None:
        fallback.note("grouped_mm_masked", reason)
    return reference.grouped_mm_masked(a, b, counts, resolved)


register_impl("grouped_mm_masked", grouped_mm_masked_impl)


@torch.library.register_fake(qualname("grouped_mm_masked"), lib=lib)
def _grouped_mm_masked_fake(a, b, counts, out_dtype=None):
    shape, out_dtype = _validate_masked(a, b, counts, out_dtype)
    return a.new_empty(shape, dtype=out_dtype)


# ------------------------------------------------------------------------- gated (SwiGLU)

GATED_ACTIVATIONS = ("swiglu", "swiglu_oai")
GATE_UP_LAYOUTS = ("concat", "interleaved")


def _validate_gated(a, b, offs, activation, gate_up_layout, out_dtype):
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {GATED_ACTIVATIONS}, got {activation!r}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout: expected one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    form, shape, out_dtype, extent = _validate(a, b, offs, None, out_dtype)
    if form != "rows":
        raise NotImplementedError(f"activation: {activation} needs the 2D x 3D form, got {a.dim()}D x {b.dim()}D")
    if shape[1] % 2:
        raise ValueError(f"mat_b: expected an even N (gate and up columns), got shape {tuple(b.shape)}")
    return (shape[0], shape[1] // 2), out_dtype


_gated_plans: dict[tuple, tuple] = {}


def _gated_plan(mat_a, mat_b, offs, activation, gate_up_layout, alpha, limit, out_dtype):
    key = (_layout_key(mat_a, mat_b, offs, None, out_dtype), activation, gate_up_layout, alpha, limit)
    plan = _gated_plans.get(key)
    if plan is None:
        shape, resolved = _validate_gated(mat_a, mat_b, offs, activation, gate_up_layout, out_dtype)
        launch = reason = None
        # concatenated columns fuse where b is K-major (nn.Linear's (G, 2H, K) weight transposed):
        # the TMA then loads a tile's gate and up columns side by side (kernels/sm90/gemm_grouped.py)
        k_major_b = mat_b.stride(-2) == 1 or mat_b.shape[-2] == 1
        fusable = gate_up_layout == "interleaved" or k_major_b
        if fusable and math.prod(shape) > 0 and offs.shape[0] > 0:
            launch, reason = _host_plan("grouped_mm", mat_a, mat_b, "rows", resolved, offs.shape[0],
                                        (activation, alpha, limit, gate_up_layout))
        plan = (shape, resolved, launch)
        if len(_gated_plans) >= _MAX_PLANS:
            _gated_plans.clear()
        _gated_plans[key] = plan
    return plan


def grouped_mm_swiglu_impl(mat_a, mat_b, offs, activation, gate_up_layout, alpha=1.702, limit=7.0, out_dtype=None):
    """One kernel, the activation in its epilogue on the fp32 accumulator, for interleaved gate/up
    columns and for concatenated ones of a K-major b; otherwise (and where no kernel runs) the
    grouped GEMM with an fp32 out, then the activation."""
    shape, out_dtype, launch = _gated_plan(mat_a, mat_b, offs, activation, gate_up_layout, alpha, limit, out_dtype)
    if launch is not None:
        check_offs(offs, mat_a.shape[0], "the rows of mat_a")
        if pointer_reason(mat_a, mat_b, None) is None:
            out = empty_output(shape, out_dtype, mat_a.device)
            launch(mat_a, mat_b, offs, out)
            return out
    pre = grouped_mm_impl(mat_a, mat_b, offs, None, _acc_dtype(mat_a.dtype))
    return reference.swiglu(pre, gate_up_layout, activation, alpha, limit).to(out_dtype)


register_impl("grouped_mm_swiglu", grouped_mm_swiglu_impl)


@torch.library.register_fake(qualname("grouped_mm_swiglu"), lib=lib)
def _grouped_mm_swiglu_fake(mat_a, mat_b, offs, activation, gate_up_layout, alpha=1.702, limit=7.0, out_dtype=None):
    shape, out_dtype = _validate_gated(mat_a, mat_b, offs, activation, gate_up_layout, out_dtype)
    return mat_a.new_empty(shape, dtype=out_dtype)


def _setup_gated(ctx, inputs, output):
    mat_a, mat_b, offs, activation, layout, alpha, limit, _ = (*inputs, 1.702, 7.0, None)[:8]
    ctx.gated = (activation, layout, alpha, limit)
    ctx.save_for_backward(mat_a, mat_b, offs)


def _backward_gated(ctx, grad):
    """The pre-activation is recomputed (one more grouped GEMM, fp32 out) rather than stored: an
    expert layer's (rows, 2H) buffer per layer is what MoE training is short of. The activation's
    derivative is autograd of the reference math; dA and dB are the plain grouped_mm's."""
    mat_a, mat_b, offs = ctx.saved_tensors
    activation, layout, alpha, limit = ctx.gated
    pre = torch.ops.cute.grouped_mm(mat_a, mat_b, offs, None, _acc_dtype(mat_a.dtype)).detach().requires_grad_()
    with torch.enable_grad():
        out = reference.swiglu(pre, layout, activation, alpha, limit)
        (grad_pre,) = torch.autograd.grad(out, pre, grad.to(out.dtype))
    grad_pre = grad_pre.to(mat_a.dtype)
    need_a, need_b = (*ctx.needs_input_grad, False, False)[:2]
    op = torch.ops.cute.grouped_mm
    grad_a = op(grad_pre, mat_b.mT, offs) if need_a else None
    grad_b = op(mat_a.mT, grad_pre, offs) if need_b else None
    return grad_a, grad_b, None, None, None, None, None, None


torch.library.register_autograd(qualname("grouped_mm_swiglu"), _backward_gated, setup_context=_setup_gated, lib=lib)
