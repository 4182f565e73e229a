"""Gradients of the ops (reference path) agree with finite differences in float64."""

import pytest
import torch
from torch.autograd import gradcheck

import torch_cute_ops as tco


def _f64(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("activation", [None, "relu", "gelu_tanh", "silu"])
def test_gemm_gradcheck(activation):
    a, b, bias = _f64(2, 6, 5), _f64(2, 5, 4), _f64(4)
    assert gradcheck(lambda a, b, bias: tco.gemm(a, b, bias, activation), (a, b, bias))


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_gemm_gradcheck_alpha(activation):
    """alpha scales the pre-activation, so it scales dA, dB and reaches act'."""
    a, b, bias = _f64(6, 5), _f64(5, 4), _f64(4)
    assert gradcheck(lambda a, b, bias: tco.gemm(a, b, bias, activation, alpha=-0.75), (a, b, bias))


def test_gemm_gradcheck_transposed_operands():
    a, b = _f64(5, 6), _f64(4, 5)
    assert gradcheck(lambda a, b: tco.gemm(a.mT, b.mT), (a, b))


def test_linear_gradcheck():
    x, w, bias = _f64(3, 2, 5), _f64(4, 5), _f64(4)
    assert gradcheck(tco.linear, (x, w, bias))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,hq,hkv", [(5, 5, 2, 2), (3, 7, 4, 2), (7, 3, 2, 1)])
def test_flash_attn_gradcheck(causal, sq, sk, hq, hkv):
    q, k, v = _f64(2, sq, hq, 8), _f64(2, sk, hkv, 8), _f64(2, sk, hkv, 8)
    assert gradcheck(lambda q, k, v: tco.flash_attn_func(q, k, v, 0.3, causal), (q, k, v))


def test_sdpa_gradcheck_through_transposed_layout():
    q, k, v = _f64(2, 4, 5, 8), _f64(2, 2, 5, 8), _f64(2, 2, 5, 8)
    fn = lambda q, k, v: tco.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    assert gradcheck(fn, (q, k, v))


def test_empty_rows_have_zero_output_and_gradient():
    # seqlen_k < seqlen_q under bottom-right causal: the first rows see no key
    q, k, v = _f64(1, 6, 1, 4), _f64(1, 2, 1, 4), _f64(1, 2, 1, 4)
    out, lse = tco.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.isneginf(lse[0, 0, :4]).all() and torch.isfinite(lse[0, 0, 4:]).all()
    assert (out[0, :4] == 0).all()
    out.sum().backward()
    assert (q.grad[0, :4] == 0).all() and torch.isfinite(q.grad).all()


def test_lse_is_not_differentiable():
    q, k, v = _f64(1, 3, 1, 4), _f64(1, 3, 1, 4), _f64(1, 3, 1, 4)
    _, lse = tco.flash_attn_func(q, k, v, return_lse=True)
    assert not lse.requires_grad


@pytest.mark.parametrize("causal,window,softcap", [
    (False, (2, 1), 0.0), (True, (3, -1), 0.0), (False, (-1, -1), 1.5), (True, (2, 0), 0.7), (False, (0, 0), 0.0),
])
@pytest.mark.parametrize("sq,sk", [(5, 5), (4, 7), (7, 3)])
def test_flash_attn_window_softcap_gradcheck(causal, window, softcap, sq, sk):
    q, k, v = _f64(1, sq, 2, 8) * 3, _f64(1, sk, 1, 8), _f64(1, sk, 1, 8)
    q = q.detach().requires_grad_()
    fn = lambda q, k, v: tco.flash_attn_func(q, k, v, 0.4, causal, window, softcap)  # noqa: E731
    assert gradcheck(fn, (q, k, v))


def _brute_force(q, k, v, scale, visible, softcap=0.0):
    """One (query, head) at a time, straight from the definition."""
    b, sq, h, d = q.shape
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                keys = [j for j in range(k.shape[1]) if visible(i, j)]
                if not keys:
                    continue
                s = torch.stack([q[bi, i, hi] @ k[bi, j, hi] * scale for j in keys])
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                p = torch.softmax(s, 0)
                out[bi, i, hi] = sum(p[n] * v[bi, j, hi] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("causal,left,right,softcap", [
    (False, 2, 1, 0.0), (True, 3, None, 0.0), (False, None, -2, 0.0), (False, 0, 0, 0.0), (True, None, 4, 2.0),
])
@pytest.mark.parametrize("sq,sk", [(6, 6), (4, 9), (9, 4)])
def test_window_semantics_match_the_definition(causal, left, right, softcap, sq, sk):
    """query i sees key j iff i + S_k - S_q - left <= j <= i + S_k - S_q + right (causal:
    right = min(right, 0)); rows that see nothing are 0 with lse = -inf."""
    q, k, v = (torch.randn(1, s, 2, 8, dtype=torch.float64) for s in (sq, sk, sk))
    hi = 0 if causal and right is None else right
    if causal and right is not None:
        hi = min(right, 0)
    offset = sk - sq
    visible = lambda i, j: ((left is None or j >= i + offset - left)  # noqa: E731
                            and (hi is None or j <= i + offset + hi))
    window = (-1 if left is None else left, -1 if hi is None else hi) if right is None or right >= -1 else None
    out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.3, causal, left, right, softcap)
    torch.testing.assert_close(out, _brute_force(q, k, v, 0.3, visible, softcap))
    empty = [i for i in range(sq) if not any(visible(i, j) for j in range(sk))]
    assert torch.isneginf(lse[0, :, empty]).all() and (out[0, empty] == 0).all()
    if window is not None and window[0] >= -1 and window[1] >= -1:  # the public API's form
        torch.testing.assert_close(tco.flash_attn_func(q, k, v, 0.3, causal, window, softcap), out)


def test_window_size_is_validated():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="window_size: left must be an int >= -1"):
        tco.flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size: expected a pair"):
        tco.flash_attn_func(q, q, q, window_size=5)
    with pytest.raises(ValueError, match="softcap: expected a finite value >= 0"):
        tco.flash_attn_func(q, q, q, softcap=-1.0)
