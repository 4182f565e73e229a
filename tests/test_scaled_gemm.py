"""FP8 scaled matmul on the CPU: the op's semantics for each scale mode against a float64
computation from the stored values and scales, the quantizers' scales, layouts and error bounds,
named errors for bad input (K-major operands included), the fake function, opcheck and
torch.compile. The Hopper kernel's numbers are pinned by test_scaled_gemm_sm90_gpu.py, its
instruction mix by test_gemm_sm90_ptx.py."""

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops import fp8
from torch_cute_ops.reference.scaled_gemm import scale_mode

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _expand(scale, mode, operand, shape):
    """float64 scales broadcast to an operand's shape, written out independently of the op."""
    scale = scale.double()
    if mode == "tensor":
        return scale.reshape(()).expand(shape)
    if mode == "row":
        return scale.expand(shape)
    out = torch.empty(shape, dtype=torch.float64)
    rows, cols = shape[-2], shape[-1]
    for i in range(rows):
        for j in range(cols):
            out[..., i, j] = scale[..., i, j // 128] if operand == "a" else scale[..., i // 128, j // 128]
    return out


def _expected(a, b, sa, sb, mode, bias=None, activation=None):
    out = (a.double() * _expand(sa, mode, "a", a.shape)) @ (b.double() * _expand(sb, mode, "b", b.shape))
    if bias is not None:
        out = out + bias.double()
    if activation == "gelu_tanh":
        out = torch.nn.functional.gelu(out, approximate="tanh")
    return out


def _operands(mode, lead=(), m=37, k=256, n=150, a_dtype=E4M3, b_dtype=E4M3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(*lead, m, k, generator=gen) * 3).to(a_dtype)
    b = (torch.randn(*lead, n, k, generator=gen) * 3).to(b_dtype).mT  # K-major (K, N)
    rand = lambda *shape: torch.rand(*shape, generator=gen) + 0.5  # noqa: E731
    if mode == "tensor":
        sa, sb = rand(()), rand(1)
    elif mode == "row":
        sa, sb = rand(*lead, m, 1), rand(*lead, 1, n)
    else:
        sa, sb = rand(*lead, m, -(-k // 128)), rand(*lead, -(-k // 128), -(-n // 128))
    return a, b, sa, sb


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
@pytest.mark.parametrize("lead", [(), (2,)], ids=["2d", "batched"])
def test_each_scale_mode_matches_float64(mode, lead):
    a, b, sa, sb = _operands(mode, lead)
    assert scale_mode(a, b, sa, sb) == mode
    out = tco.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (*lead, 37, 150)
    ref = _expected(a, b, sa, sb, mode)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3)


def test_bias_activation_and_e5m2_operand():
    a, b, sa, sb = _operands("row", a_dtype=E5M2, m=40, k=128, n=64, seed=3)
    bias = torch.randn(64).bfloat16()
    out = tco.scaled_mm(a, b, sa, sb, bias=bias, activation="gelu_tanh")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _expected(a, b, sa, sb, "row", bias, "gelu_tanh"), rtol=1e-2, atol=1e-2)


def test_operands_must_be_k_major_on_every_device():
    """FP8 tensor cores read K-major smem: a column-major a or a row-major b is a named error
    (as in torch._scaled_mm), not a silent copy; the message says which layout is expected."""
    a, b, sa, sb = _operands("row", m=40, k=128, n=64)
    with pytest.raises(ValueError, match=r"a: FP8 matmul needs K-major operands .* a \(M, K\) must be row-major"):
        tco.scaled_mm(a.t().contiguous().t(), b, sa, sb)
    with pytest.raises(ValueError, match=r"b: FP8 matmul needs K-major .* w.t\(\) of a row-major \(N, K\) weight"):
        tco.scaled_mm(a, b.contiguous(), sa, sb)
    # size-1 dims carry no majorness: a single row of a, a single column of b are accepted
    out = tco.scaled_mm(a[:1], b[:, :1].contiguous(), sa[:1], sb[:, :1], out_dtype=torch.float32)
    assert out.shape == (1, 1)
    k1 = tco.scaled_mm(a[:, :1].contiguous(), b[:1].contiguous(), sa, sb, out_dtype=torch.float32)  # K = 1
    torch.testing.assert_close(k1.double(), _expected(a[:, :1], b[:1], sa, sb, "row"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantize,mode,kwargs", [
    (fp8.quantize_tensorwise, "tensor", {}),
    (fp8.quantize_rowwise, "row", {}),
    (fp8.quantize_blockwise, "block", {}),
    (fp8.quantize_rowwise, "row", {"dtype": E5M2}),
])
def test_quantizers_feed_the_op_within_fp8_error(quantize, mode, kwargs):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 384, generator=gen).bfloat16()
    w = torch.randn(384, 200, generator=gen).bfloat16()
    (a, sa), (b, sb) = quantize(x, **kwargs), quantize(w, operand="b", **kwargs)
    assert a.dtype == kwargs.get("dtype", E4M3) and scale_mode(a, b, sa, sb) == mode
    out = tco.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    ref = x.double() @ w.double()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < (0.08 if kwargs.get("dtype") == E5M2 else 0.04), rel  # 3 / 2 mantissa bits


