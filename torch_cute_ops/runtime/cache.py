"""Where a compiled kernel variant comes from, fastest first, without the CuTe DSL when it can.

:func:`get_compiled` looks for a :class:`~.spec.KernelSpec` in

1. memory (this process);
2. a prebuilt library (``python -m torch_cute_ops aot``): ``TORCH_CUTE_OPS_AOT_DIR``, then the
   package's own ``_aot/`` folder, each holding ``<arch>/manifest.json`` and one shared
   library per arch;
3. the on-disk cache (``TORCH_CUTE_OPS_CACHE_DIR``, default ``~/.cache/torch_cute_ops``): one
   shared library per variant with a JSON sidecar;
4. and only then compiles it with the CuTe DSL, storing it to the on-disk cache.

Steps 1-3 load shared libraries with TVM-FFI alone: each is the DSL's exported host+device
object linked against the DSL's runtime library (``libcute_dsl_runtime.so``, found in the
installed wheel without importing the DSL) and ``libtvm_ffi.so``, so a process that finds
its kernels there never imports ``cutlass``.

What is trusted, and why. Loading a shared library runs its code, so a library is loaded only
if nobody but this user (or root, for a prebuilt one) could have written it or what vouches
for it, and only if its bytes are those its builder recorded:

* digests: a cached library's size and sha256 must match its sidecar, which must name this
  very variant; a prebuilt library's sha256 must match its manifest, which must have been
  built from these kernel sources (a fingerprint of every file under ``kernels/``) with this
  DSL and TVM-FFI. The cache folder's name carries the same and torch's version.
* ownership and permissions: cache folders and files must be this user's and not writable by
  others (group-writable only with our own group); a prebuilt manifest and its library must be
  owned by root or this user and writable by neither group nor others, their folder not by
  everyone. A digest vouches for nothing if whoever can rewrite the library can rewrite the
  digest beside it.
* containment: a manifest's ``library`` is a plain file name in the manifest's own folder (no
  path, no ``..``), and no library is reached through a symbolic link, so a manifest cannot
  send the loader to a file in a folder nobody checked.
* a check is remembered only while what it read is unchanged: a manifest's parse is keyed on
  its bytes and the toolchain, its library's digest check on the library's path, identity,
  size, times, owner and mode; the folders searched and the permissions of each manifest and
  folder are looked at again at every look-up.

Everything else on disk is input that never fails an op: a sidecar or manifest that is not
what it should be (not JSON, not an object, fields missing or mistyped) is removed (sidecar)
or ignored (manifest), with a warning; a cache that cannot be used (a folder that cannot be
made or written, a lock path that is not a file, a full disk) leaves kernels compiled in
memory, with one warning per process. Processes that compile the same variant take turns on
an ``flock`` (the kernel drops it when its holder dies); a holder that stops or hangs is
waited on for ``TORCH_CUTE_OPS_LOCK_TIMEOUT`` seconds (default 300), then the waiter names the
lock and its holder and compiles in memory. Files appear by atomic rename; temporary files of
a store that was killed are swept when a process first opens the cache (those whose
variant's lock is free, so no store is writing them).

Compiles never run under FakeTensorMode or while torch.compile traces.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .spec import KernelSpec

log = logging.getLogger("torch_cute_ops")

CACHE_FORMAT = 2  # layout of the on-disk cache; bump to orphan every older entry
MANIFEST_FORMAT = 1
PACKAGE_DIR = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = PACKAGE_DIR / "kernels"
PACKAGED_AOT_DIR = PACKAGE_DIR / "_aot"
LOCK_TIMEOUT_S = 300.0  # default bound on waiting for another process's compile of a variant
LOCK_NOTICE_S = 10.0  # a wait this long is said (once per process), naming the lock's holder


@dataclass
class CacheStats:
    memory_hits: int = 0
    aot_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    rejected: int = 0  # cache entries found truncated, foreign or stale, removed


stats = CacheStats()
_memory: dict[KernelSpec, Callable] = {}
_lock = threading.RLock()
_keep_alive: list = []  # loaded modules and runtime libraries live as long as the process
_warned: set[str] = set()
_swept: set[Path] = set()  # cache folders this process swept of a killed store's files


def _warn_once(message: str, key: str | None = None) -> None:
    """Log ``message`` unless this process logged it, or another message of the same ``key``."""
    key = message if key is None else key
    if key not in _warned:
        _warned.add(key)
        log.warning("torch_cute_ops: %s", message)


# ---------------------------------------------------------------------------- fingerprints

@functools.cache
def source_fingerprint() -> str:
    """sha256 of every kernel source file: an edited kernel never loads a stale library."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_SOURCES.rglob("*.py")):
        digest.update(path.relative_to(KERNEL_SOURCES).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


@functools.cache
def toolchain() -> dict[str, str]:
    """What a library's code depends on besides its spec (the manifest of a prebuilt one)."""
    from .. import __version__

    return {"torch_cute_ops": __version__, "sources": source_fingerprint(),
            "cutlass_dsl": _dist_version("nvidia-cutlass-dsl"), "tvm_ffi": _dist_version("apache-tvm-ffi")}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------- loading without the DSL

def dsl_runtime_library() -> Path | None:
    """``libcute_dsl_runtime.so`` of the installed DSL wheel, located without importing it."""
    for entry in os.environ.get("CUTE_DSL_LIBS", "").split(os.pathsep):
        if entry.endswith("libcute_dsl_runtime.so") and Path(entry).is_file():
            return Path(entry)
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(root).glob("*/lib/libcute_dsl_runtime.so"))
        if found:
            return found[-1]
    return None


