"""Device tensors that outlive the call that makes them (tile counters, placeholders, index tables,
mask summaries), made where no CUDA graph's memory pool can claim them.

While a CUDA graph is captured, and while torch.compile's CUDA graphs ("reduce-overhead") warm up a
compiled function, torch routes every allocation of the calling thread to the graph's private pool.
A tensor a kernel host keeps across calls must not land there: torch.compile checks after the
warm-up that nothing but the function's outputs lives in its pool, and fails the call; and a
tensor made during a capture holds what the captured kernels write only after a replay, so an
eager call that found it cached would read garbage. :func:`outside_graph_pools` makes such tensors
on a helper thread (its allocations go to the ordinary pool) on a side stream ordered after the
caller's stream, and waits for them. During a capture it is not used: callers make a per-call
tensor that the graph owns and do not cache it. :class:`PerTensor` keeps values derived from a
tensor (a mask's block summary) for as long as that tensor lives.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import weakref
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

_helper: concurrent.futures.ThreadPoolExecutor | None = None
_helper_thread: threading.Thread | None = None
_helper_lock = threading.Lock()
_side_streams: dict[int, torch.cuda.Stream] = {}


def capturing() -> bool:
    """A CUDA graph capture is under way on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def outside_graph_pools(device: torch.device, make: Callable[[], T]) -> T:
    """``make()``'s tensors, allocated in the ordinary pool of ``device`` and complete when this
    returns (made on a side stream that first waits for the caller's current stream). Not for use
    during a capture (see the module's note); off CUDA it is ``make()``."""
    if device.type != "cuda" or not torch.cuda.is_available() or threading.current_thread() is _helper_thread:
        return make()  # off CUDA, or already on the helper (a nested make)
    global _helper
    with _helper_lock:  # one helper for the process, whichever thread asks first
        if _helper is None:
            _helper = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-cute-ops-lasting")
    index = torch.cuda.current_device() if device.index is None else device.index
    caller = torch.cuda.current_stream(index)

    def job():
        global _helper_thread
        _helper_thread = threading.current_thread()
        with torch.cuda.device(index), torch.no_grad():
            side = _side_streams.get(index)
            if side is None:
                side = _side_streams[index] = torch.cuda.Stream(index)
            side.wait_stream(caller)  # inputs the caller's stream is still writing (a mask)
            with torch.cuda.stream(side):
                made = make()
            side.synchronize()
        for t in made if isinstance(made, tuple) else (made,):
            if isinstance(t, torch.Tensor):
                t.record_stream(caller)  # freed (an evicted summary): reused after the caller's reads
        return made

    return _helper.submit(job).result()


def lasting(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn(device_index, *key)``, made once per arguments by :func:`outside_graph_pools` and kept;
    during a capture, an uncached call (the graph owns what it makes) unless already kept."""
    made: dict[tuple, T] = {}

    @functools.wraps(fn)
    def get(*args):  # args: (device_index, *key), the dict's key as given (the per-launch lookup)
        found = made.get(args)
        if found is None:
            if capturing():
                return fn(*args)
            found = made[args] = outside_graph_pools(torch.device("cuda", args[0]), lambda: fn(*args))
        return found

    get.cache_clear = made.clear
    return get


class PerTensor:
    """Values derived from a tensor, made once per (tensor, version, key) and dropped with the
    tensor (a weak reference): transformers hands every layer the same mask tensor, so its layers
    share what is derived from it."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}  # id(tensor) -> (weak reference, {key: (version, value)})

    def get(self, tensor: torch.Tensor, key, make: Callable[[], T], keep: bool = True) -> T:
        """The value kept for ``key``, else ``make()``'s (kept unless ``keep`` is False)."""
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            found = entry[1].get(key)
            if found is not None and found[0] == tensor._version:
                return found[1]
        value = make()
        if keep:
            if entry is None or entry[0]() is not tensor:
                ref = weakref.ref(tensor, functools.partial(self._forget, id(tensor)))
                entry = self._entries[id(tensor)] = (ref, {})
            entry[1][key] = (tensor._version, value)
        return value

    def _forget(self, tensor_id: int, ref: weakref.ref) -> None:
        if self._entries.get(tensor_id, (None,))[0] is ref:
            del self._entries[tensor_id]

    def __contains__(self, tensor: torch.Tensor) -> bool:
        entry = self._entries.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def __len__(self) -> int:
        return len(self._entries)
