"""Which kernel family serves a device: sm_90 -> Hopper, sm_100 -> Blackwell, else reference."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

# (op, arch generation) -> module with launch() and unsupported_reason()
_KERNEL_MODULES = {
    ("gemm", "sm90"): "torch_cute_ops.kernels.sm90.gemm",
    ("gemm", "sm100"): "torch_cute_ops.kernels.sm100.gemm",
    ("flash_attn_fwd", "sm90"): "torch_cute_ops.kernels.sm90.flash_fwd",
    ("flash_attn_bwd", "sm90"): "torch_cute_ops.kernels.sm90.flash_bwd",
}


def arch_of_capability(capability: tuple[int, int]) -> str | None:
    major = capability[0]
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"
    return None


@functools.cache
def _device_arch(index: int) -> str | None:
    if os.environ.get("TORCH_CUTE_OPS_DISABLE_KERNELS", "0") == "1":
        return None
    return arch_of_capability(torch.cuda.get_device_capability(index))


@functools.cache
def _kernel_module(op: str, arch: str) -> ModuleType | str:
    """The kernel module, or the reason there is none."""
    name = _KERNEL_MODULES.get((op, arch))
    if name is None:
        return f"no {op} kernel for {arch}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:  # the DSL is missing, or this kernel has not landed yet
        return f"{op} kernel for {arch} unavailable ({err})"


def kernel_for(op: str, device: torch.device) -> ModuleType | str:
    """The kernel module that serves ``op`` on ``device``, or the reason none does."""
    if device.type != "cuda":
        return f"{device.type} tensors take the reference path"
    arch = _device_arch(device.index if device.index is not None else torch.cuda.current_device())
    if arch is None:
        cap = torch.cuda.get_device_capability(device)
        return f"no kernels for compute capability {cap[0]}.{cap[1]}"
    return _kernel_module(op, arch)


def reset_cache() -> None:
    _device_arch.cache_clear()
    _kernel_module.cache_clear()
