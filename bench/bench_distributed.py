"""Training the recipe decoder on several GPUs: FSDP2 and tensor parallelism against one GPU.

    torchrun --standalone --nproc_per_node 2 bench/bench_distributed.py --out DIR [--compile]
    torchrun --standalone --nproc_per_node 2 bench/bench_distributed.py --cpu --out DIR   # gloo smoke run

The model is ``torch_cute_ops.testing.RecipeDecoder`` (every projection ``tco.linear``,
attention ``tco.scaled_dot_product_attention``) with ``import torch_cute_ops.distributed``'s
sharding rules, trained with AdamW on fixed random batches (step t always sees batch t % 2):

* ``single``: rank 0 alone trains an unsharded copy on the global batch (``world x --batch``
  sequences): the reference loss curve; then it times steps at the per-GPU batch (``--batch``).
* ``fsdp2``: ``fully_shard`` per block and on the root, each rank its ``--batch`` sequences of the
  global batch (the loss curve is the mean over ranks);
* ``tp``: ``parallelize_module`` with ``tensor_parallel_plan`` (column-parallel q/k/v/up,
  row-parallel o/down), every rank the global batch.

Each run asserts no fallback on any rank and, on CUDA, that every step launched this package's
GEMM and attention kernels (CUDA kernel names, profiled on one step); it compares the loss curve
with the single-GPU one (the model tests' tolerance: 3% + 0.05) and reports tokens/s (medians of
the timed steps), FSDP2's against one GPU at the same per-GPU batch. Rank 0 writes
DIR/distributed.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNEL_FAMILIES = {"gemm": "gemm", "flash_fwd": "flash_fwd", "flash_bwd": "flash_bwd"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, float32, tiny model (smoke run)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--modes", default="fsdp2,tp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    # 1e-3 diverged after 6 steps on two H200s (loss 4.9 -> 27.5 in every run; bench/NOTES.md,
    # 2026-11-23, "FP8 under Nsight; first two-GPU run"), after which the curves are chaos, not a
    # comparison
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--no-reshard", action="store_true",
                        help="FSDP2 keeps each block's parameters gathered from forward to backward "
                             "(reshard_after_forward=False: one all-gather per step instead of two, more memory)")
    args = parser.parse_args(argv)
    if args.cpu:  # a tiny model: the reference path does the math
        args.seqlen, args.dim, args.heads, args.kv_heads, args.layers, args.vocab = 16, 32, 4, 2, 2, 64
        args.batch = min(args.batch, 2)
    return args


def batches(args, world: int, device) -> list[torch.Tensor]:
    """The two global batches (world x batch sequences), the same on every rank."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, args.vocab, (world * args.batch, args.seqlen), generator=gen).to(device)
            for _ in range(2)]


