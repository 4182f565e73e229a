"""The Hopper FP8 GEMM (``cute::scaled_gemm`` on the sm90 kernel) on an sm_90 GPU.

Fresh random FP8 operands and random positive scales per case; outputs poisoned with NaN
before the launch; compared with a float64 matmul of the dequantized operands (relative
Frobenius error and max error relative to max |ref|), and for per-tensor and rowwise scales
with torch._scaled_mm too. Every case asserts that the kernel ran (no fallback).
"""

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops import fp8
from torch_cute_ops.ops import fallback
from torch_cute_ops.reference.scaled_gemm import dequantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs an sm_90 (Hopper) GPU",
    ),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# relative Frobenius error, max error / max |ref| (the output's rounding dominates)
TOLERANCE = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 4e-3), torch.float32: (1e-3, 4e-3)}


def operands(mode, m, n, k, lead=(), a_dtype=E4M3, b_dtype=E4M3):
    a = (torch.randn(*lead, m, k, device="cuda") * 2).to(a_dtype)
    b = (torch.randn(*lead, n, k, device="cuda") * 2).to(b_dtype).mT  # K-major (K, N)
    rand = lambda *shape: torch.rand(*shape, device="cuda") + 0.5  # noqa: E731
    if mode == "tensor":
        sa, sb = rand(()), rand(())
    elif mode == "row":
        sa, sb = rand(*lead, m, 1), rand(*lead, 1, n)
    else:
        sa, sb = rand(*lead, m, -(-k // 128)), rand(*lead, -(-k // 128), -(-n // 128))
    return a, b, sa, sb


def reference(a, b, sa, sb, mode, bias=None, activation=None):
    from torch_cute_ops.reference.gemm import ACTIVATIONS

    ref = dequantize(a, sa, mode, "a").double() @ dequantize(b, sb, mode, "b").double()
    if bias is not None:
        ref = ref + bias.double()
    if activation is not None:
        ref = ACTIVATIONS[activation](ref)
    return ref


def errors(out, ref):
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    diff = out.double() - ref
    return (diff.norm() / ref.norm().clamp_min(1e-12)).item(), (diff.abs().max() / ref.abs().max()).item()


def check(out, ref):
    rel, max_rel = errors(out, ref)
    bound_rel, bound_max = TOLERANCE[out.dtype]
    assert rel < bound_rel and max_rel < bound_max, f"rel {rel:.2e} max {max_rel:.2e}"


def run_kernel(a, b, sa, sb, mode, bias=None, activation=None, out_dtype=torch.bfloat16, config=None):
    """Through the launch plan (``config`` overrides the heuristic's), into a NaN-poisoned output."""
    from torch_cute_ops.runtime.gemm import SM90

    bias_layout = None if bias is None else (tuple(bias.shape), bias.stride())
    plan = SM90.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype, bias_layout, activation,
                     out_dtype, torch.cuda.current_device(), config, b_dtype=b.dtype,
                     bias_dtype=None if bias is None else bias.dtype, scale_mode=mode)
    assert not isinstance(plan, str), plan
    assert plan.spec["scale"] == mode
    out = torch.full((*a.shape[:-1], b.shape[-1]), float("nan"), device="cuda", dtype=out_dtype)
    plan(a, b, sa, sb, bias, out)
    torch.cuda.synchronize()
    return out


@pytest.fixture(autouse=True)
def no_fallbacks():
    fallback.reset()
    torch.manual_seed(0)
    yield
    assert not fallback.counts(), fallback.counts()


# (M, N, K): tails in M and N, a single tile, M <= 64 (the one-warpgroup tiles), odd K for the
# epilogue-scaled modes (a multiple of 16 bytes, not of the 128-wide k-tile)
SHAPES = [(1000, 1000, 1024), (4095, 264, 2048), (17, 4096, 1024), (128, 128, 128), (1, 300, 512)]


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_each_scale_mode_matches_float64(mode, shape):
    m, n, k = shape
    a, b, sa, sb = operands(mode, m, n, k)
    check(run_kernel(a, b, sa, sb, mode, out_dtype=torch.float32), reference(a, b, sa, sb, mode))


@pytest.mark.parametrize("k", [256, 384, 640])
def test_blockwise_small_k_tile_counts(k):
    """Blockwise scales over 2, 3 and 5 k-tiles (1, 4, 6, 8 and more are in the other tests)."""
    a, b, sa, sb = operands("block", 300, 200, k)
    check(run_kernel(a, b, sa, sb, "block", out_dtype=torch.float32), reference(a, b, sa, sb, "block"))


@pytest.mark.parametrize("k", [128, 256, 640, 16384])
@pytest.mark.parametrize("m,n", [(300, 200), (4096, 1024)])
def test_blockwise_scales_loaded_a_k_tile_ahead(m, n, k):
    """Each k-tile's scales are loaded a k-tile ahead: one k-tile (only the prologue's loads),
    a few, and many; one tile per CTA and several (4096 x 1024: 256 tiles on the persistent
    grid)."""
    a, b, sa, sb = operands("block", m, n, k)
    out = run_kernel(a, b, sa, sb, "block", out_dtype=torch.float32)
    check(out, reference(a, b, sa, sb, "block"))


@pytest.mark.parametrize("m,n,k,lead,out_dtype,stream_k", [
    (300, 200, 128, (), torch.float32, False),  # one k-tile; the second tile starts mid-block
    (257, 1000, 640, (), torch.bfloat16, False),  # N tail inside the last tile's first block
    (1000, 584, 1664, (2,), torch.float32, False),  # batched; the last tile's second block past N
    (4096, 3072, 16384, (), torch.bfloat16, False),  # many tiles per CTA, 128 k-tiles
    (2048, 1920, 4096, (), torch.bfloat16, True),  # stream-K segments
])
def test_blockwise_192_column_tiles(m, n, k, lead, out_dtype, stream_k):
    """128 x 192 tiles (one k-tile fragment per warpgroup, the two warpgroups taking turns): a
    tile covers two scale blocks of B, starting on one (even tile columns) or halfway through it
    (odd ones); M and N tails, 1 to 128 k-tiles, batched, stream-K, fp32 and bf16 out."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    a, b, sa, sb = operands("block", m, n, k, lead)
    out = run_kernel(a, b, sa, sb, "block", out_dtype=out_dtype,
                     config=GemmConfig(128, 192, 2, 1, stream_k=stream_k))
    check(out, reference(a, b, sa, sb, "block"))


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_k_not_a_multiple_of_the_k_tile(mode):
    a, b, sa, sb = operands(mode, 300, 200, 1040)
    check(run_kernel(a, b, sa, sb, mode, out_dtype=torch.float32), reference(a, b, sa, sb, mode))


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
def test_batched(mode):
    a, b, sa, sb = operands(mode, 300, 264, 512, lead=(3,))
    check(run_kernel(a, b, sa, sb, mode), reference(a, b, sa, sb, mode))


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
@pytest.mark.parametrize("out_dtype,bias_dtype,activation", [
    (torch.bfloat16, torch.bfloat16, "gelu_tanh"), (torch.float16, torch.float32, "relu"),
    (torch.float32, torch.bfloat16, None), (torch.bfloat16, None, "silu"),
])
def test_epilogue_out_dtypes_bias_activation(mode, out_dtype, bias_dtype, activation):
    a, b, sa, sb = operands(mode, 520, 392, 768)
    bias = None if bias_dtype is None else torch.randn(392, device="cuda").to(bias_dtype) * 4
    out = run_kernel(a, b, sa, sb, mode, bias, activation, out_dtype)
    check(out, reference(a, b, sa, sb, mode, bias, activation))


@pytest.mark.parametrize("a_dtype,b_dtype", [(E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)])
@pytest.mark.parametrize("mode", ["row", "block"])
def test_e5m2_operands(a_dtype, b_dtype, mode):
    a, b, sa, sb = operands(mode, 384, 256, 512, a_dtype=a_dtype, b_dtype=b_dtype)
    check(run_kernel(a, b, sa, sb, mode, out_dtype=torch.float32), reference(a, b, sa, sb, mode))


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("m,n,k,lead,tile_n,a_dtype,b_dtype,out_dtype,bias_dtype,activation", [
    (1, 4000, 4096, (), 16, E4M3, E4M3, torch.bfloat16, None, None),
    (13, 1100, 1040, (2,), 16, E5M2, E4M3, torch.float32, torch.bfloat16, "gelu_tanh"),
    (16, 4096, 512, (), 16, E4M3, E5M2, torch.float16, torch.float32, "silu"),
    (29, 1096, 2048, (), 32, E4M3, E4M3, torch.bfloat16, torch.bfloat16, None),
])
def test_swapped_operands(mode, m, n, k, lead, tile_n, a_dtype, b_dtype, out_dtype, bias_dtype, activation):
    """A decode step's rows on swapped operands (out^T = b^T @ a^T, 128 x 16 / 128 x 32): the
    scales trade places with the operands, the bias runs along the kernel's rows; tails in M, N
    and K, mixed e4m3 / e5m2, batched."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    a, b, sa, sb = operands(mode, m, n, k, lead, a_dtype, b_dtype)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda").to(bias_dtype) * 4
    out = run_kernel(a, b, sa, sb, mode, bias, activation, out_dtype, GemmConfig(128, tile_n, swap_ab=True))
    check(out, reference(a, b, sa, sb, mode, bias, activation))


