"""torch.compile(fullgraph=True, dynamic=True) sees the ops: no graph breaks, no recompiles."""

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import torch_cute_ops as tco


class Block(torch.nn.Module):
    """gemm with a fused epilogue, linear, and SDPA through the drop-in."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.w_qkv = torch.nn.Parameter(torch.randn(dim, 3 * dim) / dim ** 0.5)
        self.b_qkv = torch.nn.Parameter(torch.zeros(3 * dim))
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        qkv = tco.gemm(x.reshape(b * s, d), self.w_qkv, self.b_qkv, "silu")
        q, k, v = qkv.view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = tco.scaled_dot_product_attention(q, k, v, is_causal=True)
        return tco.linear(y.transpose(1, 2).reshape(b, s, d), self.out.weight, self.out.bias)


SIZES = [(2, 16), (3, 29), (5, 7)]


def test_fullgraph_dynamic_without_recompiles():
    torch._dynamo.reset()
    model = Block()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for batch, seqlen in SIZES:
        x = torch.randn(batch, seqlen, 32, requires_grad=True)
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
        out.sum().backward()
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == [frames[0]] * len(SIZES), f"recompiled for new sizes: {frames}"


def test_inductor_forward_and_backward_match_eager():
    torch._dynamo.reset()
    model = Block()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    x = torch.randn(2, 13, 32, requires_grad=True)
    out = compiled(x)
    ref = model(x)
    torch.testing.assert_close(out, ref)
    (grad_c,) = torch.autograd.grad(out.square().sum(), x)
    (grad_e,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(grad_c, grad_e)


def test_sdpa_override_under_compile_traces_the_ops():
    torch._dynamo.reset()
    q = torch.randn(2, 4, 9, 16)

    def fn(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm

    with tco.sdpa_override():
        out = torch.compile(fn, backend=backend, fullgraph=True)(q)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert "cute.flash_attn_fwd" in graphs[0].code


def test_fallback_under_compile_is_counted_once_per_graph():
    """A case the kernels do not cover (here a mask that requires grad) still reaches PyTorch
    inside the graph, and is counted when traced."""
    torch._dynamo.reset()
    tco.ops.fallback.reset()
    q = torch.randn(2, 4, 9, 16)
    mask = torch.zeros(9, 9).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    mask.requires_grad_()

    def fn(q):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    with tco.sdpa_override():
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        out = compiled(q)
        compiled(q)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    assert tco.fallback_counts() == {
        ("scaled_dot_product_attention", "attn_mask requires grad (the kernels do not differentiate it)"): 1}


def test_attn_mask_compiles_onto_the_op():
    """A bool mask under torch.compile(fullgraph=True) stays on cute::flash_attn_fwd (no fallback),
    forward and backward."""
    torch._dynamo.reset()
    tco.ops.fallback.reset()
    q = torch.randn(2, 4, 9, 16, requires_grad=True)
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(1)) > 0.3

    def fn(q, mask):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    with tco.sdpa_override():
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, mask)
    out.sum().backward()
    ref = tco.scaled_dot_product_attention(q.detach(), q.detach(), q.detach(), attn_mask=mask)
    torch.testing.assert_close(out, ref)
    assert not tco.fallback_counts() and not q.grad.isnan().any()


def test_top_left_causal_and_windows_compile_without_recompiles():
    """SDPA's top-left causal passes S_q - S_k as a SymInt window bound: new lengths (and a
    different S_q - S_k) reuse the graph; a sliding window is a plain int."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def attend(q, k, v):
        a = tco.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = tco.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_size=(3, 0))
        return a + b.transpose(1, 2)

    compiled = torch.compile(attend, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for sq, sk in ((5, 9), (7, 13), (11, 6)):
        q, k, v = torch.randn(2, 2, sq, 8), torch.randn(2, 2, sk, 8), torch.randn(2, 2, sk, 8)
        torch.testing.assert_close(compiled(q, k, v), attend(q, k, v))
        frames.append(counter.frame_count)
    assert frames == [frames[0]] * 3, f"recompiled: {frames}"


def test_deterministic_flag_compiles_into_the_backward_op(monkeypatch):
    """``deterministic=True`` is a keyword of the forward op in the graph, and autograd hands it to
    the backward op (whose plans are all made for it): fullgraph, no recompiles across sizes,
    gradients as in eager."""
    from torch_cute_ops.ops import attention

    torch._dynamo.reset()
    planned = []

    def make_bwd_plan(key, *args):
        planned.append(key[-1])
        return "cpu"  # the reference path; the key is what a CUDA input would be planned with

    monkeypatch.setattr(attention, "_make_bwd_plan", make_bwd_plan)
    monkeypatch.setattr(attention, "_bwd_plans", {})
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm.code)
        return gm

    def fn(q, k, v):
        return tco.flash_attn_func(q, k, v, causal=True, deterministic=True)

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for batch, seqlen in ((2, 9), (4, 17), (3, 5)):  # (sizes of 1 are specialized by dynamo)
        q, k, v = (torch.randn(batch, seqlen, 4, 16, requires_grad=True) for _ in range(3))
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        expected = torch.autograd.grad(fn(q, k, v).sum(), (q, k, v))
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)
    assert counter.frame_count == 1, counter.frame_count
    assert any("flash_attn_fwd" in code and "deterministic = True" in code for code in graphs), graphs
    assert planned and all(planned), planned
