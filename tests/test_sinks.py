"""Attention sinks (``learnable_sink``): a per-head logit in every row's softmax denominator,
forward and backward (its own gradient included), against a float64 softmax with the sink as an
extra column, as gpt-oss's eager attention computes it; dense, padded, packed and cache layouts."""

import pytest
import torch

import torch_cute_ops as tco


def reference(q, k, v, sink, scale, causal=False, window=(-1, -1), softcap=0.0):
    """(B, S, H, D) float64 attention with the sink as one more score column whose value is 0."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    s_q, s_k = q.shape[1], k.shape[1]
    i = torch.arange(s_q)[:, None] + s_k - s_q
    j = torch.arange(s_k)[None]
    visible = torch.ones(s_q, s_k, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    scores = scores.masked_fill(~visible, float("-inf"))
    logits = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    probs = logits.softmax(-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), torch.logsumexp(logits, -1)


def _inputs(b=2, s_q=7, s_k=11, h=4, h_kv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return make(b, s_q, h, d), make(b, s_k, h_kv, d), make(b, s_k, h_kv, d), make(h) * 2


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                    (True, (3, 0), 0.0), (False, (-1, -1), 5.0)])
def test_dense_forward_backward_and_the_sinks_gradient(causal, window, softcap):
    q, k, v, sink = (t.requires_grad_() for t in _inputs())
    out, lse = tco.flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, window_size=window, softcap=softcap,
                                   return_lse=True, learnable_sink=sink)
    ref, ref_lse = reference(q, k, v, sink, 0.3, causal, window, softcap)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sink), dout)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_gradcheck_through_the_sink():
    q, k, v, sink = (t.requires_grad_() for t in _inputs(b=1, s_q=3, s_k=5, h=2, h_kv=1, d=4))
    assert torch.autograd.gradcheck(
        lambda q, k, v, sink: tco.flash_attn_func(q, k, v, causal=True, learnable_sink=sink), (q, k, v, sink))


def test_a_very_negative_sink_is_no_sink_and_a_large_one_takes_the_rows():
    q, k, v, sink = _inputs()
    plain = tco.flash_attn_func(q, k, v)
    torch.testing.assert_close(tco.flash_attn_func(q, k, v, learnable_sink=torch.full_like(sink, -1e4)), plain)
    assert tco.flash_attn_func(q, k, v, learnable_sink=torch.full_like(sink, 1e4)).abs().max() < 1e-12


def test_packed_sequences_with_a_sink():
    q, k, v, sink = (t.requires_grad_() for t in _inputs(b=1, s_q=12, s_k=15))
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 15], dtype=torch.int32)
    out = tco.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 7, 9, causal=True, learnable_sink=sink)
    refs = [reference(q[:, a:b], k[:, c:d], v[:, c:d], sink, 16 ** -0.5, True)[0][0]
            for a, b, c, d in ((0, 5, 0, 9), (5, 12, 9, 15))]
    ref = torch.cat(refs)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v, sink), dout), torch.autograd.grad(ref, (q, k, v, sink), dout)):
        torch.testing.assert_close(got, want)


def test_decode_from_a_cache_with_a_sink():
    q, k, v, sink = _inputs(s_q=1, s_k=20)
    lengths = torch.tensor([9, 20], dtype=torch.int32)
    out, lse = tco.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, learnable_sink=sink, return_lse=True)
    for b, n in enumerate(lengths.tolist()):
        ref, ref_lse = reference(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], sink, 16 ** -0.5)
        torch.testing.assert_close(out[b:b + 1], ref)
        torch.testing.assert_close(lse[b:b + 1], ref_lse)


@pytest.mark.parametrize("sink,error,match", [(torch.zeros(3), ValueError, "learnable_sink: expected shape"),
                                              (torch.zeros(4, dtype=torch.int32), TypeError, "learnable_sink"),
                                              ([0.0] * 4, TypeError, "learnable_sink")])
def test_a_bad_sink_is_named(sink, error, match):
    q, k, v, _ = _inputs()
    with pytest.raises(error, match=match):
        tco.flash_attn_func(q, k, v, learnable_sink=sink)


def test_gpt_oss_on_the_cute_attention_matches_its_eager_attention():
    """transformers' gpt-oss (sinks in every layer, alternating sliding and full attention) with
    attn_implementation="cute" against "eager", the implementation transformers uses for sinks:
    loss, gradient norms and the sinks' gradients, on a padded batch."""
    transformers = pytest.importorskip("transformers")
    import torch_cute_ops.integrations.transformers  # noqa: F401

    config = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                       max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).float()
    for layer in model.model.layers:
        layer.self_attn.sinks.data.normal_()
    ids = torch.randint(0, 128, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    results = {}
    tco.ops.fallback.reset()
    for implementation in ("eager", "cute"):
        model.config._attn_implementation = implementation
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        sinks = torch.cat([layer.self_attn.sinks.grad for layer in model.model.layers])
        results[implementation] = (out.loss.detach(), out.logits.detach(), sinks)
    for got, want in zip(results["cute"], results["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert [op for op, _ in tco.fallback_counts() if op == "transformers attention"] == []


def test_the_backward_ops_add_the_sinks_gradient_to_dsink():
    """``dsink`` is added to (a gradient accumulates), dense and packed, and the probabilities come
    from the sink-inclusive lse alone: dq, dk, dv are the same with or without ``dsink``."""
    q, k, v, sink = _inputs()
    out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.3, True, learnable_sink=sink)
    dout = torch.randn_like(out)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    want = torch.autograd.grad(reference(*leaves, 0.3, True)[0], leaves, dout)
    dsink = torch.ones(4, dtype=torch.float64)
    grads = torch.ops.cute.flash_attn_bwd(dout, q, k, v, out, lse, 0.3, True, learnable_sink=sink, dsink=dsink)
    torch.testing.assert_close(dsink, want[3] + 1)
    plain = torch.ops.cute.flash_attn_bwd(dout, q, k, v, out, lse, 0.3, True)
    for got, same, ref in zip(grads, plain, want):
        torch.testing.assert_close(got, same)
        torch.testing.assert_close(got, ref)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    flat = [t.flatten(0, 1) for t in (q, k[:, :7], v[:, :7])]
    out, lse = torch.ops.cute.flash_attn_varlen_fwd(*flat, cu, cu, 7, 7, 0.3, True, learnable_sink=sink)
    dsink = torch.zeros(4, dtype=torch.float64)
    torch.ops.cute.flash_attn_varlen_bwd(out, *flat, out, lse, cu, cu, 7, 7, 0.3, True, learnable_sink=sink,
                                         dsink=dsink)
    packed_leaves = [t.clone().requires_grad_() for t in (*flat, sink)]
    refs = [reference(packed_leaves[0][None, a:a + 7], packed_leaves[1][None, a:a + 7], packed_leaves[2][None, a:a + 7],
                      packed_leaves[3], 0.3, True)[0][0] for a in (0, 7)]
    (want_dsink,) = torch.autograd.grad(torch.cat(refs), packed_leaves[3], out)
    torch.testing.assert_close(dsink, want_dsink)


@pytest.mark.parametrize("dsink,sink,match", [(torch.zeros(4, dtype=torch.float64), None, "dsink: given without"),
                                              (torch.zeros(4), "given", "dsink: expected a contiguous torch.float64"),
                                              (torch.zeros(3, dtype=torch.float64), "given", "dsink: expected")])
def test_a_bad_dsink_is_named(dsink, sink, match):
    q, k, v, given = _inputs()
    out, lse = torch.ops.cute.flash_attn_fwd(q, k, v, 0.3, False)
    with pytest.raises(ValueError, match=match):
        torch.ops.cute.flash_attn_bwd(out, q, k, v, out, lse, 0.3, False, learnable_sink=given if sink else None,
                                      dsink=dsink)


def test_sinks_under_fullgraph_compile():
    """The sinks reach the ops as an argument: traced with no graph break, their gradient included."""
    torch._dynamo.reset()
    q, k, v, sink = (t.float().requires_grad_() for t in _inputs())

    def attend(q, k, v, sink):
        return tco.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)

    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, sink)
    torch.testing.assert_close(out, attend(q, k, v, sink))
    got = torch.autograd.grad(out.sum(), sink)
    want = torch.autograd.grad(attend(q, k, v, sink).sum(), sink)
    torch.testing.assert_close(got, want)
