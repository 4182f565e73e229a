"""attn_mask on the kernels: scaled_dot_product_attention with a padding + causal bool mask,
beside PyTorch's SDPA with the same mask and our own is_causal kernel at the same shape.

    python bench/bench_mask.py [--batch 8 --seqlen 2048 --heads 16 --head-dim 128] [--rounds 3]
                               [--additive {inf,min}]

bf16 (B, H, S, D) random inputs; the mask is (B, 1, S, S): causal, and keys past each
sequence's length hidden (lengths uniform in [S/2, S], right padding); ``--additive`` passes it
as a bf16 additive mask instead, 0 where visible and -inf (``inf``) or the dtype's lowest value
(``min``, as transformers' older mask helpers make them) where hidden. Providers through their
public calls: ``tco.scaled_dot_product_attention(q, k, v, attn_mask=mask)``,
``F.scaled_dot_product_attention(q, k, v, attn_mask=mask)`` (PyTorch's default backend choice),
``tco.scaled_dot_product_attention(q, k, v, is_causal=True)``; forward and backward (gradients of
q, k, v given dO). Medians of do_bench, providers interleaved over rounds. Writes DIR/mask.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.interleave import time_fwd_bwd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--additive", choices=("inf", "min"), help="an additive bf16 mask instead of a bool one")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch_cute_ops as tco

    b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    rng = random.Random(0)
    lengths = torch.tensor([rng.randint(s // 2, s) for _ in range(b)], device="cuda")
    causal = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    mask = (causal[None] & (torch.arange(s, device="cuda")[None, :] < lengths[:, None])[:, None, :])[:, None]
    kind = "bool"
    if args.additive:
        hidden = float("-inf") if args.additive == "inf" else torch.finfo(torch.bfloat16).min
        mask = torch.zeros(mask.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~mask, hidden)
        kind = f"additive ({hidden:g})"
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    calls = {
        "tco mask": lambda: tco.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "torch mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "tco causal": lambda: tco.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    tco.ops.fallback.reset()
    ms, outs = time_fwd_bwd(calls, (q, k, v), dout, args.rounds)
    rows = (outs["torch mask"].float().isfinite().all(-1))
    err = ((outs["tco mask"].float() - outs["torch mask"].float())[rows].norm()
           / outs["torch mask"].float()[rows].norm()).item()
    print(f"{torch.cuda.get_device_name()}: B{b} S{s} H{h} D{d}, padding + causal {kind} mask (lengths "
          f"{lengths.tolist()}); median ms of {args.rounds} interleaved rounds")
    for kind in ("fwd", "bwd"):
        ours = ms[f"tco mask {kind}"]
        print(f"{kind}: tco mask {ours:.3f} ms, torch mask {ms[f'torch mask {kind}']:.3f} ms "
              f"({ms[f'torch mask {kind}'] / ours:.2f}x), tco is_causal {ms[f'tco causal {kind}']:.3f} ms "
              f"(mask speed / causal speed {ms[f'tco causal {kind}'] / ours:.2f}x)")
    print(f"fallbacks: {tco.fallback_counts() or 'none'}; rel. diff vs torch: {err:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mask.json").write_text(json.dumps({"ms": ms, "lengths": lengths.tolist(), "rel_diff": err,
                                                    "args": vars(args) | {"out": str(args.out)}}, indent=1))


if __name__ == "__main__":
    main()
