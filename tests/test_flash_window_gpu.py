"""Sliding windows and both causal alignments on the Hopper attention kernels, forward and
backward, against a float32 reference from the same rounded inputs.

Outputs and gradients are poisoned with NaN before each launch, so an unwritten element fails;
windows cover (0, 0), (1, 0), (127, 0), (W, W), wider than the sequence, negative right edges
(PyTorch's top-left causal), GQA, S_q != S_k both ways, odd lengths and rows that see nothing.
"""

import math

import pytest
import torch

from torch_cute_ops.reference.attention import flash_attn_bwd as ref_bwd
from torch_cute_ops.reference.attention import flash_attn_fwd as ref_fwd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm_90 (Hopper) GPU"),
]

# (head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, window_left, window_right)
CASES = [
    (128, 2, 300, 300, 4, 4, True, 0, None),        # (0, 0): each query sees itself
    (128, 2, 300, 300, 4, 2, True, 1, None),        # (1, 0)
    (128, 1, 1000, 1000, 8, 2, True, 127, None),    # (127, 0), GQA 4
    (128, 1, 777, 777, 4, 4, False, 100, 100),      # (W, W)
    (128, 1, 513, 513, 4, 1, True, 5000, None),     # wider than the sequence, MQA
    (64, 2, 389, 1021, 4, 4, True, 200, None),      # S_q < S_k
    (64, 1, 1021, 389, 4, 4, True, 200, None),      # S_q > S_k: rows that see nothing
    (256, 1, 333, 517, 2, 2, False, 64, 17),
    (128, 1, 300, 700, 4, 4, False, None, -400),    # PyTorch's top-left causal (right = S_q - S_k)
    (128, 1, 700, 300, 4, 4, False, None, 400),
    (96, 1, 255, 255, 2, 2, False, 31, 0),
]
IDS = [f"d{c[0]}-{c[2]}x{c[3]}-h{c[4]}/{c[5]}-{'causal' if c[6] else 'full'}-w{c[7]},{c[8]}" for c in CASES]


def _inputs(head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 7 + seqlen_k)
    rand = lambda s, h: torch.randn(batch, s, h, head_dim, device="cuda", generator=gen).to(dtype)
    return rand(seqlen_q, heads_q), rand(seqlen_k, heads_kv), rand(seqlen_k, heads_kv), rand(seqlen_q, heads_q)


def _close(name, ours, ref, rel_bound=1.5e-2):
    """Relative Frobenius and max errors; a reference that is ~0 everywhere (window (0, 0):
    dQ = dK = 0 up to rounding) is measured against an RMS floor of 1e-2 instead."""
    assert not torch.isnan(ours).any(), f"{name}: NaN (an element was not written)"
    ours, ref = ours.float(), ref.float()
    floor = 1e-2 * ref.numel() ** 0.5
    rel = ((ours - ref).norm() / ref.norm().clamp_min(floor)).item()
    max_err = ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-2)).item()
    assert rel < rel_bound and max_err < 5 * rel_bound, f"{name}: rel {rel:.2e} max {max_err:.2e}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_window_forward_and_backward(case):
    from torch_cute_ops.runtime import attention as flash_host

    head_dim, batch, s_q, s_k, h_q, h_kv, causal, left, right = case
    q, k, v, dout = _inputs(head_dim, batch, s_q, s_k, h_q, h_kv)
    scale = 1.0 / math.sqrt(head_dim)
    band = dict(window_left=left, window_right=right)
    ref_out, ref_lse = ref_fwd(q.float(), k.float(), v.float(), scale, causal, left, right)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, h_q, s_q), float("nan"), device="cuda")
    flash_host.launch_fwd(q, k, v, out, lse, scale, causal, **band)
    torch.cuda.synchronize()
    _close("out", out, ref_out)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "rows that see no key must have lse = -inf"
    _close("lse", lse[~empty], ref_lse[~empty], 1e-3)
    assert (out.float()[empty.transpose(1, 2)] == 0).all() if empty.any() else True

    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    flash_host.launch_bwd(dout, q, k, v, out, lse, *grads, scale, causal, **band)
    torch.cuda.synchronize()
    ref_grads = ref_bwd(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, scale, causal, left, right)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(name, g, r, 2e-2)


def test_public_api_and_autograd_with_a_window():
    import torch_cute_ops as tco

    q, k, v, dout = _inputs(128, 2, 1000, 1000, 8, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    tco.ops.fallback.reset()
    out = tco.flash_attn_func(q, k, v, causal=True, window_size=(255, 0))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert not tco.fallback_counts()
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = ref_fwd(qf, kf, vf, 128 ** -0.5, True, 255, None)[0]
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    _close("out", out, ref)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(name, g, r, 2e-2)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 1000), (1000, 300), (1, 4096)])
def test_sdpa_top_left_causal_on_the_kernels(seqlen_q, seqlen_k):
    import torch.nn.functional as F

    import torch_cute_ops as tco

    gen = torch.Generator(device="cuda").manual_seed(seqlen_q)
    q = torch.randn(2, 8, seqlen_q, 128, device="cuda", generator=gen).bfloat16()
    k = torch.randn(2, 2, seqlen_k, 128, device="cuda", generator=gen).bfloat16()
    v = torch.randn(2, 2, seqlen_k, 128, device="cuda", generator=gen).bfloat16()
    tco.ops.fallback.reset()
    ours = tco.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not tco.fallback_counts()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    rows = ref.isfinite().all(-1)  # torch gives NaN for rows that see no key; ours give 0
    _close("sdpa", ours[rows], ref[rows])


