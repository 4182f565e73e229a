"""The DSL-free host side of the kernels: variants, caches and prebuilt libraries, launches.

Nothing here imports the CuTe DSL: a process whose kernels are prebuilt (``aot``) or cached
on disk loads them as shared libraries through TVM-FFI and launches them with plain torch
tensors. ``torch_cute_ops.kernels`` (the device code) is imported only to compile a variant.
"""

from __future__ import annotations

from .spec import ARCHES, KernelSpec


def shipped_specs(arch: str, family: str | None = None) -> list[KernelSpec]:
    """The variants the package ships for ``arch`` (prebuilt by ``aot``, listed by ``compile``);
    ``family`` filters by family name or prefix (``gemm``, ``flash_fwd_sm90``)."""
    from . import attention, gemm, grouped_gemm

    specs = [*gemm.SM90.shipped(), *gemm.SM100.shipped(), *grouped_gemm.SM90.shipped(), *attention.shipped(arch)]
    return [s for s in specs if s.arch == arch
            and (family is None or s.family == family or s.family.startswith(family + "_"))]


__all__ = ["ARCHES", "KernelSpec", "shipped_specs"]
