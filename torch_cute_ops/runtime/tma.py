"""What the TMA needs of a global tensor, checked on the host before any launch (torch only)."""

from __future__ import annotations

from typing import Sequence

import torch

TMA_ALIGN_BYTES = 16


def tma_reason(name: str, t: torch.Tensor, contiguous_dims: Sequence[int], check_pointer: bool = True) -> str | None:
    """Why a TMA cannot address ``t`` whose unit-stride dim is one of ``contiguous_dims``, or None.

    The TMA needs one dim of stride 1, every other stride a multiple of 16 bytes (size-1 dims
    too: the tensor map encodes every stride), and a 16-byte-aligned base address. Kernels that
    take views with odd strides on size-1 dims normalise them first (``runtime.gemm.operand_strides``).
    ``check_pointer=False`` leaves the base address to a per-call check (layout plans).
    """
    size = t.element_size()
    unit = [d for d in contiguous_dims if t.stride(d) == 1 or t.shape[d] == 1]
    if not unit:
        dims = " or ".join(str(d) for d in contiguous_dims)
        return f"{name}: the TMA needs stride 1 on dim {dims}, got strides {tuple(t.stride())}"
    unit_dim = unit[0]
    for d, stride in enumerate(t.stride()):
        if d != unit_dim and (stride * size) % TMA_ALIGN_BYTES:
            return (f"{name}: stride {stride} of dim {d} is {stride * size} bytes, the TMA "
                    f"needs a multiple of {TMA_ALIGN_BYTES} bytes (pad the leading dimension)")
    if check_pointer and t.device.type != "meta" and t.data_ptr() % TMA_ALIGN_BYTES:
        return f"{name}: data pointer is not {TMA_ALIGN_BYTES}-byte aligned (storage offset {t.storage_offset()})"
    return None


def tma_inner_ready(t: torch.Tensor, inner: int) -> bool:
    """Whether a kernel compiled for dim ``inner`` of stride 1 can take ``t`` as it is:
    ``tma_reason``'s rule, with that dim's stride 1 even where its size is 1."""
    inner %= t.dim()
    return t.stride(inner) == 1 and tma_reason("", t, (inner,)) is None


def tma_inner_layout(t: torch.Tensor, inner: int) -> torch.Tensor:
    """A copy of ``t`` with dim ``inner`` contiguous and padded to 16 bytes, the other dims outer
    in their order (a view of the padded buffer, of ``t``'s shape): ``tma_inner_ready``. Plain
    tensor ops, so it traces under torch.compile."""
    inner %= t.dim()
    order = [d for d in range(t.dim()) if d != inner] + [inner]
    padded = [t.shape[d] for d in order]
    per_16b = TMA_ALIGN_BYTES // t.element_size()
    padded[-1] = -(-padded[-1] // per_16b) * per_16b
    buffer = t.new_empty(padded)[..., :t.shape[inner]]
    buffer.copy_(t.permute(order))
    return buffer.permute([order.index(d) for d in range(t.dim())])
