"""GEMM speed on the GPU: this package's kernel vs cuBLAS (torch.matmul) and QuACK.

    python bench/bench_gemm.py --out DIR [--quick]

Times every shape with triton.testing.do_bench (medians, warmed-up JIT, random bf16
data, providers interleaved over ``--rounds`` rounds), A (M, K) and B (K, N) row-major, through
the public API (``tco.gemm``) beside cuBLAS (``torch.matmul``) and QuACK
(``quack.gemm_interface.gemm``), plus a bare-kernel column (the cached launch plan called
directly: no validation, dispatch or allocation), and prints TFLOP/s and ratios; also the
fused bias + gelu_tanh epilogue against torch.addmm + F.gelu, the first-call compile time, and
the eager per-call host time at 64x64x64 (``torch_cute_ops.measure.host_times``). ``--chain``
adds chains of GEMMs issued back to back as a model's layers do (x <- x @ W_i, eager and as a
CUDA graph replay, us per GEMM), where a GEMM's set-up overlaps the previous one's tail.
``--power`` adds sustained loops beside the SM clock and board power (bench/power.py). Writes
DIR/gemm.json (and DIR/gemm.png when matplotlib is there).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.interleave import time_interleaved  # noqa: E402

ANCHOR_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 1024), (16384, 8192, 4096),
                 (4096, 14336, 4096), (1024, 4096, 4096)]
LLM_NK = [(4096, 4096), (14336, 4096), (4096, 14336), (12288, 4096)]
LLM_SHAPES = [(m, n, k) for m in (1024, 4096, 16384) for n, k in LLM_NK]
# few rows at LLM widths (#16's bar set): too few 128-row tiles to fill the GPU
SMALL_M_SHAPES = [(m, n, k) for m in (128, 256, 512) for n, k in LLM_NK]
# decode-sized M (a serving batch's tokens): B is all the bytes; #16 asks for a measurement, not a bar
DECODE_M_SHAPES = [(m, n, k) for m in (1, 16, 32, 64) for n, k in LLM_NK]
# just over one wave of 128-row tiles, odd numbers of tile rows (a prefill chunk's tokens): not in
# the bar set; 0.67-0.89x cuBLAS when first measured (bench/NOTES.md, 2026-11-25,
# "96-column tiles; the two-wave gap")
TWO_WAVE_SHAPES = [(m, n, k) for m in (384, 640, 1152) for n, k in LLM_NK]
CHAIN_ROWS, CHAIN_WIDTH, CHAIN_DEPTH = (1, 16, 64, 128, 256), 4096, 8
FUSED_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096), (16384, 4096, 4096)]
# --power's default shapes: square, short K, the fused ones' widest, few rows
POWER_SHAPES = [(8192, 8192, 8192), (8192, 8192, 1024), (4096, 14336, 4096), (256, 12288, 4096), (4096, 4096, 4096)]


def quack_runs(quack, a, b) -> bool:
    """QuACK takes this shape (it may refuse a few-row or unaligned one): its column is left out if not."""
    try:
        quack(a, b)
        return True
    except Exception as err:
        print(f"QuACK skipped at {tuple(a.shape)} x {tuple(b.shape)}: {type(err).__name__}: {str(err)[:100]}")
        return False


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def fmt_tflops(value, width=6):
    """Three significant digits down to a decode step's single-digit TFLOP/s."""
    return f"{value:{width}.0f}" if value >= 100 else f"{value:{width}.1f}" if value >= 10 else f"{value:{width}.2f}"


