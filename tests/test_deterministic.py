"""Deterministic attention backward, the op layer (CPU): who asks for the ordered dQ variant.

``deterministic=True`` on the public functions and ``torch.use_deterministic_algorithms(True)``
both reach the backward's plan (the kernel variant is chosen by the flag in the plan's key); the
forward ignores it. The kernel itself: tests/test_flash_bwd_sm90_ptx.py and the GPU tests.
"""

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops.ops import attention, attention_varlen


@pytest.fixture
def planned(monkeypatch):
    """Record the deterministic flag each backward plan is made for; the plan stays the
    reference path (the key is what a CUDA input would be planned with)."""
    flags = []

    def record(module):
        def make(key, *args):
            flags.append(key[-1])
            return "cpu"
        monkeypatch.setattr(module, "_make_bwd_plan", make)

    record(attention)
    record(attention_varlen)
    attention._bwd_plans.clear()
    attention_varlen._bwd_plans.clear()
    return flags


def _dense(**kwargs):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 9, 4, 32, requires_grad=True) for _ in range(3))
    out = tco.flash_attn_func(q, k, v, causal=True, **kwargs)
    return torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def _varlen(**kwargs):
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 4, 32, requires_grad=True) for _ in range(3))
    out = tco.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, **kwargs)
    return torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


@pytest.mark.parametrize("run", [_dense, _varlen], ids=["dense", "varlen"])
def test_public_flag_reaches_the_backward_plan(planned, run):
    default = run()
    ordered = run(deterministic=True)
    assert planned == [False, True]
    for a, b in zip(default, ordered):  # the same math (the reference path here)
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("run", [_dense, _varlen], ids=["dense", "varlen"])
def test_torch_deterministic_mode_reaches_the_backward_plan(planned, deterministic, run):
    deterministic()
    run()
    assert planned == [True]


def test_flag_is_keyword_only_in_the_schemas():
    """A keyword-only schema argument: positional calls written for the earlier schema keep
    their meaning, and sharding rules see it as a keyword."""
    for op in ("flash_attn_fwd", "flash_attn_bwd", "flash_attn_varlen_fwd", "flash_attn_varlen_bwd"):
        schema = getattr(torch.ops.cute, op).default._schema
        arg = next(a for a in schema.arguments if a.name == "deterministic")
        assert arg.kwarg_only and arg.default_value is False, op


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_orders_its_dq_adds_only_when_asked(monkeypatch, head_dim, causal):
    """The ordered variant only when asked for: at D256 it was the default where key blocks see
    different query ranges until the unordered adds measured 7-14% faster there (bench/NOTES.md,
    2026-11-26, "Masked and long deterministic backwards")."""
    from torch_cute_ops.runtime import attention as host

    monkeypatch.setattr(host, "get_compiled", lambda spec: spec)
    monkeypatch.setattr(host, "_unused_counter", lambda index: torch.empty(1, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q = torch.randn(1, 64, 2, head_dim).bfloat16()
    assert not host.plan_bwd(q, q, q, causal).deterministic
    assert not host.plan_bwd(q, q, q, False, attn_mask="bool").deterministic
    assert host.plan_bwd(q, q, q, causal, deterministic=True).deterministic


def _fill_is_on():
    return torch._C._get_deterministic_fill_uninitialized_memory()


def test_outputs_written_in_full_skip_the_deterministic_fill(deterministic):
    """Under torch's deterministic mode new tensors are filled first, unless made through
    ``written_in_full`` (outputs and workspaces the kernel overwrites): the fill is off while
    they are made and back on after, also when making them raises."""
    from torch_cute_ops.runtime.unfilled import written_in_full
    assert _fill_is_on()
    assert written_in_full(_fill_is_on)  # mode off: nothing changes
    deterministic()
    assert written_in_full(_fill_is_on) is False
    assert _fill_is_on()

    def fails():
        raise RuntimeError("out of memory")
    with pytest.raises(RuntimeError):
        written_in_full(fails)
    assert _fill_is_on()
    filled = torch.empty(4)  # PyTorch's own fill is untouched
    assert torch.isnan(filled).all()


def test_fill_left_off_stays_off(deterministic):
    """A user who turned the fill off keeps it off."""
    from torch_cute_ops.runtime.unfilled import written_in_full
    import torch.utils.deterministic
    deterministic()
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        assert written_in_full(_fill_is_on) is False
        assert not _fill_is_on()
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = True


@pytest.mark.parametrize("mode", [False, True])
def test_gemm_outputs_skip_the_deterministic_fill(monkeypatch, deterministic, mode):
    """GEMM outputs (tco.gemm, tco.scaled_mm) are written in full by their kernels: made with the
    mode's fill off, and with torch.empty as is when the mode is off."""
    from torch_cute_ops.runtime import unfilled
    if mode:
        deterministic()
    seen = []
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        seen.append(_fill_is_on())
        return real_empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", recording_empty)
    out = unfilled.empty_output((3, 5), torch.bfloat16, torch.device("cpu"))
    assert out.shape == (3, 5) and out.dtype == torch.bfloat16
    assert seen == [not mode]
    assert _fill_is_on()
