"""The SDPA drop-in: PyTorch's signature and results, its fallbacks, and the routing switch."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import torch_cute_ops as tco
from torch_cute_ops.ops import fallback

TORCH_SDPA = F.scaled_dot_product_attention


def test_signature_is_pytorchs():
    ours = inspect.signature(tco.scaled_dot_product_attention)
    params = list(ours.parameters.values())
    assert [p.name for p in params] == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                                        "scale", "enable_gqa"]
    assert [p.default for p in params[3:]] == [None, 0.0, False, None, False]


def _bhsd(b, h, s, d, dtype=torch.float32):
    return torch.randn(b, h, s, d, dtype=dtype)


@pytest.mark.parametrize("scale", [None, 0.37])
@pytest.mark.parametrize("causal,hq,hkv,sq,sk", [(False, 4, 4, 33, 33), (True, 4, 4, 33, 33), (True, 8, 2, 17, 17),
                                                 (False, 4, 4, 5, 40), (False, 4, 1, 40, 7)])
def test_matches_pytorch(causal, scale, hq, hkv, sq, sk):
    q, k, v = _bhsd(2, hq, sq, 32), _bhsd(2, hkv, sk, 32), _bhsd(2, hkv, sk, 32)
    kw = dict(is_causal=causal, scale=scale, enable_gqa=hq != hkv)
    torch.testing.assert_close(tco.scaled_dot_product_attention(q, k, v, **kw), TORCH_SDPA(q, k, v, **kw))
    assert fallback.counts() == {}


def test_non_contiguous_inputs_from_transposed_projections():
    x = torch.randn(2, 19, 4 * 16)  # (B, S, H*D) as a projection produces it
    q = x.view(2, 19, 4, 16).transpose(1, 2)  # (B, H, S, D) view, not contiguous
    torch.testing.assert_close(tco.scaled_dot_product_attention(q, q, q, is_causal=True),
                               TORCH_SDPA(q, q, q, is_causal=True))


@pytest.mark.parametrize("kwargs,reason", [
    (dict(attn_mask=torch.zeros(9, 9).requires_grad_()),
     "attn_mask requires grad (the kernels do not differentiate it)"),
    (dict(dropout_p=0.5), "dropout is not supported by the kernels"),
])
def test_uncovered_features_go_to_pytorch_and_are_counted(kwargs, reason):
    q = _bhsd(1, 2, 9, 16)
    torch.manual_seed(0)
    ours = tco.scaled_dot_product_attention(q, q, q, **kwargs)
    torch.manual_seed(0)
    torch.testing.assert_close(ours, TORCH_SDPA(q, q, q, **kwargs))
    assert fallback.counts() == {("scaled_dot_product_attention", reason): 1}


@pytest.mark.parametrize("mask", [
    torch.ones(9, 9, dtype=torch.bool).tril(),                       # 2-D, broadcast over batch and heads
    torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(0)) > 0.4,  # per batch, a hidden row likely
    torch.randn(1, 2, 9, 9).masked_fill(torch.eye(9, dtype=torch.bool), float("-inf")),  # additive, per head
])
def test_attn_mask_is_served_by_the_op(mask):
    """Bool and additive masks of any broadcastable shape go to the cute op (its reference path on
    the CPU), not to PyTorch: same values as PyTorch where a row sees a key, 0 where none."""
    q = _bhsd(2, 2, 9, 16)
    ours = tco.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    theirs = TORCH_SDPA(q, q, q, attn_mask=mask)
    seen = theirs.isfinite().all(-1)
    torch.testing.assert_close(ours[seen], theirs[seen])
    assert (ours[~seen] == 0).all()
    assert fallback.counts() == {}


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(5, 12), (12, 5), (1, 9), (9, 9)])
def test_top_left_causal_is_served_as_a_window(seqlen_q, seqlen_k):
    """PyTorch's is_causal aligns top-left (key j <= query i); the op serves it as a band whose
    right edge sits at S_q - S_k from its bottom-right diagonal, with PyTorch's results."""
    q, k = _bhsd(1, 2, seqlen_q, 16), _bhsd(1, 2, seqlen_k, 16)
    torch.testing.assert_close(tco.scaled_dot_product_attention(q, k, k, is_causal=True),
                               TORCH_SDPA(q, k, k, is_causal=True))
    assert not fallback.counts()


def test_value_head_dim_and_rank_fallbacks():
    q, k, v = _bhsd(1, 2, 5, 16), _bhsd(1, 2, 5, 16), _bhsd(1, 2, 5, 8)
    torch.testing.assert_close(tco.scaled_dot_product_attention(q, k, v), TORCH_SDPA(q, k, v))
    q3 = torch.randn(2, 5, 16)
    torch.testing.assert_close(tco.scaled_dot_product_attention(q3, q3, q3), TORCH_SDPA(q3, q3, q3))
    assert len(fallback.counts()) == 2


