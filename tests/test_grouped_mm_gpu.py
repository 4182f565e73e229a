"""The grouped sm90 GEMM against a float64 per-group loop, on an sm_90 GPU (a couple of minutes).

Every case runs through the public functions in strict mode (a fallback fails it) with the
outputs the op allocates poisoned with NaN first, so an element the kernel should write and does
not fails; group sizes include 0, 1, primes and one group holding every row; K and N are not
multiples of the tiles.
"""

import pytest
import torch

import torch_cute_ops as tco
from grouped_checks import loop64
from torch_cute_ops.ops import grouped_gemm as grouped_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm_90 (Hopper) GPU"),
]

# relative Frobenius error, max error / max |ref|
TOLERANCE = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 4e-3)}


@pytest.fixture(autouse=True)
def strict_and_poisoned(monkeypatch):
    monkeypatch.setenv("TORCH_CUTE_OPS_STRICT", "1")

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(grouped_ops, "empty_output", poisoned)
    monkeypatch.setattr("torch_cute_ops.ops.gemm.empty_output", poisoned)
    monkeypatch.setattr("torch_cute_ops.ops.scaled_grouped_gemm.empty_output", poisoned)


def check(out, ref, dtype):
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    diff = out.double() - ref
    rel = (diff.norm() / ref.norm().clamp_min(1e-6)).item()
    max_rel = (diff.abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    bound_rel, bound_max = TOLERANCE[dtype]
    assert rel < bound_rel and max_rel < bound_max, f"rel {rel:.2e} max {max_rel:.2e}"


def group_sizes(kind: str, groups: int, gen) -> list[int]:
    if kind == "all_in_one":
        sizes = [0] * groups
        sizes[groups // 2] = 1000
        return sizes
    if kind == "edges":  # 0, 1, primes, a tile and one more, cycled
        pattern = [0, 1, 2, 7, 127, 128, 129, 0, 131, 257]
        return [pattern[g % len(pattern)] for g in range(groups)]
    # Dirichlet-like imbalance: 32 rows per group on average
    weights = torch.distributions.Dirichlet(torch.full((groups,), 0.3)).sample()
    return torch.distributions.Multinomial(32 * groups, weights).sample().long().tolist()


def offsets(sizes, device="cuda"):
    return torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


CASES = [(1, "edges"), (1, "all_in_one"), (8, "edges"), (8, "random"), (128, "random"), (256, "edges"),
         (256, "all_in_one")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups,kind", CASES)
def test_rows_grouped(groups, kind, dtype):
    """x @ W_g per group (W as nn.Linear keeps it, (G, N, K), transposed: a K-major b), plus 5 rows
    past offs[-1], which come out zero."""
    gen = torch.manual_seed(groups)
    sizes = group_sizes(kind, groups, gen)
    k, n = 328, 264 if groups > 8 else 1064  # not multiples of the k-tile (64) or the tiles' N
    x = torch.randn(sum(sizes) + 5, k, device="cuda").to(dtype)
    w = torch.randn(groups, n, k, device="cuda").to(dtype) / k ** 0.5
    offs = offsets(sizes)
    out = tco.grouped_mm(x, w.transpose(-2, -1), offs)
    check(out, loop64(x, w.transpose(-2, -1), offs), dtype)
    assert out[sum(sizes):].abs().max() == 0


@pytest.mark.parametrize("groups,kind", [(8, "edges"), (128, "random")])
def test_rows_grouped_n_major_b(groups, kind):
    gen = torch.manual_seed(1)
    sizes = group_sizes(kind, groups, gen)
    x = torch.randn(sum(sizes), 200, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(groups, 200, 136, device="cuda", dtype=torch.bfloat16) / 200 ** 0.5
    offs = offsets(sizes)
    check(tco.grouped_mm(x, b, offs), loop64(x, b, offs), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups,kind", [(1, "edges"), (8, "edges"), (128, "random"), (256, "all_in_one")])
def test_k_grouped_weight_gradient(groups, kind, dtype):
    """dW_g = x_g^T @ dy_g: x^T (M-major) and dy (N-major) with the tokens grouped; an empty group's
    gradient is zero."""
    gen = torch.manual_seed(groups + 7)
    sizes = group_sizes(kind, groups, gen)
    x = torch.randn(sum(sizes) + 3, 136, device="cuda").to(dtype)
    dy = torch.randn(sum(sizes) + 3, 264, device="cuda").to(dtype)
    offs = offsets(sizes)
    out = tco.grouped_mm(x.mT, dy, offs)
    assert out.shape == (groups, 136, 264)
    check(out, loop64(x.mT, dy, offs), dtype)
    for g, size in enumerate(sizes):
        if size == 0:
            assert out[g].abs().max() == 0


def test_columns_grouped():
    gen = torch.manual_seed(3)
    sizes = group_sizes("edges", 8, gen)
    a = torch.randn(8, 72, 200, device="cuda", dtype=torch.bfloat16)
    n = sum(sizes) + 8  # any width: its storage rows padded to 16 bytes, as the TMA needs
    b = torch.randn(200, -(-n // 8) * 8, device="cuda", dtype=torch.bfloat16)[:, :n] / 200 ** 0.5
    offs = offsets(sizes)
    check(tco.grouped_mm(a, b, offs), loop64(a, b, offs), torch.bfloat16)


@pytest.mark.parametrize("groups", [8, 128])
def test_backward_matches_the_loop(groups):
    """dA (rows grouped, b^T) and dB (K grouped) of an MoE projection, against float64 autograd
    through the loop."""
    gen = torch.manual_seed(groups)
    sizes = group_sizes("edges" if groups == 8 else "random", groups, gen)
    x = torch.randn(sum(sizes), 264, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(groups, 136, 264, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    offs = offsets(sizes)
    out = tco.grouped_mm(x, w.transpose(-2, -1), offs)
    grad = torch.randn_like(out)
    out.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loop64(x64, w64.transpose(-2, -1), offs).backward(grad.double())
    check(x.grad, x64.grad, torch.bfloat16)
    check(w.grad, w64.grad, torch.bfloat16)


def test_masked_layout_and_cuda_graph_replay():
    """DeepGEMM's masked layout: the rows below each count match; a captured call replays with new
    counts (read on the device, no sync)."""
    groups, capacity = 16, 192
    a = torch.randn(groups, capacity, 264, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(groups, 264, 520, device="cuda", dtype=torch.bfloat16) / 16
    counts = torch.tensor([0, 1, 2, 7, 64, 127, 128, 129, 191, 192, 5, 0, 3, 100, 11, 13], dtype=torch.int32,
                          device="cuda")

    def check_rows(out):
        for g, count in enumerate(counts.tolist()):
            if count:
                check(out[g, :count], a[g, :count].double() @ b[g].double(), torch.bfloat16)

    check_rows(tco.grouped_mm_masked(a, b, counts))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tco.grouped_mm_masked(a, b, counts)
    counts.copy_(counts.flip(0))
    graph.replay()
    check_rows(out)


def test_no_host_sync():
    sizes = [3, 0, 200, 17]
    x = torch.randn(220, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 256, 128, device="cuda", dtype=torch.bfloat16)
    offs = offsets(sizes)
    tco.grouped_mm(x, w.transpose(-2, -1), offs)  # plans (and maybe compiles) the variant
    offs = offsets([1, 2, 3, 4])  # a new tensor: checked again
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = tco.grouped_mm(x, w.transpose(-2, -1), offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(out, loop64(x, w.transpose(-2, -1), offs), torch.bfloat16)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
def test_gated_forward_and_backward(activation, layout):
    """A gate/up projection with the gated activation, forward and both gradients, against float64
    autograd through the loop and the activation."""
    from torch_cute_ops.reference.grouped_gemm import swiglu

    gen = torch.manual_seed(5)
    sizes = group_sizes("edges", 8, gen)
    x = torch.randn(sum(sizes), 264, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(8, 2 * 136, 264, device="cuda") / 8).to(torch.bfloat16).requires_grad_()
    offs = offsets(sizes)
    out = tco.grouped_mm(x, w.transpose(-2, -1), offs, activation=activation, gate_up_layout=layout)
    grad = torch.randn_like(out)
    out.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = swiglu(loop64(x64, w64.transpose(-2, -1), offs), layout, activation)
    ref.backward(grad.double())
    check(out, ref.detach(), torch.bfloat16)
    check(x.grad, x64.grad, torch.bfloat16)
    check(w.grad, w64.grad, torch.bfloat16)


def test_gated_concat_n_major_b():
    """Concatenated gate/up columns of an N-major b (not fused: the GEMM, then the activation)."""
    from torch_cute_ops.reference.grouped_gemm import swiglu

    gen = torch.manual_seed(6)
    sizes = group_sizes("random", 8, gen)
    x = torch.randn(sum(sizes), 264, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(8, 264, 2 * 136, device="cuda") / 8).to(torch.bfloat16)
    offs = offsets(sizes)
    out = tco.grouped_mm(x, b, offs, activation="swiglu")
    check(out, swiglu(loop64(x, b, offs), "concat", "swiglu"), torch.bfloat16)


@pytest.mark.parametrize("groups,kind", [(8, "edges"), (128, "random")])
def test_fp8_rowwise(groups, kind):
    """FP8 e4m3 expert GEMMs with rowwise scales against the dequantized float64 loop."""
    gen = torch.manual_seed(groups)
    sizes = group_sizes(kind, groups, gen)
    a = torch.randn(sum(sizes) + 3, 384, device="cuda").to(torch.float8_e4m3fn)
    w = (torch.randn(groups, 264, 384, device="cuda") / 4).to(torch.float8_e4m3fn)
    scale_a = torch.rand(a.shape[0], device="cuda") + 0.5
    scale_b = torch.rand(groups, 264, device="cuda") / 16
    offs = offsets(sizes)
    out = tco.scaled_grouped_mm(a, w.transpose(-2, -1), scale_a, scale_b, offs)
    ref = loop64(a.double() * scale_a.double()[:, None], w.transpose(-2, -1).double() * scale_b.double()[:, None, :],
                 offs)
    check(out, ref, torch.bfloat16)


def test_opcheck_and_compile_on_cuda():
    """opcheck on the kernel path, and a compiled MoE step (fullgraph, dynamic) that keeps one graph
    while the routing and the total rows change."""
    from torch._dynamo.testing import CompileCounterWithBackend

    sizes = [3, 0, 130, 17]
    x = torch.randn(sum(sizes), 136, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 264, 136, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = offsets(sizes)
    torch.library.opcheck(torch.ops.cute.grouped_mm.default, (x, w.transpose(-2, -1), offs),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def step(x, offs):
        return tco.grouped_mm(x, w.transpose(-2, -1), offs, activation="swiglu").float().square().sum()

    frames = []
    for sizes in ([3, 0, 130, 17], [64, 64, 1, 0], [0, 0, 0, 300]):
        x = torch.randn(sum(sizes) + 1, 136, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        offs = offsets(sizes)
        loss = step(x, offs)
        loss.backward()
        eager = tco.grouped_mm(x, w.transpose(-2, -1), offs, activation="swiglu").float().square().sum()
        torch.testing.assert_close(loss, eager, rtol=1e-3, atol=1e-3)
        frames.append(counter.frame_count)
    assert frames[1:] == [frames[1]] * 2, f"recompiled: {frames}"