def chain_table(gemm, rounds):
    """us per GEMM of CHAIN_DEPTH back-to-back GEMMs (x <- x @ W_i, CHAIN_WIDTH square weights)
    through ``gemm`` and torch.matmul, eager and replayed as a CUDA graph."""
    rows = []
    print(f"\n{'chain of ' + str(CHAIN_DEPTH):>22} {'eager':>7} {'cuBLAS':>7} {'graph':>7} {'cuBLAS':>7}  us per GEMM")
    for m in CHAIN_ROWS:
        x = torch.randn(m, CHAIN_WIDTH, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(CHAIN_WIDTH, CHAIN_WIDTH, device="cuda", dtype=torch.bfloat16) / CHAIN_WIDTH ** 0.5
                   for _ in range(CHAIN_DEPTH)]

        def chain(matmul):
            def run():
                y = x
                for w in weights:
                    y = matmul(y, w)
                return y
            return run

        calls = {"ours": chain(gemm), "cublas": chain(torch.matmul)}
        for name in ("ours", "cublas"):
            calls[name]()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                calls[name]()
            calls[f"{name} graph"] = graph.replay
        times = {name: ms * 1e3 / CHAIN_DEPTH for name, ms in time_interleaved(calls, rounds).items()}
        rows.append({"rows": m, **times})
        print(f"{m:>6} x {CHAIN_WIDTH:>5} x {CHAIN_WIDTH:>5} {times['ours']:7.2f} {times['cublas']:7.2f} "
              f"{times['ours graph']:7.2f} {times['cublas graph']:7.2f}")
    return rows