def tvm_ffi_library() -> Path:
    import tvm_ffi

    return Path(tvm_ffi.libinfo.find_libtvm_ffi())


@functools.cache
def _load_runtime_libraries() -> None:
    """Make the two libraries every exported kernel links against visible to the loader."""
    runtime = dsl_runtime_library()
    if runtime is None:
        raise RuntimeError("torch_cute_ops: libcute_dsl_runtime.so not found (is nvidia-cutlass-dsl installed?)")
    _keep_alive.append(ctypes.CDLL(str(tvm_ffi_library()), mode=ctypes.RTLD_GLOBAL))
    _keep_alive.append(ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL))


def load_library_function(library: Path, symbol: str) -> Callable:
    """The TVM-FFI function ``symbol`` of a shared library built by :func:`link_library`."""
    _load_runtime_libraries()
    module = _load_module(str(library))
    return getattr(module, symbol)


@functools.cache
def _load_module(path: str):
    import tvm_ffi

    module = tvm_ffi.load_module(path)
    _keep_alive.append(module)
    return module


def _linker() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def link_library(objects: Iterable[Path], library: Path) -> None:
    """Link exported kernel objects into one shared library (the DSL's AOT recipe)."""
    cc = _linker()
    if cc is None:
        raise RuntimeError("no C compiler to link kernel libraries (set CC)")
    runtime = dsl_runtime_library()
    if runtime is None:
        raise RuntimeError("libcute_dsl_runtime.so not found (is nvidia-cutlass-dsl installed?)")
    cmd = [cc, "-shared", "-o", str(library), *map(str, objects),
           f"-L{runtime.parent}", "-lcute_dsl_runtime", f"-L{tvm_ffi_library().parent}", "-ltvm_ffi"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"linking {library.name} failed: {proc.stderr.strip()[-2000:]}")


# ------------------------------------------------------------------------------ trust

def untrusted_reason(path: Path, *, must_own: bool) -> str | None:
    """Why loading code from folder or file ``path`` could run someone else's code, or None.

    Writable by every user: refused. ``must_own`` (the cache): owned by another user, or
    group-writable with a group other than ours, is refused too. Otherwise (a prebuilt
    library, often installed by root): the owner may be root or us.
    """
    st = path.stat()
    uid = os.getuid()
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is writable by every user"
    if must_own:
        if st.st_uid != uid:
            return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
        if st.st_mode & stat.S_IWGRP and st.st_gid != os.getgid():
            return f"{path} is writable by group {st.st_gid}"
    elif st.st_uid not in (0, uid):
        return f"{path} is owned by uid {st.st_uid}, neither root nor this user"
    return None


