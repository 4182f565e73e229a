"""Attention forward / backward speed: our CuTe kernels vs SDPA (cuDNN, flash) and FA4.

    python bench/bench_attention.py [--backward] [--quick] [--rounds N] [--out DIR]
    python bench/bench_attention.py --varlen [bench_varlen.py's options]   # packed sequences vs FA4
    python bench/bench_attention.py --window [bench_window.py's options]   # sliding window vs FA4

Grid: FlashAttention-3's (16k tokens in total, hidden 2048, head dims 64/128/256,
seqlen 512..16k, causal and not), which holds every attention shape of the
anchor table. bf16, (B, S, H, D) tensors, random inputs, warmed-up JIT,
``triton.testing.do_bench`` medians, all providers timed side by side per shape.
TFLOP/s counts 4*B*S*S*H*D for the forward (half when causal) and 2.5x that for
the backward. Prints a table with ratios, writes JSON (and a PNG when matplotlib
is there) to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOTAL_TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"B{self.batch} S{self.seqlen} H{self.heads} D{self.head_dim} {mask}"

    def fwd_flops(self) -> float:
        flops = 4.0 * self.batch * self.seqlen * self.seqlen * self.heads * self.head_dim
        return flops / 2 if self.causal else flops


@dataclass
class Row:
    shape: Shape
    ms: dict = field(default_factory=dict)  # provider -> median ms (median over rounds)
    ms_rounds: dict = field(default_factory=dict)  # provider -> median ms of each round
    notes: dict = field(default_factory=dict)  # provider -> why it was skipped
    extra_mem_mb: dict = field(default_factory=dict)  # provider -> peak extra MiB


def grid(quick: bool, head_dims=HEAD_DIMS, seqlens=SEQLENS) -> list[Shape]:
    shapes = []
    for head_dim in head_dims:
        heads = HIDDEN // head_dim
        for seqlen in seqlens:
            if quick and seqlen not in (1024, 4096, 16384):
                continue
            for causal in (False, True):
                shapes.append(Shape(TOTAL_TOKENS // seqlen, seqlen, heads, head_dim, causal))
    return shapes


# ------------------------------------------------------------------- providers
# Each provider maker takes the inputs and returns a no-argument callable to time,
# or a string saying why it is not available.


def _sdpa(backend_name):
    def make(q, k, v, shape: Shape, backward: bool):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views

        def forward():
            with sdpa_kernel([backend]):
                return scaled_dot_product_attention(qt, kt, vt, is_causal=shape.causal)

        try:
            out = forward()
        except RuntimeError as err:
            return f"unavailable: {str(err).splitlines()[0][:80]}"
        if not backward:
            return forward
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)

    return make


def _fa4(q, k, v, shape: Shape, backward: bool):
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as err:
        return f"flash_attn.cute not importable ({err})"

    def forward():
        return flash_attn_func(q, k, v, causal=shape.causal)

    result = forward()
    out = result[0] if isinstance(result, tuple) else result
    if not backward:
        return forward
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def _cute(q, k, v, shape: Shape, backward: bool, fwd_overrides=None):
    scale = 1.0 / math.sqrt(shape.head_dim)
    if not backward:
        from torch_cute_ops.runtime import attention as flash_host

        reason = flash_host.fwd_unsupported_reason(q, k, v, shape.causal)
        if reason:
            return reason
        if fwd_overrides is None:  # the public API
            import torch_cute_ops as tco

            return lambda: tco.flash_attn_func(q, k, v, softmax_scale=scale, causal=shape.causal)
        # the bare kernel (the launch plan the op caches), maybe with a changed config
        out = torch.empty_like(q)
        lse = torch.empty(shape.batch, shape.heads, shape.seqlen, device=q.device)
        config, max_ctas = None, None
        fields = dict(fwd_overrides)
        if fields.pop("per_tile", False):
            max_ctas = 2**31 - 1  # the grid is clipped to the tile count
        if fields:
            config = flash_host.config_for(shape.head_dim, shape.causal,
                                           shape.seqlen <= flash_host.SHORT_CAUSAL_KEYS)
            config = replace(config, **{key: type(getattr(config, key))(value) for key, value in fields.items()})
        plan = flash_host.plan_fwd(q, k, v, shape.causal, config, max_ctas)
        return lambda: plan(q, k, v, out, lse, scale)

    import torch_cute_ops  # noqa: F401  (registers torch.ops.cute)
    from torch_cute_ops.ops import fallback

    out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, scale, shape.causal)
    dout = torch.randn_like(out)
    fallback.reset()
    torch.ops.cute.flash_attn_bwd(dout, q, k, v, out, lse, scale, shape.causal)
    fell_back = [reason for (op, reason) in fallback.counts() if op == "flash_attn_bwd"]
    if fell_back:
        return f"no kernel: {fell_back[0][:80]}"
    return lambda: torch.ops.cute.flash_attn_bwd(dout, q, k, v, out, lse, scale, shape.causal)


PROVIDERS = {
    "cute": _cute,
    "cute-kernel": partial(_cute, fwd_overrides={}),
    "cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "fa4": _fa4,
}


# ---------------------------------------------------------------------- timing


def measure(shape: Shape, backward: bool, providers, warmup_ms: int, rep_ms: int, rounds: int) -> Row:
    """Times every provider on fresh random inputs of one shape. With ``rounds`` > 1 the
    providers are timed in turn that many times and each keeps the median of its rounds,
    so that drift of the clocks over the run does not favour whoever ran first."""
    from triton.testing import do_bench

    row = Row(shape)
    fns = {}
    for name in providers:
        torch.manual_seed(0)
        q, k, v = (
            torch.randn(shape.batch, shape.seqlen, shape.heads, shape.head_dim,
                        device="cuda", dtype=torch.bfloat16, requires_grad=backward)
            for _ in range(3)
        )
        try:
            fn = PROVIDERS[name](q, k, v, shape, backward)
        except Exception as err:  # a provider failing must not stop the others
            fn = f"error: {type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}"
        if isinstance(fn, str):
            row.notes[name] = fn
            continue
        print(f"  {shape.name}: warming up {name}", flush=True)  # shows where a hang sits
        fn()  # warm JIT caches outside the timed region
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        row.extra_mem_mb[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        fns[name] = fn
    for _ in range(rounds):
        for name, fn in fns.items():
            row.ms_rounds.setdefault(name, []).append(
                do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    row.ms = {name: statistics.median(times) for name, times in row.ms_rounds.items()}
    return row


def tflops(row: Row, name: str, backward: bool) -> float | None:
    ms = row.ms.get(name)
    if ms is None:
        return None
    flops = row.shape.fwd_flops() * (2.5 if backward else 1.0)
    return flops / (ms * 1e-3) / 1e12


def print_table(rows: list[Row], providers, backward: bool) -> None:
    kind = "backward (dq, dk, dv)" if backward else "forward"
    print(f"\nattention {kind}, bf16, TFLOP/s (ratios: cute / other)")
    others = [p for p in providers if p != "cute"]
    header = f"{'shape':<30}" + "".join(f"{p:>11}" for p in providers)
    header += "".join(f"{'/' + p:>11}" for p in others)
    if backward:
        header += f"{'cute MiB':>10}"
    print(header)
    ratios = {p: [] for p in others}
    for row in rows:
        line = f"{row.shape.name:<30}"
        for p in providers:
            t = tflops(row, p, backward)
            line += f"{t:>11.0f}" if t is not None else f"{'-':>11}"
        for p in others:
            if "cute" in row.ms and p in row.ms:
                r = row.ms[p] / row.ms["cute"]
                ratios[p].append(r)
                line += f"{r:>10.2f}x"
            else:
                line += f"{'-':>11}"
        if backward:
            mem = row.extra_mem_mb.get("cute")
            line += f"{mem:>10.0f}" if mem is not None else f"{'-':>10}"
        print(line)
    for p in others:
        if ratios[p]:
            geo = math.exp(sum(math.log(r) for r in ratios[p]) / len(ratios[p]))
            print(f"geomean cute/{p}: {geo:.2f}x   min {min(ratios[p]):.2f}x over {len(ratios[p])} shapes")
    notes = {(p, n) for row in rows for p, n in row.notes.items()}
    for p, n in sorted(notes):
        print(f"note: {p}: {n}")


def save(rows: list[Row], providers, backward: bool, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tag = "bwd" if backward else "fwd"
    records = [
        {**asdict(row.shape), "ms": row.ms, "ms_rounds": row.ms_rounds, "notes": row.notes,
         "extra_mem_mb": row.extra_mem_mb,
         "tflops": {p: tflops(row, p, backward) for p in row.ms}}
        for row in rows
    ]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(os.path.join(out_dir, f"attention_{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": records}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({(r.shape.head_dim, r.shape.causal) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (head_dim, causal) in zip(axes[0], panels):
        sel = [r for r in rows if r.shape.head_dim == head_dim and r.shape.causal == causal]
        for p in providers:
            pts = [(r.shape.seqlen, tflops(r, p, backward)) for r in sel if p in r.ms]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D{head_dim} {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen")
    axes[0][0].set_ylabel("TFLOP/s")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"attention_{tag}.png"), dpi=100)


def main() -> None:
    for flag, module in (("--varlen", "bench_varlen"), ("--window", "bench_window")):
        if flag in sys.argv[1:]:  # the packed / windowed benchmarks, with their own options
            sys.argv.remove(flag)
            import importlib

            sys.path.insert(0, str(Path(__file__).resolve().parent))
            importlib.import_module(module).main()
            return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backward", action="store_true", help="time dq, dk, dv given dO")
    parser.add_argument("--quick", action="store_true", help="seqlen 1k/4k/16k only")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the providers in turn this many times, keep each one's median")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--fwd-config", action="append", default=[], metavar="NAME=FIELD:VALUE,...",
                        help="experiment: also time the forward with these FwdConfig fields changed "
                        "(per_tile:1 = one CTA per tile), as provider cute-NAME")
    parser.add_argument("--bwd-tile", action="append", default=[], metavar="D=MxNxS",
                        help="experiment: backward tile_m x tile_n x stages for head dim D")
    args = parser.parse_args()
    for override in args.bwd_tile:
        from torch_cute_ops.runtime import attention as flash_host
        head_dim, tile = override.split("=")
        flash_host.BWD_TILES[int(head_dim)] = tuple(int(x) for x in tile.split("x"))
        print(f"backward tile for head dim {head_dim}: {tile}")
    providers = [p for p in args.providers.split(",") if p]
    for variant in args.fwd_config:
        name, fields = variant.split("=")
        overrides = {key: int(value) for key, value in (f.split(":") for f in fields.split(","))}
        PROVIDERS[f"cute-{name}"] = partial(_cute, fwd_overrides=overrides)
        providers.append(f"cute-{name}")
        print(f"cute-{name}: forward config changes {overrides}")
    rows = []
    head_dims = [int(d) for d in args.head_dims.split(",")]
    seqlens = [int(s) for s in args.seqlens.split(",")]
    for shape in grid(args.quick, head_dims, seqlens):
        rows.append(measure(shape, args.backward, providers, args.warmup, args.rep, args.rounds))
        print(f"{shape.name}: " + ", ".join(
            f"{p} {tflops(rows[-1], p, args.backward):.0f}" for p in providers if p in rows[-1].ms),
            flush=True)
    save(rows, providers, args.backward, args.out)
    print_table(rows, providers, args.backward)


if __name__ == "__main__":
    main()
