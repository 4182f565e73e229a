"""CuTe DSL device code: one kernel family per file per architecture.

Every family module exposes ``build(spec) -> (jit_fn, fake_args)``: a ``@cute.jit`` host
function and the fake arguments (``cute.sym_int`` shapes, a TVM-FFI env stream) to compile
it with. Which variants exist, and everything that runs per call, lives in the DSL-free
``torch_cute_ops.runtime``; this package is imported only to compile a variant.
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path

from ..runtime.spec import KernelSpec

COMPILE_OPTIONS = "--enable-tvm-ffi"

# The DSL warns about every ``range_constexpr`` loop of 64+ iterations. Ours walk register
# fragments (64-192 values) with trace-time indices on purpose: their bodies branch on, key
# dicts by, or vectorize with the Python index, and ``cutlass.range(..., unroll_full=True)``
# changed the PTX (split-KV partial stores lost their 8-byte vectors). Only that message, only
# from our kernel modules, is silenced.
_STATIC_LOOP_WARNING = dict(message=r"This static loop has \d+ iterations", module=r"torch_cute_ops\.kernels\.")

# family name -> module that defines build(spec)
FAMILY_MODULES = {
    "gemm_sm90": "torch_cute_ops.kernels.sm90.gemm",
    "gemm_sm100": "torch_cute_ops.kernels.sm100.gemm",
    "flash_fwd_sm90": "torch_cute_ops.kernels.sm90.flash_fwd",
    "flash_bwd_sm90": "torch_cute_ops.kernels.sm90.flash_bwd",
}


def build(spec: KernelSpec):
    """``(jit_fn, fake_args)`` of one variant (imports the CuTe DSL)."""
    return importlib.import_module(FAMILY_MODULES[spec.family]).build(spec)


def compile_spec(spec: KernelSpec, dump_dir: str | os.PathLike | None = None):
    """Compile one variant now, with no cache. With ``dump_dir``, keep its PTX and cubin there."""
    import cutlass.cute as cute

    jit_fn, fake_args = build(spec)
    options = f"{COMPILE_OPTIONS} --gpu-arch={spec.arch}"
    if dump_dir is not None:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        options += f" --keep-ptx --keep-cubin --dump-dir={Path(dump_dir).resolve()}"
    from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DSLOptimizationWarning, **_STATIC_LOOP_WARNING)
        return cute.compile(jit_fn, *fake_args, options=options)
