"""Where compiled kernels come from: memory, prebuilt libraries, the on-disk cache, or a compile.

Pins: keys carry what changes code (never sizes); a cached or prebuilt variant loads as a shared
library without importing the CuTe DSL; an edited kernel source, another DSL / TVM-FFI / torch
never reuse a library; truncated or foreign files are removed and rebuilt, never loaded;
concurrent processes compile a variant once; folders others can write are refused; no compile
under fake tensors or while torch.compile traces.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")

from torch_cute_ops import kernels  # noqa: E402
from torch_cute_ops.runtime import aot, cache  # noqa: E402
from torch_cute_ops.runtime.spec import KernelSpec  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def toy(factor=2.0):
    return KernelSpec.make("toy", "sm_90a", dtype="BFloat16", factor=factor)


@pytest.fixture
def toy_family(monkeypatch, tmp_path):
    monkeypatch.setitem(kernels.FAMILY_MODULES, "toy", "toy_kernel")
    monkeypatch.setenv("TORCH_CUTE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_CUTE_OPS_AOT_DIR", str(tmp_path / "no-aot"))
    cache.clear_memory_cache()
    yield tmp_path / "cache"
    cache.clear_memory_cache()


def _child(code: str, tmp_path: Path, **env) -> dict:
    """Run ``code`` in a fresh process that sees the toy family; it prints one JSON line."""
    prelude = ("import json, sys; from torch_cute_ops import kernels; from torch_cute_ops.runtime import cache;"
               "from torch_cute_ops.runtime.spec import KernelSpec; kernels.FAMILY_MODULES['toy'] = 'toy_kernel';"
               "spec = KernelSpec.make('toy', 'sm_90a', dtype='BFloat16', factor=2.0)\n")
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
                "TORCH_CUTE_OPS_CACHE_DIR": str(tmp_path / "cache"), "TORCH_CUTE_OPS_AOT_DIR": "", **env}
    proc = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=full_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_REPORT = ("fn = cache.get_compiled(spec); s = cache.stats; print(json.dumps({'compiles': s.compiles, "
           "'disk_hits': s.disk_hits, 'aot_hits': s.aot_hits, 'rejected': s.rejected, "
           "'cutlass': any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules)}))")


def test_spec_is_ordered_named_and_validated():
    a = KernelSpec.make("gemm_sm90", "sm_90a", tile=(128, 256), dtype="bf16", bias=True)
    b = KernelSpec.make("gemm_sm90", "sm_90a", dtype="bf16", bias=True, tile=(128, 256))
    assert a == b and hash(a) == hash(b) and a.symbol == b.symbol == f"tco_{a.digest}"
    assert a.name == "gemm_sm90_sm90a_bias=1_dtype=bf16_tile=128x256"
    assert a != KernelSpec.make("gemm_sm90", "sm_100a", tile=(128, 256), dtype="bf16", bias=True)
    with pytest.raises(ValueError, match="arch must be one of"):
        KernelSpec.make("gemm_sm90", "sm_80", dtype="bf16")


def test_memory_then_disk_then_compile(toy_family, tmp_path):
    before = cache.stats.compiles
    fn = cache.get_compiled(toy())
    assert cache.stats.compiles == before + 1
    assert cache.get_compiled(toy()) is fn  # memory hit
    (library,) = toy_family.rglob("*.so")
    (sidecar,) = toy_family.rglob("*.json")
    assert toy().digest in library.name and json.loads(sidecar.read_text())["spec"] == repr(toy())
    # a new process loads the shared library and never imports the DSL
    report = _child(_REPORT, tmp_path)
    assert report == {"compiles": 0, "disk_hits": 1, "aot_hits": 0, "rejected": 0, "cutlass": False}


def test_other_code_changing_params_compile_separately(toy_family):
    first = cache.get_compiled(toy(2.0))
    other = cache.get_compiled(toy(3.0))
    assert first is not other and len(list(toy_family.rglob("*.so"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "foreign", "no-sidecar"])
def test_damaged_entries_are_removed_and_rebuilt(toy_family, tmp_path, damage):
    cache.get_compiled(toy())
    (library,) = toy_family.rglob("*.so")
    sidecar = library.with_suffix(".json")
    if damage == "truncate":
        library.write_bytes(library.read_bytes()[:1000])
    elif damage == "foreign":
        meta = json.loads(sidecar.read_text())
        meta["spec"] = repr(toy(7.0))
        sidecar.write_text(json.dumps(meta))
    else:
        sidecar.unlink()
    report = _child(_REPORT, tmp_path)
    assert report["compiles"] == 1 and report["disk_hits"] == 0
    assert report["rejected"] == (0 if damage == "no-sidecar" else 1)
    assert _child(_REPORT, tmp_path)["disk_hits"] == 1  # the rebuilt entry is good


def test_edited_kernel_sources_never_load_a_stale_library(toy_family, monkeypatch, tmp_path):
    cache.get_compiled(toy())
    sources = tmp_path / "kernels"
    sources.mkdir()
    (sources / "k.py").write_text("x = 1\n")
    monkeypatch.setattr(cache, "KERNEL_SOURCES", sources)
    keys = []
    for text in ("x = 1\n", "x = 2\n"):
        (sources / "k.py").write_text(text)
        for fn in (cache.source_fingerprint, cache.toolchain, cache._environment_key):
            fn.cache_clear()
        keys.append(cache._environment_key())
    assert keys[0] != keys[1]
    cache.clear_memory_cache()
    before = cache.stats.compiles
    cache.get_compiled(toy())  # the edited sources: a new cache folder, so a compile
    assert cache.stats.compiles == before + 1 and len(list(toy_family.iterdir())) == 2
    for fn in (cache.source_fingerprint, cache.toolchain, cache._environment_key):
        fn.cache_clear()


def test_concurrent_processes_compile_once(toy_family, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
           "TORCH_CUTE_OPS_CACHE_DIR": str(toy_family), "TORCH_CUTE_OPS_AOT_DIR": ""}
    code = ("import json, sys; from torch_cute_ops import kernels; from torch_cute_ops.runtime import cache;"
            "from torch_cute_ops.runtime.spec import KernelSpec; kernels.FAMILY_MODULES['toy'] = 'toy_kernel';"
            "spec = KernelSpec.make('toy', 'sm_90a', dtype='BFloat16', factor=2.0)\n" + _REPORT)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["compiles"] for r in reports) == 1
    assert sum(r["disk_hits"] for r in reports) == 2


def test_cache_writable_by_others_is_refused(toy_family, caplog):
    toy_family.mkdir(parents=True)
    toy_family.chmod(0o777)
    with caplog.at_level("WARNING", logger="torch_cute_ops"):
        assert callable(cache.get_compiled(toy(4.0)))
    assert "writable by every user" in caplog.text
    assert not list(toy_family.rglob("*.so"))  # compiled in memory only


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand the folder to another user")
def test_cache_owned_by_another_user_is_refused(toy_family, caplog):
    toy_family.mkdir(parents=True, mode=0o700)
    os.chown(toy_family, 4242, 4242)
    cache._warned.clear()
    with caplog.at_level("WARNING", logger="torch_cute_ops"):
        cache.get_compiled(toy(5.0))
    assert "owned by uid 4242" in caplog.text and not list(toy_family.rglob("*.so"))


def test_prebuilt_library_is_used_without_the_dsl(toy_family, tmp_path):
    manifest_path = aot.build_library("sm_90a", tmp_path / "aot", [toy(), toy(3.0)])
    manifest = json.loads(manifest_path.read_text())
    assert manifest["sources"] == cache.source_fingerprint()
    assert manifest["cutlass_dsl"] == cache.toolchain()["cutlass_dsl"]
    assert [v["symbol"] for v in manifest["variants"]] == [toy().symbol, toy(3.0).symbol]
    report = _child(_REPORT, tmp_path, TORCH_CUTE_OPS_AOT_DIR=str(tmp_path / "aot"))
    assert report == {"compiles": 0, "disk_hits": 0, "aot_hits": 1, "rejected": 0, "cutlass": False}
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.so"))


@pytest.mark.parametrize("damage", ["sources", "library"])
def test_mismatched_or_damaged_prebuilt_library_is_not_used(toy_family, tmp_path, damage):
    manifest_path = aot.build_library("sm_90a", tmp_path / "aot", [toy()])
    if damage == "sources":
        manifest = json.loads(manifest_path.read_text())
        manifest["sources"] = "0" * 16
        manifest_path.write_text(json.dumps(manifest))
    else:
        library = aot.library_path(tmp_path / "aot", "sm_90a")
        library.write_bytes(library.read_bytes() + b"\0")
    report = _child(_REPORT, tmp_path, TORCH_CUTE_OPS_AOT_DIR=str(tmp_path / "aot"))
    assert report["aot_hits"] == 0 and report["compiles"] == 1


def test_no_compile_under_fake_tensors(toy_family):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(RuntimeError, match="never compiled under FakeTensorMode"):
            cache.get_compiled(toy())


def test_no_compile_while_tracing(toy_family):
    def fn(x):
        cache.get_compiled(toy(5.0))
        return x + 1

    with pytest.raises(Exception, match="never compiled while torch.compile traces"):
        torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
