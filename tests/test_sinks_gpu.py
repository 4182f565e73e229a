"""Attention sinks on the Hopper kernels: bf16 against float64 with the sink as a score column,
forward and backward, dense (causal, window, GQA), packed and decode from a cache; transformers'
gpt-oss runs every attention layer on the kernels with its sinks."""

import pytest
import torch

import torch_cute_ops as tco
from test_sinks import reference

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("causal,window,d", [(True, (-1, -1), 64), (True, (127, 0), 64), (False, (-1, -1), 128)])
def test_dense_sinks_on_the_kernels(causal, window, d):
    torch.manual_seed(0)
    q = torch.randn(2, 300, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 300, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 300, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(8, device="cuda", dtype=torch.float32, requires_grad=True)
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_func(q, k, v, causal=causal, window_size=window, learnable_sink=sink, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    assert tco.fallback_counts() == {}
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, sink)]
    ref, ref_lse = reference(*leaves, d ** -0.5, causal, window)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    assert torch.isfinite(out).all() and _rel(out.cpu(), ref) < 1e-2
    assert _rel(lse.cpu(), ref_lse) < 1e-3
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all() and _rel(got.cpu(), want) < 2e-2


def test_packed_and_cache_sinks_on_the_kernels():
    torch.manual_seed(1)
    q = torch.randn(1, 400, 8, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 400, 2, 64, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(8, device="cuda")
    cu = torch.tensor([0, 130, 400], dtype=torch.int32, device="cuda")
    out = tco.flash_attn_varlen_func(q[0], kv[0], kv[0], cu, cu, 270, 270, causal=True, learnable_sink=sink)
    for a, b in ((0, 130), (130, 400)):
        ref, _ = reference(q[:, a:b].double().cpu(), kv[:, a:b].double().cpu(), kv[:, a:b].double().cpu(),
                           sink.double().cpu(), 0.125, True)
        assert _rel(out[a:b].cpu(), ref[0]) < 1e-2
    one = q[:, -1:].expand(3, 1, 8, 64).contiguous()
    cache = kv.expand(3, 400, 2, 64).contiguous()
    lengths = torch.tensor([1, 257, 400], dtype=torch.int32, device="cuda")
    out = tco.flash_attn_with_kvcache(one, cache, cache, cache_seqlens=lengths, learnable_sink=sink)
    for b, n in enumerate(lengths.tolist()):
        ref, _ = reference(one[b:b + 1].double().cpu(), cache[b:b + 1, :n].double().cpu(),
                           cache[b:b + 1, :n].double().cpu(), sink.double().cpu(), 0.125)
        assert _rel(out[b:b + 1].cpu(), ref) < 1e-2


def test_gpt_oss_runs_its_attention_on_the_kernels():
    transformers = pytest.importorskip("transformers")
    import torch_cute_ops.integrations.transformers  # noqa: F401

    config = transformers.GptOssConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                                       max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (2, 300), device="cuda")
    losses = {}
    tco.ops.fallback.reset()
    for implementation in ("eager", "cute"):
        model.config._attn_implementation = implementation
        losses[implementation] = model(input_ids=ids, labels=ids).loss.item()
    assert [op for op, _ in tco.fallback_counts() if op == "transformers attention"] == []
    assert abs(losses["cute"] - losses["eager"]) < 2e-2 * abs(losses["eager"])
    model.config._attn_implementation = "cute"
    out = model.generate(ids[:, :40], max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 48)
