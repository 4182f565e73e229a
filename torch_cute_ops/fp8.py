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


def _fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)


def _check_input(x: torch.Tensor, rank: tuple[int, ...]) -> None:
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise TypeError(f"x: expected a bf16, fp16 or fp32 tensor, got {x.dtype}")
    if x.dim() not in rank:
        raise ValueError(f"x: expected a {' or '.join(map(str, rank))}-d tensor, got shape {tuple(x.shape)}")


def _k_major(stored: torch.Tensor, operand: str) -> torch.Tensor:
    """b (.., K, N) in the column-major layout scaled_mm needs (a copy only if it is not)."""
    if operand == "a" or stored.dim() < 2 or stored.stride(-2) == 1:
        return stored
    return stored.mT.contiguous().mT


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
    """One scale for the whole tensor: (stored, scale of shape ()). ``operand="b"`` returns a
    (.., K, N) b column-major (K-major), as scaled_mm takes it."""
    _check_input(x, (1, 2, 3))
    return _quantize(x, x.abs().amax(), dtype, lambda s: s, operand)


def quantize_rowwise(x: torch.Tensor, operand: str = "a", dtype: torch.dtype = torch.float8_e4m3fn):
    """Per row of a ((.., M, K) -> scale (.., M, 1)) or per column of b ((.., K, N) -> (.., 1, N)):
    the scales that scaled_mm's "row" mode takes. b comes back column-major (K-major)."""
    _check_input(x, (2, 3))
    if operand not in ("a", "b"):
        raise ValueError(f"operand: expected 'a' or 'b', got {operand!r}")
    dim = {"a": -1, "b": -2}[operand]
    return _quantize(x, x.abs().amax(dim=dim, keepdim=True), dtype, lambda s: s, operand)


def quantize_blockwise(x: torch.Tensor, operand: str = "a", dtype: torch.dtype = torch.float8_e4m3fn):
    """DeepSeek-V3's blocks: a (.., M, K) per 1 x 128 block -> scale (.., M, K / 128); b (.., K, N)
    per 128 x 128 block -> (.., K / 128, N / 128). K must be a multiple of 128; M and N may end
    in a partial block. b comes back column-major (K-major)."""
    _check_input(x, (2, 3))
    if operand not in ("a", "b"):
        raise ValueError(f"operand: expected 'a' or 'b', got {operand!r}")
    k = x.shape[-1] if operand == "a" else x.shape[-2]
    if k % BLOCK:
        raise ValueError(f"x: blockwise scales need K (dim {-1 if operand == 'a' else -2}) a multiple of "
                         f"{BLOCK}, got shape {tuple(x.shape)}")
    if operand == "a":
        groups = x.unflatten(-1, (k // BLOCK, BLOCK))
        amax = groups.abs().amax(dim=-1)
        return _quantize(x, amax, dtype, lambda s: s.repeat_interleave(BLOCK, dim=-1))
    n = x.shape[-1]
    pad = -n % BLOCK
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    groups = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (k // BLOCK, BLOCK))  # (.., Kb, 128, Nb, 128)
    amax = groups.abs().amax(dim=(-3, -1))
    return _quantize(x, amax, dtype,
                     lambda s: s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :n], "b")