def quack_gemm():
    try:
        from quack.gemm_interface import gemm
    except Exception as err:  # not installed, or it fails to import on this stack
        print(f"QuACK unavailable: {err}")
        return None
    return lambda a, b: gemm(a, b, tuned=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quick", action="store_true", help="anchor shapes only")
    parser.add_argument("--shapes", default="", help="MxNxK,... instead of the grid (e.g. 128x4096x4096)")
    parser.add_argument("--configs", default="", help="extra configs to time per shape, e.g. "
                        "'128x256c2x1,pp128x128c2x1,sw64x16c1x1,128x256c2x1sk' (pp = ping-pong, sw = swapped "
                        "operands, sk = stream-K)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-fused", action="store_true", help="skip the fused-epilogue table")
    parser.add_argument("--chain", action="store_true", help="also chains of back-to-back GEMMs (eager, graph)")
    parser.add_argument("--power", action="store_true",
                        help="also sustained loops with the SM clock and board power (bench/power.py) at the "
                        "--shapes given, else at POWER_SHAPES")
    parser.add_argument("--stream-k", action="store_true",
                        help="a column with the heuristic's config toggled to/from stream-K (bare), where it applies")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_CUTE_OPS_CACHE_DIR", "off")

    import torch_cute_ops as tco
    from torch_cute_ops.runtime.gemm import SM90
    from torch_cute_ops.runtime.gemm_config import choose_config

    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    dtype = torch.bfloat16
    quack = quack_gemm()
    results = {"device": dev, "torch": torch.__version__, "gemm": [], "fused": []}

    def ours(a, b, bias=None, activation=None, config=None):
        """The public API; with ``config``, the bare kernel of that config."""
        if config is None:
            return lambda: tco.gemm(a, b, bias, activation)
        return bare(a, b, bias, activation, config)

    def bare(a, b, bias=None, activation=None, config=None):
        """The launch plan the op caches, called directly on a preallocated output."""
        out = torch.empty(a.shape[0], b.shape[1], device="cuda", dtype=dtype)
        bias_layout = None if bias is None else (tuple(bias.shape), bias.stride())
        plan = SM90.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), dtype, bias_layout, activation,
                         dtype, 0, config)
        return lambda: plan(a, b, bias, out, 1.0)

    extra = {name: parse_config(name) for name in args.configs.split(",") if name}

    # first-call compile time of one fresh variant (no disk cache)
    a = torch.randn(256, 256, device="cuda", dtype=dtype)
    start = time.perf_counter()
    ours(a, a)()
    torch.cuda.synchronize()
    results["first_call_s"] = time.perf_counter() - start

    shapes = ANCHOR_SHAPES if args.quick else list(dict.fromkeys(ANCHOR_SHAPES + LLM_SHAPES + SMALL_M_SHAPES
                                                                 + DECODE_M_SHAPES + TWO_WAVE_SHAPES))
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    print(f"{dev}, {sm_count} SMs\n{'M x N x K':>22} {'config':>16} {'tco':>6} {'cuBLAS':>6} {'QuACK':>6} "
          f"{'/cuBLAS':>7} {'/QuACK':>6} {'bare':>6}")
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        c = choose_config("sm_90a", m, n, k, 1, sm_count)
        config_short = (f"{'pp' * c.pingpong}{'sw' * c.swap_ab}{c.tile_m}x{c.tile_n} c{c.cluster_m}x{c.cluster_n}"
                        f"{' sk' * c.stream_k}")
        row = {"shape": [m, n, k], "config_short": config_short}
        calls = {"ours": ours(a, b), "cublas": lambda: torch.matmul(a, b), "bare": bare(a, b)}
        if quack and quack_runs(quack, a, b):
            calls["quack"] = lambda: quack(a, b)
        shape_configs = dict(extra)
        if args.stream_k and not c.pingpong:
            shape_configs["toggled-sk"] = dataclasses.replace(c, stream_k=not c.stream_k)
        for name, config in list(shape_configs.items()):
            try:
                calls[f"config {name}"] = ours(a, b, config=config)
            except Exception as error:  # a config the kernel refuses: drop its column
                print(f"config {name} refused: {error}")
                del shape_configs[name]
                extra.pop(name, None)
        times = time_interleaved(calls, args.rounds)
        row.update({name: tflops(m, n, k, times[name]) for name in ("ours", "cublas", "bare")})
        row["quack"] = tflops(m, n, k, times["quack"]) if "quack" in times else None
        row["configs"] = {name: tflops(m, n, k, times[f"config {name}"]) for name in shape_configs}
        results["gemm"].append(row)
        quack_cols = (f"{fmt_tflops(row['quack'])} {row['ours'] / row['quack']:6.2f}" if row["quack"]
                      else f"{'-':>6} {'-':>6}")
        print(f"{m:>6} x {n:>5} x {k:>5} {row['config_short']:>16} {fmt_tflops(row['ours'])} "
              f"{fmt_tflops(row['cublas'])} {quack_cols.split()[0]:>6} {row['ours'] / row['cublas']:7.3f} "
              f"{quack_cols.split()[1]:>6} {fmt_tflops(row['bare'])}  "
              + " ".join(f"{name} {fmt_tflops(t, 0)}" for name, t in row["configs"].items()))

    # the fused epilogue against our plain GEMM timed in the same rounds (the bar: within 2%)
    print(f"\n{'fused bias+gelu_tanh':>22} {'ours':>6} {'plain':>6} {'addmm+gelu':>10} {'/plain':>7} {'/addmm':>7}")
    for m, n, k in [] if args.no_fused else FUSED_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        calls = {"ours": ours(a, b, bias, "gelu_tanh"), "plain": ours(a, b),
                 "eager": lambda: F.gelu(torch.addmm(bias, a, b), approximate="tanh")}
        calls.update({f"config {name}": ours(a, b, bias, "gelu_tanh", c) for name, c in extra.items()})
        times = time_interleaved(calls, args.rounds)
        ours_t, plain_t, eager_t = (tflops(m, n, k, times[name]) for name in ("ours", "plain", "eager"))
        configs = {name: tflops(m, n, k, times[f"config {name}"]) for name in extra}
        results["fused"].append({"shape": [m, n, k], "ours": ours_t, "plain": plain_t, "addmm_gelu": eager_t,
                                 "configs": configs})
        print(f"{m:>6} x {n:>5} x {k:>5} {ours_t:6.0f} {plain_t:6.0f} {eager_t:10.0f} {ours_t / plain_t:7.3f} "
              f"{ours_t / eager_t:7.2f}  " + " ".join(f"{name} {t:.0f}" for name, t in configs.items()))

    if args.chain:
        results["chain_us_per_gemm"] = chain_table(tco.gemm, args.rounds)
    if args.power:
        from bench.power import power_table

        results["power"] = power_table(shapes if args.shapes else POWER_SHAPES, power_calls(tco, quack))

    results["host_overhead_us"] = host_overhead()
    # #16's bar is over the 15 grid shapes plus the few-row ones; the other groups are reported
    # apart, and shapes given with --shapes outside every group as "other"
    bar_set = set(ANCHOR_SHAPES + LLM_SHAPES + SMALL_M_SHAPES)
    group_of = {**{shape: "other" for shape in map(tuple, (r["shape"] for r in results["gemm"]))},
                **{shape: "two waves" for shape in TWO_WAVE_SHAPES}, **{shape: "decode M" for shape in DECODE_M_SHAPES},
                **{shape: "bar set" for shape in bar_set}}
    groups = {group: [r for r in results["gemm"] if group_of[tuple(r["shape"])] == group]
              for group in ("bar set", "decode M", "two waves", "other")}
    summary = []
    for group, rows in groups.items():
        if not rows:
            continue
        ratios = [r["ours"] / r["cublas"] for r in rows]
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        results[f"{group.replace(' ', '_')}_geomean_vs_cublas"] = geomean
        results[f"{group.replace(' ', '_')}_min_vs_cublas"] = min(ratios)
        summary.append(f"{group} ({len(rows)} shapes): geomean vs cuBLAS {geomean:.3f}, min {min(ratios):.3f}")
    print("\n" + "; ".join(summary) + f"; first call (compile) {results['first_call_s']:.2f} s; host overhead "
          "(us/call) " + ", ".join(f"{k} {v:.1f}" for k, v in results["host_overhead_us"].items()))
    (out_dir / "gemm.json").write_text(json.dumps(results, indent=1))
    plot(results, out_dir)


