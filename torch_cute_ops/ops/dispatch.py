"""Which kernels serve a device: sm_90 -> Hopper, sm_100 -> Blackwell, else the reference.

The hosts named here are the DSL-free launchers of ``torch_cute_ops.runtime``; importing them
never imports the CuTe DSL (a variant that is neither prebuilt nor cached compiles on first use).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

# (op, arch generation) -> (runtime module, attribute or None for the module itself)
_HOSTS = {
    ("gemm", "sm90"): ("torch_cute_ops.runtime.gemm", "SM90"),
    ("gemm", "sm100"): ("torch_cute_ops.runtime.gemm", "SM100"),
    ("grouped_mm", "sm90"): ("torch_cute_ops.runtime.grouped_gemm", "SM90"),
    ("flash_attn_fwd", "sm90"): ("torch_cute_ops.runtime.attention", None),
    ("flash_attn_bwd", "sm90"): ("torch_cute_ops.runtime.attention", None),
    ("flash_attn_varlen_fwd", "sm90"): ("torch_cute_ops.runtime.attention", None),
    ("flash_attn_varlen_bwd", "sm90"): ("torch_cute_ops.runtime.attention", None),
    ("flash_attn_kvcache", "sm90"): ("torch_cute_ops.runtime.attention", None),
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
def _host(op: str, arch: str):
    """The host launcher, or the reason there is none."""
    entry = _HOSTS.get((op, arch))
    if entry is None:
        return f"no {op} kernel for {arch}"
    module = importlib.import_module(entry[0])
    return module if entry[1] is None else getattr(module, entry[1])


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def kernel_for(op: str, device: torch.device):
    """The host launcher that serves ``op`` on ``device``, or the reason none does (a str)."""
    if device.type != "cuda":
        return f"{device.type} tensors take the reference path"
    arch = _device_arch(device_index(device))
    if arch is None:
        cap = torch.cuda.get_device_capability(device)
        return f"no kernels for compute capability {cap[0]}.{cap[1]}"
    return _host(op, arch)


def reset_cache() -> None:
    _device_arch.cache_clear()
    _host.cache_clear()
