"""Packed (varlen) attention through the public API, beside FlashAttention-4's varlen function.

    python bench/bench_varlen.py [--tokens 16384 --min-len 128 --max-len 4096 --heads 16
                                  --kv-heads 16 --head-dim 128 --causal 1 --window -1] [--rounds 3]

bf16 random sequences, lengths uniform in [min_len, max_len] drawn until ``--tokens`` are
packed (the last one trimmed), q/k/v (total, H, D). Forward: ``tco.flash_attn_varlen_func`` vs
``flash_attn.cute.flash_attn_varlen_func`` on the same inputs; backward: the gradients of the
same calls (``torch.autograd.grad`` given dO). Medians of ``triton.testing.do_bench``, providers
interleaved over ``--rounds`` rounds. TFLOP/s count the visible (causal) area of each sequence.
Prints ms and ratios, writes DIR/varlen.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.interleave import time_fwd_bwd  # noqa: E402


def packed_lengths(tokens: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lens = []
    while sum(lens) < tokens:
        lens.append(rng.randint(lo, hi))
    lens[-1] -= sum(lens) - tokens
    return [n for n in lens if n > 0]


def visible_pairs(lens, causal: bool, window: int) -> int:
    """(query, key) pairs each query sees: all, the causal triangle, or the causal band of ``window``."""
    total = 0
    for n in lens:
        if not causal:
            total += n * n
        elif window < 0:
            total += n * (n + 1) // 2
        else:
            total += sum(min(i, window) + 1 for i in range(n))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--window", type=int, default=-1, help="left window (causal only); -1: none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch_cute_ops as tco

    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4
    except ImportError as err:
        fa4 = None
        print(f"FlashAttention-4 unavailable: {err}")
    lens = packed_lengths(args.tokens, args.min_len, args.max_len)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    total, max_len = sum(lens), max(lens)
    torch.manual_seed(0)
    make = lambda h: torch.randn(total, h, args.head_dim, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                 requires_grad=True)
    q, k, v = make(args.heads), make(args.kv_heads), make(args.kv_heads)
    dout = torch.randn_like(q)
    causal = bool(args.causal)
    window = (args.window, 0 if causal else -1)

    def first(result):
        return result[0] if isinstance(result, tuple) else result

    calls = {"tco": lambda: tco.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal,
                                                       window_size=window)}
    if fa4 is not None:
        fa4_window = (None if window[0] < 0 else window[0], None if window[1] < 0 else window[1])
        calls["fa4"] = lambda: first(fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                         max_seqlen_k=max_len, causal=causal, window_size=fa4_window))
    tco.ops.fallback.reset()
    ms, outs = time_fwd_bwd(calls, (q, k, v), dout, args.rounds)
    flops = 4 * visible_pairs(lens, causal, args.window) * args.heads * args.head_dim
    ref = outs.get("fa4")
    err = None if ref is None else ((outs["tco"].float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{torch.cuda.get_device_name()}: {len(lens)} sequences, {total} tokens, lengths in "
          f"[{min(lens)}, {max_len}], H{args.heads}/{args.kv_heads} D{args.head_dim}, causal={causal}, "
          f"window={window}; median ms of {args.rounds} interleaved rounds")
    for kind, mult in (("fwd", 1.0), ("bwd", 2.5)):
        ours = ms[f"tco {kind}"]
        line = f"{kind}: tco {ours:.3f} ms ({flops * mult / ours / 1e9:.0f} TFLOP/s)"
        if fa4 is not None:
            theirs = ms[f"fa4 {kind}"]
            line += (f", FA4 {theirs:.3f} ms ({flops * mult / theirs / 1e9:.0f} TFLOP/s), "
                     f"tco/FA4 speed {theirs / ours:.2f}x")
        print(line)
    print(f"fallbacks: {tco.fallback_counts() or 'none'}; rel. diff of outputs vs FA4: {err}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "varlen.json").write_text(json.dumps({"ms": ms, "lengths": lens, "fa4_rel_diff": err,
                                                      "args": vars(args) | {"out": str(args.out)}}, indent=1))


if __name__ == "__main__":
    main()