def untrusted_file_reason(path: Path) -> str | None:
    """Why a prebuilt manifest or library must not be believed, or None: it must be a regular
    file (no symbolic link), owned by root or us, writable by its owner alone."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by {'every user' if st.st_mode & stat.S_IWOTH else f'group {st.st_gid}'}"
    return untrusted_reason(path, must_own=False)


def _stat_key(path: Path) -> tuple | None:
    """What a check of ``path`` read of its metadata (None: absent); a changed key redoes it."""
    try:
        st = path.lstat()
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, st.st_gid


# ------------------------------------------------------------------------- prebuilt libraries

def aot_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get("TORCH_CUTE_OPS_AOT_DIR", "")
    if env:
        dirs.append(Path(env))
    dirs.append(PACKAGED_AOT_DIR)
    return dirs


def manifest_mismatch(manifest: dict) -> str | None:
    """Why a prebuilt library's manifest does not fit this installation, or None."""
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"manifest format {manifest.get('format')} (expected {MANIFEST_FORMAT})"
    have = toolchain()
    for key in ("sources", "cutlass_dsl", "tvm_ffi"):
        if manifest.get(key) != have[key]:
            return f"built with {key} {manifest.get(key)}, this installation has {have[key]}"
    return None


class ManifestError(ValueError):
    """A prebuilt manifest that is not what ``python -m torch_cute_ops aot`` writes."""


@dataclass(frozen=True)
class PrebuiltManifest:
    path: Path
    library: Path
    sha256: str
    symbols: tuple[tuple[str, str], ...]  # (spec digest, exported symbol) per variant


