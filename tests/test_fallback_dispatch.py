"""Dispatch by compute capability, and fallbacks that are counted, logged once and fatal when strict."""

import logging

import pytest
import torch

from torch_cute_ops.ops import dispatch, fallback


@pytest.mark.parametrize("cap,arch", [((9, 0), "sm90"), ((10, 0), "sm100"), ((10, 3), "sm100"),
                                      ((8, 0), None), ((8, 9), None), ((12, 0), None)])
def test_capability_selects_kernel_family(cap, arch):
    assert dispatch.arch_of_capability(cap) == arch


@pytest.fixture
def mocked_gpu(monkeypatch):
    """Pretend a CUDA device of a given capability exists (kernels are not imported here)."""
    def use(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(dispatch, "_host", lambda op, arch: f"module for {op} on {arch}")
        dispatch._device_arch.cache_clear()
    yield use
    dispatch._device_arch.cache_clear()


@pytest.mark.parametrize("cap,expected", [
    ((9, 0), "module for gemm on sm90"),
    ((10, 0), "module for gemm on sm100"),
    ((8, 0), "no kernels for compute capability 8.0"),
])
def test_kernel_for_follows_device_capability(mocked_gpu, cap, expected):
    mocked_gpu(cap)
    assert dispatch.kernel_for("gemm", torch.device("cuda", 0)) == expected


def test_missing_kernel_family_is_a_reason_not_an_error():
    dispatch.reset_cache()
    reason = dispatch._host("gemm", "sm120")
    assert reason == "no gemm kernel for sm120"


def test_cpu_tensors_take_the_reference_without_counting():
    import torch_cute_ops as tco

    tco.gemm(torch.randn(3, 4), torch.randn(4, 5))
    assert fallback.counts() == {}


def test_fallback_is_counted_and_logged_once_per_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="torch_cute_ops"):
        for _ in range(3):
            fallback.note("gemm", "reason A")
        fallback.note("gemm", "reason B")
    assert fallback.counts() == {("gemm", "reason A"): 3, ("gemm", "reason B"): 1}
    assert [r.getMessage() for r in caplog.records] == [
        "torch_cute_ops.gemm falls back to the PyTorch reference: reason A",
        "torch_cute_ops.gemm falls back to the PyTorch reference: reason B",
    ]


def test_strict_mode_raises_instead_of_falling_back(monkeypatch):
    monkeypatch.setenv("TORCH_CUTE_OPS_STRICT", "1")
    with pytest.raises(fallback.FallbackError, match=r"torch_cute_ops.gemm: no kernel for this case \(why\)"):
        fallback.note("gemm", "why")
    assert fallback.counts() == {}


def test_constant_result_marks_like_the_dynamo_decorator():
    """fallback.constant_result stands in for torch.compiler.assume_constant_result at import
    time (so that import never loads torch._dynamo): both must mark a function the same way."""
    import torch._dynamo  # noqa: F401

    def mine():
        return True

    def theirs():
        return True

    marked = {k: v for k, v in vars(torch.compiler.assume_constant_result(theirs)).items()}
    fallback_marked = dict(vars(_mark_without_dynamo(mine)))
    assert marked == fallback_marked == {"_dynamo_marked_constant": True}


def _mark_without_dynamo(fn):
    import sys

    saved = sys.modules.pop("torch._dynamo")
    try:
        return fallback.constant_result(fn)
    finally:
        sys.modules["torch._dynamo"] = saved

