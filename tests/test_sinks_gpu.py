"""Attention sinks on the Hopper kernels: bf16 against float64 with the sink as a score column,
forward and backward (the sinks' gradient included), dense (causal, window, softcap, GQA, every
head dim), packed and decode from a cache (contiguous, paged, split-KV, several query tokens);
transformers' gpt-oss runs every attention layer on the kernels with its sinks. The sinks are
fused into the kernels: no fallback is taken, and every output starts as NaN."""

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops.ops.sinks import sink_grad
from test_sinks import reference

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def poisoned(monkeypatch):
    """Every output and gradient the attention ops make for a kernel starts as NaN: one the kernel
    leaves unwritten fails the NaN checks."""
    from torch_cute_ops.ops import attention, attention_kvcache, attention_varlen

    def nan_filled(make):
        return lambda *args: tuple(t.fill_(float("nan")) for t in make(*args))

    for module, name in ((attention, "_fwd_outputs_like"), (attention, "empty_grads"),
                         (attention_varlen, "_fwd_outputs_like"), (attention_varlen, "empty_grads"),
                         (attention_kvcache, "_outputs_like")):
        monkeypatch.setattr(module, name, nan_filled(getattr(module, name)))


def _sinks(heads, seed=0):
    """Logits around the scores' scale, one far above them (the row max is the sink's) and one far below."""
    sink = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2
    sink[0], sink[-1] = 30.0, -30.0
    return sink.cuda().requires_grad_()


def _check_dsink(dsink, want, out, lse, dout, sink, packed=False):
    """The sinks' gradient: exactly the sum the kernel should form from its own out and lse
    (``-sum exp(sink - lse) * rowsum(dout * out)``, in float64), and near the float64 reference's
    (bf16 rounding of out moves each row's ``dout . out``, and the rows' terms cancel in the sum)."""
    own = sink_grad(*(t.detach().double() for t in (dout, out, lse, sink)), packed=packed)
    _check("dsink (own out, lse)", dsink, own.cpu(), 1e-3)
    _check("dsink", dsink, want, 1e-1)


def _check(name, got, want, tol):
    got = got.detach().cpu()
    assert not got.isnan().any(), f"{name}: NaN (unwritten or invalid)"
    assert _rel(got, want) < tol, (name, _rel(got, want))


# (head dim, causal, window, softcap, queries, keys); 333 queries over 200 causal keys leave the first
# 133 rows no key (out 0, lse = their sink)
CASES = [(64, True, (-1, -1), 0.0, 200, 333), (64, False, (100, 0), 0.0, 200, 333),
         (64, True, (-1, -1), 0.0, 333, 200), (128, True, (-1, -1), 0.0, 200, 333),
         (128, False, (-1, -1), 30.0, 200, 333), (256, True, (-1, -1), 0.0, 200, 333),
         (256, False, (64, 32), 0.0, 200, 333)]


@pytest.mark.parametrize("d,causal,window,softcap,seqlen_q,seqlen_k", CASES)
def test_fused_sinks_forward_backward_against_float64(poisoned, d, causal, window, softcap, seqlen_q, seqlen_k):
    """GQA 8/2, bottom-right alignment, a sink far above and one far below the scores."""
    torch.manual_seed(d + seqlen_q)
    q = torch.randn(2, seqlen_q, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, seqlen_k, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    sink = _sinks(8, d)
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink,
                                   return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    assert tco.fallback_counts() == {}
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, sink)]
    ref, ref_lse = reference(*leaves, d ** -0.5, causal, window, softcap)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    _check("out", out, ref, 1e-2)
    _check("lse", lse, ref_lse, 1e-3)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _check(name, got, want, 2e-2)
    _check_dsink(grads[3], ref_grads[3], out, lse, dout, sink)


def test_sink_gradient_against_finite_differences():
    """A tiny fp16 case: d/d sink of sum(dout * out) from the kernels against central differences
    of the kernels' own forward (float64 sums)."""
    torch.manual_seed(7)
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    dout = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    sink = torch.tensor([0.5, -1.0], device="cuda", requires_grad=True)
    (dsink,) = torch.autograd.grad(tco.flash_attn_func(q, k, v, causal=True, learnable_sink=sink), sink, dout)
    loss = lambda s: (tco.flash_attn_func(q, k, v, causal=True, learnable_sink=s).double() * dout.double()).sum()
    eps = 0.1  # fp16 outputs: a step whose change of the loss stands well above their rounding
    numeric = torch.stack([(loss(sink.detach() + eps * e) - loss(sink.detach() - eps * e)) / (2 * eps)
                           for e in torch.eye(2, device="cuda")])
    assert _rel(dsink, numeric) < 3e-2, (dsink, numeric)


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


