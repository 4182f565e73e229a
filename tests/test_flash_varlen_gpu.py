"""Packed sequences (varlen) on the Hopper attention kernels, forward and backward, against a
float32 reference from the same rounded inputs.

Outputs and gradients are poisoned with NaN before each launch, so an unwritten element fails
and a store past a sequence's end (into the next one's rows) is caught as a wrong value there.
Batches mix lengths 0, 1, primes, exact and off-by-one tile multiples, q and k lengths that
differ per sequence (both ways: rows that see nothing under causal), GQA/MQA, every head dim,
windows, softcap on logits scaled by 30, fp16.
"""

import itertools
import math

import pytest
import torch

from attention_checks import HOPPER, close

from torch_cute_ops.reference.attention import flash_attn_varlen_bwd as ref_bwd
from torch_cute_ops.reference.attention import flash_attn_varlen_fwd as ref_fwd

pytestmark = HOPPER

SAME = None  # lens_k = lens_q
# (head_dim, lens_q, lens_k, heads_q, heads_kv, causal, window_left, window_right, softcap)
CASES = [
    (128, [0, 1, 127, 128, 129, 257, 1000], SAME, 4, 4, True, None, None, 0.0),
    (128, [5, 300, 0, 61, 1024], [700, 300, 13, 1, 2000], 8, 2, True, None, None, 0.0),  # S_q != S_k both ways
    (64, [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101,
          103, 107, 109, 113, 127, 131, 137, 139, 149], SAME, 4, 1, False, None, None, 0.0),  # primes, MQA
    (128, [300, 1, 77], SAME, 4, 4, True, 0, None, 0.0),          # window (0, 0)
    (128, [300, 1, 77], SAME, 4, 2, True, 1, None, 0.0),          # (1, 0)
    (128, [1000, 129, 511], SAME, 4, 2, True, 127, None, 0.0),    # (127, 0)
    (128, [777, 64, 300], [777, 100, 200], 4, 4, False, 64, 64, 0.0),  # (W, W)
    (128, [513, 20], SAME, 4, 1, True, 5000, None, 0.0),          # wider than the sequence
    (128, [500, 0, 333], SAME, 4, 2, True, None, None, 50.0),     # softcap (logits x 30)
    (256, [300, 65, 1], [517, 65, 3], 2, 2, True, 64, None, 50.0),
    (96, [255, 1, 100], [256, 2, 99], 2, 2, False, None, None, 0.0),
    (192, [200, 333], [150, 400], 2, 1, False, None, None, 0.0),
]
IDS = [f"d{c[0]}-b{len(c[1])}-h{c[3]}/{c[4]}-{'causal' if c[5] else 'full'}-w{c[6]},{c[7]}-cap{c[8]:g}"
       for c in CASES]


def _cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")


def _inputs(head_dim, lens_q, lens_k, heads_q, heads_kv, dtype=torch.bfloat16, logit_scale=1.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed + sum(lens_q) * 7 + sum(lens_k))
    rand = lambda n, h: torch.randn(n, h, head_dim, device="cuda", generator=gen)
    q = (rand(sum(lens_q), heads_q) * logit_scale).to(dtype)
    k, v = rand(sum(lens_k), heads_kv).to(dtype), rand(sum(lens_k), heads_kv).to(dtype)
    return q, k, v, rand(sum(lens_q), heads_q).to(dtype)


_close = close


def _run(case, dtype=torch.bfloat16):
    from torch_cute_ops.runtime import attention as flash_host

    head_dim, lens_q, lens_k, h_q, h_kv, causal, left, right, softcap = case
    lens_k = lens_q if lens_k is SAME else lens_k
    q, k, v, dout = _inputs(head_dim, lens_q, lens_k, h_q, h_kv, dtype, 30.0 if softcap else 1.0)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    max_q, max_k = max(lens_q), max(lens_k)
    scale = 1.0 / math.sqrt(head_dim)
    band_causal, local, lo, hi = flash_host.kernel_band(causal, left, right, max_q, max_k)

    out = torch.full_like(q, float("nan"))
    lse = torch.full((h_q, q.shape[0]), float("nan"), device="cuda")
    plan = flash_host.plan_fwd(q, k, v, band_causal, local=local, softcap=softcap, rows="packed")
    assert not isinstance(plan, str), plan
    plan.packed(q, k, v, cu_q, cu_k, max_q, max_k, out, lse, scale, lo, hi, softcap)
    torch.cuda.synchronize()
    ref_out, ref_lse = ref_fwd(q.float(), k.float(), v.float(), cu_q, cu_k, scale, causal, left, right, softcap)
    _close("out", out, ref_out, 2e-2 if softcap else 1.5e-2)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "rows that see no key must have lse = -inf"
    _close("lse", lse[~empty], ref_lse[~empty], 1e-3)
    assert (out.float()[empty.t()] == 0).all()

    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    bwd = flash_host.plan_bwd(q, k, v, band_causal, local, softcap != 0.0, rows="packed")
    assert not isinstance(bwd, str), bwd
    bwd.packed(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *grads, scale, lo, hi, softcap)
    torch.cuda.synchronize()
    ref_grads = ref_bwd(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, cu_q, cu_k, scale,
                        causal, left, right, softcap)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(name, g, r, 3e-2 if softcap else 2e-2)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_varlen_forward_and_backward(case):
    _run(case)


