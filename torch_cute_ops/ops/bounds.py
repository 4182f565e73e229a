"""Values that bound a kernel's memory access, checked before it launches.

Lengths, offsets, key ranges, page indices and cache rows decide which addresses a kernel
loads, so every one of them is checked before the launch that reads it:

* on the host when the tensor lives there (a CPU tensor: reading it costs nothing), with a
  ``ValueError`` that names the argument;
* on the device when it lives there, without a host synchronization: the condition is reduced
  on the GPU and handed to ``torch._assert_async``, queued on the caller's stream ahead of the
  kernel. A violated bound stops the stream with a device-side assertion (as PyTorch's own
  indexing does on CUDA): the kernel that would have read out of bounds never runs. Such checks
  are captured into CUDA graphs with the launch, so every replay checks the values it finds;
  key ranges of a contiguous cache are the exception (``in_graphs=False``): they only place the
  TMA's loads of that cache, which read zeros out of range, so a replay is memory-safe without
  the check's launches (a wrong range then gives a wrong row, never a stray read).

A check done once is remembered for that tensor (a weak reference), its version (an in-place
write makes it new) and every bound it was checked against, so a model's layers, which share one
``cache_seqlens`` or key range per step, pay for one check per step. Tensors the package makes
itself from values it has bounded (the key ranges of a padding mask) are recorded as checked when
they are made (:func:`mark_checked`). Under tracing (fake tensors, torch.compile) nothing is read:
the compiled graph calls the op with real tensors, which checks them then.
"""

from __future__ import annotations

import itertools

import torch

from ..runtime.lasting import PerTensor

# per tensor and version: its serial, and the bounds its values passed (True)
_records = PerTensor()
_serials = itertools.count()


def readable(*tensors) -> bool:
    """Real tensors whose values exist now (not fake, not traced)."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def serial(t: torch.Tensor) -> int:
    """A number naming ``t`` as it is now (this version), never reused: for a bound that involves
    another tensor's values (``start <= end``)."""
    return _records.get(t, "serial", lambda: next(_serials))


def _recorded(t: torch.Tensor, bound) -> bool:
    return _records.get(t, bound, lambda: False, keep=False)


def was_checked(t: torch.Tensor, bound) -> bool:
    """``t``'s current values passed the check named by ``bound`` (a hashable of every value the
    check read besides ``t``). Never during a CUDA-graph capture: replays must check."""
    return not _capturing(t) and _recorded(t, bound)


def mark_checked(t: torch.Tensor, bound) -> None:
    """Record that ``t``'s current values satisfy ``bound``."""
    _records.get(t, bound, lambda: True)


def require(ok: torch.Tensor, message: str, values: torch.Tensor | None = None) -> None:
    """``ok`` (a bool tensor) all true: on the host a ValueError with ``message`` (and the first
    offending ``values``); on a GPU a device-side assertion queued ahead of whatever the caller
    launches next (no sync)."""
    if ok.is_cuda:
        torch._assert_async(ok.all(), message)
    elif not bool(ok.all()):
        if values is not None:
            message += f", got {values.expand_as(ok)[~ok][:4].tolist()}"
        raise ValueError(message)


def _within(low: int, high, offset: int) -> tuple:
    """The bound ``low <= t <= high + offset`` as a record's key (a tensor ``high`` by its serial)."""
    return ("within", low, ("tensor", serial(high)) if isinstance(high, torch.Tensor) else high, offset)


def check_within(name: str, t: torch.Tensor, low: int, high, what: str, offset: int = 0,
                 in_graphs: bool = True) -> None:
    """``low <= t <= high + offset`` elementwise, ``high`` an int or a tensor that broadcasts with
    ``t`` (a relation between two index tensors: ``key_start <= key_end``); ``what`` says what
    the bound is, for the message. Once per version of ``t`` (and of ``high``) and bound.
    ``in_graphs=False``: not captured into CUDA graphs, for values that only bound TMA loads of
    one tensor (out-of-range coordinates read zeros, never another tensor's memory), where a
    serving loop's replays should not pay for the check's launches."""
    if not readable(t, high if isinstance(high, torch.Tensor) else None):
        return
    capturing = _capturing(t)
    if capturing and not in_graphs:
        return
    bound = _within(low, high, offset)
    if not capturing and _recorded(t, bound):
        return
    upper = high + offset if offset else high
    require((t >= low) & (t <= upper), f"{name}: every value must lie in [{low}, {what}]", t)
    mark_checked(t, bound)


def check_nondecreasing(name: str, t: torch.Tensor) -> None:
    """``t`` (1-D) never decreases: cumulative offsets. Once per version of ``t``."""
    if not readable(t) or t.numel() < 2:
        return
    capturing = _capturing(t)
    if not capturing and _recorded(t, "nondecreasing"):
        return
    require(t[1:] >= t[:-1], f"{name}: values must be non-decreasing (cumulative group ends)", t[1:])
    mark_checked(t, "nondecreasing")


def mark_within(t: torch.Tensor, low: int, high, offset: int = 0) -> None:
    """Record that the package made ``t`` within these bounds (:func:`check_within` then skips it)."""
    if readable(t, high if isinstance(high, torch.Tensor) else None):
        mark_checked(t, _within(low, high, offset))


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """An index tensor as the kernels read it: contiguous int32 (a strided view is copied)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def lengths_of(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The sequence lengths ``cu[b + 1] - cu[b]`` of a cu_seqlens tensor (one per version; made
    afresh inside a CUDA graph capture, so that replays read the new values)."""
    if not readable(cu_seqlens) or _capturing(cu_seqlens):
        return cu_seqlens[1:] - cu_seqlens[:-1]
    return _records.get(cu_seqlens, "lengths", lambda: cu_seqlens[1:] - cu_seqlens[:-1])


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, max_name: str) -> None:
    """A cu_seqlens (B + 1,) of a packed tensor of ``total`` rows: from 0, non-decreasing, ending
    at most at ``total`` (a serving engine's CUDA graph replays a padded batch), no sequence longer
    than ``max_seqlen``. On the device without a sync, captured into CUDA graphs (its values place
    a kernel's plain stores)."""
    if not readable(cu):
        return
    capturing = _capturing(cu)
    bound = ("cu_seqlens", total, max_seqlen)
    if not capturing and _recorded(cu, bound):
        return
    lengths = lengths_of(cu)
    ok = torch.cat([cu[:1] == 0, cu[-1:] <= total, (lengths >= 0) & (lengths <= max_seqlen)])
    require(ok, f"{name}: must start at 0, be non-decreasing and end at most at {total} (the packed length), "
                f"with no sequence longer than {max_name} = {max_seqlen}", torch.cat([cu[:1], cu[-1:], lengths]))
    mark_checked(cu, bound)
