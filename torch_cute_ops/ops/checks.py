"""Input validation shared by the ops: every message names the argument and what was expected.

Two kinds of checks:

* ``require_*``: the inputs are invalid for the op itself (wrong dtype, rank, shape, mixed
  devices). They raise before anything launches, on every device and under fake tensors.
* ``tma_reason``: the inputs are valid but a TMA-based kernel cannot address them (a leading
  stride that is not 16-byte aligned, a misaligned base pointer). The op then falls back to
  the reference (``fallback.note``), which strict mode turns into an error with this text.
"""

from __future__ import annotations

from typing import Sequence

import torch

TMA_ALIGN_BYTES = 16


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


def require_dim(name: str, t: torch.Tensor, dim: int, expected, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{name}: expected size {expected} at dim {dim} ({what}), "
                         f"got shape {tuple(t.shape)}")


def tma_reason(name: str, t: torch.Tensor, contiguous_dims: Sequence[int]) -> str | None:
    """Why a TMA cannot load ``t`` whose unit-stride dim is one of ``contiguous_dims``, or None.

    The TMA needs one dim of stride 1, every other stride a multiple of 16 bytes, and a
    16-byte-aligned base address. Sizes of 1 carry no stride constraint.
    """
    size = t.element_size()
    unit = [d for d in contiguous_dims if t.stride(d) == 1 or t.shape[d] == 1]
    if not unit:
        dims = " or ".join(str(d) for d in contiguous_dims)
        return (f"{name}: the TMA needs stride 1 on dim {dims}, got strides {tuple(t.stride())}")
    unit_dim = unit[0]
    for d in range(t.dim()):
        if d != unit_dim and t.shape[d] > 1 and (t.stride(d) * size) % TMA_ALIGN_BYTES:
            return (f"{name}: stride {t.stride(d)} of dim {d} is {t.stride(d) * size} bytes, the TMA "
                    f"needs a multiple of {TMA_ALIGN_BYTES} bytes (pad the leading dimension)")
    if not _is_fake(t) and t.data_ptr() % TMA_ALIGN_BYTES:
        return f"{name}: data pointer is not {TMA_ALIGN_BYTES}-byte aligned (storage offset {t.storage_offset()})"
    return None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.device.type == "meta"
