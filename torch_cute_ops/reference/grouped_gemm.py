"""Plain-PyTorch grouped GEMMs: the semantics the grouped kernels reproduce, one GEMM per group.

``torch._grouped_mm``'s four forms (``offs`` int32 cumulative group ends, group ``g`` owning
``offs[g - 1]:offs[g]`` of the jagged dim, ``offs[-1] = 0`` before the first):

* 2D x 3D: a (M, K) rows grouped, b (G, K, N) -> (M, N);
* 3D x 3D: batched, a (G, M, K), b (G, K, N) -> (G, M, N), no offs;
* 2D x 2D: the contraction dim grouped, a (M, K), b (K, N) -> (G, M, N) (a weight's gradient);
* 3D x 2D: b's columns grouped, a (G, M, K), b (K, N) -> (M, N).

Where torch leaves the rows (columns) past ``offs[-1]`` unwritten, these functions and the kernels
write zeros, so that a gradient through them is defined. ``bias`` (G, N) adds group ``g``'s row
to its outputs (the forms with a 3-D b). Accumulates in float32 (float64 for float64 inputs),
rounds once to ``out_dtype``.

The loop reads ``offs`` on the host: it is the reference and the fallback, never the kernel path.
"""

from __future__ import annotations

import torch

from .gemm import _acc_dtype


def group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, bias: torch.Tensor | None,
               out_dtype: torch.dtype, acc: torch.dtype | None = None) -> torch.Tensor:
    acc = acc or _acc_dtype(a.dtype)
    a, b = a.to(acc), b.to(acc)
    if a.dim() == 3 and b.dim() == 3:
        out = torch.bmm(a, b)
        if bias is not None:
            out = out + bias.to(acc)[:, None, :]
        return out.to(out_dtype)
    bounds = group_bounds(offs)
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for g, (start, end) in enumerate(bounds):
            out[start:end] = a[start:end] @ b[g] + (0 if bias is None else bias[g].to(acc))
    elif a.dim() == 2:  # 2D x 2D: K grouped
        out = a.new_zeros(len(bounds), a.shape[0], b.shape[1])
        for g, (start, end) in enumerate(bounds):
            out[g] = a[:, start:end] @ b[start:end]
    else:  # 3D x 2D: b's columns grouped
        out = a.new_zeros(a.shape[1], b.shape[1])
        for g, (start, end) in enumerate(bounds):
            out[:, start:end] = a[g] @ b[:, start:end]
    return out.to(out_dtype)


def grouped_mm_masked(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, out_dtype: torch.dtype,
                      acc: torch.dtype | None = None) -> torch.Tensor:
    """DeepGEMM's masked layout: a (G, capacity, K), b (G, K, N), group g's first ``counts[g]``
    rows are real; out (G, capacity, N) with the rows past each count zero here (the kernel
    leaves them unwritten)."""
    acc = acc or _acc_dtype(a.dtype)
    out = torch.bmm(a.to(acc), b.to(acc))
    rows = torch.arange(a.shape[1], device=a.device)
    out = out * (rows[None, :, None] < counts.to(rows.dtype)[:, None, None])
    return out.to(out_dtype)


def swiglu(pre: torch.Tensor, layout: str, activation: str = "swiglu", alpha: float = 1.702,
           limit: float = 7.0) -> torch.Tensor:
    """The gated activation of a fused gate/up projection's (.., 2H) pre-activation: gate and up
    columns concatenated (``layout="concat"``: [gate | up]) or interleaved (gpt-oss: gate at even
    columns, up at odd ones). ``"swiglu"``: silu(gate) * up; ``"swiglu_oai"`` (gpt-oss): gate
    clamped above at ``limit``, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = split_gate_up(pre, layout)
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def split_gate_up(pre: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "interleaved":
        return pre[..., 0::2], pre[..., 1::2]
    half = pre.shape[-1] // 2
    return pre[..., :half], pre[..., half:]


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 2D x 3D with rowwise scales (``torch._scaled_grouped_mm``'s): a (M, K) with scale_a (M,)
    per row, b (G, K, N) with scale_b (G, N) per group and column; dequantized in fp32."""
    a32 = a.to(torch.float32) * scale_a.to(torch.float32)[:, None]
    b32 = b.to(torch.float32) * scale_b.to(torch.float32)[:, None, :]
    return grouped_mm(a32, b32, offs, None, out_dtype, torch.float32)
