"""The op contract on CUDA tensors: whichever path serves this GPU (kernel or reference), the ops
agree with the float64 reference, pass opcheck, compile without graph breaks and capture in CUDA
graphs."""

import pytest
import torch
import torch.nn.functional as F

import torch_cute_ops as tco
from torch_cute_ops.reference import attention as ref_attn
from torch_cute_ops.reference import gemm as ref_gemm

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm()).item()


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", [None, "relu", "gelu_tanh", "silu"])
def test_gemm_matches_reference(dtype, activation):
    a, b, bias = randn(3, 257, 136, dtype=dtype), randn(3, 136, 264, dtype=dtype), randn(264, dtype=dtype)
    out = tco.gemm(a, b, bias, activation)
    ref = ref_gemm.gemm(a.double(), b.double(), bias.double(), activation, torch.float64)
    assert out.dtype == dtype and rel_err(out, ref) < 1e-2


def test_gemm_opcheck_on_cuda():
    a, b = randn(2, 64, 32).requires_grad_(), randn(2, 32, 48).requires_grad_()
    bias = randn(48).requires_grad_()
    torch.library.opcheck(torch.ops.cute.gemm.default, (a, b, bias, "gelu_tanh", None),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_gemm_gradients_match_reference():
    a, b, bias = (randn(*s, dtype=torch.float16).requires_grad_() for s in ((96, 64), (64, 80), (80,)))
    out = tco.gemm(a, b, bias, "silu")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (a, b, bias), grad)
    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    want = torch.autograd.grad(F.silu(a64 @ b64 + bias64), (a64, b64, bias64), grad.double())
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-2


def test_misaligned_operand_falls_back_or_names_the_argument_in_strict_mode(monkeypatch):
    a = randn(64, 24)[:, :17]  # valid: K = 17 on a padded, aligned leading dim
    b = randn(17, 40)          # row stride 80 bytes: aligned
    torch.testing.assert_close(tco.gemm(a, b).float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-2)
    odd = randn(64, 17)        # 34-byte rows: the TMA cannot address it
    out = tco.gemm(odd, b)
    assert torch.isfinite(out).all()
    monkeypatch.setenv("TORCH_CUTE_OPS_STRICT", "1")
    with pytest.raises(tco.FallbackError, match=r"a: stride 17 of dim \d is 34 bytes"):
        tco.gemm(odd, b)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_backward_match_reference(causal):
    q, k, v = randn(2, 300, 8, 128), randn(2, 257, 2, 128), randn(2, 257, 2, 128)
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = tco.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ref_out, ref_lse = ref_attn.flash_attn_fwd(q64, k64, v64, 128 ** -0.5, causal)
    assert rel_err(out, ref_out) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and rel_err(lse[finite], ref_lse[finite]) < 1e-3
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = ref_attn.flash_attn_bwd(dout.double(), q64, k64, v64, ref_out, ref_lse, 128 ** -0.5, causal)
    for g, w in zip(grads, want):
        assert rel_err(g, w) < 2e-2


def test_sdpa_drop_in_matches_pytorch_on_cuda():
    q = randn(2, 16, 1000, 128).requires_grad_()
    k, v = randn(2, 4, 1000, 128).requires_grad_(), randn(2, 4, 1000, 128).requires_grad_()
    ours = tco.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_err(ours, theirs.detach()) < 1e-2
    dout = torch.randn_like(ours)
    for g, w in zip(torch.autograd.grad(ours, (q, k, v), dout), torch.autograd.grad(theirs, (q, k, v), dout)):
        assert rel_err(g, w) < 2e-2


def test_compiled_block_without_recompiles_on_cuda():
    from test_torch_compile import SIZES, Block

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graphs compiled by earlier tests in this process do not count
    model = Block(dim=128, heads=2).to(DEV, torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for batch, seqlen in SIZES:
        x = randn(batch, seqlen * 8, 128)
        assert rel_err(compiled(x), model(x)) < 2e-2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_max_autotune_compile_of_a_gemm_model_with_backward():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(512, 256)).to(DEV, torch.bfloat16)

    def forward(x):
        hidden = tco.gemm(x, model[0].weight.T, model[0].bias, "gelu_tanh")
        return tco.linear(hidden, model[2].weight, model[2].bias)

    compiled = torch.compile(forward, fullgraph=True, mode="max-autotune-no-cudagraphs")
    x = randn(384, 256).requires_grad_()
    out = compiled(x)
    assert rel_err(out, model(x).detach()) < 2e-2
    (grad,) = torch.autograd.grad(out.float().square().sum(), x)
    (want,) = torch.autograd.grad(model(x).float().square().sum(), x)
    assert rel_err(grad, want) < 3e-2


def test_cuda_graph_capture_and_replay():
    a, b, bias = randn(512, 256), randn(256, 384), randn(384)
    q, k, v = randn(2, 256, 4, 64), randn(2, 256, 4, 64), randn(2, 256, 4, 64)

    def step():
        return tco.gemm(a, b, bias, "relu"), tco.flash_attn_func(q, k, v, causal=True)

    eager = step()  # compiles and warms up outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (a, b, q):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for c, f, e in zip(captured, fresh, eager):
        assert torch.equal(c, f) and not torch.equal(c, e)