def test_block_scales_reach_the_kernel_in_its_tma_layout():
    """Blockwise scales go to the Hopper kernel's TMA M-contiguous (scale_a) and N-contiguous
    (scale_b), the other strides and the address 16-byte aligned: the quantizer returns them so
    (no copy per call), any other layout is copied with the same values, batched too."""
    from torch_cute_ops.runtime.gemm import tma_block_scales
    from torch_cute_ops.runtime.tma import tma_inner_ready

    _, sa = fp8.quantize_blockwise(torch.randn(301, 512))
    _, sb = fp8.quantize_blockwise(torch.randn(512, 300), operand="b")
    assert sa.shape == (301, 4) and sa.stride() == (1, 304) and sb.shape == (4, 3) and sb.stride() == (4, 1)
    ta, tb = tma_block_scales(sa, sb)
    assert ta.data_ptr() == sa.data_ptr() and tb.data_ptr() == sb.data_ptr()
    for scale_a, scale_b in ((torch.rand(301, 4), torch.rand(4, 3).t().contiguous().t()),  # row-major a, K-major b
                             (torch.rand(3, 5, 4), torch.rand(3, 4, 6)),  # batched, odd M and N blocks
                             (torch.rand(2, 64, 9)[:, 1:, 1:5], torch.rand(4, 8)[:, 1:4]),  # offset views
                             (torch.rand(1, 2), torch.rand(2, 1))):  # one row, one block
        ta, tb = tma_block_scales(scale_a, scale_b)
        assert tma_inner_ready(ta, -2) and tma_inner_ready(tb, -1)
        assert torch.equal(ta, scale_a) and torch.equal(tb, scale_b)


def test_quantizer_scales_saturation_and_zero_blocks():
    x = torch.zeros(3, 256)
    x[0, :128] = torch.linspace(-900, 900, 128)  # amax 900 > e4m3's 448: scaled, not clipped
    x[1, 5] = 1e-3
    stored, scale = fp8.quantize_blockwise(x)
    assert scale.shape == (3, 2)
    assert scale[0, 0] == pytest.approx(900 / 448) and scale[2, 0] == 1.0 and scale[0, 1] == 1.0  # zeros: 1
    assert stored.float().abs().max() <= 448 and not stored.float().isnan().any()
    back = stored.float() * scale.repeat_interleave(128, dim=1)
    torch.testing.assert_close(back[0, :128], x[0, :128], rtol=0.07, atol=0.0)
    b_stored, b_scale = fp8.quantize_blockwise(torch.randn(256, 300), operand="b")
    assert b_scale.shape == (2, 3) and b_stored.shape == (256, 300)
    assert b_stored.stride() == (1, 256)  # b comes back K-major, as scaled_mm takes it
    for quantize in (fp8.quantize_rowwise, fp8.quantize_tensorwise):
        kwargs = {"operand": "b"}
        assert quantize(torch.randn(256, 300), **kwargs)[0].stride() == (1, 256)
        assert quantize(torch.randn(256, 300))[0].stride() == (300, 1)
    with pytest.raises(ValueError, match="operand: expected 'a' or 'b'"):
        fp8.quantize_rowwise(torch.randn(4, 8), operand="c")


@pytest.mark.parametrize("change,error,match", [
    (lambda a, b, sa, sb: (a.float(), b, sa, sb), TypeError, "a: expected dtype in"),
    (lambda a, b, sa, sb: (a, b, sa.double(), sb), TypeError, "scale_a: expected dtype"),
    (lambda a, b, sa, sb: (a, b[:100], sa, sb), ValueError, "b: expected size 256 at dim -2"),
    (lambda a, b, sa, sb: (a, b, sa[:5], sb), ValueError, r"scale_a, scale_b: expected fp32 scales"),
    (lambda a, b, sa, sb: (a, b, sa[:1, :1], sb), ValueError, r"\(37, 1\) and \(1, 150\) \(rowwise\)"),  # mixed modes
])
def test_named_errors(change, error, match):
    a, b, sa, sb = change(*_operands("row"))
    with pytest.raises(error, match=match):
        tco.scaled_mm(a, b, sa, sb)


def test_blockwise_needs_whole_k_blocks_and_other_checks():
    a, b, sa, sb = _operands("block", k=200)
    with pytest.raises(ValueError, match="a: blockwise scales need K a multiple of 128"):
        tco.scaled_mm(a, b, sa, sb)
    a, b, sa, sb = _operands("row")
    with pytest.raises(TypeError, match="out_dtype"):
        tco.scaled_mm(a, b, sa, sb, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="activation"):
        tco.scaled_mm(a, b, sa, sb, activation="tanh")
    with pytest.raises(ValueError, match="bias: expected size 150"):
        tco.scaled_mm(a, b, sa, sb, bias=torch.zeros(7))
    with pytest.raises(ValueError, match=r"x: blockwise scales need K \(dim -1\) a multiple of 128"):
        fp8.quantize_blockwise(torch.randn(4, 200))


