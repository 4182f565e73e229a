"""Decode attention (GQA) through the public API beside torch's SDPA.

    python bench/bench_decode.py [--rounds 3] [--seqlen-q 1] [--shapes 1x512x32x8,...] [--out DIR]

Providers on the same data, q (B, S_q, H_q, D): ``tco.flash_attn_func(q, k, v, causal=True)``
(dense, the cache exactly as long as the keys); ``tco.flash_attn_with_kvcache`` on a contiguous
cache with ``cache_seqlens``, on the same cache as shuffled 256-token pages (``page_table``) and
on a copy in transformers' (B, H_kv, S, D) layout ("heads-major", the kernels' ranged rows);
``F.scaled_dot_product_attention`` (default backend, enable_gqa; with S_q > 1 its top-left
is_causal is not the decode band, so it runs without a mask: an upper bound on its speed);
FlashAttention-4, when ``flash_attn.cute`` imports, through its own decode path on the same two
caches: ``flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=cache_seqlens, causal=True)``
with q batched (B, S_q, H, D), and the same with ``page_table`` (see ``fa4_kvcache``). K/V read
bandwidth is cache bytes / time. Medians of ``triton.testing.do_bench``, interleaved rounds.
A decode step is microseconds of GPU work, so host time per call shows in eager timings; the
"graph" columns replay the same call captured in a CUDA graph (as serving loops run it): GPU
time only, for kvcache, paged, FA4 and torch. do_bench empties the L2 by writing a buffer, so a
call that reads tens of MiB also pays for writing back those dirty lines; the "clean" columns
time the same graph replays after a read-only flush (``bench.interleave.time_clean_l2``): a cold
L2 holding no dirty lines, as a decode step in a serving loop finds it. Speed ratios are the
other's time / ours.
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

from bench.interleave import time_clean_l2  # noqa: E402

SHAPES = [(8, 4096, 32, 8), (64, 2048, 32, 8), (1, 32768, 32, 8), (64, 4096, 64, 8), (256, 1024, 32, 8)]


def graphed(fn):
    """``fn`` captured in a CUDA graph (after a warm-up call); returns the replay. The replay holds
    ``fn``, so the tensors it closes over (the graph's inputs) live as long as the replay does: a
    graph holds device pointers, and replaying one whose inputs were freed reads whatever the
    allocator put there since."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay(fn=fn):
        graph.replay()
    return replay


def load_fa4():
    """FlashAttention-4's ``flash_attn_varlen_func``, or None (said once) when it does not import."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as err:
        print(f"FlashAttention-4 columns skipped: flash_attn.cute not importable ({err})")
        return None
    return flash_attn_varlen_func


def fa4_kvcache(fa4_varlen, q, k_cache, v_cache, cache_seqlens, page_table=None, split_kv=False):
    """FA4's counterpart of ``tco.flash_attn_with_kvcache(q, k_cache, v_cache,
    cache_seqlens=cache_seqlens, page_table=page_table, causal=True)``, as a closure returning the
    output: its varlen function takes a batched q (B, S_q, H, D), a (B, S_k, H_kv, D) cache or
    (pages, page_size, H_kv, D) pages with ``page_table`` (B, pages) int32, and each sequence's
    key count as ``seqused_k`` (B,) int32, causal aligned bottom-right to it. ``split_kv`` lets it
    split the keys over CTAs (``num_splits=0``: its heuristic); on Hopper it has no split-KV
    kernel and asserts ``num_splits == 1``.
    """
    kwargs = {"seqused_k": cache_seqlens, "page_table": page_table, "causal": True,
              "num_splits": 0 if split_kv else 1}
    return lambda: fa4_varlen(q, k_cache, v_cache, **kwargs)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen-q", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--shapes", default="", help="BxKEYSxHQxHKV,... instead of the default grid, "
                        "e.g. 1x512x32x8 (keys a multiple of the page size)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch_cute_ops as tco

    fa4 = load_fa4()
    fa4_splits = torch.cuda.get_device_capability()[0] in (10, 11)  # FA4's split-KV: Blackwell only
    rows = []
    print(f"{torch.cuda.get_device_name()}: {args.seqlen_q} query token(s), D{args.head_dim}, bf16; "
          f"ms and K/V GB/s")
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")] if args.shapes else SHAPES
    for batch, seqlen_k, h_q, h_kv in shapes:
        d, page = args.head_dim, args.page_size
        q = torch.randn(batch, args.seqlen_q, h_q, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen_k, h_kv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
        pages = seqlen_k // page
        table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
        k_pages = torch.empty(batch * pages, page, h_kv, d, device="cuda", dtype=torch.bfloat16)
        v_pages = torch.empty_like(k_pages)
        k_pages[table.long().flatten()] = k.reshape(-1, page, h_kv, d)
        v_pages[table.long().flatten()] = v.reshape(-1, page, h_kv, d)
        # transformers' layout: (B, H_kv, S, D) storage, attended as (B, S, H_kv, D) (ranged rows)
        k_heads, v_heads = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
        calls = {"tco": lambda: tco.flash_attn_func(q, k, v, causal=True),
                 "kvcache": lambda: tco.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True),
                 "paged": lambda: tco.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths,
                                                              page_table=table, causal=True),
                 "heads-major": lambda: tco.flash_attn_with_kvcache(q, k_heads, v_heads, cache_seqlens=lengths,
                                                                    causal=True),
                 "torch": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}
        if fa4 is not None:
            calls["fa4"] = fa4_kvcache(fa4, q, k, v, lengths, split_kv=fa4_splits)
            calls["fa4 paged"] = fa4_kvcache(fa4, q, k_pages, v_pages, lengths, table, split_kv=fa4_splits)
        graphs = {f"{name} graph": graphed(calls[name])
                  for name in ("kvcache", "paged", "heads-major", "tco", "fa4", "fa4 paged", "torch")
                  if name in calls}
        calls |= graphs
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        ms = {name: statistics.median(t) for name, t in times.items()}
        ms |= {name.replace(" graph", " clean"): t for name, t in time_clean_l2(graphs, args.rounds).items()}
        gbs = {name: 2 * k.numel() * 2 / (t * 1e-3) / 1e9 for name, t in ms.items()}
        row = {"shape": [batch, seqlen_k, h_q, h_kv], "ms": ms, "kv_gb_s": gbs}
        ratios = (f"kvcache/torch speed {ms['torch'] / ms['kvcache']:.2f}x (graphs "
                  f"{ms['torch graph'] / ms['kvcache graph']:.2f}x, "
                  f"clean {ms['torch clean'] / ms['kvcache clean']:.2f}x)"
                  f", paged/kvcache {ms['kvcache'] / ms['paged']:.2f}x (graphs "
                  f"{ms['kvcache graph'] / ms['paged graph']:.2f}x, "
                  f"clean {ms['kvcache clean'] / ms['paged clean']:.2f}x)"
                  f", heads-major/kvcache clean {ms['kvcache clean'] / ms['heads-major clean']:.2f}x")
        if fa4 is not None:
            vs_fa4 = {"kvcache": ms["fa4"] / ms["kvcache"], "paged": ms["fa4 paged"] / ms["paged"],
                      "graphs": ms["fa4 graph"] / ms["kvcache graph"], "clean": ms["fa4 clean"] / ms["kvcache clean"],
                      "paged clean": ms["fa4 paged clean"] / ms["paged clean"]}
            ours, theirs = calls["kvcache"]().float(), calls["fa4"]().float()
            row |= {"speed_vs_fa4": vs_fa4, "fa4_rel_diff": ((ours - theirs).norm() / theirs.norm()).item()}
            ratios += (", tco/FA4 speed " + ", ".join(f"{name} {x:.2f}x" for name, x in vs_fa4.items())
                       + f" (outputs' rel. diff {row['fa4_rel_diff']:.1e})")
        rows.append(row)
        print(f"B{batch:<4} keys {seqlen_k:<6} H{h_q}/{h_kv}: " + ", ".join(
            f"{name} {ms[name]:.4f} ms ({gbs[name]:.0f} GB/s)" for name in ms) + "; " + ratios)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
