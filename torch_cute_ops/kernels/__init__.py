"""CuTe DSL kernels, one family per file per architecture.

Every family module exposes ``FAMILY``, a :class:`KernelFamily`:

* ``shipped(arch)`` lists the :class:`KernelSpec` variants the package ships for an
  arch (what ``python -m torch_cute_ops compile`` builds and what pre-warms caches);
* ``build(spec)`` returns ``(jit_fn, fake_args)``: a ``@cute.jit`` host function and
  the fake arguments (``cute.sym_int`` shapes, a TVM-FFI env stream) to compile it
  with. ``compile_cache`` owns the ``cute.compile`` call.

Families are imported lazily so that ``import torch_cute_ops`` never imports the DSL.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .common.compile_cache import KernelSpec

# family name -> module that defines FAMILY
_FAMILY_MODULES = {
    "gemm_sm90": "torch_cute_ops.kernels.sm90.gemm",
    "gemm_sm100": "torch_cute_ops.kernels.sm100.gemm",
    "flash_fwd_sm90": "torch_cute_ops.kernels.sm90.flash_fwd",
    "flash_bwd_sm90": "torch_cute_ops.kernels.sm90.flash_bwd",
}


@dataclass(frozen=True)
class KernelFamily:
    name: str
    arch: str
    shipped: Callable[[str], Iterable[KernelSpec]]
    build: Callable[[KernelSpec], tuple[Callable, tuple[Any, ...]]]


def available_families() -> dict[str, KernelFamily]:
    """Every family the package ships (imports the CuTe DSL)."""
    return {name: importlib.import_module(module).FAMILY for name, module in _FAMILY_MODULES.items()}


def family_of(spec: KernelSpec) -> KernelFamily:
    return importlib.import_module(_FAMILY_MODULES[spec.family]).FAMILY


def shipped_specs(arch: str, family: str | None = None) -> list[KernelSpec]:
    specs = []
    for name, fam in available_families().items():
        if fam.arch == arch and (family is None or name == family or name.startswith(family + "_")):
            specs.extend(fam.shipped(arch))
    return specs
