"""Tensors that a kernel writes in full, made without PyTorch's deterministic fill.

Under ``torch.use_deterministic_algorithms(True)`` every tensor made by ``torch.empty`` and its
kin is first filled with NaN (integers: their maximum) while
``torch.utils.deterministic.fill_uninitialized_memory`` is on (the default), so that an op that
reads memory it never wrote still gives the same bytes every run. ATen's own ops allocate their
outputs beneath that fill. Ours go through ``torch.empty``, and their kernels overwrite every
byte: the fill is a second full write of each output and workspace, an extra ~20% on the
attention backward at S1024 (dq, dk, dv and the fp32 dQ accumulator; bench/NOTES.md, 2026-11-26,
"Deterministic cost: mostly PyTorch's fill").
"""

from __future__ import annotations

import torch


def written_in_full(make, *args, **kwargs):
    """``make(*args, **kwargs)``: tensors that a kernel overwrites in full, made with the
    deterministic fill off (and back on after, if it was on)."""
    if not (torch.are_deterministic_algorithms_enabled() and torch._C._get_deterministic_fill_uninitialized_memory()):
        return make(*args, **kwargs)
    torch._C._set_deterministic_fill_uninitialized_memory(False)
    try:
        return make(*args, **kwargs)
    finally:
        torch._C._set_deterministic_fill_uninitialized_memory(True)


def empty_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for a GEMM's output, which its kernel writes in full: the mode checked
    inline first, since these ops' host time is counted in fractions of a microsecond."""
    if torch.are_deterministic_algorithms_enabled():
        return written_in_full(torch.empty, shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
