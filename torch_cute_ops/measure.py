"""Start-up and per-call host costs, measured the way a user meets them.

Shared by the main job (``python -m torch_cute_ops``) and ``bench/bench_first_call.py`` /
``bench/bench_host.py``:

* :func:`import_cost`: ``import torch_cute_ops`` on top of ``import torch`` in fresh
  processes, and whether it pulled in ``torch._dynamo`` or the CuTe DSL;
* :func:`first_calls`: the first call of each op in a fresh process, given a cache folder and
  an optional prebuilt-library folder (cold = empty cache, the DSL compiles; warm = the cache
  a previous process left; AOT = the prebuilt library);
* :func:`host_times`: eager per-call wall time of tiny problems, where the host path is all
  there is, against the PyTorch calls they replace.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]

_IMPORT_CHILD = r"""
import sys, time
start = time.perf_counter()
import torch
after_torch = time.perf_counter()
if {with_package}:
    import torch_cute_ops
end = time.perf_counter()
heavy = sorted({{m.split(".")[0] if m.startswith("cutlass") else m for m in sys.modules
               if m == "torch._dynamo" or m == "cutlass" or m.startswith("cutlass.")}})
print(repr((after_torch - start, end - after_torch, heavy)))
"""


def _run(code: str, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_ROOT,
                          env={**os.environ, **(env or {})})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    return proc.stdout.strip().splitlines()[-1]


def import_cost(runs: int = 5) -> dict:
    """Median seconds of ``import torch`` and of ``import torch_cute_ops`` after it (fresh
    processes, interleaved), and the heavy modules the package import loaded."""
    torch_only, package, heavy = [], [], []
    for _ in range(runs):
        t, _, _ = eval(_run(_IMPORT_CHILD.format(with_package=False)))
        torch_only.append(t)
        t, extra, heavy = eval(_run(_IMPORT_CHILD.format(with_package=True)))
        package.append(extra)
    return {"import_torch_s": statistics.median(torch_only), "import_package_s": statistics.median(package),
            "heavy_modules": heavy}


_FIRST_CALL_CHILD = r"""
import json, sys, time
import torch
import torch_cute_ops as tco
from torch_cute_ops.runtime import cache
dev, bf = "cuda", torch.bfloat16
a, b = torch.randn(4096, 4096, device=dev, dtype=bf), torch.randn(4096, 4096, device=dev, dtype=bf)
q = torch.randn(2, 2048, 16, 128, device=dev, dtype=bf, requires_grad=True)
out = tco.flash_attn_func(q, q, q, causal=True)
dout = torch.randn_like(out)
x = torch.ones(2, device=dev, requires_grad=True)
torch.autograd.grad(x * 2, x, torch.ones_like(x))  # torch's first grad_outputs imports sympy (seconds): not ours
cases = {
    "gemm": lambda: tco.gemm(a, b),
    "gemm+bias+gelu": lambda: tco.gemm(a, b, b[0], "gelu_tanh"),
    "flash_attn_fwd": lambda: tco.flash_attn_func(q, q, q, causal=False),
    "flash_attn_bwd": lambda: torch.autograd.grad(out, q, dout, retain_graph=True),
}
torch.cuda.synchronize()
times = {}
for name, fn in cases.items():
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    times[name] = {"first_s": first, "second_s": time.perf_counter() - start}
s = cache.stats
times["_cache"] = {"compiles": s.compiles, "disk_hits": s.disk_hits, "aot_hits": s.aot_hits,
                   "cutlass_imported": "cutlass" in sys.modules}
