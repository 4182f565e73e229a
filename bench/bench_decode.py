"""Decode attention (one query token, GQA) through the public API beside torch's SDPA.

    python bench/bench_decode.py [--rounds 3] [--out DIR]

``tco.flash_attn_func(q, k_cache, v_cache, causal=True)`` with q (B, 1, H_q, D) vs
``F.scaled_dot_product_attention`` (default backend, enable_gqa) on the same data; K/V read
bandwidth is cache bytes / time. Medians of ``triton.testing.do_bench``, interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(8, 4096, 32, 8), (64, 2048, 32, 8), (1, 32768, 32, 8), (64, 4096, 64, 8), (256, 1024, 32, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch_cute_ops as tco

    rows = []
    print(f"{torch.cuda.get_device_name()}: one query token, D{args.head_dim}, bf16; ms and K/V GB/s")
    for batch, seqlen_k, h_q, h_kv in SHAPES:
        d = args.head_dim
        q = torch.randn(batch, 1, h_q, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen_k, h_kv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        calls = {"tco": lambda: tco.flash_attn_func(q, k, v, causal=True),
                 "torch": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        ms = {name: statistics.median(t) for name, t in times.items()}
        gbs = {name: 2 * k.numel() * 2 / (t * 1e-3) / 1e9 for name, t in ms.items()}
        rows.append({"shape": [batch, seqlen_k, h_q, h_kv], "ms": ms, "kv_gb_s": gbs})
        print(f"B{batch:<4} keys {seqlen_k:<6} H{h_q}/{h_kv}: tco {ms['tco']:.4f} ms ({gbs['tco']:.0f} GB/s), "
              f"torch {ms['torch']:.4f} ms ({gbs['torch']:.0f} GB/s), tco/torch speed {ms['torch'] / ms['tco']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