def test_varlen_fp16():
    _run((128, [100, 0, 257], [300, 5, 257], 4, 2, True, None, None, 0.0), torch.float16)


def test_public_api_autograd_and_compile_without_recompiles():
    """flash_attn_varlen_func end to end: gradients through autograd, no fallback, and a compiled
    function that takes three different packings (new cu_seqlens, totals and max lengths) with
    one compilation."""
    import torch._dynamo.testing

    import torch_cute_ops as tco

    def attend(q, k, v, cu, max_len):
        return tco.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, window_size=(255, 0))

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for lens in ([700, 3, 1200], [1, 1, 1, 4000], [333, 0, 257, 64, 9]):
        q, k, v, dout = _inputs(128, lens, lens, 8, 2, seed=len(lens))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        cu = _cu(lens)
        tco.ops.fallback.reset()
        for fn in (attend, compiled):
            out = fn(q, k, v, cu, max(lens))
            grads = torch.autograd.grad(out, (q, k, v), dout)
            assert not tco.fallback_counts()
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            ref = ref_fwd(qf, kf, vf, cu, cu, 128 ** -0.5, True, 255, None)[0]
            ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
            _close("out", out, ref)
            for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
                _close(name, g, r, 2e-2)
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[-1] == frames[0], f"compiled frames after each packing: {frames}"


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, window_left, softcap, key ranges)
PADDED_CASES = [
    (4, 300, 300, 8, 2, True, None, 0.0, [(0, 300), (0, 129), (171, 300), (300, 300)]),   # right, left, empty
    (3, 1, 1000, 8, 2, True, None, 0.0, [(0, 1000), (377, 1000), (999, 1000)]),         # decode, left padding
    (2, 64, 700, 4, 4, True, 100, 0.0, [(0, 700), (200, 700)]),                          # chunked prefill, window
    (2, 257, 257, 4, 1, False, None, 30.0, [(13, 257), (0, 200)]),                       # bidirectional, softcap
]


@pytest.mark.parametrize("case", PADDED_CASES, ids=[f"b{c[0]}-{c[1]}x{c[2]}-h{c[3]}/{c[4]}" for c in PADDED_CASES])
def test_padded_batch_forward_and_backward(case):
    """A padded batch through key_start/key_end: entry b's real keys [start, end), queries aligned
    bottom-right; rows that are not real give 0 (forward) and zero gradients."""
    import torch_cute_ops as tco

    batch, s_q, s_k, h_q, h_kv, causal, left, softcap, ranges = case
    gen = torch.Generator(device="cuda").manual_seed(s_q + s_k)
    rand = lambda s, h: torch.randn(batch, s, h, 128, device="cuda", generator=gen).bfloat16()  # noqa: E731
    q, k, v, dout = rand(s_q, h_q), rand(s_k, h_kv), rand(s_k, h_kv), rand(s_q, h_q)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    start = torch.tensor([r[0] for r in ranges], dtype=torch.int32, device="cuda")
    end = torch.tensor([r[1] for r in ranges], dtype=torch.int32, device="cuda")
    window = (-1 if left is None else left, 0 if causal else -1)
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True,
                                   key_start=start, key_end=end)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert not tco.fallback_counts()
    from torch_cute_ops.reference.attention import flash_attn_fwd as dense_ref

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = dense_ref(qf, kf, vf, 128 ** -0.5, causal, left, None, softcap, start, end)
    ref_grads = torch.autograd.grad(ref_out, (qf, kf, vf), dout.float())
    _close("out", out, ref_out, 2e-2)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    _close("lse", lse[~empty], ref_lse[~empty], 1e-3)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(name, g, r, 3e-2)
