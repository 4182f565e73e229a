"""Run the fuzz properties (tests/test_fuzz_*.py) on a GPU, for compute-sanitizer's memcheck:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --target-processes all \\
        python bench/fuzz_memcheck.py --examples 8

Each property runs ``--examples`` cases (hypothesis, derandomized: the same cases every run) on
cuda tensors; the script prints, per property and in total, the cases tried and the failures
(a wrong result, a crash, or an error that does not name its argument), and exits 1 when any
failed. memcheck's own ERROR SUMMARY follows at the end. Without the caching allocator
(PYTORCH_NO_CUDA_MEMORY_CACHING=1, set here unless ``--caching``) every tensor is its own
allocation, so an access past a tensor's end is reported, not hidden in a pooled block.
``--only NAME`` (repeatable) runs the properties whose label contains NAME.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

# property label -> (test module, test function, its pytest parameters)
PROPERTIES = [
    ("gemm", "test_fuzz_gemm", "test_gemm", dict(direct=False)),
    ("cute.gemm", "test_fuzz_gemm", "test_gemm", dict(direct=True)),
    ("linear", "test_fuzz_gemm", "test_linear", {}),
    ("scaled_mm", "test_fuzz_gemm", "test_scaled_mm", dict(direct=False)),
    ("fp8.quantizers", "test_fuzz_gemm", "test_fp8_quantizers", {}),
    ("fp8.linear", "test_fuzz_gemm", "test_fp8_linear", {}),
    ("flash_attn_func", "test_fuzz_attention", "test_flash_attn_func", {}),
    ("cute.flash_attn_fwd/bwd", "test_fuzz_attention", "test_cute_flash_attn_fwd_bwd", {}),
    ("scaled_dot_product_attention", "test_fuzz_attention", "test_scaled_dot_product_attention", {}),
    ("flash_attn_varlen_func", "test_fuzz_packed", "test_varlen", dict(public=True)),
    ("cute.flash_attn_varlen_fwd/bwd", "test_fuzz_packed", "test_varlen", dict(public=False)),
    ("flash_attn_with_kvcache", "test_fuzz_packed", "test_kvcache", dict(public=True)),
    ("cute.flash_attn_kvcache", "test_fuzz_packed", "test_kvcache", dict(public=False)),
    ("softcap on a warm layout", "test_fuzz_cached_checks", "test_softcap_is_checked_on_a_warm_layout",
     dict(kind="flash_attn_func")),
    ("cu_seqlens rechecked", "test_fuzz_cached_checks",
     "test_checked_cu_seqlens_are_rechecked_for_another_packed_length", dict(public=True)),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=8,
                        help="cases per property, about (each property's CI count of 20-60, scaled by examples / 40)")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument("--only", action="append", default=[], help="run the properties whose label contains this")
    parser.add_argument("--caching", action="store_true", help="keep PyTorch's caching allocator")
    args = parser.parse_args()
    if not args.caching:
        os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    # fuzz_support reads the scale at import: a profile of --examples cases per property
    os.environ["TORCH_CUTE_OPS_FUZZ_SCALE"] = str(args.examples / 40)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import importlib

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu)")
        return 2
    import fuzz_support

    failures = 0
    for label, module, name, params in PROPERTIES:
        if args.only and not any(part in label for part in args.only):
            continue
        test = getattr(importlib.import_module(module), name)
        before, start = fuzz_support.TALLY.cases, time.perf_counter()
        fuzz_support.RUNNING.append(label)
        try:
            test(device=args.device, **params)
            outcome = "ok"
        except Exception as e:  # a failing property: report it and go on with the next
            failures += 1
            outcome = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
            traceback.print_exc(limit=3)
        finally:
            fuzz_support.RUNNING.pop()
        tried = fuzz_support.TALLY.cases - before
        print(f"{label}: {tried} cases tried, {outcome} ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"fuzz_memcheck: {fuzz_support.TALLY.cases} cases tried, {failures} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