def test_input_pytorch_rejects_gets_a_named_error():
    q, k = _bhsd(1, 4, 5, 16), _bhsd(1, 2, 5, 16)
    with pytest.raises(RuntimeError):  # head counts differ and enable_gqa is False
        TORCH_SDPA(q, k, k)
    with pytest.raises(ValueError, match=r"^key, value: batch and head dims"):
        tco.scaled_dot_product_attention(q, k, k)


@pytest.mark.parametrize("strict", ["0", "1"])
@pytest.mark.parametrize("make,exc,match", [
    (lambda: (_bhsd(1, 4, 5, 16), _bhsd(1, 2, 5, 16), _bhsd(1, 2, 5, 16)), ValueError, r"^key, value: batch"),
    (lambda: (_bhsd(1, 2, 5, 16), _bhsd(1, 2, 5, 8), _bhsd(1, 2, 5, 16)), ValueError, r"^key: expected head dim 16"),
    (lambda: (_bhsd(1, 2, 5, 16), _bhsd(1, 2, 5, 16), _bhsd(1, 2, 5, 16).double()), TypeError,
     r"^value: expected dtype"),
    (lambda: (torch.ones(1, 2, 5, 16, dtype=torch.int32),) * 3, TypeError, r"^query: expected dtype in"),
])
def test_strict_mode_reports_the_inputs_own_error(monkeypatch, strict, make, exc, match):
    """An invalid input is not a missing kernel: its own error comes first, strict or not."""
    monkeypatch.setenv("TORCH_CUTE_OPS_STRICT", strict)
    q, k, v = make()
    with pytest.raises(exc, match=match):
        tco.scaled_dot_product_attention(q, k, v, dropout_p=0.1)  # dropout alone would be a fallback
    assert not fallback.counts()


def test_strict_mode_refuses_the_pytorch_fallback(monkeypatch):
    monkeypatch.setenv("TORCH_CUTE_OPS_STRICT", "1")
    q = _bhsd(1, 2, 9, 16)
    with pytest.raises(tco.FallbackError, match="dropout"):
        tco.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


class TinyAttention(torch.nn.Module):
    """A model that knows nothing of torch_cute_ops: it calls F.scaled_dot_product_attention."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


def test_override_routes_an_unchanged_model_and_restores(monkeypatch):
    calls = []
    real_op = torch.ops.cute.flash_attn_fwd
    monkeypatch.setattr(torch.ops.cute, "flash_attn_fwd", lambda *a: calls.append(1) or real_op(*a),
                        raising=False)
    model, x = TinyAttention(), torch.randn(2, 11, 32)
    expected = model(x)
    assert not calls
    with tco.sdpa_override():
        assert tco.sdpa_override_enabled()
        torch.testing.assert_close(model(x), expected)
    assert calls and F.scaled_dot_product_attention is TORCH_SDPA
    tco.enable_sdpa_override()
    try:
        with tco.sdpa_override():
            pass
        assert tco.sdpa_override_enabled()  # the context manager keeps a global switch that was on
    finally:
        tco.disable_sdpa_override()
    assert F.scaled_dot_product_attention is TORCH_SDPA


@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 3, 7)])
def test_linear_matches_pytorch(shape):
    x, w, bias = torch.randn(shape), torch.randn(5, 7), torch.randn(5)
    torch.testing.assert_close(tco.linear(x, w, bias), F.linear(x, w, bias))
    torch.testing.assert_close(tco.linear(x, w), F.linear(x, w))


def test_kernel_band_kinds():
    """The op's band becomes one of three compiled kinds; open sides get a bound past every key."""
    from torch_cute_ops.runtime.attention import kernel_band

    assert kernel_band(False, None, None, 7, 9) == (False, False, 0, 0)  # dense
    assert kernel_band(True, None, None, 7, 9) == (True, False, 0, 0)  # causal
    assert kernel_band(False, None, 0, 7, 9) == (True, False, 0, 0)  # a right edge of 0 is causal
    assert kernel_band(True, 5, None, 7, 9) == (False, True, 5, 0)  # causal + window
    assert kernel_band(True, None, 3, 7, 9) == (True, False, 0, 0)  # causal wins over a wider right
    assert kernel_band(False, None, -2, 7, 9) == (False, True, 16, -2)  # top-left causal, S_q < S_k
    assert kernel_band(False, 10 ** 12, 4, 7, 9) == (False, True, 16, 4)  # clamped: no int32 overflow


