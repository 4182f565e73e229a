"""A stand-in for the CuTe DSL's compile, export, link and load steps, for the cache fault tests.

A "compiled" variant multiplies by its spec's ``factor``; its "library" is a JSON file mapping
symbols to factors. :func:`install` puts these steps where :mod:`torch_cute_ops.runtime.cache`
calls them, so the cache's own code (keys, locks, sidecars, manifests, sweeps) runs unchanged
while a compile takes no time. Each compile appends ``"<pid> <digest>"`` to the file named by
``FAKE_COMPILE_LOG`` (when set), so tests count compiles across processes.

``FAKE_FAULT=<stage>:<action>`` (or :data:`faults`) makes a stage (``compile``, ``export``,
``link``) misbehave after writing half of its file: ``stop`` (SIGSTOP itself), ``kill``
(SIGKILL itself) or ``enospc`` (raise the full-disk error).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from pathlib import Path

faults: dict[str, str] = dict([os.environ["FAKE_FAULT"].split(":")]) if os.environ.get("FAKE_FAULT") else {}


def _fault(stage: str, path) -> None:
    action = faults.get(stage)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _write_in_halves(path, text: str, stage: str) -> None:
    with open(path, "w") as handle:
        handle.write(text[: len(text) // 2])
        handle.flush()
        _fault(stage, path)
        handle.write(text[len(text) // 2:])


class Scale:
    """What a variant computes: ``x * factor``."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, x):
        return x * self.factor


class FakeCompiled(Scale):
    def export_to_c(self, path, function_name: str, export_only_tvm_ffi_symbols: bool = True) -> None:
        _write_in_halves(path, json.dumps({function_name: self.factor}), "export")


def compile_spec(spec, dump_dir=None) -> FakeCompiled:
    time.sleep(float(os.environ.get("FAKE_COMPILE_SECONDS", "0")))
    log = os.environ.get("FAKE_COMPILE_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()} {spec.digest}\n")
    _fault("compile", None)
    return FakeCompiled(spec["factor"])


def link_library(objects, library) -> None:
    symbols = {}
    for obj in objects:
        symbols.update(json.loads(Path(obj).read_text()))
    _write_in_halves(library, json.dumps({"symbols": symbols}), "link")


def load_library_function(library, symbol: str) -> Scale:
    return Scale(json.loads(Path(library).read_text())["symbols"][symbol])


def install(monkeypatch=None) -> None:
    """Route the cache's compile, link and load steps here (through ``monkeypatch`` in a test)."""
    from torch_cute_ops import kernels
    from torch_cute_ops.runtime import cache

    set_attr = monkeypatch.setattr if monkeypatch is not None else setattr
    set_attr(kernels, "compile_spec", compile_spec)
    set_attr(cache, "link_library", link_library)
    set_attr(cache, "load_library_function", load_library_function)


def stress(processes: int, threads: int, factors: list[float], out_dir: str) -> None:
    """Fork ``processes`` workers at once, each running ``threads`` threads that resolve every
    factor's variant in their own order; each worker writes ``<out_dir>/<pid>.json``: the
    (factor, result of f(3)) pairs it saw and any error. One import, so the fork is quick."""
    from torch_cute_ops.runtime import cache
    from torch_cute_ops.runtime.spec import KernelSpec

    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:  # a worker: no threads existed before the fork
            seen, errors = [], []

            def resolve(order):
                try:
                    for factor in order:
                        fn = cache.get_compiled(KernelSpec.make("fake", "sm_90a", factor=factor))
                        seen.append((factor, fn(3.0)))
                except Exception as err:  # noqa: BLE001 (reported to the test)
                    errors.append(repr(err))

            workers = [threading.Thread(target=resolve, args=(factors[i % len(factors):] + factors[:i % len(factors)],))
                       for i in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            Path(out_dir, f"{os.getpid()}.json").write_text(json.dumps(
                {"seen": seen, "errors": errors, "compiles": cache.stats.compiles, "disk_hits": cache.stats.disk_hits}))
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
