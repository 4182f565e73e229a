"""FP8 quantization for :func:`torch_cute_ops.scaled_mm`: a bf16/fp16/fp32 tensor to float8 values
and the fp32 scales of one of the three scale modes (``value = stored * scale``).

Each scale is ``amax / max_finite`` of its group (the whole tensor, a row of a / a column of b,
a 1 x 128 block of a, a 128 x 128 block of b), so the group's largest magnitude maps to the
format's largest finite value; stored values are rounded to nearest and saturated there (a
value past it after rounding of the scale never becomes inf). All-zero groups get scale 1.
Plain tensor ops: they trace under ``torch.compile`` without graph breaks.
"""

from __future__ import annotations

import torch

from .reference.scaled_gemm import BLOCK, FP8_DTYPES
from .runtime.tma import tma_inner_layout


def _fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)


def _check_input(x: torch.Tensor, rank: tuple[int, ...]) -> None:
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise TypeError(f"x: expected a bf16, fp16 or fp32 tensor, got {x.dtype}")
    if x.dim() not in rank:
        raise ValueError(f"x: expected a {' or '.join(map(str, rank))}-d tensor, got shape {tuple(x.shape)}")


def _amax(x: torch.Tensor, dims) -> torch.Tensor:
    """The largest |x| over ``dims`` (all of them when None), keeping them; 0 (a scale of 1) for
    an empty group, where ``amax`` itself refuses to reduce."""
    dims = tuple(range(x.dim())) if dims is None else dims
    if all(x.shape[d] for d in dims):
        return x.abs().amax(dim=dims, keepdim=True)
    return x.new_zeros([1 if d in dims or d - x.dim() in dims else n for d, n in enumerate(x.shape)])


def _k_major(stored: torch.Tensor, operand: str) -> torch.Tensor:
    """a (.., M, K) row-major, b (.., K, N) column-major: the K-major layouts scaled_mm needs (a
    copy only if the stored values, which follow the input's strides, are not)."""
    if stored.dim() < 2:
        return stored
    if operand == "a":
        return stored if stored.stride(-1) == 1 else stored.contiguous()
    return stored if stored.stride(-2) == 1 else stored.mT.contiguous().mT


def _quantize(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, expand,
              operand: str = "a") -> tuple[torch.Tensor, torch.Tensor]:
    if operand not in ("a", "b"):
        raise ValueError(f"operand: expected 'a' or 'b', got {operand!r}")
    top = _fp8_max(dtype)
    amax = amax.to(torch.float32)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    stored = (x.to(torch.float32) / expand(scale)).clamp(-top, top).to(dtype)
    return _k_major(stored, operand), scale


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, operand: str = "a"):
    """One scale for the whole tensor: (stored, scale of shape ()), laid out K-major for
    ``operand`` ("a": row-major, "b": column-major), as scaled_mm takes it."""
    _check_input(x, (1, 2, 3))
    return _quantize(x, _amax(x, None).reshape(()), dtype, lambda s: s, operand)


def quantize_rowwise(x: torch.Tensor, operand: str = "a", dtype: torch.dtype = torch.float8_e4m3fn):
    """Per row of a ((.., M, K) -> scale (.., M, 1)) or per column of b ((.., K, N) -> (.., 1, N)):
    the scales that scaled_mm's "row" mode takes, laid out K-major (a row-major, b column-major)."""
    _check_input(x, (2, 3))
    if operand not in ("a", "b"):
        raise ValueError(f"operand: expected 'a' or 'b', got {operand!r}")
    dim = {"a": -1, "b": -2}[operand]
    return _quantize(x, _amax(x, (dim,)), dtype, lambda s: s, operand)


