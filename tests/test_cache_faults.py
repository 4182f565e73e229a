"""The kernel cache and the prebuilt-library loader under faults: they never fail an op.

Pins: an unusable cache (unwritable folder, lock path that is a folder, full disk, no parent
folder) compiles in memory with one warning; malformed sidecars are removed and rebuilt;
malformed, misplaced or loosely permitted prebuilt manifests are ignored with one warning; a
lock held by a stopped process is waited on for a bounded time, naming the lock and its holder;
a process killed mid-store leaves nothing that outlives the next start; concurrent cold starts
compile each variant once. The CuTe DSL is replaced by :mod:`fake_kernels` (instant compiles),
so these run on any machine in seconds.
"""

import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import fake_kernels
from torch_cute_ops import cli
from torch_cute_ops.runtime import cache
from torch_cute_ops.runtime.spec import KernelSpec

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NOBODY = 65534


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


# ------------------------------------------------------------------------- child processes

_PRELUDE = """\
import json, logging, sys
import fake_kernels
fake_kernels.install()
from torch_cute_ops.runtime import cache
from torch_cute_ops.runtime.spec import KernelSpec
warned = []
handler = logging.Handler()
handler.emit = lambda record: warned.append(record.getMessage())
logging.getLogger("torch_cute_ops").addHandler(handler)
fake = lambda factor: KernelSpec.make("fake", "sm_90a", factor=factor)
"""


def child_env(tmp_path: Path, cache_root: Path | None = None, **extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
            "TORCH_CUTE_OPS_CACHE_DIR": str(cache_root or tmp_path / "cache"),
            "TORCH_CUTE_OPS_AOT_DIR": str(tmp_path / "aot"), "FAKE_COMPILE_LOG": str(tmp_path / "compiles.log"),
            **extra}


def start_child(code: str, env: dict, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _PRELUDE + code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def run_child(code: str, env: dict, **popen) -> dict:
    """Run ``code`` after the prelude; it prints one JSON line, returned with the warnings logged."""
    proc = start_child(code + "\nprint(json.dumps({**result, 'warned': warned}))", env, **popen)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


_RESOLVE = ("result = {'values': [cache.get_compiled(fake(f))(3.0) for f in FACTORS], "
            "'compiles': cache.stats.compiles, 'disk_hits': cache.stats.disk_hits}")


# ------------------------------------------------------------------------------ the cache

def test_fake_compiles_are_cached_like_real_ones(env, caplog):
    resolve(2.0)
    assert cache.stats.compiles >= 1 and sorted(p.suffix for p in cache_folder(env).iterdir()) == [".json", ".lock",
                                                                                                 ".so"]
    new_process()
    hits = cache.stats.disk_hits
    resolve(2.0)
    assert cache.stats.disk_hits == hits + 1 and not warnings_of(caplog)


@pytest.mark.parametrize("text", ["null", "[]", "42", '"text"', "{", "", '{"spec": []}'])
def test_malformed_sidecar_is_removed_and_rebuilt(env, caplog, text):
    resolve(2.0)
    (sidecar,) = cache_folder(env).glob("*.json")
    sidecar.write_text(text)
    new_process()
    compiles, rejected = cache.stats.compiles, cache.stats.rejected
    resolve(2.0)
    assert cache.stats.compiles == compiles + 1 and cache.stats.rejected == rejected + 1
    assert len(warnings_of(caplog)) == 1 and sidecar.stem in warnings_of(caplog)[0]
    assert json.loads(sidecar.read_text())["spec"] == repr(fake(2.0))  # rebuilt
    new_process()
    hits = cache.stats.disk_hits
    resolve(2.0)
    assert cache.stats.disk_hits == hits + 1


def test_cached_library_that_is_a_folder_is_not_loaded(env, caplog):
    resolve(2.0)
    (library,) = cache_folder(env).glob("*.so")
    library.unlink()
    library.mkdir()
    new_process()
    compiles = cache.stats.compiles
    resolve(2.0)
    assert cache.stats.compiles == compiles + 1 and library.is_file()  # the empty folder removed, rebuilt
    assert len(warnings_of(caplog)) == 1 and library.name in warnings_of(caplog)[0]


def test_lock_path_that_is_a_folder_compiles_in_memory(env, caplog):
    entry = cache._disk_entry(fake(2.0))
    entry.lock.mkdir()
    compiles = cache.stats.compiles
    resolve(2.0)
    resolve(2.0)
    assert cache.stats.compiles == compiles + 1
    assert len(warnings_of(caplog)) == 1 and str(entry.lock) in warnings_of(caplog)[0]
    assert not entry.library.exists()


_AS_NOBODY = """
import os
if os.geteuid() == 0:  # permission bits bind only below root: load what the run needs, then drop it
    import torch_cute_ops.kernels
    cache._environment_key(), cache._refuse_while_tracing()
    os.setgroups([]), os.setgid(%d), os.setuid(%d)
""" % (NOBODY, NOBODY)


def test_unwritable_cache_folder_loads_what_it_has_and_compiles_the_rest_in_memory(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="tco-unwritable-"))  # a folder that nobody can reach too
    try:
        base.chmod(0o755)
        if os.geteuid() == 0:
            os.chown(base, NOBODY, NOBODY)
        env = child_env(tmp_path, base / "cache", FAKE_COMPILE_LOG="", TORCH_CUTE_OPS_AOT_DIR=str(base / "aot"))
        stored = run_child(_AS_NOBODY + "FACTORS = [2.0]\n" + _RESOLVE, env)
        assert stored["values"] == [6.0] and stored["compiles"] == 1 and not stored["warned"]
        (folder,) = (base / "cache").glob("v*")
        folder.chmod(0o500)  # existing, readable, not writable
        report = run_child(_AS_NOBODY + "FACTORS = [2.0, 3.0, 4.0]\n" + _RESOLVE, env)
        assert report["values"] == [6.0, 9.0, 12.0]
        assert report["disk_hits"] == 1 and report["compiles"] == 2
        assert len(report["warned"]) == 1 and "in memory" in report["warned"][0], report["warned"]
        assert len(list(folder.glob("*.so"))) == 1
    finally:
        for folder in (base / "cache").glob("v*"):
            folder.chmod(0o700)
        shutil.rmtree(base)


