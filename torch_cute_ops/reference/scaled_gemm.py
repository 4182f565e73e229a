"""Plain-PyTorch scaled (FP8) matmul: the semantics every FP8 GEMM kernel must reproduce.

``out = act(dequant(a) @ dequant(b) + bias)`` in fp32, rounded once to ``out_dtype``, where a
(M, K) / (L, M, K) and b (K, N) / (L, K, N) are float8 (e4m3fn or e5m2) and the fp32 scales
say what each stored value stands for (``value = stored * scale``). Three scale modes, told
apart by the scales' shapes (both operands in the same mode):

* ``"tensor"``: one scale each (any shape of one element), torch._scaled_mm's per-tensor case;
* ``"row"``: scale_a (M, 1) per row of a, scale_b (1, N) per column of b ([L,] leading);
* ``"block"``: scale_a (M, K / 128) per 1 x 128 block of a, scale_b (K / 128, N / 128) per
  128 x 128 block of b, as DeepSeek-V3 and DeepGEMM define them (K a multiple of 128; N may end
  in a partial block).
"""

from __future__ import annotations

import torch

from .gemm import ACTIVATIONS

BLOCK = 128  # the block edge of blockwise scales
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MODES = ("tensor", "row", "block")


def scale_mode(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> str | None:
    """The scale mode the scales' shapes describe, or None when they describe none."""
    lead = tuple(a.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensor"
    if tuple(scale_a.shape) == (*lead, m, 1) and tuple(scale_b.shape) == (*lead, 1, n):
        return "row"
    blocks_k, blocks_n = -(-k // BLOCK), -(-n // BLOCK)
    if tuple(scale_a.shape) == (*lead, m, blocks_k) and tuple(scale_b.shape) == (*lead, blocks_k, blocks_n):
        return "block"
    return None


def dequantize(x: torch.Tensor, scale: torch.Tensor, mode: str, operand: str) -> torch.Tensor:
    """fp32 values of an FP8 operand ("a": (.., M, K), "b": (.., K, N)) under its scales."""
    values = x.to(torch.float32)
    scale = scale.to(torch.float32)
    if mode == "tensor":
        return values * scale.reshape(())
    if mode == "row":
        return values * scale
    if operand == "a":  # (.., M, K / 128) -> one scale per 128 columns
        return values * scale.repeat_interleave(BLOCK, dim=-1)[..., :values.shape[-1]]
    expanded = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return values * expanded[..., :values.shape[-2], :values.shape[-1]]


def scaled_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, activation: str | None) -> torch.Tensor:
    mode = scale_mode(a, b, scale_a, scale_b)
    out = torch.matmul(dequantize(a, scale_a, mode, "a"), dequantize(b, scale_b, mode, "b"))
    if bias is not None:
        out = out + bias.to(torch.float32)
    if activation is not None:
        out = ACTIVATIONS[activation](out)
    return out.to(out_dtype)
