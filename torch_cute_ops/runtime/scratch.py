"""Per-stream device scratch that kernels keep between calls.

* zeroed int32 words (:func:`zeroed_int32`) that a launch leaves zeroed again when it ends: the
  attention's dynamic tile counter, the GEMM's stream-K flags. Launches in stream order share
  them; launches on other streams, which may overlap, get their own.
* buffers whose contents never outlive a launch (:func:`scratch`): the stream-K partial sums.

While a CUDA graph is captured, each launch gets words of its own from a slab zeroed by an eager
call before the capture (:func:`_capture_words`): a zeroed tensor made during the capture would be
one more graph node (a memset, ~2 us of every replay of a decode step), and graphs replayed on
different streams never share a word. Its buffers then belong to the graph (its private pool).
"""

from __future__ import annotations

import torch

from .lasting import outside_graph_pools

_zeroed: dict[tuple[int, int, str, int], torch.Tensor] = {}
_buffers: dict[tuple[int, int, str], torch.Tensor] = {}

CAPTURE_COUNTERS_PER_SLAB = 65536  # int32 words: 256 KB, room for a few hundred captured GEMMs' flags
_capture_slabs: dict[int, list] = {}  # device index -> [slab, words handed out]
_retired_slabs: list[torch.Tensor] = []  # words of these may still live in captured graphs


def _capture_words(device: torch.device, count: int) -> torch.Tensor:
    """During a capture: the next ``count`` unused words of the device's slab."""
    slab = _capture_slabs.get(device.index)
    if slab is None or slab[1] + count > CAPTURE_COUNTERS_PER_SLAB:  # no eager call made one: a captured memset
        return torch.zeros(count, dtype=torch.int32, device=device)
    slab[1] += count
    return slab[0][slab[1] - count:slab[1]]


def _ready_capture_slab(device_index: int) -> None:
    """Outside a capture: a zeroed slab for the captures to come, a fresh one when half used."""
    slab = _capture_slabs.get(device_index)
    if slab is None or 2 * slab[1] > CAPTURE_COUNTERS_PER_SLAB:
        if slab is not None:
            _retired_slabs.append(slab[0])
        device = torch.device("cuda", device_index)
        slab = outside_graph_pools(device, lambda: torch.zeros(CAPTURE_COUNTERS_PER_SLAB, dtype=torch.int32,
                                                               device=device))
        _capture_slabs[device_index] = [slab, 0]


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def current_raw_stream(device_index: int) -> int:
    """The current stream's handle (the C binding when this torch build has it: ~0.2 us)."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def zeroed_int32(device: torch.device, count: int, owner: str) -> torch.Tensor:
    """``count`` int32 words of the current stream, zero now; the kernels of ``owner`` that
    take them leave them zero when they end."""
    if device.type != "cuda":
        return torch.zeros(count, dtype=torch.int32, device=device)
    if torch._C._cuda_isCurrentStreamCapturing():
        return _capture_words(device, count)
    key = (device.index, current_raw_stream(device.index), owner, count)
    words = _zeroed.get(key)
    if words is None:
        words = _zeroed[key] = outside_graph_pools(device, lambda: torch.zeros(count, dtype=torch.int32, device=device))
    _ready_capture_slab(device.index)
    return words


def scratch(device: torch.device, numel: int, dtype: torch.dtype, owner: str) -> torch.Tensor:
    """A buffer of at least ``numel`` values for one launch at a time on the current stream
    (its contents are garbage); it grows to the largest request."""
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(numel, dtype=dtype, device=device)
    key = (device.index, current_raw_stream(device.index), owner)
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
        buffer = _buffers[key] = outside_graph_pools(device, lambda: torch.empty(numel, dtype=dtype, device=device))
    return buffer