def test_packed_gqa_views_map_heads_to_rows():
    """Decode's pack-GQA: row r of kv head h in the packed views is query head h * g + r, for q,
    out and lse alike, without copies."""
    from torch_cute_ops.runtime.attention import packed_gqa_views

    b, h_q, h_kv, d = 2, 8, 2, 16
    q = torch.randn(b, 1, h_q, d)
    k = torch.randn(b, 5, h_kv, d)
    out, lse = torch.randn(b, 1, h_q, d), torch.randn(b, h_q, 1)
    q_rows, out_rows, lse_rows = packed_gqa_views(q, q.shape[2] // k.shape[2], out, lse)
    g = h_q // h_kv
    assert q_rows.shape == out_rows.shape == (b, g, h_kv, d) and lse_rows.shape == (b, h_kv, g)
    for h in range(h_kv):
        for r in range(g):
            assert torch.equal(q_rows[:, r, h], q[:, 0, h * g + r])
            assert torch.equal(out_rows[:, r, h], out[:, 0, h * g + r])
            assert torch.equal(lse_rows[:, h, r], lse[:, h * g + r, 0])
    assert q_rows.data_ptr() == q.data_ptr() and out_rows.data_ptr() == out.data_ptr()


@pytest.fixture
def cpu_launch_plans(monkeypatch):
    """The forward's launch plans on CPU tensors: a 132-SM device 0, placeholders for the unused
    kernel arguments; tests set ``get_compiled`` to their stand-in kernel."""
    from torch_cute_ops.runtime import attention as flash_host

    monkeypatch.setattr(flash_host, "num_sms", lambda index: 132)
    monkeypatch.setattr(flash_host, "_unused_counter", lambda index: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(flash_host, "_mask_placeholders", lambda index: (None, None, None))
    monkeypatch.setattr(flash_host, "_split_placeholders", lambda index, head_dim: (None, None, 1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return flash_host


def test_decode_plan_runs_the_dense_kernel_on_packed_views(monkeypatch, cpu_launch_plans):
    """One query token with GQA: the plan (made once per layout) picks the dense variant and each
    call hands the kernel the packed views of q, out and lse."""
    flash_host = cpu_launch_plans
    calls = []
    monkeypatch.setattr(flash_host, "get_compiled", lambda spec: (lambda *args: calls.append((spec, args))))
    q, k = torch.randn(2, 1, 8, 64).bfloat16(), torch.randn(2, 300, 2, 64).bfloat16()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 1)
    plan = flash_host.plan_fwd(q, k, k, causal=True)
    plan(q, k, k, out, lse, 0.125)
    (spec, args), = calls
    assert spec["causal"] is False and not spec["local"]
    q_rows, out_rows, lse_rows = args[0], args[3], args[4]
    assert q_rows.shape == out_rows.shape == (2, 4, 2, 64) and lse_rows.shape == (2, 2, 4)
    assert q_rows.data_ptr() == q.data_ptr() and out_rows.data_ptr() == out.data_ptr()
    assert lse_rows.data_ptr() == lse.data_ptr()
    # with a window the rows would not share the band: no packing
    assert flash_host.plan_fwd(q, k, k, causal=False, local=True).group == 0


def test_speculative_decode_plan_packs_token_head_pairs(monkeypatch, cpu_launch_plans):
    """A few query tokens with GQA: a causal variant that counts g rows as one token takes the
    caller's q, out and lse themselves (it forms the (token, head) rows in the kernel: no copies
    before or after it)."""
    flash_host = cpu_launch_plans
    calls = []

    def kernel(*args):
        calls.append(args)
        args[3].fill_(1.0)  # out rows
        args[4].fill_(2.0)  # lse rows

    monkeypatch.setattr(flash_host, "get_compiled", lambda spec: (calls.append(spec), kernel)[1])
    q, k = torch.randn(2, 4, 8, 64).bfloat16(), torch.randn(2, 300, 2, 64).bfloat16()
    out, lse = torch.zeros_like(q), torch.zeros(2, 8, 4)
    plan = flash_host.plan_fwd(q, k, k, causal=True)
    plan(q, k, k, out, lse, 0.125)
    spec, args = calls
    assert spec["causal"] is True and spec["rows_per_query"] == 4
    assert args[0] is q and args[3] is out and args[4] is lse
    assert (out == 1).all() and (lse == 2).all()
    many = torch.randn(2, 17, 8, 64).bfloat16()  # more tokens than pack-GQA serves: one row per query
    calls.clear()
    flash_host.plan_fwd(many, k, k, causal=True)
    assert "rows_per_query" not in dict(calls[0].params)
