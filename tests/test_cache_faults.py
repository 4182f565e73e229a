"""The prebuilt-library loader under faults: it never fails an op.

Pins: malformed, misplaced or loosely permitted prebuilt manifests are ignored with one
warning; a check is redone when what it read changes. The CuTe DSL is replaced by
:mod:`fake_kernels` (instant compiles), so these run on any machine in seconds.
"""

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest

import fake_kernels
from torch_cute_ops import cli
from torch_cute_ops.runtime import cache
from torch_cute_ops.runtime.spec import KernelSpec

def fake(factor: float) -> KernelSpec:
    return KernelSpec.make("fake", "sm_90a", factor=factor)


def resolve(factor: float):
    """Resolve the variant of ``factor`` as an op would, and check what it computes."""
    fn = cache.get_compiled(fake(factor))
    assert fn(3.0) == 3.0 * factor
    return fn


def new_process() -> None:
    """Forget what this process resolved, checked and warned about."""
    cache.clear_memory_cache()
    cache._warned.clear()


@pytest.fixture
def env(monkeypatch, tmp_path, caplog):
    """A fresh cache under ``tmp_path/cache``, prebuilt libraries looked for in ``tmp_path/aot``."""
    monkeypatch.setenv("TORCH_CUTE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_CUTE_OPS_AOT_DIR", str(tmp_path / "aot"))
    monkeypatch.setenv("FAKE_COMPILE_LOG", str(tmp_path / "compiles.log"))
    monkeypatch.delenv("FAKE_FAULT", raising=False)
    monkeypatch.setattr(cache, "PACKAGED_AOT_DIR", tmp_path / "no-packaged-aot")
    monkeypatch.setattr(fake_kernels, "faults", {})
    fake_kernels.install(monkeypatch)
    new_process()
    caplog.set_level(logging.WARNING, logger="torch_cute_ops")
    yield tmp_path
    new_process()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "torch_cute_ops" and r.levelno >= logging.WARNING]


def cache_folder(tmp_path: Path) -> Path:
    (folder,) = (tmp_path / "cache").glob("v*")
    return folder


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


# ---------------------------------------------------------------------- prebuilt manifests

def write_prebuilt(root: Path, factors=(2.0, 3.0), library_at: Path | None = None) -> tuple[Path, dict]:
    """A fake prebuilt library of ``factors`` with a manifest that this installation accepts;
    returns the manifest's path and its content (written again by :func:`rewrite`)."""
    folder = root / "sm_90a"
    folder.mkdir(parents=True, exist_ok=True)
    library = library_at or folder / "libfake.so"
    library.parent.mkdir(parents=True, exist_ok=True)
    library.write_text(json.dumps({"symbols": {fake(f).symbol: f for f in factors}}))
    library.chmod(0o755)
    manifest = {"format": cache.MANIFEST_FORMAT, "arch": "sm_90a", "library": library.name,
                "sha256": hashlib.sha256(library.read_bytes()).hexdigest(), **cache.toolchain(),
                "variants": [{"name": fake(f).name, "digest": fake(f).digest, "symbol": fake(f).symbol,
                              "family": "fake"} for f in factors]}
    path = folder / "manifest.json"
    rewrite(path, manifest)
    return path, manifest


def rewrite(path: Path, manifest) -> None:
    path.write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    path.chmod(0o644)


def test_good_prebuilt_library_is_used(env, caplog):
    write_prebuilt(env / "aot")
    hits, compiles = cache.stats.aot_hits, cache.stats.compiles
    resolve(2.0)
    resolve(3.0)
    assert cache.stats.aot_hits == hits + 2 and cache.stats.compiles == compiles and not warnings_of(caplog)


def _drop(key):
    return lambda m: {k: v for k, v in m.items() if k != key}


MALFORMED_MANIFESTS = {
    "a list": lambda m: [m],
    "null": lambda m: None,
    "not JSON": lambda m: "{",
    "nested too deep": lambda m: "[" * 100_000,
    "no variants": _drop("variants"),
    "variants null": lambda m: {**m, "variants": None},
    "variants an object": lambda m: {**m, "variants": {"a": 1}},
    "variant a string": lambda m: {**m, "variants": ["tco_0"]},
    "variant without digest": lambda m: {**m, "variants": [_drop("digest")(v) for v in m["variants"]]},
    "symbol a number": lambda m: {**m, "variants": [{**v, "symbol": 5} for v in m["variants"]]},
    "library 123": lambda m: {**m, "library": 123},
    "no library": _drop("library"),
    "no sha256": _drop("sha256"),
    "format 2": lambda m: {**m, "format": 2},
    "other sources": lambda m: {**m, "sources": "0" * 16},
}


