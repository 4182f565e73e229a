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