def test_deterministic_backward_forms_the_sink_gradient_reproducibly():
    """deterministic=True: the sinks' gradient by ordered reductions (not the kernel's per-block
    fp32 adds), bitwise equal run to run and equal to the fused one within fp32 rounding."""
    torch.manual_seed(3)
    q = torch.randn(2, 512, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 512, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sink = _sinks(8, 3)
    dout = torch.randn_like(q)

    def grads(deterministic):
        out = tco.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, deterministic=deterministic)
        return torch.autograd.grad(out, (q, sink), dout)

    first, second, fused = grads(True), grads(True), grads(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert _rel(fused[1].cpu(), first[1].cpu()) < 1e-4 and _rel(fused[0].cpu(), first[0].cpu()) < 1e-2


def test_packed_sinks_forward_backward(poisoned):
    """Packed sequences (an empty one, one of several query tiles) with sinks, the sinks' gradient
    summed over every sequence's rows."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 130, 130, 700], dtype=torch.int32, device="cuda")
    q = torch.randn(700, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(700, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sink = _sinks(8, 1)
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_varlen_func(q, k, v, cu, cu, 570, 570, causal=True, learnable_sink=sink,
                                          return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    assert tco.fallback_counts() == {}
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, sink)]
    refs = [reference(leaves[0][None, a:b], leaves[1][None, a:b], leaves[2][None, a:b], leaves[3], 0.125, True)
            for a, b in ((0, 130), (130, 700))]
    ref, ref_lse = torch.cat([r[0][0] for r in refs]), torch.cat([r[1][0] for r in refs], -1)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    _check("out", out, ref, 1e-2)
    _check("lse", lse, ref_lse, 1e-3)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _check(name, got, want, 2e-2)
    _check_dsink(grads[3], ref_grads[3], out, lse, dout, sink, packed=True)


def _cache_reference(q, k_cache, v_cache, lengths, sink, causal=True):
    outs, lses = [], []
    for b, n in enumerate(lengths):
        out, lse = reference(q[b:b + 1].double().cpu(), k_cache[b:b + 1, :n].double().cpu(),
                             v_cache[b:b + 1, :n].double().cpu(), sink.detach().double().cpu(),
                             q.shape[-1] ** -0.5, causal)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("seqlen_q,batch,capacity", [(1, 3, 448), (1, 1, 8192), (4, 3, 448)])
@pytest.mark.parametrize("paged", [False, True])
def test_cache_sinks_on_the_kernels(poisoned, seqlen_q, batch, capacity, paged):
    """One-token decode (pack-GQA rows), a lone long entry (split-KV: the sink joins at the combine)
    and four query tokens (gathered rows), from a contiguous cache and a paged one (64-key pages);
    an empty entry gives out 0 and lse = its sink."""
    torch.manual_seed(seqlen_q + capacity)
    q = torch.randn(batch, seqlen_q, 8, 64, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch, capacity, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = [capacity, 0, 257][:batch]
    sink = _sinks(8, 2).detach()
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kwargs = {}
    caches = (k_cache, v_cache)
    if paged:
        pages = capacity // 64
        order = torch.randperm(batch * pages, device="cuda")
        caches = tuple(torch.empty_like(c.reshape(-1, 64, 2, 64)).index_copy_(0, order, c.reshape(-1, 64, 2, 64))
                       for c in caches)
        kwargs["page_table"] = order.view(batch, pages).int()
    tco.ops.fallback.reset()
    out, lse = tco.flash_attn_with_kvcache(q, *caches, cache_seqlens=cache_seqlens, causal=True, learnable_sink=sink,
                                           return_lse=True, **kwargs)
    assert tco.fallback_counts() == {}
    ref, ref_lse = _cache_reference(q, k_cache, v_cache, lengths, sink)
    _check("out", out, ref, 1e-2)
    _check("lse", lse, ref_lse, 1e-3)


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
