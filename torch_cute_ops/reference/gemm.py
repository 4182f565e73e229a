"""Plain-PyTorch GEMM with a fused epilogue: the semantics every gemm kernel must reproduce.

Accumulates in float32 (float64 for float64 inputs), scales by alpha, adds the bias and
applies the activation in that precision, then rounds once to the output dtype, as the
kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "relu": torch.relu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
         out_dtype: torch.dtype, alpha: float = 1.0) -> torch.Tensor:
    acc = _acc_dtype(a.dtype)
    out = torch.matmul(a.to(acc), b.to(acc))
    if alpha != 1.0:
        out = out * alpha
    if bias is not None:
        out = out + bias.to(acc)
    if activation is not None:
        out = ACTIVATIONS[activation](out)
    return out.to(out_dtype)


def activation_backward(activation: str, grad: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """d activation(pre) / d pre, times ``grad`` (both in the accumulation dtype)."""
    if activation == "relu":
        return torch.where(pre > 0, grad, torch.zeros_like(grad))
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, pre, approximate="tanh")
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, pre)
    raise ValueError(f"activation: unknown {activation!r}")
