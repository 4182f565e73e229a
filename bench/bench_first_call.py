"""First-call time of each op in a fresh process: with an empty on-disk cache (the DSL compiles)
and again with the cache the first run left (the compiled object is loaded).

    python bench/bench_first_call.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, time, torch
import torch_cute_ops as tco
from torch_cute_ops.kernels.common import compile_cache
dev, bf = "cuda", torch.bfloat16
a, b = torch.randn(4096, 4096, device=dev, dtype=bf), torch.randn(4096, 4096, device=dev, dtype=bf)
q = torch.randn(2, 2048, 16, 128, device=dev, dtype=bf, requires_grad=True)
cases = {
    "gemm": lambda: tco.gemm(a, b),
    "gemm+bias+gelu": lambda: tco.gemm(a, b, b[0], "gelu_tanh"),
    "flash_attn_fwd": lambda: tco.flash_attn_func(q, q, q, causal=True),
    "flash_attn_bwd": lambda: tco.flash_attn_func(q, q, q, causal=True).sum().backward(),
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
times["_cache"] = {"compiles": compile_cache.stats.compiles, "disk_hits": compile_cache.stats.disk_hits}
print(json.dumps(times))
"""


def run_child(cache_dir: str) -> dict:
    env = {**os.environ, "TORCH_CUTE_OPS_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold, warm = run_child(cache), run_child(cache)
    print(f"{'op':<18} {'cold cache: first call':>24} {'disk cache: first call':>24} {'steady call':>12}")
    for name in (k for k in cold if not k.startswith("_")):
        print(f"{name:<18} {cold[name]['first_s']:>22.2f} s {warm[name]['first_s']:>22.3f} s "
              f"{warm[name]['second_s'] * 1e3:>9.2f} ms")
    print(f"cold run: {cold['_cache']}, warm run: {warm['_cache']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "first_call.json").write_text(json.dumps({"cold": cold, "warm": warm}, indent=2))


if __name__ == "__main__":
    main()
