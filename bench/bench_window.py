"""Sliding-window attention through the public API, beside FlashAttention-4's window and our own
full-causal attention at the same shape.

    python bench/bench_window.py [--seqlen 8192 --batch 2 --heads 16 --head-dim 128 --window 1024]
                                 [--rounds 3] [--out DIR]

bf16 (B, S, H, D) random inputs, causal with window (W, 0) (each query sees itself and the W
keys before it). Forward: ``tco.flash_attn_func(..., causal=True, window_size=(W, 0))`` vs
``flash_attn.cute.flash_attn_func`` with the same window, and vs ``tco.flash_attn_func(...,
causal=True)``; backward: the gradients of the same calls (``torch.autograd.grad`` given dO).
``--softcap C``: also full causal with softcap C, ours and FA4's (each one's cost of the cap).
Medians of ``triton.testing.do_bench``, providers interleaved over ``--rounds`` rounds. Prints ms
and ratios, writes DIR/window.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.interleave import time_fwd_bwd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--softcap", type=float, default=0.0,
                        help="also time full causal with this softcap (its cost over no softcap)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch_cute_ops as tco

    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError as err:
        fa4 = None
        print(f"FlashAttention-4 unavailable: {err}")
    torch.manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    window = (args.window, 0)

    def first(result):
        return result[0] if isinstance(result, tuple) else result

    calls = {
        "tco window": lambda: tco.flash_attn_func(q, k, v, causal=True, window_size=window),
        "tco causal": lambda: tco.flash_attn_func(q, k, v, causal=True),
    }
    if args.softcap:
        calls["tco causal softcap"] = lambda: tco.flash_attn_func(q, k, v, causal=True, softcap=args.softcap)
    if fa4 is not None:
        calls["fa4 window"] = lambda: first(fa4(q, k, v, causal=True, window_size=window))
        if args.softcap:  # FA4's own cost of the cap: what the design allows (MUFU: tanh + exp2)
            calls["fa4 causal"] = lambda: first(fa4(q, k, v, causal=True))
            calls["fa4 causal softcap"] = lambda: first(fa4(q, k, v, causal=True, softcap=args.softcap))
    tco.ops.fallback.reset()
    ms, outs = time_fwd_bwd(calls, (q, k, v), dout, args.rounds)
    ref = outs.get("fa4 window")
    err = None if ref is None else ((outs["tco window"].float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{torch.cuda.get_device_name()}: B{args.batch} S{args.seqlen} H{args.heads} D{args.head_dim}, "
          f"causal window ({args.window}, 0); median ms of {args.rounds} interleaved rounds")
    for kind in ("fwd", "bwd"):
        ours = ms[f"tco window {kind}"]
        line = f"{kind}: tco window {ours:.3f} ms, tco full causal {ms[f'tco causal {kind}']:.3f} ms " \
               f"(window/causal {ours / ms[f'tco causal {kind}']:.2f}x time)"
        if fa4 is not None:
            theirs = ms[f"fa4 window {kind}"]
            line += f", FA4 window {theirs:.3f} ms (tco/FA4 speed {theirs / ours:.2f}x)"
        print(line)
    if args.softcap:
        for kind in ("fwd", "bwd"):
            capped, plain = ms[f"tco causal softcap {kind}"], ms[f"tco causal {kind}"]
            line = (f"{kind}: full causal with softcap {args.softcap:g} {capped:.3f} ms vs without {plain:.3f} ms "
                    f"(+{(capped / plain - 1) * 100:.1f}%)")
            if f"fa4 causal softcap {kind}" in ms:
                fa4_capped, fa4_plain = ms[f"fa4 causal softcap {kind}"], ms[f"fa4 causal {kind}"]
                line += (f"; FA4 {fa4_capped:.3f} vs {fa4_plain:.3f} ms (+{(fa4_capped / fa4_plain - 1) * 100:.1f}%), "
                         f"tco/FA4 speed capped {fa4_capped / capped:.2f}x")
            print(line)
    print(f"fallbacks: {tco.fallback_counts() or 'none'}; rel. diff of outputs vs FA4: {err}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "window.json").write_text(json.dumps({"ms": ms, "args": vars(args) | {"out": str(args.out)},
                                                      "fa4_rel_diff": err}, indent=1))


if __name__ == "__main__":
    main()