@pytest.mark.parametrize("form", MALFORMED_MANIFESTS)
def test_malformed_manifest_is_ignored_with_one_warning(env, caplog, form):
    path, manifest = write_prebuilt(env / "aot")
    rewrite(path, MALFORMED_MANIFESTS[form](manifest))
    compiles, hits = cache.stats.compiles, cache.stats.aot_hits
    resolve(2.0)
    resolve(3.0)
    assert cache.stats.compiles == compiles + 2 and cache.stats.aot_hits == hits
    (warning,) = warnings_of(caplog)
    assert str(path.parent) in warning and "not used" in warning


def _elsewhere(env: Path, name: str) -> Path:
    path, manifest = write_prebuilt(env / "aot", library_at=env / "elsewhere" / "lib.so")
    rewrite(path, {**manifest, "library": name})
    return path


TRUST_FAULTS = {
    "absolute library path": lambda env: _elsewhere(env, str(env / "elsewhere" / "lib.so")),
    "library path with ..": lambda env: _elsewhere(env, "../../elsewhere/lib.so"),
    "library a symlink": lambda env: (_elsewhere(env, "lib.so"),
                                      (env / "aot" / "sm_90a" / "lib.so").symlink_to(env / "elsewhere" / "lib.so")),
    "manifest writable by all": lambda env: write_prebuilt(env / "aot")[0].chmod(0o666),
    "manifest writable by its group": lambda env: write_prebuilt(env / "aot")[0].chmod(0o664),
    "library writable by its group": lambda env: (write_prebuilt(env / "aot"),
                                                  (env / "aot" / "sm_90a" / "libfake.so").chmod(0o775)),
    "folder writable by all": lambda env: (write_prebuilt(env / "aot"), (env / "aot" / "sm_90a").chmod(0o777)),
}


@pytest.mark.parametrize("fault", TRUST_FAULTS)
def test_untrusted_prebuilt_library_is_refused(env, caplog, fault):
    TRUST_FAULTS[fault](env)
    hits = cache.stats.aot_hits
    resolve(2.0)
    resolve(3.0)
    assert cache.stats.aot_hits == hits
    (warning,) = warnings_of(caplog)
    assert "not used" in warning


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a file to another user")
@pytest.mark.parametrize("owned", ["manifest.json", "libfake.so"])
def test_prebuilt_file_owned_by_another_user_is_refused(env, caplog, owned):
    write_prebuilt(env / "aot")
    os.chown(env / "aot" / "sm_90a" / owned, 4242, 4242)
    hits = cache.stats.aot_hits
    resolve(2.0)
    assert cache.stats.aot_hits == hits
    assert len(warnings_of(caplog)) == 1 and "owned by uid 4242" in warnings_of(caplog)[0]


@pytest.mark.parametrize("change", ["manifest permissions", "library bytes", "AOT folder"])
def test_prebuilt_check_is_redone_when_what_it_read_changes(env, monkeypatch, caplog, change):
    path, _ = write_prebuilt(env / "aot")
    hits = cache.stats.aot_hits
    resolve(2.0)
    assert cache.stats.aot_hits == hits + 1
    if change == "manifest permissions":
        path.chmod(0o666)
    elif change == "library bytes":
        library = path.parent / "libfake.so"
        library.write_text(library.read_text().replace("3.0", "30.0"))
    else:
        monkeypatch.setenv("TORCH_CUTE_OPS_AOT_DIR", str(env / "other-aot"))
    resolve(3.0)  # same process: the first check must not be reused
    assert cache.stats.aot_hits == hits + 1


def test_startup_report_survives_a_malformed_manifest(env):
    path, _ = write_prebuilt(env / "aot")
    rewrite(path, "[]")
    (row,) = [value for key, value in cli._kernel_sources("sm_90a") if str(env / "aot") in value]
    assert "not used" in row


def test_aot_output_is_accepted_whatever_the_umask(env, caplog):
    from torch_cute_ops.runtime import aot

    old = os.umask(0o002)  # group-writable files by default, as with per-user groups
    try:
        manifest_path = aot.build_library("sm_90a", env / "aot", [fake(2.0), fake(3.0)])
    finally:
        os.umask(old)
    library = aot.library_path(env / "aot", "sm_90a")
    assert manifest_path.stat().st_mode & 0o777 == 0o644 and library.stat().st_mode & 0o777 == 0o755
    hits = cache.stats.aot_hits
    resolve(2.0)
    resolve(3.0)
    assert cache.stats.aot_hits == hits + 2 and not warnings_of(caplog)