def _field(mapping: dict, key: str, kind: type, where: str = ""):
    value = mapping.get(key)
    if not isinstance(value, kind):
        raise ManifestError(f"{where}{key} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def parse_manifest(path: Path, text: str) -> PrebuiltManifest:
    """The manifest at ``path`` holding ``text``, checked for shape and toolchain (not for
    trust, nor against its library); ManifestError says what is wrong."""
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ManifestError(f"not JSON ({str(err)[:200]})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"a JSON {type(manifest).__name__}, not an object")
    mismatch = manifest_mismatch(manifest)
    if mismatch:
        raise ManifestError(mismatch)
    name = _field(manifest, "library", str)
    if name in ("", ".", "..") or "\0" in name or "/" in name or os.sep in name:
        raise ManifestError(f"library {name!r} is not a file name in the manifest's own folder")
    symbols = []
    for i, variant in enumerate(_field(manifest, "variants", list)):
        if not isinstance(variant, dict):
            raise ManifestError(f"variants[{i}] is a {type(variant).__name__}, not an object")
        symbols.append((_field(variant, "digest", str, f"variants[{i}]."),
                        _field(variant, "symbol", str, f"variants[{i}].")))
    return PrebuiltManifest(path, path.parent / name, _field(manifest, "sha256", str), tuple(symbols))


@functools.lru_cache(maxsize=32)
def _parsed_manifest(path: Path, text: str, toolchain_key: tuple) -> PrebuiltManifest | str:
    """:func:`parse_manifest`, or what is wrong; cached on all it reads (text, toolchain)."""
    try:
        return parse_manifest(path, text)
    except ManifestError as err:
        return str(err)


@functools.lru_cache(maxsize=32)
def _library_reason(library: Path, sha256: str, library_key: tuple | None) -> str | None:
    """Why a prebuilt library is not the one its manifest vouches for; cached on its metadata."""
    try:
        reason = untrusted_file_reason(library)
        if reason is None and _sha256(library) != sha256:
            reason = f"{library.name}'s sha256 differs from the manifest's (truncated or replaced)"
        return reason
    except OSError as err:
        return f"its library is unreadable ({err})"


def check_prebuilt(manifest_path: Path) -> PrebuiltManifest | str | None:
    """The usable manifest at ``manifest_path``, why it is not usable, or None (there is none)."""
    try:
        manifest_path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as err:
        return f"unreadable ({err})"
    try:
        reason = untrusted_reason(manifest_path.parent, must_own=False) or untrusted_file_reason(manifest_path)
        if reason:
            return reason
        text = manifest_path.read_text()
    except (OSError, ValueError) as err:
        return f"unreadable ({err})"
    found = _parsed_manifest(manifest_path, text, tuple(sorted(toolchain().items())))
    if isinstance(found, str):
        return found
    return _library_reason(found.library, found.sha256, _stat_key(found.library)) or found


def _aot_index(arch: str) -> dict[str, tuple[Path, str]]:
    """spec digest -> (library, symbol), from the usable manifests of the AOT folders."""
    index: dict[str, tuple[Path, str]] = {}
    for root in reversed(aot_dirs()):  # the environment's folder overrides the package's
        manifest_path = root / arch / "manifest.json"
        found = check_prebuilt(manifest_path)
        if isinstance(found, str):
            _warn_once(f"prebuilt kernels in {manifest_path.parent} not used: {found}")
        elif found is not None:
            index.update((digest, (found.library, symbol)) for digest, symbol in found.symbols)
    return index


def _load_prebuilt(spec: KernelSpec) -> Callable | None:
    entry = _aot_index(spec.arch).get(spec.digest)
    if entry is None:
        return None
    start = time.perf_counter()
    try:
        fn = load_library_function(*entry)
    except Exception as err:  # noqa: BLE001 (a library that does not load is not used)
        _warn_once(f"prebuilt kernel library {entry[0]} does not load ({err}); compiling instead",
                   key=f"prebuilt-load:{entry[0]}")
        return None
    stats.load_seconds += time.perf_counter() - start
    stats.aot_hits += 1
    return fn


# ---------------------------------------------------------------------------- on-disk cache

def cache_dir() -> Path | None:
    """The on-disk cache root, or None when ``TORCH_CUTE_OPS_CACHE_DIR`` is ``off``."""
    value = os.environ.get("TORCH_CUTE_OPS_CACHE_DIR", "")
    if value.lower() in ("0", "off", "none", "false"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "torch_cute_ops"


@functools.cache
def _environment_key() -> str:
    import torch

    key = json.dumps({**toolchain(), "torch": torch.__version__, "format": CACHE_FORMAT}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DiskEntry:
    library: Path
    sidecar: Path
    lock: Path


def _cache_folder() -> Path | None:
    """This installation's folder of the on-disk cache, made (with its parents) if need be and
    swept once per process; None when the cache is off, or refused or unusable (said once)."""
    root = None
    try:
        root = cache_dir()
        if root is None:
            return None
        folder = root / f"v{CACHE_FORMAT}-{_environment_key()}"
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # parents: a machine with no ~/.cache
        reason = untrusted_reason(root, must_own=True)
        if reason is None:
            folder.mkdir(mode=0o700, exist_ok=True)
            reason = untrusted_reason(folder, must_own=True)
    except (OSError, RuntimeError) as err:  # RuntimeError: no home folder
        _warn_once(f"on-disk kernel cache unavailable ({err}); kernels compile in memory only", key=f"folder:{root}")
        return None
    if reason:
        _warn_once(f"on-disk kernel cache refused: {reason}; kernels compile in memory only", key=f"folder:{root}")
        return None
    if folder not in _swept:
        _swept.add(folder)
        _sweep(folder)
    return folder


def _disk_entry(spec: KernelSpec) -> DiskEntry | None:
    """Where ``spec`` lives in the on-disk cache, or None when the cache is off or refused."""
    folder = _cache_folder()
    if folder is None:
        return None
    stem = f"{spec.name[:100]}-{spec.digest}"  # names hold dots ("factor=2.0"): no with_suffix
    return DiskEntry(folder / f"{stem}.so", folder / f"{stem}.json", folder / f"{stem}.lock")


def _check_disk_entry(spec: KernelSpec, entry: DiskEntry) -> str | None:
    """Why the files of ``entry`` must not be loaded, or None (missing files: 'missing')."""
    try:
        if not entry.sidecar.exists() or not entry.library.exists():
            return "missing"
        meta = json.loads(entry.sidecar.read_text())
    except (OSError, ValueError, RecursionError) as err:
        return f"unreadable sidecar ({str(err)[:200]})"
    if not isinstance(meta, dict):
        return f"its sidecar holds a JSON {type(meta).__name__}, not an object"
    if meta.get("spec") != repr(spec) or meta.get("symbol") != spec.symbol:
        return "it belongs to another variant"
    try:
        if not stat.S_ISREG(entry.library.lstat().st_mode):
            return "it is not a regular file"
        if entry.library.stat().st_size != meta.get("size") or _sha256(entry.library) != meta.get("sha256"):
            return "its size or sha256 differs from what was stored (truncated or replaced)"
        return untrusted_reason(entry.library, must_own=True)
    except OSError as err:
        return f"unreadable library ({err})"


def _load_disk(spec: KernelSpec, entry: DiskEntry) -> Callable | None:
    """The checked library of ``entry``, or None (missing, damaged or failing to load)."""
    if _check_disk_entry(spec, entry) is not None:
        return None
    start = time.perf_counter()
    try:
        fn = load_library_function(entry.library, spec.symbol)
    except Exception as err:  # noqa: BLE001 (a library that does not load is rebuilt)
        log.warning("torch_cute_ops: cached kernel %s does not load (%s); rebuilding it", entry.library, err)
        return None
    stats.load_seconds += time.perf_counter() - start
    stats.disk_hits += 1
    return fn


class LockTimeout(Exception):
    """Another process held a variant's lock for longer than this one would wait."""


def lock_timeout() -> float:
    """Seconds to wait for another process compiling the same variant (``TORCH_CUTE_OPS_LOCK_TIMEOUT``)."""
    value = os.environ.get("TORCH_CUTE_OPS_LOCK_TIMEOUT", "")
    try:
        seconds = float(value) if value else LOCK_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        _warn_once(f"TORCH_CUTE_OPS_LOCK_TIMEOUT={value!r} is not a number of seconds >= 0; "
                   f"waiting at most {LOCK_TIMEOUT_S:g} s", key="lock-timeout-value")
        seconds = LOCK_TIMEOUT_S
    return seconds


def _lock_holder(fd: int) -> str:
    """Who holds the lock open as ``fd``, from what its holder wrote into the file."""
    try:
        record = json.loads(os.pread(fd, 256, 0))
        pid, host = int(record["pid"]), str(record["host"])
    except (OSError, ValueError, TypeError, KeyError):
        return "a process that did not say which"
    if host != socket.gethostname():
        return f"pid {pid} on host {host}"
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return f"an unnamed process (pid {pid}, the last to name itself, has exited)"
    except (OSError, IndexError):
        return f"pid {pid}"
    return f"pid {pid} (stopped)" if state in ("T", "t") else f"pid {pid}"


def acquire_lock(path: Path, timeout: float) -> int:
    """An ``flock``-ed descriptor of ``path`` (made if need be), waiting at most ``timeout`` s.
    The holder writes its pid and host into the file, so that a waiter can name it; the kernel
    drops the lock when its holder dies, so a dead holder never blocks anyone. Raises OSError
    (the file cannot be made or locked) or LockTimeout."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        start, delay, told = time.monotonic(), 0.002, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
            if waited >= timeout:
                raise LockTimeout(f"kernel cache lock {path} is still held by {_lock_holder(fd)} "
                                  f"after {waited:.0f} s (TORCH_CUTE_OPS_LOCK_TIMEOUT={timeout:g})")
            if not told and waited >= LOCK_NOTICE_S:  # said once per process: concurrent starts wait too
                told = True
                _warn_once(f"waiting for kernel cache lock {path}, held by {_lock_holder(fd)} (compiling that "
                           f"variant; TORCH_CUTE_OPS_LOCK_TIMEOUT={timeout:g} s bounds the wait)", key="lock-wait")
            time.sleep(min(delay, timeout - waited))
            delay = min(delay * 2, 0.2)
    except BaseException:
        os.close(fd)
        raise
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
    with contextlib.suppress(OSError):  # a full disk: the lock holds without its record
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
    return fd


def release_lock(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)  # drops the flock


def _remove(*paths: Path) -> None:
    """Remove files (or empty folders where a file belongs); what cannot be removed stays."""
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            with contextlib.suppress(OSError):
                path.rmdir()
        except OSError as err:
            log.debug("torch_cute_ops: cannot remove %s (%s)", path, err)


_TMP_NAME = re.compile(r"(?P<stem>.+)\.\d+\.tmp(\.o|\.so|\.json)?")


def _sweep(folder: Path) -> None:
    """Remove the temporary files of stores that were killed: those of variants whose lock is
    free (a store holds its variant's lock while its temporary files exist)."""
    by_stem: dict[str, list[Path]] = {}
    try:
        for path in folder.iterdir():
            match = _TMP_NAME.fullmatch(path.name)
            if match:
                by_stem.setdefault(match["stem"], []).append(path)
    except OSError:
        return
    for stem, paths in by_stem.items():
        try:
            fd = acquire_lock(folder / f"{stem}.lock", timeout=0)
        except (OSError, LockTimeout):
            continue  # a store in progress, or a lock this process cannot take
        try:
            _remove(*paths)
        finally:
            release_lock(fd)


def store_to_disk(spec: KernelSpec, compiled, entry: DiskEntry) -> None:
    """Export, link and publish one variant (the caller holds the entry's lock)."""
    tmp = f"{entry.library.name[:-3]}.{os.getpid()}.tmp"
    obj, lib, side = (entry.library.with_name(tmp + suffix) for suffix in (".o", ".so", ".json"))
    try:
        compiled.export_to_c(str(obj), function_name=spec.symbol, export_only_tvm_ffi_symbols=True)
        link_library([obj], lib)
        meta = {"spec": repr(spec), "symbol": spec.symbol, "size": lib.stat().st_size, "sha256": _sha256(lib),
                **toolchain()}
        side.write_text(json.dumps(meta, indent=1))
        os.replace(lib, entry.library)  # atomic: readers never see half a file
        os.replace(side, entry.sidecar)
    finally:
        _remove(obj, lib, side)


# ------------------------------------------------------------------------------- compiling

def _refuse_while_tracing() -> None:
    import torch

    if torch.compiler.is_compiling():
        raise RuntimeError("torch_cute_ops: kernels are never compiled while torch.compile traces")
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None:
        raise RuntimeError("torch_cute_ops: kernels are never compiled under FakeTensorMode")


def _jit(spec: KernelSpec):
    from ..kernels import compile_spec

    start = time.perf_counter()
    compiled = compile_spec(spec)
    stats.compile_seconds += time.perf_counter() - start
    stats.compiles += 1
    return compiled


def _build_locked(spec: KernelSpec, entry: DiskEntry) -> Callable:
    """Holding the entry's lock: load what another process built meanwhile, else compile and store."""
    reason = _check_disk_entry(spec, entry)
    if reason is None:
        fn = _load_disk(spec, entry)
        if fn is not None:
            return fn
    elif reason != "missing":
        log.warning("torch_cute_ops: removing cached kernel %s: %s", entry.library.name, reason)
        stats.rejected += 1
    _remove(entry.library, entry.sidecar)
    compiled = _jit(spec)
    try:
        store_to_disk(spec, compiled, entry)
    except Exception as err:  # noqa: BLE001 (a full disk, a failed export or link: it runs from memory)
        _warn_once(f"compiled kernels are not cached on disk ({err}); they run from memory", key="store")
    return compiled


def _compile_or_load(spec: KernelSpec) -> Callable:
    entry = _disk_entry(spec)
    if entry is not None:
        fn = _load_disk(spec, entry)
        if fn is not None:
            return fn
    _refuse_while_tracing()
    if entry is None:
        return _jit(spec)
    try:
        fd = acquire_lock(entry.lock, lock_timeout())
    except LockTimeout as err:
        _warn_once(f"{err}; compiling this kernel in memory", key=f"lock-timeout:{entry.lock}")
        return _jit(spec)
    except OSError as err:
        _warn_once(f"kernel cache lock {entry.lock} cannot be used ({err}); kernels compile in memory",
                   key="lock-unusable")
        return _jit(spec)
    try:
        return _build_locked(spec, entry)
    finally:
        release_lock(fd)


def get_compiled(spec: KernelSpec) -> Callable:
    """The callable of ``spec``: from memory, a prebuilt library, the disk cache, or compiled."""
    fn = _memory.get(spec)
    if fn is not None:
        stats.memory_hits += 1
        return fn
    _refuse_while_tracing()  # kernels are resolved from real-tensor calls only
    with _lock:
        fn = _memory.get(spec)
        if fn is None:
            fn = _load_prebuilt(spec) or _compile_or_load(spec)
            _memory[spec] = fn
    return fn


def clear_memory_cache() -> None:
    """Forget what this process loaded, checked, swept and warned about (what a new process
    sees); for tests."""
    _memory.clear()
    _parsed_manifest.cache_clear()
    _library_reason.cache_clear()
    _swept.clear()
    _warned.clear()
