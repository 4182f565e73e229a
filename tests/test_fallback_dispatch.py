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


def test_nondeterministic_kernels_follow_torchs_deterministic_mode(deterministic, caplog):
    """Off: the kernels run. On: a reason (the op falls back, counted). warn_only: one warning
    per op and the kernel runs, as PyTorch's own nondeterministic ops do."""
    assert fallback.nondeterministic_reason("flash_attn_bwd") is None
    deterministic()
    assert "use_deterministic_algorithms" in fallback.nondeterministic_reason("flash_attn_bwd")
    deterministic(warn_only=True)
    with caplog.at_level(logging.WARNING, logger="torch_cute_ops"):
        assert fallback.nondeterministic_reason("flash_attn_bwd") is None
        assert fallback.nondeterministic_reason("flash_attn_bwd") is None
    assert sum("not bitwise reproducible" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("varlen", [False, True])
def test_deterministic_mode_takes_the_backward_off_the_kernel(monkeypatch, deterministic, varlen):
    """With a kernel plan in hand (stubbed: calling it fails the test), deterministic mode sends
    the attention backward to the reference path and counts the fallback; the gradients are the
    reference's."""
    from torch_cute_ops.ops import attention, attention_varlen
    from torch_cute_ops.reference import attention as ref

    class KernelPlan:
        def __getattr__(self, name):
            raise AssertionError("the kernel ran under deterministic mode")

        def __call__(self, *args, **kwargs):
            raise AssertionError("the kernel ran under deterministic mode")

    module = attention_varlen if varlen else attention
    monkeypatch.setattr(module, "_make_bwd_plan", lambda key, *args: KernelPlan())
    torch.manual_seed(0)
    if varlen:
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        q, k, v = (torch.randn(12, 4, 32) for _ in range(3))
        out, lse = ref.flash_attn_varlen_fwd(q, k, v, cu, cu, 0.2, True)
        dout = torch.randn_like(out)
        args = (dout, q, k, v, out, lse, cu, cu, 7, 7, 0.2, True)
        expected = ref.flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu, cu, 0.2, True)
    else:
        q, k, v = (torch.randn(2, 9, 4, 32) for _ in range(3))
        out, lse = ref.flash_attn_fwd(q, k, v, 0.2, True)
        dout = torch.randn_like(out)
        args = (dout, q, k, v, out, lse, 0.2, True)
        expected = ref.flash_attn_bwd(dout, q, k, v, out, lse, 0.2, True)
    deterministic()
    fallback.reset()
    grads = (attention_varlen._flash_attn_varlen_bwd if varlen else attention._flash_attn_bwd)(*args)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
    op = "flash_attn_varlen_bwd" if varlen else "flash_attn_bwd"
    assert [reason for (name, reason) in fallback.counts() if name == op] == [
        fallback.nondeterministic_reason(op)]