@pytest.mark.parametrize("m,n,k,lead,out_dtype,cluster,stream_k,with_bias", [
    (300, 200, 128, (), torch.float32, (1, 1), False, False),  # one k-tile; a 44-row second tile
    (257, 1000, 640, (), torch.bfloat16, (2, 1), False, True),  # one row in the second tile row
    (1000, 584, 1664, (2,), torch.float32, (1, 1), False, False),  # batched; M and N tails
    (4096, 3072, 16384, (), torch.bfloat16, (2, 1), False, False),  # many tiles per CTA, 128 k-tiles
    (2000, 1000, 1024, (), torch.bfloat16, (1, 2), False, True),  # A multicast along N, N tail
    (2048, 1920, 4096, (), torch.bfloat16, (2, 1), True, False),  # stream-K segments
])
def test_blockwise_256_row_tiles(m, n, k, lead, out_dtype, cluster, stream_k, with_bias):
    """256 x 128 tiles (each warpgroup's rows in two waves of 64, issued, waited for and promoted
    in turn): M and N tails, 1 to 128 k-tiles, batched, both cluster shapes, stream-K, bias and
    activation, fp32 and bf16 out."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    a, b, sa, sb = operands("block", m, n, k, lead)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) * 4 if with_bias else None
    activation = "silu" if with_bias else None
    out = run_kernel(a, b, sa, sb, "block", bias, activation, out_dtype,
                     config=GemmConfig(256, 128, *cluster, stream_k=stream_k))
    check(out, reference(a, b, sa, sb, "block", bias, activation))


@pytest.mark.parametrize("mode,m,n,k,config", [
    ("row", 4096, 4096, 4096, (128, 256, 2, 1)),
    ("tensor", 1000, 1000, 2048, (128, 128, 1, 1)),
    ("block", 4096, 4096, 4096, (128, 128, 2, 1)),
    ("block", 300, 1000, 1664, (128, 128, 1, 1)),
])
def test_stream_k(mode, m, n, k, config):
    """Stream-K variants: a segment's blockwise scales start at its first k-tile; the finisher
    applies the epilogue scales once, to the whole tile's sum."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    a, b, sa, sb = operands(mode, m, n, k)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) * 4
    out = run_kernel(a, b, sa, sb, mode, bias, "silu", torch.bfloat16, GemmConfig(*config, stream_k=True))
    check(out, reference(a, b, sa, sb, mode, bias, "silu"))


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_agrees_with_torch_scaled_mm(mode):
    a, b, sa, sb = operands(mode, 1024, 2048, 4096)
    ours = tco.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    theirs = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    ref = reference(a, b, sa, sb, mode)
    check(ours, ref)
    ours_rel, _ = errors(ours, ref)
    theirs_rel, _ = errors(theirs, ref)
    assert ours_rel < 1.5 * theirs_rel + 1e-4, (ours_rel, theirs_rel)


