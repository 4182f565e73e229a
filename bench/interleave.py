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
