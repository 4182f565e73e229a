"""The cost of a bitwise-reproducible attention backward, through the public API.

    python bench/bench_deterministic.py [--rounds 3] [--mask]

The same ``torch.autograd.grad`` of ``tco.flash_attn_func``'s output (bf16, random inputs, given
dO) timed three ways, interleaved over rounds (medians of ``triton.testing.do_bench``): by
default, with ``deterministic=True`` (the ordered-dQ kernel; "flag"), and under
``torch.use_deterministic_algorithms(True)`` ("mode": the same kernel, plus whatever PyTorch's
deterministic mode does around it, such as filling new tensors that the op does not mark as
written in full). Also checks that two deterministic runs give identical bytes and that nothing
fell back. ``--mask`` times ``tco.scaled_dot_product_attention`` with a boolean attn_mask instead
(causal and a random key padding per sequence; the shapes' causal flag is folded into the mask;
the drop-in has no flag, so mode only).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench

SHAPES = [  # (batch, seqlen, heads, head_dim, causal): the quick grid's D128 row, D64, D256
    (16, 1024, 16, 128, True), (4, 4096, 16, 128, False), (4, 4096, 16, 128, True),
    (1, 16384, 16, 128, True), (2, 8192, 32, 64, True), (2, 8192, 8, 256, True),
    (16, 1024, 8, 256, False), (4, 4096, 8, 256, False),  # D256 full: rotated (S1k) and in-step walks
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mask", action="store_true", help="boolean attn_mask through the SDPA drop-in")
    args = parser.parse_args()
    import torch_cute_ops as tco
    from torch_cute_ops.ops import fallback

    print(f"{torch.cuda.get_device_name()}: backward ms, median of {args.rounds} interleaved rounds")
    print(f"{'shape':34} {'default':>8} {'flag':>8} {'mode':>8} {'flag cost':>9} {'mode cost':>9}  bitwise")
    costs = {"flag": [], "mode": []}
    for batch, seqlen, heads, head_dim, causal in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        if args.mask:
            q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))  # (B, H, S, D) views
            keys = torch.arange(seqlen, device="cuda")
            kept = torch.randint(seqlen // 2, seqlen + 1, (batch, 1, 1, 1), device="cuda")
            mask = keys < kept
            if causal:
                mask = mask & (keys[None, :] <= keys[:, None])
            outs = {"default": tco.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
        else:
            outs = {"default": tco.flash_attn_func(q, k, v, causal=causal),
                    "flag": tco.flash_attn_func(q, k, v, causal=causal, deterministic=True)}
        outs["mode"] = outs["default"]
        grads = {way: (lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                 for way, out in outs.items()}
        times = {way: [] for way in grads}
        try:
            for _ in range(args.rounds):
                for way, grad in grads.items():
                    torch.use_deterministic_algorithms(way == "mode")
                    times[way].append(do_bench(grad, warmup=25, rep=100, return_mode="median"))
            same = "flag" not in grads or all(torch.equal(a, b) for a, b in zip(grads["flag"](), grads["flag"]()))
            torch.use_deterministic_algorithms(True)
            same &= all(torch.equal(a, b) for a, b in zip(grads["mode"](), grads["mode"]()))
        finally:
            torch.use_deterministic_algorithms(False)
        ms = {way: statistics.median(t) for way, t in times.items()}
        cost = {way: ms[way] / ms["default"] for way in ("flag", "mode") if way in ms}
        for way, value in cost.items():
            costs[way].append(value)
        name = f"B{batch} S{seqlen} H{heads} D{head_dim} {'causal' if causal else 'full'}{' mask' if args.mask else ''}"
        flag_ms, flag_cost = ((f"{ms['flag']:8.3f}", f"{cost['flag'] - 1:+9.1%}") if "flag" in ms
                              else (f"{'-':>8}", f"{'-':>9}"))
        print(f"{name:34} {ms['default']:8.3f} {flag_ms} {ms['mode']:8.3f} {flag_cost} {cost['mode'] - 1:+9.1%}"
              f"  {same}")
    for way, values in costs.items():
        if values:
            print(f"{way}: geomean cost {statistics.geometric_mean(values) - 1:+.1%}, max {max(values) - 1:+.1%}")
    print(f"fallbacks: {fallback.counts() or 'none'}")


if __name__ == "__main__":
    main()