print(json.dumps(times))
"""


def first_calls(cache_dir: str, aot_dir: str | None = None) -> dict:
    """First and second call of each op (s) in a fresh process; ``_cache`` says where the
    kernels came from. The causal forward that feeds the backward, and one plain torch backward
    (torch's first one imports sympy), run before the timings."""
    env = {"TORCH_CUTE_OPS_CACHE_DIR": cache_dir, "TORCH_CUTE_OPS_AOT_DIR": aot_dir or ""}
    return json.loads(_run(_FIRST_CALL_CHILD, env))


def _per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Median over rounds of the wall time per call of an eager loop, ending on a sync."""
    import torch

    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def host_times(calls: int = 2000) -> dict[str, dict[str, float]]:
    """us per eager call: the public API, the op through the dispatcher, and the bare
    launch, against the PyTorch call each replaces (gemm 64^3 bf16; attention B1 S128 H8 D64)."""
    import torch
    import torch.nn.functional as F

    import torch_cute_ops as tco
    from torch_cute_ops.ops import dispatch

    dev, bf = torch.device("cuda"), torch.bfloat16
    a = torch.randn(64, 64, device=dev, dtype=bf)
    out = torch.empty(64, 64, device=dev, dtype=bf)
    gemm_plan = dispatch.kernel_for("gemm", dev).plan((64, 64), (64, 1), (64, 64), (64, 1), bf, None, None, bf,
                                                       dispatch.device_index(dev))
    gemm = {
        "torch.matmul": lambda: torch.matmul(a, a),
        "tco.gemm": lambda: tco.gemm(a, a),
        "torch.ops.cute.gemm": lambda: torch.ops.cute.gemm(a, a),
        "bare launch": lambda: gemm_plan(a, a, None, out, 1.0),
    }
    q = torch.randn(1, 128, 8, 64, device=dev, dtype=bf)
    qt = q.transpose(1, 2)
    o, lse = torch.empty_like(q), torch.empty(1, 8, 128, device=dev)
    attn_plan = dispatch.kernel_for("flash_attn_fwd", dev).plan_fwd(q, q, q, False)
    attention = {
        "torch SDPA": lambda: F.scaled_dot_product_attention(qt, qt, qt),
        "tco.flash_attn_func": lambda: tco.flash_attn_func(q, q, q),
        "tco.scaled_dot_product_attention": lambda: tco.scaled_dot_product_attention(qt, qt, qt),
        "torch.ops.cute.flash_attn_fwd": lambda: torch.ops.cute.flash_attn_fwd(q, q, q, 0.125, False),
        "bare launch": lambda: attn_plan(q, q, q, o, lse, 0.125),
    }
    return {"gemm 64^3": {k: _per_call_us(f, calls) for k, f in gemm.items()},
            "attention B1 S128 H8 D64": {k: _per_call_us(f, calls) for k, f in attention.items()}}


def _wall_and_gpu_us(fn, calls: int, rounds: int = 5) -> tuple[float, float]:
    """(wall, GPU-stream) us per call of an eager loop: the wall time ends on a sync; the stream
    time spans CUDA events around the loop. Wall well above the stream time: host-bound."""
    import torch

    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    walls, gpus = [], []
    for _ in range(rounds):
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        start_event.record()
        for _ in range(calls):
            fn()
        end_event.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) / calls * 1e6)
        gpus.append(start_event.elapsed_time(end_event) / calls * 1e3)
    return statistics.median(walls), statistics.median(gpus)


def decode_host_times(calls: int = 1000, keys: int = 256) -> dict[str, tuple[float, float]]:
    """One decode step's attention (B8, one query token, GQA 32/8, D128, ``keys`` cached keys):
    (wall, GPU-stream) us per eager call for torch's SDPA, the public function, the op and the
    bare launch; and the public function when the keys grow by one every call (a dynamic cache:
    a new layout, so a new launch plan, each call)."""
    import torch
    import torch.nn.functional as F

    import torch_cute_ops as tco
    from torch_cute_ops.ops import dispatch

    dev, bf = torch.device("cuda"), torch.bfloat16
    k_cache = torch.randn(8, keys + calls + 200, 8, 128, device=dev, dtype=bf)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(8, 1, 32, 128, device=dev, dtype=bf)
    k, v = k_cache[:, :keys], v_cache[:, :keys]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out, lse = torch.empty_like(q), torch.empty(8, 32, 1, device=dev)
    plan = dispatch.kernel_for("flash_attn_fwd", dev).plan_fwd(q, k, v, False)
    growing = iter(range(keys, keys + 10 * calls))
    cases = {
        "torch SDPA": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
        "tco.flash_attn_func": lambda: tco.flash_attn_func(q, k, v, causal=True),
        "torch.ops.cute.flash_attn_fwd": lambda: torch.ops.cute.flash_attn_fwd(q, k, v, 128 ** -0.5, True),
        "bare launch": lambda: plan(q, k, v, out, lse, 128 ** -0.5),
    }
    results = {name: _wall_and_gpu_us(fn, calls) for name, fn in cases.items()}

    def grow():
        n = next(growing)
        return tco.flash_attn_func(q, k_cache[:, :n], v_cache[:, :n], causal=True)

    results["tco.flash_attn_func, keys + 1 per call"] = _wall_and_gpu_us(grow, calls // 10, rounds=3)
    return results