def quantize_blockwise(x: torch.Tensor, operand: str = "a", dtype: torch.dtype = torch.float8_e4m3fn):
    """DeepSeek-V3's blocks: a (.., M, K) per 1 x 128 block -> scale (.., M, K / 128); b (.., K, N)
    per 128 x 128 block -> (.., K / 128, N / 128). K must be a multiple of 128; M and N may end
    in a partial block. Values laid out K-major (a row-major, b column-major); the scales M-major
    for a (as torch._scaled_mm's 1 x 128 scales), N-major for b, padded to 16 bytes: the layout
    the Hopper kernel loads them in (``runtime.tma.tma_inner_layout``)."""
    _check_input(x, (2, 3))
    if operand not in ("a", "b"):
        raise ValueError(f"operand: expected 'a' or 'b', got {operand!r}")
    k = x.shape[-1] if operand == "a" else x.shape[-2]
    if k % BLOCK:
        raise ValueError(f"x: blockwise scales need K (dim {-1 if operand == 'a' else -2}) a multiple of "
                         f"{BLOCK}, got shape {tuple(x.shape)}")
    if operand == "a":
        groups = x.unflatten(-1, (k // BLOCK, BLOCK))
        amax = _amax(groups, (-1,)).squeeze(-1)
        stored, scale = _quantize(x, amax, dtype, lambda s: s.repeat_interleave(BLOCK, dim=-1))
        return stored, tma_inner_layout(scale, -2)
    n = x.shape[-1]
    pad = -n % BLOCK
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    groups = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (k // BLOCK, BLOCK))  # (.., Kb, 128, Nb, 128)
    amax = _amax(groups, (-3, -1)).squeeze(-1).squeeze(-2)

    def expand(s):
        return s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :n]

    stored, scale = _quantize(x, amax, dtype, expand, "b")
    return stored, tma_inner_layout(scale, -1)


# ------------------------------------------------------------------------------ FP8 training

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Fp8Linear(torch.autograd.Function):
    """y = x @ w.T + bias with all three GEMMs of a linear layer in FP8 (dynamic rowwise or
    per-tensor scaling, the recipe of torchao's float8 training): x and w in e4m3 for the forward,
    the output gradient in e5m2 (its range) for dx = dy @ w and dw = dy.T @ x. Each operand is
    quantized along the dim its GEMM contracts, so every scale is a per-row / per-column one."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling):
        from .functional import scaled_mm

        quantize = quantize_rowwise if scaling == "row" else _tensorwise
        (qx, sx), (qw, sw) = quantize(x, "a", E4M3), quantize(weight.t(), "b", E4M3)
        ctx.save_for_backward(x, weight)
        ctx.scaling, ctx.bias_dtype = scaling, None if bias is None else bias.dtype
        return scaled_mm(qx, qw, sx, sw, bias, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        from .functional import scaled_mm

        x, weight = ctx.saved_tensors
        quantize = quantize_rowwise if ctx.scaling == "row" else _tensorwise
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:  # dx (M, K) = dy (M, N) @ w (N, K): contracts N
            (qg, sg), (qw, sw) = quantize(grad, "a", E5M2), quantize(weight, "b", E4M3)
            grad_x = scaled_mm(qg, qw, sg, sw, out_dtype=x.dtype)
        if ctx.needs_input_grad[1]:  # dw (N, K) = dy.T (N, M) @ x (M, K): contracts M
            (qg, sg), (qx, sx) = quantize(grad.t(), "a", E5M2), quantize(x, "b", E4M3)
            grad_w = scaled_mm(qg, qx, sg, sx, out_dtype=weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_bias, None


def _tensorwise(x: torch.Tensor, operand: str, dtype: torch.dtype):
    return quantize_tensorwise(x, dtype, operand)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scaling: str = "row") -> torch.Tensor:
    """``input @ weight.T + bias`` (``torch.nn.functional.linear``'s contract), differentiable, with
    its forward and both backward GEMMs in FP8 through :func:`torch_cute_ops.scaled_mm`: input and
    weight quantized to e4m3, the output gradient to e5m2, each along the dim its GEMM contracts,
    ``scaling`` "row" (a scale per row / column, the default) or "tensor" (one per operand), from
    the current values at every call (dynamic scaling). Results and gradients come back in the
    input's / weight's dtype. The quantizations and the transposed copies the backward's K-major
    operands need are plain tensor ops (they trace under torch.compile)."""
    if scaling not in ("row", "tensor"):
        raise ValueError(f"scaling: expected 'row' or 'tensor', got {scaling!r}")
    for name, t in (("input", input), ("weight", weight)):  # the dtypes scaled_mm returns results and grads in
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name}: expected a bf16, fp16 or fp32 tensor, got {t.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-d tensor (out_features, in_features), got shape {tuple(weight.shape)}")
    if input.dim() == 0 or input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input: expected last dim {weight.shape[1]} (in_features of weight), "
                         f"got shape {tuple(input.shape)}")
    lead = input.shape[:-1]
    out = _Fp8Linear.apply(input.reshape(lead.numel(), input.shape[-1]), weight, bias, scaling)
    return out.view(*lead, weight.shape[0])


class Fp8Linear(torch.nn.Linear):
    """``nn.Linear`` that trains and runs through :func:`linear` (FP8 GEMMs, dynamic scaling); its
    parameters stay in their own dtype (the master weights)."""

    scaling: str = "row"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.scaling}"


def convert_linears(model: torch.nn.Module, scaling: str = "row", module_filter=None) -> torch.nn.Module:
    """Swap, in place, every ``nn.Linear`` of ``model`` (exactly that class, so subclasses with
    their own forward are left alone) for an :class:`Fp8Linear` sharing its parameters, where
    ``module_filter(name, module)`` allows it (default: every one). Returns ``model``.

    The FP8 kernel needs in_features and out_features multiples of 16 (16-byte rows of FP8
    operands); layers that are not keep running, on the reference path (counted as fallbacks), so
    such layers, and usually the output head, are better left out with ``module_filter``."""
    if scaling not in ("row", "tensor"):
        raise ValueError(f"scaling: expected 'row' or 'tensor', got {scaling!r}")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full_name = f"{name}.{child_name}" if name else child_name
            if type(child) is not torch.nn.Linear or (module_filter and not module_filter(full_name, child)):
                continue
            swapped = Fp8Linear.__new__(Fp8Linear)
            swapped.__dict__.update(child.__dict__)  # the same parameters, hooks and flags
            swapped.scaling = scaling
            setattr(module, child_name, swapped)
    return model
