"""Context-parallel attention on several GPUs against one: correctness and throughput.

    torchrun --standalone --nproc_per_node 2 bench/bench_context_parallel.py [--seqlen 131072] [--out DIR]
    torchrun --standalone --nproc_per_node 2 bench/bench_context_parallel.py --cpu   # gloo smoke run

Every rank draws the same full (1, S, H, D) bf16 q, k, v (seed 0) and first runs the unsplit
``tco.flash_attn_func`` (causal) forward and backward on its own GPU: the one-GPU reference and its
timing (each GPU alone, at the same time). Then the ranks run
``torch_cute_ops.distributed.context_parallel_attention`` on their ``shard_sequence`` parts (head
and tail chunks, K/V all-gathered over NCCL, the local attention on the kernels), forward and
backward, and compare their part of the output and of dq, dk, dv with the same part of the
reference (relative norm errors; the local kernels sum the same products in another order).
Timing: CUDA-synchronized wall time of ``--reps`` forward + backward steps after a warm-up, the
median over ranks' medians; the speedup is one GPU's time over the split one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_distributed import start_ranks  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, float32, a short sequence")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.cpu:
        args.seqlen, args.heads, args.kv_heads, args.head_dim, args.reps = 64, 4, 2, 16, 1
    return args


def step_time(fn, reps: int, device) -> float:
    """Median wall seconds of ``fn`` (synchronized), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world, device, dtype, cuda = start_ranks(args.cpu)

    import torch_cute_ops as tco
    from torch_cute_ops.distributed import context_parallel_attention, shard_sequence

    gen = torch.Generator(device).manual_seed(0)
    shape_q = (1, args.seqlen, args.heads, args.head_dim)
    shape_kv = (1, args.seqlen, args.kv_heads, args.head_dim)
    q = torch.randn(shape_q, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(shape_kv, generator=gen, device=device, dtype=dtype) for _ in range(2))
    dout = torch.randn(shape_q, generator=gen, device=device, dtype=dtype)

    def full_step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = tco.flash_attn_func(*leaves, causal=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    local = [shard_sequence(t).detach() for t in (q, k, v, dout)]

    def split_step():
        leaves = [t.detach().requires_grad_() for t in local[:3]]
        out = context_parallel_attention(*leaves, causal=True)
        return (out, *torch.autograd.grad(out, leaves, local[3]))

    tco.ops.fallback.reset()
    reference = [shard_sequence(t) for t in full_step()]
    ours = split_step()
    errors = {name: relative(got, want) for name, got, want in zip(("out", "dq", "dk", "dv"), ours, reference)}
    one_gpu = step_time(full_step, args.reps, device)
    dist.barrier()
    split = step_time(split_step, args.reps, device)
    fallbacks = tco.fallback_counts()

    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "errors": errors, "one_gpu_s": one_gpu, "split_s": split,
                                      "fallbacks": fallbacks})
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world": world, "args": vars(args),
              "ranks": gathered}
    if rank == 0:
        one = statistics.median(r["one_gpu_s"] for r in gathered)
        many = max(r["split_s"] for r in gathered)  # the step ends with its slowest rank
        flops = 4 * args.seqlen ** 2 * args.heads * args.head_dim / 2 * 3.5  # causal fwd + bwd (2.5x fwd)
        result.update(one_gpu_s=one, split_s=many, speedup=one / many)
        print(f"{result['device']} x{world}: context-parallel causal attention, S {args.seqlen}, "
              f"H {args.heads}/{args.kv_heads}, D {args.head_dim}, {dtype}, forward + backward")
        print(f"  one GPU {one * 1e3:8.1f} ms ({flops / one / 1e12:5.0f} TFLOP/s)   {world} GPUs {many * 1e3:8.1f} ms "
              f"({flops / many / 1e12 / world:5.0f} TFLOP/s per GPU)   speedup x{one / many:.2f}")
        for r in gathered:
            print(f"  rank {r['rank']}: errors vs one GPU " + ", ".join(f"{n} {e:.1e}" for n, e in r["errors"].items())
                  + f"; fallbacks {r['fallbacks'] or 'none'}")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "context_parallel.json").write_text(json.dumps(result, indent=1, default=str))
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
