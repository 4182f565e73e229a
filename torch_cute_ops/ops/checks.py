"""Input validation shared by the ops: every message names the argument and what was expected.

Two kinds of checks:

* ``require_*``: the inputs are invalid for the op itself (wrong dtype, rank, shape, mixed
  devices). They raise before anything launches, on every device and under fake tensors.
* ``runtime.tma.tma_reason`` (used by the launch plans of ``torch_cute_ops.runtime``): the inputs
  are valid but a TMA-based kernel cannot address them (a leading stride that is not 16-byte
  aligned, a misaligned base pointer). The op then falls back to the reference
  (``fallback.note``), which strict mode turns into an error with that text.
"""

from __future__ import annotations

from typing import Sequence

import torch


def require_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name}: expected dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")


def require_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {t.dtype}")


def require_rank(name: str, t: torch.Tensor, ranks: Sequence[int], layout: str) -> None:
    if t.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name}: expected a {want}-d tensor {layout}, got shape {tuple(t.shape)}")


def require_same_device(named: Sequence[tuple[str, torch.Tensor | None]]) -> None:
    first_name, first = named[0]
    for name, t in named[1:]:
        if t is not None and t.device != first.device:
            raise ValueError(f"{name}: expected device {first.device} (the device of {first_name}), "
                             f"got {t.device}")


def require_epilogue(bias: torch.Tensor | None, n: int, activation: str | None, activations) -> None:
    """A GEMM epilogue's bias (N,) and activation name (the bias dtype is each op's to check)."""
    if bias is not None:
        require_rank("bias", bias, (1,), "(N,)")
        require_dim("bias", bias, 0, n, "N, the last dim of b")
    if activation is not None and activation not in activations:
        raise ValueError(f"activation: expected None or one of {tuple(activations)}, got {activation!r}")


def require_dim(name: str, t: torch.Tensor, dim: int, expected, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{name}: expected size {expected} at dim {dim} ({what}), "
                         f"got shape {tuple(t.shape)}")
