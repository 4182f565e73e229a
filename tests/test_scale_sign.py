"""A zero or negative softmax_scale: the kernels need a positive one (they keep raw scores and their
row max, and mask with -inf), so the ops run softmax(c q.k) as softmax(|c| (-q).k) for c < 0 and
a zero scale as 2^-100. Found by the GPU fuzz: scale 0 with a key tail gave NaN in every row."""

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops.ops.attention import ZERO_SCALE, positive_scale
from torch_cute_ops.reference import attention as reference


@pytest.mark.parametrize("scale", [0.0, -0.3, -2.5])
@pytest.mark.parametrize("causal", [False, True])
def test_the_rewritten_scale_gives_the_same_attention(scale, causal):
    """In float64, with masked (causal) scores: same output and lse, and dq through the negation."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 37, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = reference.flash_attn_fwd(q, k, v, scale, causal)
    q_run, scale_run = positive_scale(q, scale)
    assert scale_run > 0.0
    out_run, lse_run = reference.flash_attn_fwd(q_run, k, v, scale_run, causal)
    torch.testing.assert_close(out_run, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_run, lse, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = torch.autograd.grad(out_run, (q, k, v), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12 if scale else ZERO_SCALE * 1e3)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.0, -0.3])
@pytest.mark.parametrize("causal", [False, True])
def test_kernels_take_zero_and_negative_scales(scale, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 200, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_func(q, k, v, scale, causal, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    cache_out = tco.flash_attn_with_kvcache(q.detach()[:, -1:], k.detach(), v.detach(), softmax_scale=scale,
                                            causal=causal)
    cu = torch.tensor([0, 200, 400], device="cuda", dtype=torch.int32)
    packed = tco.flash_attn_varlen_func(q.detach().flatten(0, 1), k.detach().flatten(0, 1),
                                        v.detach().flatten(0, 1), cu, cu, 200, 200, scale, causal)
    assert tco.fallback_counts() == {}
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference.flash_attn_fwd(*leaves, scale, causal)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    for got, want, tol in [(out, ref, 2e-3), (lse, ref_lse, 1e-4), (cache_out, ref[:, -1:], 2e-3),
                           (packed, ref.flatten(0, 1), 2e-3), *[(g, w, 1e-2) for g, w in zip(grads, ref_grads)]]:
        got = got.double().cpu()
        assert torch.isfinite(got).all()
        assert (got - want).norm() <= tol * want.norm() + 1e-6
