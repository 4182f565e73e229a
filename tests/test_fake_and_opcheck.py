"""Fake (meta) functions give the real shapes, dtypes and strides; opcheck passes on every op."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_cute_ops  # noqa: F401


def _gemm_cases():
    return [
        ((37, 19), (19, 23), None, None, None),
        ((3, 37, 19), (3, 19, 23), (23,), "gelu_tanh", torch.float32),
        ((37, 19), (19, 23), (23,), "silu", None),
    ]


@pytest.mark.parametrize("a_shape,b_shape,bias_shape,act,out_dtype", _gemm_cases())
def test_gemm_fake_matches_real(a_shape, b_shape, bias_shape, act, out_dtype):
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    bias = torch.randn(bias_shape) if bias_shape else None
    real = torch.ops.cute.gemm(a, b, bias, act, out_dtype)
    with FakeTensorMode() as mode:
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        fbias = mode.from_tensor(bias) if bias is not None else None
        fake = torch.ops.cute.gemm(fa, fb, fbias, act, out_dtype)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.parametrize("sq,sk,hq,hkv", [(17, 17, 4, 4), (9, 33, 8, 2), (33, 9, 4, 1)])
def test_attention_fakes_match_real(sq, sk, hq, hkv):
    q, k, v = torch.randn(2, sq, hq, 32), torch.randn(2, sk, hkv, 32), torch.randn(2, sk, hkv, 32)
    out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.2, True)
    grads = torch.ops.cute.flash_attn_bwd(torch.randn_like(out), q, k, v, out, lse, 0.2, True)
    with FakeTensorMode() as mode:
        fq, fk, fv, fo, fl = (mode.from_tensor(t) for t in (q, k, v, out, lse))
        fout, flse = torch.ops.cute.flash_attn_fwd(fq, fk, fv, 0.2, True)
        fgrads = torch.ops.cute.flash_attn_bwd(mode.from_tensor(out), fq, fk, fv, fo, fl, 0.2, True)
    for fake, real in zip((fout, flse, *fgrads), (out, lse, *grads)):
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    assert lse.dtype == torch.float32 and lse.shape == (2, hq, sq)


def _req(*ts):
    return [t.requires_grad_() for t in ts]


def test_opcheck_gemm():
    a, b = _req(torch.randn(2, 9, 5), torch.randn(2, 5, 7))
    bias = torch.randn(7, requires_grad=True)
    for act in (None, "relu", "gelu_tanh", "silu"):
        torch.library.opcheck(torch.ops.cute.gemm.default, (a, b, bias, act, None))
    torch.library.opcheck(torch.ops.cute.gemm.default, (a[0].detach(), b[0].detach().mT.contiguous().mT))
    torch.library.opcheck(torch.ops.cute.gemm.default, (a, b, bias, "gelu_tanh", None, 0.5))


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_flash_attn(causal):
    q, k, v = _req(torch.randn(2, 9, 4, 16), torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16))
    torch.library.opcheck(torch.ops.cute.flash_attn_fwd.default, (q, k, v, 0.25, causal))
    out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.25, causal)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, 0.25, causal)
    torch.library.opcheck(torch.ops.cute.flash_attn_bwd.default, args)


@pytest.mark.parametrize("band", [(3, 0, 0.0), (None, -4, 0.0), (2, 5, 1.5)])
def test_opcheck_flash_attn_window_softcap(band):
    q, k, v = _req(torch.randn(2, 9, 4, 16), torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16))
    torch.library.opcheck(torch.ops.cute.flash_attn_fwd.default, (q, k, v, 0.25, False, *band))
    out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.25, False, *band)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, 0.25, False, *band)
    torch.library.opcheck(torch.ops.cute.flash_attn_bwd.default, args)


def test_opcheck_deterministic_keyword():
    """The keyword-only ``deterministic`` of the four attention ops: schema, fakes, autograd."""
    q, k, v = _req(torch.randn(2, 9, 4, 16), torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16))
    flag = {"deterministic": True}
    torch.library.opcheck(torch.ops.cute.flash_attn_fwd.default, (q, k, v, 0.25, True), flag)
    out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.25, True, **flag)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, 0.25, True)
    torch.library.opcheck(torch.ops.cute.flash_attn_bwd.default, args, flag)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = _req(*(torch.randn(9, 4, 16) for _ in range(3)))
    varlen_args = (cu, cu, 5, 5, 0.25, True)
    torch.library.opcheck(torch.ops.cute.flash_attn_varlen_fwd.default, (*packed, *varlen_args), flag)
    out, lse = torch.ops.cute.flash_attn_varlen_fwd(*packed, *varlen_args, **flag)
    torch.library.opcheck(torch.ops.cute.flash_attn_varlen_bwd.default,
                          (torch.randn_like(out), *(t.detach() for t in packed), out.detach(), lse, *varlen_args),
                          flag)
