"""Tensors the kernel hosts keep across calls (runtime.lasting): made once per key outside CUDA
graphs' memory pools, never kept when made during a capture; mask summaries leave with their mask."""

import gc

import torch

from torch_cute_ops.runtime import attention_mask as rt
from torch_cute_ops.runtime import lasting


def test_lasting_makes_once_per_key_and_keeps_nothing_made_during_a_capture(monkeypatch):
    made = []

    @lasting.lasting
    def table(device_index, rows):
        made.append((device_index, rows))
        return torch.arange(rows)

    monkeypatch.setattr(lasting, "capturing", lambda: True)
    during = table(0, 3)
    assert table(0, 3) is not during and made == [(0, 3), (0, 3)], "a capture's tensors belong to its graph"
    monkeypatch.setattr(lasting, "capturing", lambda: False)
    kept = table(0, 3)
    assert table(0, 3) is kept and table(0, 4) is not kept and table(1, 3) is not kept
    assert made[2:] == [(0, 3), (0, 4), (1, 3)]
    monkeypatch.setattr(lasting, "capturing", lambda: True)
    assert table(0, 3) is kept, "a capture reuses what an eager call made"
    assert table.__wrapped__(0, 5).tolist() == list(range(5))


def test_outside_graph_pools_is_a_plain_call_off_cuda():
    assert lasting.outside_graph_pools(torch.device("cpu"), lambda: 7) == 7


def test_mask_summaries_are_kept_per_key_and_version_and_leave_with_the_mask(monkeypatch):
    monkeypatch.setattr(rt, "_summaries", lasting.PerTensor())
    calls = []

    def summary(mask, key):
        return rt.mask_summary(mask, key, lambda: calls.append(key) or (mask.sum(),))

    mask = torch.rand(2, 1, 5, 7) > 0.5
    first = summary(mask, "fwd")
    assert summary(mask, "fwd") is first and calls == ["fwd"]
    summary(mask, "bwd")
    assert calls == ["fwd", "bwd"]
    mask.logical_not_()  # a new version: summarised again
    assert summary(mask, "fwd") is not first and calls == ["fwd", "bwd", "fwd"]
    monkeypatch.setattr(rt, "capturing", lambda: True)
    other = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    summary(other, "fwd")
    assert other not in rt._summaries, "a summary made during a capture is not kept"
    monkeypatch.setattr(rt, "capturing", lambda: False)
    del mask
    gc.collect()
    assert len(rt._summaries) == 0, "an entry leaves with its mask"