def test_default_cache_folder_is_made_with_its_parents(env, monkeypatch, caplog):
    monkeypatch.delenv("TORCH_CUTE_OPS_CACHE_DIR")
    home = env / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    resolve(2.0)
    root = home / ".cache" / "torch_cute_ops"
    assert len(list(root.glob("v*/*.so"))) == 1 and not warnings_of(caplog)
    assert root.stat().st_mode & 0o777 == 0o700


def test_unusable_cache_folder_is_reported_once(env, monkeypatch, caplog):
    blocker = env / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_CUTE_OPS_CACHE_DIR", str(blocker / "cache"))
    for factor in (2.0, 3.0, 4.0):
        resolve(factor)
    assert len(warnings_of(caplog)) == 1 and str(blocker) in warnings_of(caplog)[0]


def _fail_opens(monkeypatch, path_ends: str, code: int) -> None:
    """``open``/``os.open`` of a path ending in ``path_ends`` fails with ``code``."""
    real_open, real_os_open = open, os.open

    def check(path):
        if str(path).endswith(path_ends):
            raise OSError(code, os.strerror(code), str(path))

    def fake_open(path, *args, **kwargs):
        check(path)
        return real_open(path, *args, **kwargs)

    def fake_os_open(path, *args, **kwargs):
        check(path)
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)


