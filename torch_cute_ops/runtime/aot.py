"""Ahead-of-time kernel libraries: every shipped variant of an arch in one shared library.

``python -m torch_cute_ops aot --arch sm_90a --out DIR`` compiles the shipped variants (no GPU
needed), exports each with a symbol named by its spec digest, links them into
``DIR/<arch>/libtorch_cute_ops_<arch>.so`` against the DSL's runtime library and TVM-FFI, and
writes ``DIR/<arch>/manifest.json``: the variants with their symbols, and what the library was
built from (package version, kernel-source fingerprint, DSL and TVM-FFI versions), which
:mod:`.cache` checks before it loads anything from it. Both files are written writable by
their owner alone (the loader refuses a manifest or library that its group or others may
write), the library under a plain name beside the manifest (the only place the loader looks).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Callable

from . import cache
from .spec import KernelSpec

LIBRARY_NAME = "libtorch_cute_ops_{arch}.so"


def library_path(out_dir: Path, arch: str) -> Path:
    return Path(out_dir) / arch / LIBRARY_NAME.format(arch=arch.replace("_", ""))


def build_library(arch: str, out_dir: Path, specs: list[KernelSpec],
                  on_variant: Callable[[KernelSpec, float, Path], None] | None = None,
                  ptx_dir: Path | None = None) -> Path:
    """Compile ``specs`` into one library under ``out_dir/arch``; return the manifest's path.
    ``on_variant(spec, seconds, dump_dir)`` sees each compiled variant (its PTX and cubin are
    in ``dump_dir`` when ``ptx_dir`` is given)."""
    from ..kernels import compile_spec

    if not specs:
        raise ValueError(f"no kernel variants to build for {arch}")
    folder = Path(out_dir) / arch
    folder.mkdir(parents=True, exist_ok=True)
    library = library_path(out_dir, arch)
    variants = []
    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        for spec in specs:
            dump = Path(tmp) / spec.digest
            start = time.perf_counter()
            compiled = compile_spec(spec, dump_dir=dump if ptx_dir is not None else None)
            seconds = time.perf_counter() - start
            obj = Path(tmp) / f"{spec.symbol}.o"
            compiled.export_to_c(str(obj), function_name=spec.symbol, export_only_tvm_ffi_symbols=True)
            objects.append(obj)
            variants.append({"name": spec.name, "digest": spec.digest, "symbol": spec.symbol,
                             "family": spec.family})
            if on_variant is not None:
                on_variant(spec, seconds, dump)
        staged = library.with_suffix(".so.tmp")
        cache.link_library(objects, staged)
        staged.chmod(0o755)  # the loader refuses files others may write, whatever the umask
        staged.replace(library)
    manifest = {"format": cache.MANIFEST_FORMAT, "arch": arch, "library": library.name,
                "sha256": cache._sha256(library), **cache.toolchain(), "variants": variants}
    path = folder / "manifest.json"
    staged = path.with_suffix(".json.tmp")
    staged.write_text(json.dumps(manifest, indent=1) + "\n")
    staged.chmod(0o644)
    staged.replace(path)
    return path


def read_manifest(out_dir: Path, arch: str) -> dict:
    return json.loads((Path(out_dir) / arch / "manifest.json").read_text())
