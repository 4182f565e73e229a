"""Waiting for a pipeline stage by polling, for main loops whose every wait is on the tensor
cores' critical path.

The CuTe DSL pipelines wait with ``mbarrier.try_wait`` and a 10 ms suspend-time hint: a warp whose
stage has not landed sleeps (``NANOSLEEP.SYNCS`` in SASS) until the phase completes and the
scheduler wakes it. :func:`poll_until_full` polls ``try_wait`` without the hint instead, so each
poll is only the hardware's own short wait. On the blockwise FP8 GEMM, which waits for a stage
right before each k-tile's batch, that was +3 to +5% (H100, bench/NOTES.md, 2026-11-26,
"DeepGEMM measured here; blockwise 256 x 128").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def poll_until_full(pipe, state, full=None):
    """Return once ``pipe``'s stage ``state`` is full (what ``pipe.consumer_wait`` waits for).
    ``full``: the result of an earlier ``pipe.consumer_try_wait(state)``, taken where its latency
    hid behind other work; polling starts only if that found the stage not yet full."""
    if cutlass.const_expr(full is None):
        full = pipe.consumer_try_wait(state)
    while not full:
        full = pipe.consumer_try_wait(state)