def power_calls(tco, quack):
    """``--power``'s providers at one shape (bench/power.py): tco.gemm, cuBLAS and QuACK, and the
    fused bias + gelu_tanh epilogue at the fused shapes."""
    def make_calls(m, n, k):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        calls = {"tco": lambda: tco.gemm(a, b), "cuBLAS": lambda: torch.matmul(a, b)}
        if quack and quack_runs(quack, a, b):
            calls["QuACK"] = lambda: quack(a, b)
        if (m, n, k) in FUSED_SHAPES:
            calls["tco fused"] = lambda: tco.gemm(a, b, bias, "gelu_tanh")
        return calls
    return make_calls


def parse_config(name):
    """'pp128x192c2x1' -> GemmConfig(128, 192, 2, 1, pingpong=True); 'sw64x16c1x1' swaps the
    operands (tile_m over N, tile_n over M); a trailing 'sk' splits the last waves along K
    (stream-K)."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    pingpong, swap_ab, stream_k = name.startswith("pp"), name.startswith("sw"), name.endswith("sk")
    tile, cluster = name.removeprefix("pp").removeprefix("sw").removesuffix("sk").split("c")
    return GemmConfig(*map(int, tile.split("x")), *map(int, cluster.split("x")), pingpong=pingpong,
                      swap_ab=swap_ab, stream_k=stream_k)


def host_overhead():
    """Eager per-call host time at 64x64x64 (public API, op, bare launch, torch.matmul)."""
    from torch_cute_ops.measure import host_times

    return host_times()["gemm 64^3"]


def plot(results, out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = results["gemm"]
    labels = ["x".join(map(str, r["shape"])) for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.7), 4))
    for i, (key, name) in enumerate([("ours", "torch-cute-ops"), ("cublas", "cuBLAS"), ("quack", "QuACK")]):
        if any(r.get(key) is not None for r in rows):  # a shape QuACK refused plots as 0
            ax.bar([x + (i - 1) * 0.27 for x in xs], [r.get(key) or 0 for r in rows], 0.27, label=name)
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.set_title(results["device"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "gemm.png", dpi=120)


if __name__ == "__main__":
    main()