def train(model, steps: int, batch_of_step, compile_model: bool, timed: int = 0, lr: float = 1e-4):
    """Loss per step (a float, averaged over the process group when ``model`` is sharded by data),
    and the step times (s) of the last ``timed`` steps."""
    params = list(model.parameters())
    # tensor parallelism leaves the unplanned parameters (norms, embeddings) plain tensors; the
    # multi-tensor AdamW kernels cannot take DTensors and plain tensors in one list
    mixed = len({isinstance(p, DTensor) for p in params}) > 1
    opt = torch.optim.AdamW(params, lr=lr, foreach=False if mixed else None)
    loss_fn = torch.compile(model.loss) if compile_model else model.loss
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        loss = loss_fn(batch_of_step(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step >= steps - timed:
            if torch.cuda.is_available() and loss.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return [float(loss) for loss in losses], times


def kernels_launched(fn) -> set[str]:
    """This package's kernel families among the CUDA kernels ``fn`` launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [n for n in names if "cute" in n or "cutlass" in n]
    return {family for family, key in KERNEL_FAMILIES.items() if any(key in n for n in ours)}


def mean_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def curve_gap(losses: list[float], reference: list[float]) -> float:
    """How far past the tolerance (3% + 0.05 of the reference) the worst step is (<= 0: within)."""
    return max(abs(a - b) - (0.03 * abs(b) + 0.05) for a, b in zip(losses, reference))


def start_ranks(cpu: bool) -> tuple:
    """Join the torchrun process group: NCCL on this rank's GPU (bf16), or gloo on the CPU
    (float32: the reference path). Returns (rank, world, device, dtype, cuda)."""
    cuda = not cpu and torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device, torch.bfloat16 if cuda else torch.float32, cuda


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world, device, dtype, cuda = start_ranks(args.cpu)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import torch_cute_ops as tco
    import torch_cute_ops.distributed  # noqa: F401  (the sharding rules)
    from torch_cute_ops.testing import RecipeDecoder, tensor_parallel_plan

    torch.manual_seed(0)  # the same initial weights on every rank
    base = RecipeDecoder(args.vocab, args.dim, args.heads, args.kv_heads, args.layers).to(device, dtype)
    mesh = init_device_mesh(device.type, (world,))
    data = batches(args, world, device)
    tokens_per_gpu = args.batch * args.seqlen
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world": world, "dtype": str(dtype),
              "args": vars(args), "runs": {}}

    def record(name, losses, times, tokens_per_step, kernels=None):
        fallbacks, kernels_per_rank = [None] * world, [None] * world
        dist.all_gather_object(fallbacks, {f"{op}: {why}": n for (op, why), n in tco.fallback_counts().items()})
        dist.all_gather_object(kernels_per_rank, sorted(kernels) if kernels is not None else None)
        run = {"losses": losses, "tokens_per_s": tokens_per_step / statistics.median(times) if times else None,
               "fallbacks_per_rank": fallbacks, "kernels_per_rank": kernels_per_rank}
        result["runs"][name] = run
        return run

    # single GPU: the reference curve on the global batch, then the time at the per-GPU batch
    reference = None
    if rank == 0:
        tco.ops.fallback.reset()
        losses, _ = train(copy.deepcopy(base), args.steps, lambda step: data[step % 2], args.compile, lr=args.lr)
        _, times = train(copy.deepcopy(base), args.timed_steps + 3,
                         lambda step: data[step % 2][:args.batch], args.compile, args.timed_steps, lr=args.lr)
        reference = losses
    holder = [reference]
    dist.broadcast_object_list(holder, src=0)
    reference = holder[0]
    record("single", reference, times if rank == 0 else [], tokens_per_gpu)

    for mode in [m for m in args.modes.split(",") if m]:
        tco.ops.fallback.reset()
        model = copy.deepcopy(base)
        if mode == "fsdp2":
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=not args.no_reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=not args.no_reshard)
            local = lambda step: data[step % 2][rank * args.batch:(rank + 1) * args.batch]  # noqa: E731
            tokens_per_step = world * tokens_per_gpu
        elif mode == "tp":
            parallelize_module(model, mesh, tensor_parallel_plan(args.layers))
            local = lambda step: data[step % 2]  # noqa: E731
            tokens_per_step = world * tokens_per_gpu
        else:
            raise ValueError(f"--modes: expected fsdp2 and/or tp, got {mode!r}")
        losses, times = train(model, args.steps + args.timed_steps, local, args.compile, args.timed_steps,
                              lr=args.lr)
        losses = losses[:args.steps]
        if mode == "fsdp2":  # each rank's loss is over its own sequences
            losses = mean_over_ranks(losses, device)
        kernels = kernels_launched(lambda: model.loss(local(0)).backward()) if cuda else None
        model.zero_grad(set_to_none=True)
        run = record(mode, losses, times, tokens_per_step, kernels)
        run["curve_gap"] = curve_gap(losses, reference)
        if rank == 0 and run["tokens_per_s"] is not None:
            run["vs_single"] = run["tokens_per_s"] / result["runs"]["single"]["tokens_per_s"]
    result["problems"] = problems(result, expect_kernels=cuda)
    if rank == 0:
        print_summary(result)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "distributed.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return result


def problems(result: dict, expect_kernels: bool) -> list[str]:
    """What fails the run: fallbacks on any rank, a loss curve outside the tolerance, a rank
    whose step did not launch every kernel family (CUDA)."""
    found = []
    for name, run in result["runs"].items():
        for rank, fallbacks in enumerate(run["fallbacks_per_rank"]):
            if fallbacks:
                found.append(f"{name}: fallbacks on rank {rank}: {fallbacks}")
        if run.get("curve_gap", 0.0) > 0:
            found.append(f"{name}: loss curve off the single-GPU one by {run['curve_gap']:.4f} past the tolerance")
        if expect_kernels and name != "single":
            for rank, kernels in enumerate(run["kernels_per_rank"]):
                if set(kernels or ()) != set(KERNEL_FAMILIES):
                    found.append(f"{name}: rank {rank} launched {kernels}, expected {sorted(KERNEL_FAMILIES)}")
    return found


def print_summary(result: dict) -> None:
    single = result["runs"]["single"]
    print(f"{result['device']} x {result['world']}, {result['dtype']}")
    print(f"{'run':>8} {'tokens/s':>12} {'vs 1 GPU':>9} {'curve gap':>10} {'kernels':>28} fallbacks")
    for name, run in result["runs"].items():
        tps = f"{run['tokens_per_s']:12.0f}" if run["tokens_per_s"] else f"{'-':>12}"
        ratio = f"{run['vs_single']:9.2f}" if run.get("vs_single") else f"{'-':>9}"
        gap = f"{run['curve_gap']:10.4f}" if "curve_gap" in run else f"{'-':>10}"
        kernels = ",".join(run["kernels_per_rank"][0]) if run["kernels_per_rank"][0] is not None else "-"
        fallbacks = [f for f in run["fallbacks_per_rank"] if f]
        print(f"{name:>8} {tps} {ratio} {gap} {kernels:>28} {fallbacks or 'none'}")
    print("losses (single):", " ".join(f"{x:.3f}" for x in single["losses"][::5]))
    print("problems:", result["problems"] or "none")


if __name__ == "__main__":
    code = 1 if main()["problems"] else 0
    # Leave without the interpreter's teardown: after destroy_process_group, gloo's threads
    # sometimes abort it at exit ("terminate called without an active exception"), turning a
    # finished, reported run into a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
