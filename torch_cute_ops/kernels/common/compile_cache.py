"""Compile CuTe DSL kernels once per code-changing key, never per size.

A kernel variant is named by a :class:`KernelSpec`: its family, the target arch and
the parameters that change the generated code (dtypes, majorness, flags, tile
config). Sizes never enter the spec: every family builds its fake arguments from
``cute.sym_int`` shapes, so one compiled function serves any batch, sequence length
or M/N/K.

Two cache levels:

* in memory, a dict from spec to the TVM-FFI callable;
* on disk (``TORCH_CUTE_OPS_CACHE_DIR``, default ``~/.cache/torch_cute_ops``), the
  host+device object exported with ``export_to_c`` and reloaded with
  ``cute.runtime.load_module``, so a new process skips the DSL compile.

Compiles never run under FakeTensorMode or while torch.compile traces: the op layer
only calls :func:`get_compiled` from real-tensor implementations, and
:func:`get_compiled` refuses otherwise.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

COMPILE_OPTIONS = "--enable-tvm-ffi"
ARCHES = ("sm_90a", "sm_100a")


@dataclass(frozen=True)
class KernelSpec:
    """Everything that changes the code of one kernel variant (never sizes)."""

    family: str
    arch: str
    params: tuple[tuple[str, Any], ...]

    @staticmethod
    def make(family: str, arch: str, **params: Any) -> "KernelSpec":
        if arch not in ARCHES:
            raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
        return KernelSpec(family, arch, tuple(sorted(params.items())))

    def __getitem__(self, name: str) -> Any:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(name)

    @property
    def name(self) -> str:
        """A readable, file-name-safe name: ``gemm_sm90a_a=bf16_..._tile=128x256``."""
        parts = [self.family, self.arch.replace("_", "")]
        for key, value in self.params:
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, (tuple, list)):
                value = "x".join(str(v) for v in value)
            parts.append(f"{key}={value}")
        return re.sub(r"[^A-Za-z0-9_.=x-]", "-", "_".join(parts))

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0


stats = CacheStats()
_memory: dict[KernelSpec, Callable] = {}
_lock = threading.Lock()


def cache_dir() -> Path | None:
    """The on-disk cache folder, or None when ``TORCH_CUTE_OPS_CACHE_DIR`` is ``off``."""
    value = os.environ.get("TORCH_CUTE_OPS_CACHE_DIR", "")
    if value.lower() in ("0", "off", "none", "false"):
        return None
    return Path(value) if value else Path.home() / ".cache" / "torch_cute_ops"


def _dsl_fingerprint() -> str:
    import cutlass

    from ... import __version__

    return f"cutlass-dsl-{cutlass.__version__}_torch-cute-ops-{__version__}"


def compile_spec(spec: KernelSpec, dump_dir: str | os.PathLike | None = None):
    """Compile one variant now (no cache). With ``dump_dir``, keep its PTX and cubin there."""
    import cutlass.cute as cute

    from .. import family_of

    jit_fn, fake_args = family_of(spec).build(spec)
    options = f"{COMPILE_OPTIONS} --gpu-arch={spec.arch}"
    if dump_dir is not None:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        options += f" --keep-ptx --keep-cubin --dump-dir={Path(dump_dir).resolve()}"
    return cute.compile(jit_fn, *fake_args, options=options)


def _refuse_while_tracing() -> None:
    import torch

    if torch.compiler.is_compiling():
        raise RuntimeError("torch_cute_ops: kernels are never compiled while torch.compile traces")
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None:
        raise RuntimeError("torch_cute_ops: kernels are never compiled under FakeTensorMode")


def _disk_paths(spec: KernelSpec) -> tuple[Path, str] | None:
    root = cache_dir()
    if root is None:
        return None
    symbol = f"tco_{spec.digest}"
    return root / _dsl_fingerprint() / f"{spec.name[:120]}-{spec.digest}.o", symbol


def _load_from_disk(spec: KernelSpec) -> Callable | None:
    paths = _disk_paths(spec)
    if paths is None or not paths[0].exists():
        return None
    import cutlass.cute as cute

    start = time.perf_counter()
    try:
        module = cute.runtime.load_module(str(paths[0]), enable_tvm_ffi=True)
        fn = getattr(module, paths[1])
    except Exception:  # a stale or truncated file: recompile and overwrite it
        return None
    fn._tco_module = module  # keep the JIT engine alive as long as the function
    stats.load_seconds += time.perf_counter() - start
    stats.disk_hits += 1
    return fn


def store_to_disk(spec: KernelSpec, compiled) -> None:
    """Export a compiled variant to the on-disk cache (a no-op when the cache is off)."""
    paths = _disk_paths(spec)
    if paths is None:
        return
    path, symbol = paths
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.o")
    compiled.export_to_c(str(tmp), function_name=symbol)
    os.replace(tmp, path)  # atomic: concurrent processes never read half a file


def get_compiled(spec: KernelSpec) -> Callable:
    """The callable for ``spec``: from memory, else from disk, else compiled now."""
    fn = _memory.get(spec)
    if fn is not None:
        stats.memory_hits += 1
        return fn
    _refuse_while_tracing()
    with _lock:
        fn = _memory.get(spec)
        if fn is None:
            fn = _load_from_disk(spec)
        if fn is None:
            start = time.perf_counter()
            fn = compile_spec(spec)
            stats.compile_seconds += time.perf_counter() - start
            stats.compiles += 1
            try:
                store_to_disk(spec, fn)
            except OSError:
                pass  # a read-only cache folder costs only the next process a compile
        _memory[spec] = fn
    return fn


def clear_memory_cache() -> None:
    _memory.clear()
