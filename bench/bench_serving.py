"""A continuous-batching step on a paged KV cache: our one call against our separate prefill and
decode calls, and FlashAttention-4's varlen function with a page table.

    python bench/bench_serving.py [--rounds 3] [--decode 64] [--chunks 2] [--chunk 2048]
                                  [--configs 64/8/64,32/8/128] [--pages 16,64]

The step: ``--decode`` decode rows (one query each) whose contexts are drawn uniformly from
[1k, 32k] keys (seed 0), and ``--chunks`` prefill chunks of ``--chunk`` queries each, chunk i
attending to ``(i + 1) * chunk`` keys (its own and the chunks before it), causal, bf16, every
sequence's pages shuffled over one pool. Per (q heads / kv heads / head dim) config and page size:

* ``one call``: ``tco.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q=...,
  seqused_k=..., page_table=..., causal=True)``, decode rows and chunks packed together;
* ``separate``: ``tco.flash_attn_with_kvcache`` twice, the decode rows as (decode, 1, H, D) and
  the chunks as (chunks, chunk, H, D), each against its sequences' pages;
* ``fa4``: ``flash_attn.cute.flash_attn_varlen_func`` with the packed q, ``cu_seqlens_q``,
  ``seqused_k`` and ``page_table`` (when it imports).

Medians of ``triton.testing.do_bench``, providers interleaved over ``--rounds`` rounds
(bench/interleave.py). Prints ms, the KV bytes read per second, the ratios and the outputs'
relative differences; writes DIR/serving.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_decode import load_fa4  # noqa: E402
from bench.interleave import time_interleaved  # noqa: E402

# the serving kernels are opt-in until their GPU tests have passed (read when a layout is planned)
os.environ.setdefault("TORCH_CUTE_OPS_SERVING_KERNELS", "1")


def step_lengths(decode: int, chunks: int, chunk: int, seed: int = 0):
    """(query lengths, key lengths): decode rows first, then the prefill chunks."""
    rng = random.Random(seed)
    contexts = [rng.randint(1024, 32768) for _ in range(decode)]
    return [1] * decode + [chunk] * chunks, contexts + [(i + 1) * chunk for i in range(chunks)]


def paged_step(query_lengths, key_lengths, heads_q, heads_kv, head_dim, page_size, seed=0):
    """q (total_q, H_q, D), the caches (pages, page_size, H_kv, D) and each sequence's pages, shuffled."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = max(-(-n // page_size) for n in key_lengths)
    pages = [-(-n // page_size) for n in key_lengths]
    pool = sum(pages)
    order = torch.randperm(pool, device="cuda", generator=gen).int()
    table = torch.zeros(len(key_lengths), per_seq, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(pages):  # unused table entries stay 0 (a valid page, never read)
        table[b, :n] = order[start:start + n]
        start += n
    k_cache, v_cache = (torch.randn(pool, page_size, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16,
                                    generator=gen) for _ in range(2))
    q = torch.randn(sum(query_lengths), heads_q, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, *itertools.accumulate(query_lengths)], dtype=torch.int32, device="cuda")
    used = torch.tensor(key_lengths, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, cu, used, table


def bench_config(tco, fa4, heads_q, heads_kv, head_dim, page_size, args) -> dict:
    query_lengths, key_lengths = step_lengths(args.decode, args.chunks, args.chunk)
    q, k_cache, v_cache, cu, used, table = paged_step(query_lengths, key_lengths, heads_q, heads_kv, head_dim,
                                                      page_size)
    decode, max_q = args.decode, max(query_lengths)
    q_decode = q[:decode].view(decode, 1, heads_q, head_dim)
    q_chunks = q[decode:].view(args.chunks, args.chunk, heads_q, head_dim)
    out = torch.empty_like(q)
    calls = {
        "one call": lambda: tco.flash_attn_varlen_func(q, k_cache, v_cache, cu, max_seqlen_q=max_q, seqused_k=used,
                                                       page_table=table, causal=True, out=out),
        "separate": lambda: (tco.flash_attn_with_kvcache(q_decode, k_cache, v_cache, cache_seqlens=used[:decode],
                                                         page_table=table[:decode], causal=True),
                             tco.flash_attn_with_kvcache(q_chunks, k_cache, v_cache, cache_seqlens=used[decode:],
                                                         page_table=table[decode:], causal=True)),
    }
    if fa4 is not None:
        calls["fa4"] = lambda: fa4(q, k_cache, v_cache, cu_seqlens_q=cu, seqused_k=used, page_table=table,
                                   max_seqlen_q=max_q, causal=True)
    tco.ops.fallback.reset()
    ms = time_interleaved(calls, args.rounds)
    one = calls["one call"]().float()
    decode_out, chunk_out = calls["separate"]()
    separate = torch.cat([decode_out.reshape(decode, heads_q, head_dim),
                          chunk_out.reshape(-1, heads_q, head_dim)]).float()
    diffs = {"separate": ((one - separate).norm() / separate.norm()).item()}
    if fa4 is not None:
        theirs = calls["fa4"]()
        theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).float()
        diffs["fa4"] = ((one - theirs).norm() / theirs.norm()).item()
    kv_bytes = 2 * sum(key_lengths) * heads_kv * head_dim * 2
    return {"config": f"{heads_q}/{heads_kv} D{head_dim}", "page_size": page_size, "ms": ms,
            "kv_gb_per_s": {name: kv_bytes / t / 1e6 for name, t in ms.items()}, "rel_diff": diffs,
            "fallbacks": {f"{op}: {reason}": n for (op, reason), n in tco.fallback_counts().items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--configs", default="64/8/64,32/8/128", help="q heads/kv heads/head dim, ...")
    parser.add_argument("--pages", default="16,64")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch_cute_ops as tco

    fa4 = load_fa4()
    print(f"{torch.cuda.get_device_name()}: {args.decode} decode rows (contexts in [1k, 32k], seed 0) + "
          f"{args.chunks} x {args.chunk}-token chunks, causal, bf16; median ms of {args.rounds} interleaved rounds")
    results = []
    for config, page in itertools.product(args.configs.split(","), args.pages.split(",")):
        heads_q, heads_kv, head_dim = (int(x) for x in config.split("/"))
        result = bench_config(tco, fa4, heads_q, heads_kv, head_dim, int(page), args)
        results.append(result)
        ms = result["ms"]
        line = (f"{result['config']} page {page}: one call {ms['one call']:.3f} ms "
                f"({result['kv_gb_per_s']['one call']:.0f} GB/s of K/V), separate {ms['separate']:.3f} ms "
                f"(one call {ms['separate'] / ms['one call']:.2f}x)")
        if "fa4" in ms:
            line += f", FA4 {ms['fa4']:.3f} ms (one call {ms['fa4'] / ms['one call']:.2f}x FA4's speed)"
        print(line)
        print(f"    rel. diff of outputs: {result['rel_diff']}; fallbacks: {result['fallbacks'] or 'none'}")
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps({"results": results, "device": torch.cuda.get_device_name(),
                                                       "args": vars(args) | {"out": str(args.out)}}, indent=1))


if __name__ == "__main__":
    main()
