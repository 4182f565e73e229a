"""GPU tests of the sm_90a attention backward against a float32 autograd reference.

Speed is measured by ``bench/bench_attention.py --backward``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a Hopper (sm_90) GPU",
    ),
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference_attention(q, k, v, scale: float, causal: bool):
    """fp32 attention on (B, S, H, D); GQA by index; causal aligned bottom-right.

    Returns (out, lse); rows that attend to nothing get out = 0 and lse = -inf.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    kv_head = torch.arange(q.shape[2], device=q.device) // group
    k, v = k[:, :, kv_head], v[:, :, kv_head]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (seqlen_k - seqlen_q), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite_lse[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def _rel_err(x, ref):
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _make_inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, layout="bshd"):
    def rand(b, s, h):
        if layout == "bhsd":  # storage (B, H, S, D), viewed as (B, S, H, D)
            return torch.randn(b, h, s, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
        if layout == "padded":  # a slice of a wider last dim
            return torch.randn(b, s, h, head_dim + 64, device="cuda", dtype=dtype)[..., :head_dim]
        return torch.randn(b, s, h, head_dim, device="cuda", dtype=dtype)

    q = rand(batch, seqlen_q, heads_q)
    k = rand(batch, seqlen_k, heads_kv)
    v = rand(batch, seqlen_k, heads_kv)
    dout = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype)
    return q, k, v, dout


def _reference_grads(q, k, v, dout, scale, causal):
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out32, lse = reference_attention(q32, k32, v32, scale, causal)
    dq, dk, dv = torch.autograd.grad(out32, (q32, k32, v32), dout.float())
    return out32.detach(), lse.detach(), (dq, dk, dv)


def _run_ours(q, k, v, out, lse, dout, scale, causal):
    from torch_cute_ops.runtime import attention as flash_host

    assert flash_host.bwd_unsupported_reason(q, k, v, causal) is None
    grads = [torch.full(t.shape, float("nan"), device="cuda", dtype=t.dtype) for t in (q, k, v)]
    flash_host.launch_bwd(dout, q, k, v, out, lse, *grads, scale, causal)
    torch.cuda.synchronize()
    return grads