@pytest.mark.parametrize("stage", ["lock", "export", "link", "sidecar"])
def test_full_disk_runs_from_the_in_memory_compile(env, monkeypatch, caplog, stage):
    resolve(1.0)  # makes the cache folder while the disk has room
    if stage == "lock":
        _fail_opens(monkeypatch, ".lock", errno.ENOSPC)
    elif stage == "sidecar":
        real_write_text = pathlib.Path.write_text

        def full_disk(self, *args, **kwargs):
            if self.name.endswith(".tmp.json"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
            return real_write_text(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    else:
        fake_kernels.faults[stage] = "enospc"
    compiles = cache.stats.compiles
    for factor in (2.0, 3.0, 4.0):
        resolve(factor)
    assert cache.stats.compiles == compiles + 3
    assert len(warnings_of(caplog)) == 1, warnings_of(caplog)
    folder = cache_folder(env)
    assert len(list(folder.glob("*.so"))) == 1 and not leftovers(folder)


# ------------------------------------------------------------------------ locks and kills

def test_lock_held_by_a_stopped_process_is_waited_on_for_a_bounded_time(env, monkeypatch, caplog):
    holder = start_child("cache.get_compiled(fake(2.0))", child_env(env, FAKE_FAULT="compile:stop"))
    waiter = None
    try:
        _, status = os.waitpid(holder.pid, os.WUNTRACED)  # returns once it stopped, lock held
        assert os.WIFSTOPPED(status), holder.stderr.read()
        monkeypatch.setenv("TORCH_CUTE_OPS_LOCK_TIMEOUT", "1")
        results = []
        waiter = threading.Thread(target=lambda: results.append(resolve(2.0)), daemon=True)
        start = time.monotonic()
        waiter.start()
        waiter.join(timeout=20)
        assert results, "the waiter hangs on the stopped holder's lock"
        assert time.monotonic() - start < 10
    finally:
        holder.kill()
        holder.communicate()
        if waiter is not None:
            waiter.join()
    (warning,) = warnings_of(caplog)
    lock = cache._disk_entry(fake(2.0)).lock
    assert str(lock) in warning and f"pid {holder.pid}" in warning, warning
    assert not lock.with_name(lock.name[:-5] + ".so").exists()  # the waiter compiled in memory
    new_process()
    resolve(2.0)  # the holder is gone: the lock is free again
    assert len(list(cache_folder(env).glob("*.so"))) == 1


def test_a_long_wait_is_said_once_with_the_holder(env, monkeypatch, caplog):
    monkeypatch.setattr(cache, "LOCK_NOTICE_S", 0.05)
    monkeypatch.setenv("TORCH_CUTE_OPS_LOCK_TIMEOUT", "0.5")
    entry = cache._disk_entry(fake(2.0))
    held = cache.acquire_lock(entry.lock, timeout=0)  # as another compile of this variant would
    try:
        resolve(2.0)
    finally:
        cache.release_lock(held)
    waiting, gave_up = warnings_of(caplog)
    assert waiting.startswith(f"torch_cute_ops: waiting for kernel cache lock {entry.lock}, held by pid {os.getpid()}")
    assert "still held by" in gave_up and "compiling this kernel in memory" in gave_up
    assert not entry.library.exists()


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_bad_lock_timeout_is_said_once_and_the_default_used(env, monkeypatch, caplog, value):
    monkeypatch.setenv("TORCH_CUTE_OPS_LOCK_TIMEOUT", value)
    assert cache.lock_timeout() == cache.LOCK_TIMEOUT_S == cache.lock_timeout()
    (warning,) = warnings_of(caplog)
    assert "TORCH_CUTE_OPS_LOCK_TIMEOUT" in warning and repr(value) in warning


@pytest.mark.parametrize("stage", ["export", "link"])
def test_process_killed_mid_store_leaves_nothing_behind(env, caplog, stage):
    killed = start_child("cache.get_compiled(fake(2.0))", child_env(env, FAKE_FAULT=f"{stage}:kill"))
    killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    folder = cache_folder(env)
    assert leftovers(folder)  # what the killed store left
    compiles = cache.stats.compiles
    resolve(2.0)  # the next start sweeps and rebuilds
    assert cache.stats.compiles == compiles + 1 and not leftovers(folder)
    assert sorted(p.suffix for p in folder.iterdir()) == [".json", ".lock", ".so"]
    new_process()
    hits = cache.stats.disk_hits
    resolve(2.0)
    assert cache.stats.disk_hits == hits + 1 and not warnings_of(caplog)


def test_sweep_keeps_the_files_of_a_store_in_progress(env):
    import fcntl

    resolve(1.0)
    entry = cache._disk_entry(fake(2.0))
    busy = entry.library.with_name(f"{entry.library.name[:-3]}.{os.getpid() + 1}.tmp.o")
    with open(entry.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a process storing this entry would
        busy.write_text("half")
        new_process()
        resolve(3.0)  # a new start sweeps
        assert busy.exists()
        fcntl.flock(lock, fcntl.LOCK_UN)
    new_process()
    resolve(3.0)
    assert not busy.exists()


def test_concurrent_cold_start_compiles_each_variant_once(env):
    """8 processes x 4 threads resolve the same 4 variants at once on an empty cache."""
    out = env / "reports"
    out.mkdir()
    factors = [1.0, 2.0, 3.0, 4.0]
    launcher = start_child(f"fake_kernels.stress(8, 4, {factors}, {str(out)!r})",
                           child_env(env, FAKE_COMPILE_SECONDS="0.1"))
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err[-3000:]
    reports = [json.loads(p.read_text()) for p in out.iterdir()]
    assert len(reports) == 8 and not [e for r in reports for e in r["errors"]]
    assert all(sorted(r["seen"]) == sorted([[f, 3.0 * f] for f in factors] * 4) for r in reports)
    compiled = Counter(line.split()[1] for line in (env / "compiles.log").read_text().splitlines())
    assert compiled == Counter({fake(f).digest: 1 for f in factors})
    assert sum(r["disk_hits"] for r in reports) == 8 * 4 - 4
    assert not leftovers(cache_folder(env))


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
