"""Fallbacks to the PyTorch reference: counted, logged once per reason, fatal in strict mode.

A fallback happens when inputs are valid but no kernel covers the case on this device (an
arch without kernels, an unsupported dtype, a stride the TMA cannot address, ...). The
result is still right, only slower, so by default it is logged once per (op, reason) and
counted; ``TORCH_CUTE_OPS_STRICT=1`` turns it into an error so that a benchmark or a
production job cannot silently run the slow path.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter

import torch

log = logging.getLogger("torch_cute_ops")

_counts: Counter[tuple[str, str]] = Counter()


class FallbackError(RuntimeError):
    """Raised instead of falling back when TORCH_CUTE_OPS_STRICT=1."""


def strict() -> bool:
    return os.environ.get("TORCH_CUTE_OPS_STRICT", "0").lower() in ("1", "true", "yes", "on")


def note(op: str, reason: str) -> None:
    """Record that ``op`` takes the reference path because of ``reason`` (or raise in strict mode)."""
    if strict():
        raise FallbackError(f"torch_cute_ops.{op}: no kernel for this case ({reason}) and "
                            "TORCH_CUTE_OPS_STRICT=1 forbids the reference fallback")
    if torch.compiler.is_compiling():
        _note_traced(op, reason)
    else:
        _record(op, reason)


def _record(op: str, reason: str) -> None:
    key = (op, reason)
    if key not in _counts:
        log.warning("torch_cute_ops.%s falls back to the PyTorch reference: %s", op, reason)
    _counts[key] += 1


def constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (seconds)
    at import time: that decorator only marks the function, which is what this does until
    dynamo is loaded (a test pins the two to the same effect)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@constant_result
def _note_traced(op: str, reason: str) -> bool:
    """Under torch.compile the choice is made once, while tracing: record it then (one count
    per compiled graph, not per call), as plain Python that the graph does not capture."""
    _record(op, reason)
    return True


def counts() -> dict[tuple[str, str], int]:
    """How often each (op, reason) fell back in this process (eager calls, plus one per
    compiled graph that traced the fallback)."""
    return dict(_counts)


def reset() -> None:
    _counts.clear()
