"""FP8 GEMM speed on the GPU: ``tco.scaled_mm`` per scale mode vs torch._scaled_mm (cuBLAS) and
vs this package's bf16 GEMM.

    python bench/bench_fp8.py --out DIR [--quick] [--shapes MxNxK,...] [--configs 128x128c2x1,...]

Random bf16 data quantized with ``torch_cute_ops.fp8`` (a (M, K) row-major, b (K, N) K-major:
``w.t()`` of a row-major (N, K) weight, the layout torch._scaled_mm needs too). Timed with
triton.testing.do_bench medians through the public APIs, providers interleaved over rounds:

* ``tensor``, ``row``: ``tco.scaled_mm`` with per-tensor / rowwise scales beside
  ``torch._scaled_mm`` with the same scales, bf16 output;
* ``block``: ``tco.scaled_mm`` with 1 x 128 / 128 x 128 blockwise scales (cuBLAS has no
  Hopper blockwise path in torch._scaled_mm);
* ``bf16``: ``tco.gemm`` on the bf16 operands; ``bare``: the rowwise launch plan called directly.

Shapes: the GEMM bench shapes (bench_gemm.py) and, with ``--deepgemm``, DeepGEMM's dense shapes,
printed next to the H800 figures DeepGEMM published (not measured here); with ``--decode``, a
serving batch's rows (bench_gemm.py's decode M shapes), summarized apart. ``--power`` adds
sustained loops beside the SM clock and board power (bench/power.py). Writes DIR/fp8.json.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_gemm import ANCHOR_SHAPES, DECODE_M_SHAPES, LLM_SHAPES, fmt_tflops  # noqa: E402
from bench.interleave import time_interleaved  # noqa: E402

# --power's default shapes: square, the long-K LLM ones (blockwise's lowest), a wide one
POWER_SHAPES = [(8192, 8192, 8192), (4096, 4096, 14336), (1024, 4096, 14336), (4096, 14336, 4096)]

# DeepGEMM README (February 2025), normal dense GEMMs, H800 SXM, blockwise scales, bf16 out:
# TFLOP/s as published there, not measured here
DEEPGEMM_H800 = {(128, 2112, 7168): 352, (128, 4096, 7168): 533, (128, 7168, 2048): 510,
                 (64, 2112, 7168): 206, (4096, 2112, 7168): 1058, (4096, 24576, 1536): 990,
                 (4096, 32768, 512): 590, (4096, 7168, 16384): 1358, (4096, 4096, 7168): 1304,
                 (4096, 7168, 2048): 1025}


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def _summarize(results, shapes, prefix, label):
    """Geomean and min of the ratios to torch._scaled_mm over the rows of ``shapes`` that ran."""
    rows = [r for r in results["rows"] if tuple(r["shape"]) in set(shapes)]
    if not rows:
        return
    for key in ("tensor/torch", "row/torch"):
        values = [r[key] for r in rows]
        results[f"{prefix}geomean {key}"], results[f"{prefix}min {key}"] = geomean(values), min(values)
    print(f"{label} ({len(rows)} shapes): " + "; ".join(
        f"{key} geomean {results[f'{prefix}geomean {key}']:.3f} (min {results[f'{prefix}min {key}']:.3f})"
        for key in ("tensor/torch", "row/torch")))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quick", action="store_true", help="anchor shapes only")
    parser.add_argument("--deepgemm", action="store_true", help="also DeepGEMM's published dense shapes")
    parser.add_argument("--decode", action="store_true", help="also decode-sized M (1 to 64) at the LLM widths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="", help="MxNxK,... instead of the grid (e.g. 8192x8192x8192)")
    parser.add_argument("--configs", default="", help="extra tile configs to time bare (rowwise and blockwise "
                        "plans), e.g. '128x128c2x2,pp128x128c2x1' (pp = ping-pong)")
    parser.add_argument("--power", action="store_true",
                        help="also sustained loops with the SM clock and board power (bench/power.py): rowwise, "
                        "blockwise and torch._scaled_mm rowwise at the --shapes given, else at POWER_SHAPES")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_CUTE_OPS_CACHE_DIR", "off")

    import torch_cute_ops as tco
    from torch_cute_ops import fp8
    from torch_cute_ops.ops import fallback
    from torch_cute_ops.runtime.gemm import SM90

    from bench.bench_gemm import parse_config

    extra = {name: parse_config(name) for name in args.configs.split(",") if name}

    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    results = {"device": dev, "torch": torch.__version__, "rows": []}
    shapes = ANCHOR_SHAPES if args.quick else list(dict.fromkeys(ANCHOR_SHAPES + LLM_SHAPES))
    if args.deepgemm:
        shapes += [s for s in DEEPGEMM_H800 if s not in shapes]
    if args.decode:
        shapes += [s for s in DECODE_M_SHAPES if s not in shapes]
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    cols = ["tco tensor", "torch tensor", "tco row", "torch row", "tco block", "tco bf16", "bare row"]
    print(f"{dev}\n{'M x N x K':>22} " + " ".join(f"{c:>12}" for c in cols)
          + f" {'tensor/torch':>12} {'row/torch':>9} {'block/row':>9} {'row/bf16':>8} {'DeepGEMM*':>9}")
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # nn.Linear's (N, K) weight
        (qa_t, sa_t), (qb_t, sb_t) = fp8.quantize_tensorwise(x), fp8.quantize_tensorwise(w.t(), operand="b")
        (qa_r, sa_r), (qb_r, sb_r) = fp8.quantize_rowwise(x), fp8.quantize_rowwise(w.t(), operand="b")
        block = k % 128 == 0
        if block:
            (qa_b, sa_b), (qb_b, sb_b) = fp8.quantize_blockwise(x), fp8.quantize_blockwise(w.t(), operand="b")
        wt = w.t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        plan = SM90.plan((m, k), qa_r.stride(), (k, n), qb_r.stride(), qa_r.dtype, None, None, torch.bfloat16, 0,
                         b_dtype=qb_r.dtype, scale_mode="row")
        calls = {
            "tco tensor": lambda: tco.scaled_mm(qa_t, qb_t, sa_t, sb_t),
            "torch tensor": lambda: torch._scaled_mm(qa_t, qb_t, sa_t, sb_t, out_dtype=torch.bfloat16),
            "tco row": lambda: tco.scaled_mm(qa_r, qb_r, sa_r, sb_r),
            "torch row": lambda: torch._scaled_mm(qa_r, qb_r, sa_r, sb_r, out_dtype=torch.bfloat16),
            "tco block": (lambda: tco.scaled_mm(qa_b, qb_b, sa_b, sb_b)) if block else None,
            "tco bf16": lambda: tco.gemm(x, wt),
            "bare row": lambda: plan(qa_r, qb_r, sa_r, sb_r, None, out),
        }
        for name, config in extra.items():
            operands = {"row": (qa_r, qb_r, sa_r, sb_r)}
            if block:
                operands["block"] = (qa_b, qb_b, sa_b, sb_b)
            for mode, (qa, qb, sa, sb) in operands.items():
                try:  # (a tile one scale mode does not take: 256 x 128 is blockwise only)
                    extra_plan = SM90.plan((m, k), qa.stride(), (k, n), qb.stride(), qa.dtype, None, None,
                                           torch.bfloat16, 0, config, b_dtype=qb.dtype, scale_mode=mode)
                except ValueError as error:
                    if "unsupported sm90 tile" not in str(error):
                        raise
                    continue
                if not isinstance(extra_plan, str):
                    calls[f"{mode} {name}"] = (lambda p=extra_plan, t=(qa, qb, sa, sb): p(*t, None, out))
        times = time_interleaved({name: fn for name, fn in calls.items() if fn is not None}, args.rounds)
        row = {"shape": [m, n, k]}
        row.update({name: tflops(m, n, k, ms) for name, ms in times.items()})
        row["tensor/torch"] = row["tco tensor"] / row["torch tensor"]
        row["row/torch"] = row["tco row"] / row["torch row"]
        row["block/row"] = row["tco block"] / row["tco row"] if block else None
        row["row/bf16"] = row["tco row"] / row["tco bf16"]
        row["deepgemm_h800_published"] = DEEPGEMM_H800.get((m, n, k))
        results["rows"].append(row)
        fmt = lambda v, w=12: fmt_tflops(v, w) if v is not None else f"{'-':>{w}}"  # noqa: E731
        ratio = lambda v, w: f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        print(f"{m:>6} x {n:>5} x {k:>5} " + " ".join(fmt(row.get(c)) for c in cols)
              + f" {ratio(row['tensor/torch'], 12)} {ratio(row['row/torch'], 9)} {ratio(row['block/row'], 9)}"
              + f" {ratio(row['row/bf16'], 8)} {fmt(row['deepgemm_h800_published'], 9)}  "
              + " ".join(f"{name} {row[name]:.0f}" for name in times if name not in cols))
    print()
    _summarize(results, ANCHOR_SHAPES + LLM_SHAPES, "", "GEMM bench shapes")
    _summarize(results, DECODE_M_SHAPES, "decode ", "decode M")
    results["fallbacks"] = {f"{op}: {reason}": n for (op, reason), n in fallback.counts().items()}
    print(f"fallbacks: {results['fallbacks'] or 'none'}")
    print("* DeepGEMM: TFLOP/s published for an H800 (blockwise scales), not measured here")
    if args.power:
        from bench.power import power_table

        results["power"] = power_table(shapes if args.shapes else POWER_SHAPES, power_calls(tco, fp8))
    (out_dir / "fp8.json").write_text(json.dumps(results, indent=1))


def power_calls(tco, fp8):
    """``--power``'s providers at one shape (bench/power.py): our rowwise and blockwise kernels
    and torch._scaled_mm rowwise."""
    def make_calls(m, n, k):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        (qa_r, sa_r), (qb_r, sb_r) = fp8.quantize_rowwise(x), fp8.quantize_rowwise(w.t(), operand="b")
        calls = {"row": lambda: tco.scaled_mm(qa_r, qb_r, sa_r, sb_r),
                 "torch row": lambda: torch._scaled_mm(qa_r, qb_r, sa_r, sb_r, out_dtype=torch.bfloat16)}
        if k % 128 == 0:
            (qa_b, sa_b), (qb_b, sb_b) = fp8.quantize_blockwise(x), fp8.quantize_blockwise(w.t(), operand="b")
            calls["block"] = lambda: tco.scaled_mm(qa_b, qb_b, sa_b, sb_b)
        return calls
    return make_calls


if __name__ == "__main__":
    main()
