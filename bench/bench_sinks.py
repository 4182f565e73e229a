"""The cost of attention sinks (``learnable_sink``) through the public API: the same call with and
without sinks, ours and FlashAttention-4's, forward and forward + backward.

    python bench/bench_sinks.py [--batch 2 --seqlen 8192 --heads 64 --kv-heads 8 --head-dim 64]
                                [--rounds 3] [--out DIR]

bf16 (B, S, H, D) random inputs, causal, GQA, float32 sinks (H,) that need a gradient. Forward
under no_grad; forward + backward as one call: the forward, then ``torch.autograd.grad`` of its
output with respect to q, k, v (and the sinks, when given) given dO. Medians of
``triton.testing.do_bench``, providers interleaved over ``--rounds`` rounds (bench/interleave.py).
FlashAttention-4 (``flash_attn.cute.flash_attn_func``) is timed when it imports. Prints ms, the
sinks' cost over the same call without them, and our ratio to FA4; writes DIR/sinks.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.interleave import time_interleaved  # noqa: E402


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _calls(attention: dict, inputs: tuple, sink: torch.Tensor, dout: torch.Tensor) -> dict:
    """``{"<provider>[ sink] fwd|fwd+bwd": fn}`` for each provider's ``fn(sink or None) -> out``."""
    calls = {}
    for provider, fn in attention.items():
        for with_sink in (False, True):
            name = f"{provider}{' sink' if with_sink else ''}"
            given = sink if with_sink else None
            wrt = inputs + ((sink,) if with_sink else ())

            def forward(fn=fn, given=given):
                with torch.no_grad():
                    return fn(given)

            def forward_backward(fn=fn, given=given, wrt=wrt):
                return torch.autograd.grad(fn(given), wrt, dout)

            calls[f"{name} fwd"], calls[f"{name} fwd+bwd"] = forward, forward_backward
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch_cute_ops as tco

    attention = {"tco": lambda q, k, v, sink: tco.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)}
    try:
        from flash_attn.cute import flash_attn_func as fa4

        attention["fa4"] = lambda q, k, v, sink: _first(fa4(q, k, v, causal=True, learnable_sink=sink))
    except ImportError as err:
        print(f"FlashAttention-4 unavailable: {err}")
    torch.manual_seed(0)
    b, s, d = args.batch, args.seqlen, args.head_dim
    q = torch.randn(b, s, args.heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, args.kv_heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    sink = torch.randn(args.heads, device="cuda", requires_grad=True)
    dout = torch.randn_like(q)
    bound = {name: (lambda fn: lambda given: fn(q, k, v, given))(fn) for name, fn in attention.items()}
    calls = _calls(bound, (q, k, v), sink, dout)
    for name, fn in list(calls.items()):  # e.g. a provider without the sinks' backward
        try:
            fn()
        except Exception as err:  # noqa: BLE001 (any provider failure drops that call, named)
            print(f"{name}: skipped ({type(err).__name__}: {err})")
            del calls[name]
    times = time_interleaved(calls, args.rounds)

    print(f"B{b} S{s} H{args.heads}/{args.kv_heads} D{d} causal bf16, {args.rounds} interleaved rounds")
    for name, ms in times.items():
        print(f"  {name:<20} {ms:8.3f} ms")
    for kind in ("fwd", "fwd+bwd"):
        for provider in attention:
            plain, sinked = times.get(f"{provider} {kind}"), times.get(f"{provider} sink {kind}")
            if plain and sinked:
                print(f"  {provider} sinks' cost, {kind}: {100 * (sinked / plain - 1):+.1f}%")
        if f"fa4 sink {kind}" in times:
            print(f"  FA4 / ours with sinks, {kind}: {times[f'fa4 sink {kind}'] / times[f'tco sink {kind}']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"shape": [b, s, args.heads, args.kv_heads, d], "device": torch.cuda.get_device_name(),
              "rounds": args.rounds, "ms": times}
    (args.out / "sinks.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
