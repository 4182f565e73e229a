"""Timing shared by the attention benchmarks: forward and backward medians, providers interleaved."""

from __future__ import annotations

import statistics

import torch
from triton.testing import do_bench


def time_interleaved(calls: dict, rounds: int, warmup: int = 25, rep: int = 100) -> dict:
    """``{name: median ms}``: each call run once first (compiles stay out of the timing), then
    timed once per round, round after round (providers interleaved), the median of the rounds'
    ``triton.testing.do_bench`` medians."""
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return {name: statistics.median(values) for name, values in times.items()}


def time_fwd_bwd(calls: dict, inputs: tuple, dout: torch.Tensor, rounds: int) -> tuple[dict, dict]:
    """``{"<name> fwd"|"<name> bwd": median ms}`` and each call's output.

    Every call is timed once per round, round after round (interleaved), with
    ``triton.testing.do_bench`` medians: the forward under no_grad, the backward as
    ``torch.autograd.grad`` of the call's output with respect to ``inputs`` given ``dout``.
    """
    times = {f"{name} {kind}": [] for name in calls for kind in ("fwd", "bwd")}
    outs = {name: fn() for name, fn in calls.items()}
    for _ in range(rounds):
        for name, fn in calls.items():
            with torch.no_grad():
                times[f"{name} fwd"].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
            out = outs[name]
            grad = lambda out=out: torch.autograd.grad(out, inputs, dout, retain_graph=True)  # noqa: E731
            times[f"{name} bwd"].append(do_bench(grad, warmup=25, rep=100, return_mode="median"))
    return {key: statistics.median(values) for key, values in times.items()}, outs


def time_clean_l2(calls: dict, rounds: int, reps: int = 40, flush_mib: int = 256) -> dict:
    """``{name: median ms}`` from a cold L2 that holds no dirty lines.

    ``triton.testing.do_bench`` empties the L2 by zeroing a 256 MB buffer before each timed
    call, which leaves the L2 (50 MB on an H100) full of dirty lines: a call that reads tens of
    MiB then also pays for writing them back, ~15 us at HBM speed, inside its timed region. A
    decode step in a serving loop finds the L2 holding mostly clean lines (weights and caches
    read, a few MiB of activations written). Here the flush *reads* a ``flush_mib`` buffer
    (evicting everything, dirtying nothing), then events time one call. Each call is run once
    first; providers are interleaved, ``reps`` timings per provider per round; median of all.
    """
    flush = torch.ones(flush_mib << 18, dtype=torch.float32, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for _ in range(rounds):
        for name, fn in calls.items():
            for start, end in events:
                torch.sum(flush, 0, out=sink)
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times[name] += [start.elapsed_time(end) for start, end in events]
    return {name: statistics.median(values) for name, values in times.items()}
