"""Decode-shaped attention (one query token against a long cache) on the Hopper forward kernel:
with grouped kv heads the group's query heads run as the rows of one tile (pack-GQA by strided
views), against the float32 reference; outputs poisoned before the run."""

import math

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops.reference.attention import flash_attn_fwd as ref_fwd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm_90 (Hopper) GPU"),
]

# (batch, seqlen_k, heads_q, heads_kv, head_dim, causal, softcap)
CASES = [
    (8, 4096, 32, 8, 128, True, 0.0),
    (3, 1000, 32, 8, 128, False, 0.0),
    (2, 777, 8, 1, 64, True, 0.0),      # MQA: 8 rows per tile
    (1, 5000, 64, 8, 128, True, 30.0),
    (4, 129, 16, 16, 128, True, 0.0),   # no GQA: unpacked
]


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}-k{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-c{int(c[5])}-cap{c[6]:g}"
                                             for c in CASES])
def test_one_query_token_against_a_cache(case):
    batch, seqlen_k, h_q, h_kv, head_dim, causal, softcap = case
    gen = torch.Generator(device="cuda").manual_seed(seqlen_k)
    q = torch.randn(batch, 1, h_q, head_dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(batch, seqlen_k, h_kv, head_dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, seqlen_k, h_kv, head_dim, device="cuda", generator=gen).bfloat16()
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_func(q, k, v, causal=causal, softcap=softcap, return_lse=True)
    assert not tco.fallback_counts()
    ref_out, ref_lse = ref_fwd(q.float(), k.float(), v.float(), 1 / math.sqrt(head_dim), causal, None, None, softcap)
    assert out.shape == q.shape and lse.shape == (batch, h_q, 1)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    rel = ((out.float() - ref_out).norm() / ref_out.norm()).item()
    assert rel < 1.5e-2, rel
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


def test_packed_views_write_every_head():
    """Poisoned outputs: the strided views must cover every (head, dim) of out and lse."""
    from torch_cute_ops.runtime.attention import packed_gqa_views

    q = torch.randn(2, 1, 32, 128, device="cuda").bfloat16()
    k = torch.randn(2, 300, 8, 128, device="cuda").bfloat16()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 32, 1), float("nan"), device="cuda")
    q_rows, out_rows, lse_rows = packed_gqa_views(q, q.shape[2] // k.shape[2], out, lse)
    from torch_cute_ops.runtime import attention as flash_host

    flash_host.launch_fwd(q_rows, k, k, out_rows, lse_rows, 128 ** -0.5, False)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    ref_out, _ = ref_fwd(q.float(), k.float(), k.float(), 128 ** -0.5, False)
    assert ((out.float() - ref_out).norm() / ref_out.norm()).item() < 1.5e-2