# (head_dim, seqlen_q, seqlen_k, heads_q, heads_kv, causal, window_left, softcap, logit_scale)
SOFTCAP_CASES = [
    (128, 500, 500, 4, 2, True, None, 50.0, 30.0),   # logits ~N(0, 30): deep in tanh's bend
    (64, 333, 517, 4, 4, False, None, 20.0, 30.0),
    (128, 700, 700, 4, 1, True, 100, 30.0, 10.0),    # Gemma 2's sliding layers: window + softcap
    (256, 300, 300, 2, 2, True, 64, 50.0, 30.0),
    (96, 129, 257, 2, 2, False, None, 5.0, 1.0),
    # bf16 caps up to BOUNDED_SOFTCAP_MAX (63.8) skip the running max, larger ones keep it
    (128, 400, 400, 4, 2, True, None, 100.0, 60.0),
]


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=[f"d{c[0]}-{c[1]}x{c[2]}-cap{c[7]:g}-x{c[8]:g}-w{c[6]}"
                                                     for c in SOFTCAP_CASES])
def test_softcap_forward_and_backward(case):
    """softcap * tanh(s / softcap) on the scaled scores, forward and backward (the kernels use
    tanh.approx, as FlashAttention does: ~2^-11 relative error on tanh)."""
    from torch_cute_ops.runtime import attention as flash_host

    head_dim, s_q, s_k, h_q, h_kv, causal, left, softcap, logit_scale = case
    q, k, v, dout = _inputs(head_dim, 1, s_q, s_k, h_q, h_kv)
    q = (q.float() * logit_scale).bfloat16()
    scale = 1.0 / math.sqrt(head_dim)
    ref_out, ref_lse = ref_fwd(q.float(), k.float(), v.float(), scale, causal, left, None, softcap)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, h_q, s_q), float("nan"), device="cuda")
    flash_host.launch_fwd(q, k, v, out, lse, scale, causal, window_left=left, softcap=softcap)
    torch.cuda.synchronize()
    _close("out", out, ref_out, 2e-2)
    _close("lse", lse, ref_lse, 1e-3)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    flash_host.launch_bwd(dout, q, k, v, out, lse, *grads, scale, causal, window_left=left, softcap=softcap)
    torch.cuda.synchronize()
    ref_grads = ref_bwd(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, scale, causal, left, None,
                        softcap)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(name, g, r, 3e-2)


@pytest.mark.parametrize("sign", [-1.0, 1.0], ids=["near-minus-cap", "near-plus-cap"])
@pytest.mark.parametrize("softcap", [30.0, 50.0, 63.0, 100.0])
def test_softcap_rows_of_saturated_scores(softcap, sign):
    """Every score of a row capped near -softcap or +softcap (queries pointing away from, or
    along, all keys), V large: the bounded-score forward (no running max, bf16 caps <= 63.8)
    takes exp2 of the same extreme value for all of them and must still normalize the row (no
    underflow to a zero sum, no overflow of O), as the running-max forward does above that cap."""
    from torch_cute_ops.runtime import attention as flash_host

    assert (flash_host.softcap_kind(softcap, torch.bfloat16) == "bounded") == (softcap <= 63.8)
    gen = torch.Generator(device="cuda").manual_seed(int(softcap))
    s_q, s_k, heads, head_dim = 200, 333, 2, 128
    direction = torch.randn(1, 1, heads, head_dim, device="cuda", generator=gen)
    k = (direction + 0.05 * torch.randn(1, s_k, heads, head_dim, device="cuda", generator=gen)).bfloat16()
    q = (sign * 40.0 * direction + torch.randn(1, s_q, heads, head_dim, device="cuda", generator=gen)).bfloat16()
    v = (1000.0 * torch.randn(1, s_k, heads, head_dim, device="cuda", generator=gen)).bfloat16()
    scale = head_dim ** -0.5
    ref_out, ref_lse = ref_fwd(q.float(), k.float(), v.float(), scale, False, None, None, softcap)
    # the scores really are near -softcap / +softcap
    assert ((ref_lse - math.log(s_k)) * sign > 0.8 * softcap).all()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, heads, s_q), float("nan"), device="cuda")
    flash_host.launch_fwd(q, k, v, out, lse, scale, False, softcap=softcap)
    torch.cuda.synchronize()
    _close("out", out, ref_out, 2e-2)
    _close("lse", lse, ref_lse, 1e-3)