def _sdpa_grads(q, k, v, dout, scale, causal):
    """PyTorch SDPA (cuDNN, else flash) gradients, or None where neither takes the case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    if causal and q.shape[1] != k.shape[1]:
        return None, None  # SDPA's causal mask is top-left aligned
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, scale=scale,
                    enable_gqa=q.shape[2] != k.shape[2])
                grads = torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2))
            return [g.transpose(1, 2) for g in grads], backend.name
        except RuntimeError:
            continue
    return None, None


CASES = [
    # dtype, head_dim, causal, batch, seqlen_q, seqlen_k, heads_q, heads_kv, layout
    ("bf16", 128, False, 2, 256, 256, 4, 4, "bshd"),
    ("bf16", 128, True, 2, 256, 256, 4, 4, "bshd"),
    ("bf16", 128, True, 1, 200, 333, 8, 2, "bshd"),  # seqlen_q < seqlen_k, GQA 4
    ("bf16", 128, True, 1, 333, 200, 4, 1, "bshd"),  # rows that attend to nothing, MQA
    ("bf16", 128, False, 2, 173, 301, 4, 2, "bhsd"),
    ("bf16", 64, False, 2, 129, 257, 4, 1, "padded"),
    ("bf16", 64, True, 1, 300, 300, 4, 4, "bshd"),
    ("bf16", 96, True, 1, 190, 190, 2, 2, "bshd"),
    ("bf16", 192, False, 1, 150, 270, 4, 2, "bshd"),
    ("bf16", 256, True, 1, 211, 211, 2, 2, "bshd"),
    # head dim 256 runs one Q / dO stage: many query blocks per key block, GQA, tails
    ("fp16", 256, False, 2, 190, 333, 4, 2, "bhsd"),
    ("bf16", 256, True, 1, 700, 700, 2, 1, "bshd"),
    ("fp16", 128, True, 2, 256, 256, 4, 2, "bshd"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_flash_bwd_matches_fp32_reference(case):
    dtype_name, head_dim, causal, batch, seqlen_q, seqlen_k, heads_q, heads_kv, layout = case
    dtype = _DTYPES[dtype_name]
    torch.manual_seed(0)
    q, k, v, dout = _make_inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, layout)
    scale = head_dim ** -0.5
    out32, lse, ref = _reference_grads(q, k, v, dout, scale, causal)
    out = out32.to(dtype)
    ours = _run_ours(q, k, v, out, lse, dout, scale, causal)
    sdpa, backend = _sdpa_grads(q, k, v, dout, scale, causal)
    for name, got, want, i in zip(("dq", "dk", "dv"), ours, ref, range(3)):
        assert not torch.isnan(got).any(), f"{name}: NaN (unwritten or invalid)"
        err = _rel_err(got, want)
        max_abs = (got.float() - want).abs().max().item()
        assert err < 2e-2, f"{name}: rel err {err:.3e}"
        assert max_abs < 0.05 * want.abs().max().item() + 1e-2, f"{name}: max abs {max_abs:.3e}"
        if sdpa is not None:
            sdpa_err = _rel_err(sdpa[i], want)
            assert err <= max(2 * sdpa_err, 2e-3), f"{name}: {err:.3e} vs {backend} {sdpa_err:.3e}"
    if causal and seqlen_q > seqlen_k:  # the first rows attend to nothing: zero gradient
        assert ours[0][:, : seqlen_q - seqlen_k].abs().max().item() == 0.0


@pytest.mark.parametrize("case", ["causal", "causal-short-q", "window", "window-both-sides", "varlen", "padded",
                                  "gqa-full", "long-full", "mask", "d64-full", "d256-causal", "d256-full",
                                  "public-flag"])
def test_deterministic_mode_gives_bitwise_reproducible_gradients(case):
    """torch.use_deterministic_algorithms(True) (or ``deterministic=True`` on the public function)
    selects the ordered backward variant (dQ's key blocks added from the last one down, each
    waiting for its turn): on the kernels (no fallback), three runs give identical bytes, and
    the gradients match the default variant's to the usual tolerance. The mode's own NaN fill of
    new tensors is skipped for what the kernels write in full, so each run starts from NaN left in
    the allocator's free blocks instead: an unwritten element stays NaN. The cases cover each way a
    turn is counted (dense, causal with either length longer, windows, ragged and padded
    lengths, a mask's block ranges, full walks that start at different query blocks (12 key blocks)
    and those of 24 at D128 and D256, too many for that, which walk in step and launch six heads
    in turn, a last group short) and the head dims' tile shapes."""
    import torch_cute_ops as tco
    from torch_cute_ops.ops import fallback

    torch.manual_seed(0)
    heads_kv = 2 if case == "gqa-full" else 4
    seqlen_k = 3000 if case == "long-full" else 1500
    seqlen_q = 700 if case == "causal-short-q" else seqlen_k
    head_dim = {"d64-full": 64, "d256-causal": 256, "d256-full": 256}.get(case, 128)
    make = lambda heads, seqlen: torch.randn(2, seqlen, heads, head_dim, device="cuda",  # noqa: E731
                                             dtype=torch.bfloat16, requires_grad=True)
    q, k, v = make(4, seqlen_q), make(heads_kv, seqlen_k), make(heads_kv, seqlen_k)
    dout = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    flag = {"deterministic": True} if case == "public-flag" else {}
    if case == "varlen":
        cu = torch.tensor([0, 700, 3000], dtype=torch.int32, device="cuda")
        call = lambda **det: tco.flash_attn_varlen_func(  # noqa: E731
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 2300, 2300, causal=True,
            **det).unflatten(0, (2, 1500))
    elif case == "mask":  # a causal mask with a ragged band of holes: partial and empty blocks
        keep = torch.ones(1500, 1500, dtype=torch.bool, device="cuda").tril()
        keep[300:900, 100:400] = False
        keep[:, 0] = True
        call = lambda **det: tco.scaled_dot_product_attention(  # noqa: E731
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep).transpose(1, 2)
    elif case == "padded":  # left padding in one entry, right padding in the other
        bounds = {"key_start": torch.tensor([0, 333], dtype=torch.int32, device="cuda"),
                  "key_end": torch.tensor([1201, 1500], dtype=torch.int32, device="cuda")}
        call = lambda **det: tco.flash_attn_func(q, k, v, causal=True, **bounds, **det)  # noqa: E731
    else:
        window = {"window": (300, 0), "window-both-sides": (200, 150)}.get(case, (-1, -1))
        kwargs = {"causal": case not in ("gqa-full", "long-full", "window-both-sides", "d64-full", "d256-full"),
                  "window_size": window}
        call = lambda **det: tco.flash_attn_func(q, k, v, **kwargs, **det)  # noqa: E731
    default = torch.autograd.grad(call(), (q, k, v), dout)
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(not flag)
        fallback.reset()
        runs = []
        for _ in range(3):
            torch.full((16 << 20,), float("nan"), device="cuda")  # 64 MB of NaN, freed to the cache
            runs.append(torch.autograd.grad(call(**flag), (q, k, v), dout))
        assert not fallback.counts(), fallback.counts()
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)
    for grads in runs[1:]:
        for first, again in zip(runs[0], grads):
            assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    for ours, ref in zip(runs[0], default):
        assert not ours.isnan().any()
        assert _rel_err(ours, ref.float()) < 1e-2