def test_blockwise_long_k_keeps_fp32_accuracy():
    """Blockwise partial sums are promoted to fp32 every 128 of K: the error on K = 16384 stays
    at fp32-output level, not at the tensor cores' reduced-precision accumulation level."""
    a, b, sa, sb = operands("block", 256, 256, 16384)
    rel, max_rel = errors(run_kernel(a, b, sa, sb, "block", out_dtype=torch.float32), reference(a, b, sa, sb, "block"))
    assert rel < 2e-4 and max_rel < 1e-3, (rel, max_rel)


def test_public_api_quantizers_compile_and_cuda_graph():
    """The quantizers feed the op under torch.compile, and a captured graph replays with new data."""
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)  # nn.Linear's (N, K) weight

    def step(x, w):
        (qx, sx), (qw, sw) = fp8.quantize_rowwise(x), fp8.quantize_rowwise(w.t(), operand="b")
        return tco.scaled_mm(qx, qw, sx, sw, out_dtype=torch.bfloat16)

    ref = x.double() @ w.double().t()
    eager = step(x, w)
    assert ((eager.double() - ref).norm() / ref.norm()).item() < 0.04
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x, w), eager)

    (qx, sx), (qw, sw) = fp8.quantize_blockwise(x), fp8.quantize_blockwise(w.t(), operand="b")
    tco.scaled_mm(qx, qw, sx, sw)  # plan and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tco.scaled_mm(qx, qw, sx, sw)
    x2 = torch.randn_like(x)
    (qx2, sx2) = fp8.quantize_blockwise(x2)
    qx.copy_(qx2)
    sx.copy_(sx2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, tco.scaled_mm(qx, qw, sx, sw))
    assert ((captured.double() - x2.double() @ w.double().t()).norm() / (x2.double() @ w.double().t()).norm()) < 0.05


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_fp8_linear_training_step_on_the_kernel(scaling):
    """fp8.linear's three GEMMs (e4m3 forward, e5m2 gradients, transposed K-major operands) run
    on the kernel (no fallback: the fixture) and match an fp64 linear within FP8 error."""
    x = torch.randn(4, 64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(512, 1024, device="cuda") / 32).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16)
    y = fp8.linear(x, w, bias, scaling=scaling)
    grads = torch.autograd.grad(y, (x, w, bias), dy)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, bias))
    yd = torch.nn.functional.linear(xd, wd, bd)
    refs = torch.autograd.grad(yd, (xd, wd, bd), dy.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert not y.isnan().any() and rel(y, yd) < 0.04
    assert rel(grads[0], refs[0]) < 0.08 and rel(grads[1], refs[1]) < 0.08
    assert rel(grads[2], refs[2]) < 1e-2
