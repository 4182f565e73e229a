"""The Hopper attention forward kernel against a float32 reference, on an sm_90 GPU.

Fresh random inputs every case; ``out`` and ``lse`` are poisoned with NaN before
the launch so that an unwritten element fails. The reference
(``torch_cute_ops.reference.attention``) computes in float32 from the same
rounded inputs.
"""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs an sm_90 (Hopper) GPU",
    ),
]

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = (torch.bfloat16, torch.float16)
# relative Frobenius error of out, max |out - ref| / max(1, max |ref|)
TOLERANCE = {torch.bfloat16: (1.2e-2, 4e-2), torch.float16: (3e-3, 1e-2)}

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): tails, seqlen_q != seqlen_k both ways,
# GQA 1/4/8, tiny and long sequences. Every head dim, dtype and mask runs all of them.
SHAPES = [
    (2, 128, 128, 4, 4),
    (1, 1000, 1000, 8, 2),
    (1, 17, 4096, 8, 1),
    (2, 4096, 17, 2, 2),
    (1, 1, 1000, 4, 1),
    (3, 1000, 1, 2, 2),
    (1, 1000, 4096, 4, 4),
]


def random_bshd(batch, seqlen, heads, head_dim, dtype, scale=1.0):
    return (torch.randn(batch, seqlen, heads, head_dim, device="cuda") * scale).to(dtype)


def run_kernel(q, k, v, causal, softmax_scale=None):
    from torch_cute_ops.runtime import attention as flash_host

    assert flash_host.fwd_unsupported_reason(q, k, v, causal) is None
    b, s_q, h_q, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.full((b, s_q, h_q, d), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((b, h_q, s_q), float("nan"), device="cuda", dtype=torch.float32)
    flash_host.launch_fwd(q, k, v, out, lse, scale, causal)
    return out, lse, scale


def check(q, k, v, causal, softmax_scale=None):
    from torch_cute_ops.reference.attention import flash_attn_fwd

    out, lse, scale = run_kernel(q, k, v, causal, softmax_scale)
    torch.cuda.synchronize()
    ref_out, ref_lse = flash_attn_fwd(q, k, v, scale, causal)
    ref = ref_out.float()
    assert not out.isnan().any(), "NaN in out"
    assert not lse.isnan().any(), "NaN in lse"
    diff = out.float() - ref
    rel = (diff.norm() / ref.norm().clamp_min(1e-6)).item()
    max_err = diff.abs().max().item() / max(1.0, ref.abs().max().item()) if diff.numel() else 0.0
    bound_rel, bound_max = TOLERANCE[q.dtype]
    if ref.norm() > 0:
        assert rel < bound_rel, f"out rel error {rel:.2e}"
    assert max_err < bound_max, f"out max error {max_err:.2e}"
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3)
    return rel


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_shapes(head_dim, dtype, causal):
    torch.manual_seed(head_dim + causal)
    for b, s_q, s_k, h_q, h_kv in SHAPES:
        q = random_bshd(b, s_q, h_q, head_dim, dtype)
        k = random_bshd(b, s_k, h_kv, head_dim, dtype)
        v = random_bshd(b, s_k, h_kv, head_dim, dtype)
        check(q, k, v, causal)


