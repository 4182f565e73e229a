"""PyTorch's attn_mask on the Hopper attention kernels, forward and backward, through
``scaled_dot_product_attention`` and at the launch level, against a float32 reference from the
same rounded inputs.

Masks: padding + causal (bool, (B, 1, S_q, S_k), and additive with the dtype's lowest value as
transformers' older helpers make it), additive 0 / -inf with a finite patch (blocks read from
bits and from values), 2-D (S_q, S_k), per-head bool masks, per-head additive float masks
with -inf regions and finite biases, GQA, rows that see no key, odd sizes, head dims 64-256.
Launch-level outputs are poisoned with NaN first.
"""


import pytest
import torch

from attention_checks import HOPPER, close
import torch.nn.functional as F

from torch_cute_ops.reference.attention import flash_attn_bwd as ref_bwd
from torch_cute_ops.reference.attention import flash_attn_fwd as ref_fwd

pytestmark = HOPPER


_close = close


def padding_causal_mask(batch, seqlen, lengths, device="cuda"):
    """(B, 1, S, S) bool: causal, and keys past each sequence's length hidden (right padding)."""
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device).tril()
    keys = torch.arange(seqlen, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return (causal[None] & keys[:, None, :])[:, None]


def _masks(kind, b, h, s_q, s_k, gen):
    if kind == "padding_causal":
        lengths = [s_k - 17 * i for i in range(b)]
        return padding_causal_mask(b, s_q, lengths)
    if kind == "padding_causal_lowest":  # the same, additive, hidden as the dtype's lowest value
        lengths = [s_k - 17 * i for i in range(b)]
        visible = padding_causal_mask(b, s_q, lengths)
        return torch.zeros(visible.shape, device="cuda").bfloat16().masked_fill(
            ~visible, torch.finfo(torch.bfloat16).min)
    if kind == "additive_mixed":  # padding + causal as 0 / -inf, and a finite bias over a patch:
        lengths = [s_k - 29 * i for i in range(b)]  # blocks read from bits and from values
        visible = padding_causal_mask(b, s_q, lengths)
        bias = torch.zeros(visible.shape, device="cuda").masked_fill(~visible, float("-inf"))
        bias[..., 100:230, 40:90] -= 1.5
        return bias.bfloat16()
    if kind == "2d_random":  # every block partial; one row that sees nothing
        mask = torch.rand(s_q, s_k, device="cuda", generator=gen) > 0.5
        mask[3] = False
        return mask
    if kind == "random_heads":  # a bool mask per head, every block partial
        return torch.rand(b, h, s_q, s_k, device="cuda", generator=gen) > 0.4
    if kind == "additive_heads":  # per-head biases, a hidden band, finite elsewhere
        bias = torch.randn(1, h, s_q, s_k, device="cuda", generator=gen)
        i = torch.arange(s_q, device="cuda")[:, None]
        j = torch.arange(s_k, device="cuda")[None, :]
        return bias.masked_fill((j > i + 40) | (j < i - 300), float("-inf")).bfloat16()
    if kind == "document":  # block-diagonal documents of 300 tokens, causal inside
        doc_q = torch.arange(s_q, device="cuda") // 300
        doc_k = torch.arange(s_k, device="cuda") // 300
        i = torch.arange(s_q, device="cuda")[:, None]
        j = torch.arange(s_k, device="cuda")[None, :]
        return ((doc_q[:, None] == doc_k[None, :]) & (j <= i))[None, None]
    raise ValueError(kind)


# (kind, head_dim, batch, heads_q, heads_kv, seqlen_q, seqlen_k)
CASES = [
    ("padding_causal", 128, 3, 4, 2, 777, 777),
    ("padding_causal", 64, 2, 4, 4, 1000, 1000),
    ("padding_causal_lowest", 128, 2, 4, 2, 777, 777),
    ("additive_mixed", 64, 2, 4, 2, 600, 600),
    ("additive_mixed", 256, 1, 2, 2, 500, 500),
    ("2d_random", 128, 2, 4, 1, 333, 517),
    ("2d_random", 256, 1, 2, 2, 333, 517),
    ("random_heads", 64, 2, 4, 2, 200, 391),
    ("additive_heads", 128, 1, 4, 2, 700, 700),
    ("document", 256, 1, 2, 2, 1000, 1000),
    ("document", 96, 1, 2, 1, 640, 640),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-b{c[2]}-h{c[3]}/{c[4]}-{c[5]}x{c[6]}" for c in CASES])
def test_sdpa_with_attn_mask_on_the_kernels(case):
    import torch_cute_ops as tco

    kind, d, b, h_q, h_kv, s_q, s_k = case
    gen = torch.Generator(device="cuda").manual_seed(s_q + d)
    rand = lambda h, s: torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16()  # noqa: E731
    q, k, v, dout = rand(h_q, s_q), rand(h_kv, s_k), rand(h_kv, s_k), rand(h_q, s_q)
    mask = _masks(kind, b, h_q, s_q, s_k, gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    tco.ops.fallback.reset()
    out = tco.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h_q != h_kv)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert not tco.fallback_counts(), tco.fallback_counts()
    qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref_mask = mask if mask.dtype == torch.bool else mask.float()
    ref = ref_fwd(qf, kf, vf, d ** -0.5, False, attn_mask=ref_mask)[0]
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float().transpose(1, 2))
    _close("out", out.transpose(1, 2), ref)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(name, g.transpose(1, 2), r, 3e-2)


def test_launch_level_outputs_are_all_written():
    """Poisoned outputs: every row is written by the masked forward, every gradient by the
    backward, including rows and key blocks the mask leaves empty."""
    from torch_cute_ops.runtime import attention as flash_host

    b, s, h, d = 2, 600, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16() for _ in range(4))
    mask = padding_causal_mask(b, s, [600, 250])
    mask[1, :, 100:130] = False  # rows that see nothing
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, s), float("nan"), device="cuda")
    plan = flash_host.plan_fwd(q, k, v, False, attn_mask="bool")
    plan.masked(q, k, v, mask, out, lse, d ** -0.5)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    flash_host.plan_bwd(q, k, v, False, attn_mask="bool").masked(dout, q, k, v, out, lse, mask, *grads, d ** -0.5)
    torch.cuda.synchronize()
    ref_out, ref_lse = ref_fwd(q.float(), k.float(), v.float(), d ** -0.5, False, attn_mask=mask)
    _close("out", out, ref_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (out[1, 100:130] == 0).all(), "rows that see no key give 0"
    ref_grads = ref_bwd(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, d ** -0.5, False,
                        attn_mask=mask)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(name, g, r, 3e-2)


def test_rows_that_see_nothing_match_the_documented_choice():
    """A fully masked row: ours is 0 (and lse -inf, zero gradients). PyTorch's default CUDA
    backend is printed beside it for the record (see docs/api.md)."""
    import torch_cute_ops as tco

    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda")
    mask[5] = False
    ours = tco.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    print("fully masked row, torch default backend:", theirs[0, 0, 5, :4].tolist(), "ours:", ours[0, 0, 5, :4].tolist())
    assert (ours[:, :, 5] == 0).all()
    grads = torch.autograd.grad(ours.sum(), (q, k, v))
    assert all(not g.isnan().any() for g in grads)