def test_not_differentiable_says_how():
    a, b, sa, sb = _operands("tensor")
    sa.requires_grad_()
    out = tco.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="not differentiable"):
        out.sum().backward()


def test_fake_opcheck_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b, sa, sb = _operands("block", lead=(2,))
    with FakeTensorMode() as mode:
        fake = torch.ops.cute.scaled_gemm(*(mode.from_tensor(t) for t in (a, b, sa, sb)), None, torch.float16)
    assert fake.shape == (2, 37, 150) and fake.dtype == torch.float16
    # test_schema compares inputs with ops that float8 lacks on the CPU; the others apply
    torch.library.opcheck(torch.ops.cute.scaled_gemm.default, (a, b, sa, sb, None, torch.float32, None),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))

    def step(x, w):
        (qa, scale_a), (qb, scale_b) = fp8.quantize_rowwise(x), fp8.quantize_rowwise(w, operand="b")
        return tco.scaled_mm(qa, qb, scale_a, scale_b, out_dtype=torch.float32)

    x, w = torch.randn(33, 128), torch.randn(128, 48)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x, w), step(x, w))


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops a region dispatches (a mode also forces the public functions through them)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_fp8_linear_trains_through_three_scaled_gemms(scaling):
    """fp8.linear: forward and both backward GEMMs are cute.scaled_gemm calls (e4m3 forward, e5m2
    gradients), and the result and gradients match an fp64 linear within FP8 error."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 48, 256, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(96, 256, generator=gen) / 16).bfloat16().requires_grad_()
    bias = torch.randn(96, generator=gen).requires_grad_()  # fp32 bias beside bf16 activations
    dy = torch.randn(2, 48, 96, generator=gen).bfloat16()
    log = _OpLog()
    with log:
        y = fp8.linear(x, w, bias, scaling=scaling)
        grads = torch.autograd.grad(y, (x, w, bias), dy)
    assert log.ops.count("cute.scaled_gemm") == 3, log.ops
    assert y.dtype == torch.bfloat16 and y.shape == (2, 48, 96)
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]

    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, bias))
    yd = torch.nn.functional.linear(xd, wd, bd)
    refs = torch.autograd.grad(yd, (xd, wd, bd), dy.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, yd) < 0.04  # e4m3: 3 mantissa bits
    assert rel(grads[0], refs[0]) < 0.08 and rel(grads[1], refs[1]) < 0.08  # e5m2 gradients: 2 bits
    assert rel(grads[2], refs[2]) < 1e-2  # the bias gradient is a plain sum


def test_fp8_linear_compiles_and_checks_its_arguments():
    x, w = torch.randn(33, 128, requires_grad=True), torch.randn(48, 128, requires_grad=True)

    def step(x, w):
        return fp8.linear(x, w).square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    loss = compiled(x, w)
    torch.testing.assert_close(loss, step(x, w))
    grads = torch.autograd.grad(loss, (x, w))
    for g, r in zip(grads, torch.autograd.grad(step(x, w), (x, w))):
        torch.testing.assert_close(g, r)
    with pytest.raises(ValueError, match="scaling: expected 'row' or 'tensor'"):
        fp8.linear(x, w, scaling="block")
    with pytest.raises(ValueError, match="input: expected last dim 128"):
        fp8.linear(torch.randn(4, 64), w)


def test_quantized_a_comes_back_row_major():
    """A transposed input (the backward's dy.T) is stored row-major for operand a."""
    stored, scale = fp8.quantize_rowwise(torch.randn(64, 32).t())
    assert stored.stride() == (64, 1) and scale.shape == (32, 1)


def test_convert_linears_swaps_in_place_and_keeps_the_parameters():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64),
                                torch.nn.Linear(64, 10))
    reference = torch.nn.Sequential(*(m for m in model))  # the same modules, before the swap
    x = torch.randn(8, 64)
    expected = model(x).detach()
    weights = [m.weight for m in model if isinstance(m, torch.nn.Linear)]
    fp8.convert_linears(model, module_filter=lambda name, m: m.out_features != 10)  # keep the head
    assert [type(m).__name__ for m in model] == ["Fp8Linear", "GELU", "Fp8Linear", "Linear"]
    assert [m.weight for m in model if isinstance(m, torch.nn.Linear)] == weights  # shared, not copied
    assert "scaling=row" in repr(model[0]) and reference is not model
    log = _OpLog()
    with log:
        out = model(x)
        out.square().sum().backward()
    # 2 layers x (forward + dx + dw), less the first layer's dx: x does not require grad
    assert log.ops.count("cute.scaled_gemm") == 5
    assert ((out.detach() - expected).norm() / expected.norm()).item() < 0.05
    assert all(w.grad is not None and w.grad.isfinite().all() for w in weights)
    with pytest.raises(ValueError, match="scaling"):
        fp8.convert_linears(model, scaling="block")