def test_causal_rows_without_keys_are_zero():
    """S_k < S_q under bottom-right causal: the first S_q - S_k rows see no key."""
    q = random_bshd(1, 300, 2, 128, torch.bfloat16)
    k = random_bshd(1, 100, 2, 128, torch.bfloat16)
    v = random_bshd(1, 100, 2, 128, torch.bfloat16)
    out, lse, _ = run_kernel(q, k, v, causal=True)
    assert torch.all(out[:, :200] == 0)
    assert torch.all(lse[:, :, :200] == float("-inf"))
    check(q, k, v, causal=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_transposed_and_strided_inputs(head_dim):
    """q a transposed view of (B, H, S, D); k/v slices of a wider head dimension."""
    dtype = torch.bfloat16
    q = torch.randn(2, 6, 333, head_dim, device="cuda").to(dtype).transpose(1, 2)
    kv = torch.randn(2, 700, 8, head_dim, device="cuda").to(dtype)
    k, v = kv[:, :, 0:6:2], kv[:, :, 1:7:2]  # 3 kv heads, head stride 2*head_dim
    for causal in (False, True):
        check(q, k, v, causal)


def test_many_heads_and_batches():
    q = random_bshd(8, 256, 32, 128, torch.bfloat16)
    k = random_bshd(8, 256, 8, 128, torch.bfloat16)
    v = random_bshd(8, 256, 8, 128, torch.bfloat16)
    for causal in (False, True):
        check(q, k, v, causal)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_large_inputs_stay_finite(head_dim):
    """Inputs scaled by 30: scores in the thousands, softmax must not overflow."""
    for dtype in DTYPES:
        q = random_bshd(1, 500, 4, head_dim, dtype, scale=30.0)
        k = random_bshd(1, 700, 4, head_dim, dtype, scale=30.0)
        v = random_bshd(1, 700, 4, head_dim, dtype, scale=30.0)
        for causal in (False, True):
            out, lse, _ = run_kernel(q, k, v, causal)
            assert torch.isfinite(out).all()
            check(q, k, v, causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_row_max_growing_across_key_blocks(head_dim):
    """The online softmax keeps a row's max until it grows past a threshold and only then
    rescales O. Key block n (blocks run last first) adds OFFSETS[n] x c_row to the scores
    (log2 units, c_row in [0.5, 1.5] per row): steps below the threshold that add up past
    it, single jumps past it, and warps whose rows disagree."""
    torch.manual_seed(head_dim)
    offsets = [60.0, 32.0, 31.0, 30.0, 9.0, 6.0, 3.0, 0.0]  # key block 0 .. 7, in log2 units
    seqlen_k = 128 * (len(offsets) - 1) + 100
    scale = 1.0 / math.sqrt(head_dim)
    for dtype in DTYPES:
        q = random_bshd(2, 1000, 4, head_dim, dtype, scale=0.5)
        k = random_bshd(2, seqlen_k, 4, head_dim, dtype, scale=0.5)
        v = random_bshd(2, seqlen_k, 4, head_dim, dtype)
        q[..., 0] = (torch.rand(2, 1000, 4, device="cuda") + 0.5).to(dtype)
        steps = torch.tensor(offsets, device="cuda") / (scale * math.log2(math.e))
        k[..., 0] = steps.repeat_interleave(128)[:seqlen_k, None].expand(2, seqlen_k, 4).to(dtype)
        for causal in (False, True):
            check(q, k, v, causal, softmax_scale=scale)


def test_softmax_scale_is_used():
    q = random_bshd(1, 200, 2, 128, torch.bfloat16)
    k = random_bshd(1, 300, 2, 128, torch.bfloat16)
    v = random_bshd(1, 300, 2, 128, torch.bfloat16)
    check(q, k, v, causal=False, softmax_scale=0.3)


def test_unsupported_reasons():
    from torch_cute_ops.runtime import attention as flash_host

    q = random_bshd(1, 16, 2, 128, torch.bfloat16)
    assert flash_host.fwd_unsupported_reason(q, q, q, False) is None
    q80 = random_bshd(1, 16, 2, 80, torch.bfloat16)
    assert "head dim" in flash_host.fwd_unsupported_reason(q80, q80, q80, False)
    q32 = q.float()
    assert flash_host.fwd_unsupported_reason(q32, q32, q32, False) is not None
    k3 = random_bshd(1, 16, 3, 128, torch.bfloat16)
    assert flash_host.fwd_unsupported_reason(q, k3, k3, False) is not None


def test_dynamic_schedule_counter_across_calls_and_streams():
    """The dynamic schedule's tile counter is reset by each launch's last claim and kept per stream:
    many back-to-back causal launches on one stream, and launches on two streams at once, all
    compute every tile exactly once (outputs poisoned before each launch)."""
    torch.manual_seed(0)
    q = random_bshd(2, 1000, 8, 128, torch.bfloat16)
    k = random_bshd(2, 1000, 2, 128, torch.bfloat16)
    v = random_bshd(2, 1000, 2, 128, torch.bfloat16)
    first, _, _ = run_kernel(q, k, v, causal=True)
    for _ in range(20):
        again, _, _ = run_kernel(q, k, v, causal=True)
        assert torch.equal(again, first)
    side = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    torch.cuda.synchronize()
    for stream in side:
        with torch.cuda.stream(stream):
            outs.append([run_kernel(q, k, v, causal=True)[0] for _ in range(5)])
    torch.cuda.synchronize()
    for per_stream in outs:
        for out in per_stream:
            assert torch.equal(out, first)
    check(q, k, v, causal=True)
