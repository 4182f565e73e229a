"""Property-based fuzzing of the matmuls: gemm, linear, scaled_mm, the FP8 quantizers and fp8.linear,
through the public functions and ``torch.ops.cute.gemm`` / ``scaled_gemm`` directly (fuzz_support
says what every call must do)."""

from __future__ import annotations

import pytest
import torch

from fuzz_support import (ACTIVATIONS64, DEVICES, FLOAT_DTYPES, Case, assert_close_norm, assert_matches, differentiable,
                          expect, fuzz_property, generator, grad_tolerance, layouts, make, overflowed, seeds,
                          unit_roundoff)
from hypothesis import strategies as st

import torch_cute_ops as tco
from torch_cute_ops import fp8

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_FORMAT = {torch.float8_e4m3fn: (448.0, 2.0**-4, 2.0**-10), torch.float8_e5m2: (57344.0, 2.0**-3, 2.0**-17)}
NOT_FLOAT = (torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn)
ACTIVATIONS = [None, "relu", "gelu_tanh", "silu"]


def sizes(device):
    """Dims: small ones (0 included) everywhere; on a GPU also the kernels' tile edges."""
    small = st.integers(0, 20)
    if device == "cpu":
        return small
    return st.one_of(small, st.sampled_from([16, 64, 127, 128, 136, 256, 264]))


def other(draw, options, taken):
    return draw(st.sampled_from([o for o in options if o != taken]))


# ------------------------------------------------------------------------------------------- gemm

@st.composite
def gemm_cases(draw, device, direct: bool):
    gen = generator(draw(seeds()))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    batch = (draw(st.integers(0, 3)),) if draw(st.booleans()) else ()
    m, k, n = (draw(sizes(device)) for _ in range(3))
    a_shape, b_shape, bias_shape = [*batch, m, k], [*batch, k, n], [n]
    a_dtype = b_dtype = bias_dtype = dtype
    kwargs = dict(bias=None, activation=draw(st.sampled_from(ACTIVATIONS)),
                  out_dtype=draw(st.sampled_from([None, *FLOAT_DTYPES])),
                  alpha=draw(st.sampled_from([1.0, 0.0, -2.5, 0.125, 3.0])))
    with_bias = draw(st.booleans())
    b_device = bias_device = device
    mutations = ["a rank", "b rank", "K", "a dtype", "b dtype", "bias dtype", "bias shape", "activation",
                 "out_dtype", "b device", "bias device"] + (["L"] if batch else []) + ([] if direct else ["alpha"])
    mutation = draw(st.sampled_from(mutations)) if draw(st.booleans()) else None
    error = None
    if mutation == "a rank":
        a_shape, error = draw(st.sampled_from([[k], [2, *batch, m, k] if batch else [1, 1, 1, m, k]])), ("a",)
    elif mutation == "b rank":
        b_shape, error = ([k, n] if batch else [1, k, n]), ("b",)
    elif mutation == "K":
        b_shape[-2], error = k + 1, ("b",)
    elif mutation == "L":
        b_shape[0], error = batch[0] + 1, ("b",)
    elif mutation == "a dtype":
        a_dtype = b_dtype = bias_dtype = draw(st.sampled_from(NOT_FLOAT))
        error = ("a",)
    elif mutation == "b dtype":
        b_dtype, error = other(draw, FLOAT_DTYPES, dtype), ("b",)
    elif mutation == "bias dtype":
        with_bias, bias_dtype, error = True, other(draw, FLOAT_DTYPES, dtype), ("bias",)
    elif mutation == "bias shape":
        with_bias, bias_shape, error = True, draw(st.sampled_from([[n + 1], [1, n]])), ("bias",)
    elif mutation == "activation":
        kwargs["activation"], error = draw(st.sampled_from(["tanh", "", "RELU"])), ("activation",)
    elif mutation == "out_dtype":
        kwargs["out_dtype"], error = draw(st.sampled_from([torch.int32, torch.float8_e4m3fn])), ("out_dtype",)
    elif mutation == "b device":
        b_device, error = "meta", ("b",)
    elif mutation == "bias device":
        with_bias, bias_device, error = True, "meta", ("bias",)
    elif mutation == "alpha":
        kwargs["alpha"], error = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")])), ("alpha",)
    kwargs["a"] = make(a_shape, a_dtype, device, gen, draw(layouts(len(a_shape))))
    kwargs["b"] = make(b_shape, b_dtype, b_device, gen, draw(layouts(len(b_shape))))
    if with_bias:
        kwargs["bias"] = make(bias_shape, bias_dtype, bias_device, gen, draw(layouts(len(bias_shape))))
    grad = draw(st.booleans()) and differentiable(kwargs["a"], kwargs["b"], kwargs["bias"])
    return Case(kwargs, error, f"{mutation or 'valid'} {dtype} a{a_shape} b{b_shape}"), grad


def gemm64(a, b, bias, activation, alpha):
    pre = alpha * (a.double() @ b.double())
    if bias is not None:
        pre = pre + bias.double()
    return ACTIVATIONS64[activation](pre), pre


def matmul_tolerance(a, b, alpha, pre, in_dtype, out_dtype, device, acc_eps=None, activation=None):
    """(atol, rtol): the fp32 (fp64) accumulation's error, bounded by K eps |a| |b| (the epilogue's
    activations are 1.2-Lipschitz), the GPU epilogue's approximate tanh / exp, and one rounding to
    the output dtype."""
    k = a.shape[-1]
    if acc_eps is None:
        acc_eps = unit_roundoff(torch.float64 if in_dtype == torch.float64 else torch.float32)
    magnitude = abs(alpha) * (a.double().abs() @ b.double().abs())
    epilogue_eps = 16 * acc_eps
    if torch.device(device).type == "cuda" and activation is not None:
        epilogue_eps = max(epilogue_eps, 2.0**-10 if activation == "gelu_tanh" else 2.0**-18)
    atol = 1.2 * (2 * k + 8) * acc_eps * magnitude + epilogue_eps * pre.abs()
    atol = atol + (2.0**-24 if out_dtype == torch.float16 else 1e-300)  # fp16 subnormals
    return atol, 2 * unit_roundoff(out_dtype)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direct", [False, True], ids=["gemm", "cute.gemm"])
@fuzz_property(60)
def test_gemm(device, direct, data):
    case, grad = data.draw(gemm_cases(device, direct))
    kw = case.kwargs
    if grad:  # invalid calls too: through the dispatcher and autograd, not the direct path
        kw.update({name: leaf(kw[name]) for name in ("a", "b", "bias") if kw[name] is not None})
    if direct:
        call = lambda: torch.ops.cute.gemm(kw["a"], kw["b"], kw["bias"], kw["activation"], kw["out_dtype"],
                                           kw["alpha"])
    else:
        call = lambda: tco.gemm(**kw)
    out = expect(call, case.error, case.note)
    if case.error:
        return
    a, b, bias, alpha = kw["a"], kw["b"], kw["bias"], kw["alpha"]
    out_dtype = kw["out_dtype"] or a.dtype
    assert out.dtype == out_dtype and out.device.type == torch.device(device).type, case.note
    ref, pre = gemm64(a.detach(), b.detach(), None if bias is None else bias.detach(), kw["activation"], alpha)
    atol, rtol = matmul_tolerance(a.detach(), b.detach(), alpha, pre, a.dtype, out_dtype, device,
                                  activation=kw["activation"])
    assert_matches(f"gemm {case.note}", out, overflowed(ref, out_dtype), atol, rtol)
    if grad:
        dout = torch.randn(out.shape, dtype=torch.float64, generator=generator(1)).to(out)
        out.backward(dout)
        inputs = [t for t in (a, b, bias) if t is not None]
        leaves64 = [leaf(t.detach().double()) for t in inputs]
        ref64, _ = gemm64(leaves64[0], leaves64[1], leaves64[2] if bias is not None else None, kw["activation"],
                          alpha)
        ref64.backward(dout.double())
        # the backward rounds the pre-activation's gradient g (|g| <= 1.2 |dout|) to a's dtype: an error
        # of u |g| in each term, which the sums can leave larger than their (cancelled) result
        g = 1.2 * dout.double().abs()
        magnitudes = (abs(alpha) * g @ b.detach().double().abs().mT, abs(alpha) * a.detach().double().abs().mT @ g,
                      g.sum(dim=tuple(range(g.dim() - 1))))
        for name, ours, theirs, mag in zip(("a", "b", "bias"), inputs, leaves64, magnitudes):
            assert_close_norm(f"gemm d{name} {case.note}", ours.grad, theirs.grad, grad_tolerance(a.dtype, device),
                              4 * unit_roundoff(a.dtype) * mag.norm().item())


# ----------------------------------------------------------------------------------------- linear

@st.composite
def linear_cases(draw, device):
    gen = generator(draw(seeds()))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    lead = draw(st.lists(st.integers(0, 3), max_size=3))
    k, n = draw(sizes(device)), draw(sizes(device))
    input_shape, weight_shape, bias_shape = [*lead, k], [n, k], [n]
    input_dtype = weight_dtype = bias_dtype = dtype
    with_bias, weight_device = draw(st.booleans()), device
    mutation = draw(st.sampled_from(["weight rank", "input rank", "in_features", "input dtype", "weight dtype",
                                     "bias dtype", "bias shape", "weight device"])) if draw(st.booleans()) else None
    error = None
    if mutation == "weight rank":
        weight_shape, error = draw(st.sampled_from([[k], [1, n, k]])), ("weight",)
    elif mutation == "input rank":
        input_shape, error = [], ("input",)
    elif mutation == "in_features":
        input_shape[-1], error = k + 1, ("input", "weight")
    elif mutation == "input dtype":
        input_dtype = weight_dtype = bias_dtype = draw(st.sampled_from(NOT_FLOAT))
        error = ("input",)
    elif mutation == "weight dtype":
        weight_dtype, error = other(draw, FLOAT_DTYPES, dtype), ("weight",)
    elif mutation == "bias dtype":
        with_bias, bias_dtype, error = True, other(draw, FLOAT_DTYPES, dtype), ("bias",)
    elif mutation == "bias shape":
        with_bias, bias_shape, error = True, [n + 1], ("bias",)
    elif mutation == "weight device":
        weight_device, error = "meta", ("weight",)
    kwargs = dict(input=make(input_shape, input_dtype, device, gen, draw(layouts(len(input_shape)))),
                  weight=make(weight_shape, weight_dtype, weight_device, gen, draw(layouts(len(weight_shape)))),
                  bias=make(bias_shape, bias_dtype, device, gen) if with_bias else None)
    return Case(kwargs, error, f"{mutation or 'valid'} {dtype} input{input_shape} weight{weight_shape}")


@pytest.mark.parametrize("device", DEVICES)
@fuzz_property(40)
def test_linear(device, data):
    case = data.draw(linear_cases(device))
    kw = case.kwargs
    out = expect(lambda: tco.linear(**kw), case.error, case.note)
    if case.error:
        return
    x, w, bias = kw["input"], kw["weight"], kw["bias"]
    ref, pre = gemm64(x, w.mT, bias, None, 1.0)
    atol, rtol = matmul_tolerance(x, w.mT, 1.0, pre, x.dtype, x.dtype, device)
    assert_matches(f"linear {case.note}", out, overflowed(ref, x.dtype), atol, rtol)


# ------------------------------------------------------------------------------------ scaled_mm

def k_major(shape, dtype, device, gen, operand: str, padded: bool, scale=1.0):
    """An FP8 operand as scaled_mm takes it: a (.., M, K) row-major, b (.., K, N) column-major,
    with padded rows (a sliced view) when ``padded``."""
    rows = list(shape) if operand == "a" else [*shape[:-2], shape[-1], shape[-2]]
    layout = ("sliced", len(rows) - 1, 1, 16) if padded else ("contiguous",)
    t = make(rows, dtype, device, gen, layout, scale)
    return t if operand == "a" else t.mT


def scale_values(shape, gen, device, signed: bool):
    """fp32 scales: powers of two times a normal spread, some negative or zero when ``signed``."""
    s = torch.exp2(torch.randint(-4, 5, tuple(shape), generator=gen).double()) * (1 + 0.1 * torch.rand(
        tuple(shape), generator=gen, dtype=torch.float64))
    if signed and s.numel():
        s.view(-1)[0] = 0.0
        s = s * torch.where(torch.rand(tuple(shape), generator=gen) < 0.2, -1.0, 1.0)
    return s.to(device=device, dtype=torch.float32)


@st.composite
def scaled_mm_cases(draw, device):
    gen = generator(draw(seeds()))
    a_dtype, b_dtype = draw(st.sampled_from(FP8)), draw(st.sampled_from(FP8))
    batch = (draw(st.integers(0, 2)),) if draw(st.booleans()) else ()
    mode = draw(st.sampled_from(["tensor", "row", "block"]))
    m, n = draw(sizes(device)), draw(sizes(device))
    k = 128 * draw(st.integers(0, 2)) if mode == "block" else draw(sizes(device))
    mutation = draw(st.sampled_from(["a layout", "b layout", "a dtype", "b dtype", "scale dtype", "scale shape",
                                     "block K", "bias dtype", "bias shape", "out_dtype", "activation", "K",
                                     "scale device"])) if draw(st.booleans()) else None
    error = None
    b_k = k
    if mutation == "block K":  # M, N > 1: one K block's scales would also be per-tensor or rowwise ones
        mode, k, m, n, error = "block", draw(st.sampled_from([1, 16, 130])), max(m, 2), max(n, 2), ("a",)
        b_k = k
    elif mutation == "K":
        b_k, error = k + 16, ("b",)
    kb, nb = -(-k // 128), -(-n // 128)
    scale_shapes = {"tensor": (draw(st.sampled_from([(), (1,), (1, 1)])),) * 2,
                    "row": ((*batch, m, 1), (*batch, 1, n)),
                    "block": ((*batch, m, kb), (*batch, kb, nb))}[mode]
    padded = draw(st.booleans())
    a = k_major([*batch, m, k], a_dtype, device, gen, "a", padded, 4.0)
    b = k_major([*batch, b_k, n], b_dtype, device, gen, "b", padded, 4.0)
    scale_a, scale_b = (scale_values(s, gen, device, draw(st.booleans())) for s in scale_shapes)
    bias = make([n], draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])), device, gen) \
        if draw(st.booleans()) else None
    out_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    activation = draw(st.sampled_from(ACTIVATIONS))
    if mutation == "a layout" and m > 1 and k > 1 and a.numel():
        a, error = a.mT.contiguous().mT, ("a",)
    elif mutation == "b layout" and n > 1 and k > 1 and b.numel():
        b, error = b.contiguous(), ("b",)
    elif mutation == "a dtype":
        a, error = a.to(torch.bfloat16), ("a",)
    elif mutation == "b dtype":
        b, error = b.to(torch.float16), ("b",)
    elif mutation == "scale dtype":
        scale_a, error = scale_a.to(draw(st.sampled_from([torch.float16, torch.float64]))), ("scale_a",)
    elif mutation == "scale shape":
        scale_a, error = scale_values((*batch, m + 1, 2), gen, device, False), ("scale_a", "scale_b")
    elif mutation == "bias dtype":
        bias, error = make([n], torch.float64, device, gen), ("bias",)
    elif mutation == "bias shape":
        bias, error = make([n + 1], torch.float32, device, gen), ("bias",)
    elif mutation == "out_dtype":
        out_dtype, error = draw(st.sampled_from([torch.float64, torch.int32, torch.float8_e4m3fn])), ("out_dtype",)
    elif mutation == "activation":
        activation, error = "tanh", ("activation",)
    elif mutation == "scale device":
        scale_b, error = scale_b.to("meta"), ("scale_b",)
    kwargs = dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, activation=activation)
    return Case(kwargs, error, f"{mutation or 'valid'} {mode} a{tuple(a.shape)} b{tuple(b.shape)}"), mode


def dequantize64(t, scale, mode, operand):
    values, scale = t.double(), scale.double()
    if mode == "tensor":
        return values * scale.reshape(())
    if mode == "row":
        return values * scale
    rows = 1 if operand == "a" else 128
    expanded = scale.repeat_interleave(rows, dim=-2).repeat_interleave(128, dim=-1)
    return values * expanded[..., :values.shape[-2], :values.shape[-1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direct", [False, True], ids=["scaled_mm", "cute.scaled_gemm"])
@fuzz_property(50)
def test_scaled_mm(device, direct, data):
    case, mode = data.draw(scaled_mm_cases(device))
    kw = case.kwargs
    call = (lambda: torch.ops.cute.scaled_gemm(*kw.values())) if direct else (lambda: tco.scaled_mm(**kw))
    out = expect(call, case.error, case.note)
    if case.error:
        return
    assert out.dtype == kw["out_dtype"], case.note
    a, b = dequantize64(kw["a"], kw["scale_a"], mode, "a"), dequantize64(kw["b"], kw["scale_b"], mode, "b")
    bias = kw["bias"]
    ref, pre = gemm64(a, b, bias, kw["activation"], 1.0)
    # Hopper's FP8 MMA accumulates in reduced precision: a loose eps on the GPU
    acc_eps = 2.0**-13 if torch.device(device).type == "cuda" else 2.0**-23
    atol, rtol = matmul_tolerance(a, b, 1.0, pre, torch.float32, kw["out_dtype"], device, acc_eps, kw["activation"])
    assert_matches(f"scaled_mm {case.note}", out, overflowed(ref, kw["out_dtype"]), atol, rtol)


# ------------------------------------------------------------------------------- FP8 quantizers

@st.composite
def quantizer_cases(draw, device):
    gen = generator(draw(seeds()))
    kind = draw(st.sampled_from(["tensorwise", "rowwise", "blockwise"]))
    operand = draw(st.sampled_from(["a", "b"]))
    fmt = draw(st.sampled_from(FP8))
    x_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    rank = draw(st.sampled_from([1, 2, 3] if kind == "tensorwise" else [2, 3]))
    shape = [draw(st.integers(0, 3))] * (rank - 2) + [draw(sizes(device)) for _ in range(min(rank, 2))]
    if kind == "blockwise":
        shape[-1 if operand == "a" else -2] = 128 * draw(st.integers(0, 2))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 1e3, 0.0]))
    mutation = draw(st.sampled_from(["x dtype", "x rank", "dtype", "operand", "block K"])) \
        if draw(st.booleans()) else None
    error = None
    if mutation == "x dtype":
        x_dtype, error = draw(st.sampled_from([torch.int32, torch.float8_e4m3fn, torch.bool])), ("x",)
    elif mutation == "x rank":
        shape, error = ([] if kind == "tensorwise" else draw(st.sampled_from([[4], [1, 1, 2, 2]]))), ("x",)
    elif mutation == "dtype":
        fmt, error = draw(st.sampled_from([torch.float16, torch.int8])), ("dtype",)
    elif mutation == "operand":
        operand, error = draw(st.sampled_from(["c", "A", ""])), ("operand",)
    elif mutation == "block K" and kind == "blockwise":
        shape[-1 if operand == "a" else -2], error = draw(st.sampled_from([1, 64, 130])), ("x",)
    x = make(shape, x_dtype, device, gen, draw(layouts(len(shape))), magnitude)
    fn = getattr(fp8, f"quantize_{kind}")
    call = (lambda: fn(x, fmt, operand)) if kind == "tensorwise" else (lambda: fn(x, operand, fmt))
    return call, Case(dict(x=x, fmt=fmt, operand=operand, kind=kind), error,
                      f"{mutation or 'valid'} {kind} {operand} {fmt} {x_dtype} {shape}")


def scale_groups(x, kind, operand):
    """The amax of each element's scale group, broadcast to x's shape (float64)."""
    mag = x.double().abs()
    if mag.numel() == 0:
        return mag
    if kind == "tensorwise":
        return torch.full_like(mag, mag.max().item() if mag.numel() else 0.0)
    if kind == "rowwise":
        dim = -1 if operand == "a" else -2
        return mag.amax(dim, keepdim=True).expand_as(mag) if mag.shape[dim] else mag
    rows, cols = (1, 128) if operand == "a" else (128, 128)
    pooled = torch.nn.functional.max_pool2d(mag.reshape(-1, 1, *mag.shape[-2:]), (rows, cols), ceil_mode=True)
    up = pooled.repeat_interleave(rows, -2).repeat_interleave(cols, -1)[..., :mag.shape[-2], :mag.shape[-1]]
    return up.reshape(mag.shape)


@pytest.mark.parametrize("device", DEVICES)
@fuzz_property(50)
def test_fp8_quantizers(device, data):
    call, case = data.draw(quantizer_cases(device))
    result = expect(call, case.error, case.note)
    if case.error:
        return
    x, fmt, operand, kind = (case.kwargs[n] for n in ("x", "fmt", "operand", "kind"))
    stored, scale = result
    assert stored.dtype == fmt and stored.shape == x.shape, case.note
    if x.dim() >= 2 and x.shape[-1] > 1 and x.shape[-2] > 1 and x.numel():
        unit = -1 if operand == "a" else -2
        assert stored.stride(unit) == 1, f"{case.note}: not K-major, strides {stored.stride()}"
    top, rel, sub = FP8_FORMAT[fmt]
    amax = scale_groups(x, kind, operand)
    expected_scale = torch.where(amax > 0, amax / top, 1.0)
    per_element = dequantize_like(scale, kind, operand, x)
    assert torch.isfinite(per_element).all() and (per_element > 0).all(), case.note
    assert_matches(f"scale {case.note}", per_element, expected_scale, 0.0, 2.0**-22)
    assert_matches(f"dequantized {case.note}", stored.double() * per_element.double(), x.double(),
                   sub * per_element.double() + 1e-30, rel * (1 + 2.0**-20))


def dequantize_like(scale, kind, operand, x):
    """Each element's scale, broadcast to x's shape."""
    if kind == "tensorwise":
        assert scale.shape == (), f"tensorwise scale shape {tuple(scale.shape)}"
        return scale.expand(x.shape)
    if kind == "rowwise":
        want = (*x.shape[:-1], 1) if operand == "a" else (*x.shape[:-2], 1, x.shape[-1])
        assert tuple(scale.shape) == want, f"rowwise scale shape {tuple(scale.shape)}, expected {want}"
        return scale.expand(x.shape)
    rows = 1 if operand == "a" else 128
    want = (*x.shape[:-2], -(-x.shape[-2] // rows), -(-x.shape[-1] // 128)) if operand == "b" else \
        (*x.shape[:-1], x.shape[-1] // 128)
    assert tuple(scale.shape) == want, f"blockwise scale shape {tuple(scale.shape)}, expected {want}"
    up = scale.repeat_interleave(rows, -2).repeat_interleave(128, -1)
    return up[..., :x.shape[-2], :x.shape[-1]]


# ---------------------------------------------------------------------------------- fp8.linear

def fp8_error(t, contract: int, fmt, scaling: str):
    """A bound on |dequant(quant(t)) - t| per element when t is quantized in groups along dim
    ``contract`` (rowwise) or as a whole (tensor)."""
    top, rel, sub = FP8_FORMAT[fmt]
    mag = t.double().abs()
    if scaling == "tensor" or mag.numel() == 0 or mag.shape[contract] == 0:
        amax = mag.max() if mag.numel() else torch.zeros((), dtype=torch.float64)
    else:
        amax = mag.amax(contract, keepdim=True)
    return rel * mag + sub * amax / top * (1 + 2.0**-20) + 1e-300


def fp8_matmul_bound(a, b, fmt_a, fmt_b, scaling, out_dtype, device):
    """(atol, rtol) of dequant(quant(a)) @ dequant(quant(b)) against a @ b (float64)."""
    ea, eb = fp8_error(a, -1, fmt_a, scaling), fp8_error(b, -2, fmt_b, scaling)
    a64, b64 = a.double().abs(), b.double().abs()
    quant = ea @ b64 + a64 @ eb + ea @ eb
    k = a.shape[-1]
    acc_eps = 2.0**-13 if torch.device(device).type == "cuda" else 2.0**-23
    atol = quant * (1 + 2.0**-10) + (2 * k + 8) * acc_eps * ((a64 + ea) @ (b64 + eb))
    return atol + (2.0**-24 if out_dtype == torch.float16 else 1e-300), 2 * unit_roundoff(out_dtype)


@st.composite
def fp8_linear_cases(draw, device):
    gen = generator(draw(seeds()))
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    x_dtype, w_dtype = draw(st.sampled_from(dtypes)), draw(st.sampled_from(dtypes))
    lead = draw(st.lists(st.integers(0, 3), min_size=1, max_size=2))
    k, n = draw(sizes(device)), draw(sizes(device))
    input_shape, weight_shape = [*lead, k], [n, k]
    scaling = draw(st.sampled_from(["row", "tensor"]))
    bias_dtype = draw(st.sampled_from([None, *dtypes]))
    mutation = draw(st.sampled_from(["scaling", "weight rank", "in_features", "input rank", "input dtype",
                                     "weight dtype"])) if draw(st.booleans()) else None
    error = None
    if mutation == "scaling":
        scaling, error = draw(st.sampled_from(["col", "block", ""])), ("scaling",)
    elif mutation == "weight rank":
        weight_shape, error = [n * k], ("weight",)
    elif mutation == "in_features":
        input_shape[-1], error = k + 1, ("input",)
    elif mutation == "input rank":
        input_shape, error = [], ("input",)
    elif mutation == "input dtype":
        x_dtype, error = draw(st.sampled_from([torch.float64, torch.int32, torch.float8_e4m3fn])), ("input",)
    elif mutation == "weight dtype":
        w_dtype, error = draw(st.sampled_from([torch.float64, torch.int64])), ("weight",)
    kwargs = dict(input=make(input_shape, x_dtype, device, gen, draw(layouts(len(input_shape)))),
                  weight=make(weight_shape, w_dtype, device, gen, draw(layouts(len(weight_shape)))),
                  bias=None if bias_dtype is None else make([n], bias_dtype, device, gen), scaling=scaling)
    return Case(kwargs, error, f"{mutation or 'valid'} {scaling} input{input_shape} {x_dtype} weight {w_dtype}")


@pytest.mark.parametrize("device", DEVICES)
@fuzz_property(40)
def test_fp8_linear(device, data):
    """Forward and both gradients within the FP8 rounding of each GEMM's operands (e4m3 input and
    weight, e5m2 output gradient, each scaled along the dim its GEMM contracts)."""
    case = data.draw(fp8_linear_cases(device))
    kw = case.kwargs
    grad = case.error is None
    if grad:
        kw.update({name: leaf(kw[name]) for name in ("input", "weight", "bias") if kw[name] is not None})
    out = expect(lambda: fp8.linear(**kw), case.error, case.note)
    if case.error:
        return
    x, w, bias, scaling = kw["input"], kw["weight"], kw["bias"], kw["scaling"]
    x2 = x.detach().reshape(x.shape[:-1].numel(), x.shape[-1])
    ref = x2.double() @ w.detach().double().mT + (0 if bias is None else bias.detach().double())
    atol, rtol = fp8_matmul_bound(x2, w.detach().mT, torch.float8_e4m3fn, torch.float8_e4m3fn, scaling, x.dtype,
                                  device)
    assert out.dtype == x.dtype, case.note
    assert_matches(f"fp8.linear {case.note}", out.reshape(ref.shape), ref, atol, rtol)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=generator(2)).to(out)
    out.backward(dout)
    dy = dout.reshape(x2.shape[0], out.shape[-1])
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    atol, rtol = fp8_matmul_bound(dy, w.detach(), e5, e4, scaling, x.dtype, device)
    assert_matches(f"fp8.linear dinput {case.note}", x.grad.reshape(x2.shape), dy.double() @ w.detach().double(),
                   atol, rtol)
    atol, rtol = fp8_matmul_bound(dy.mT, x2, e5, e4, scaling, w.dtype, device)
    assert_matches(f"fp8.linear dweight {case.note}", w.grad, dy.double().mT @ x2.double(), atol, rtol)
    if bias is not None:
        assert_matches(f"fp8.linear dbias {case.note}", bias.grad, dy.double().sum(0),
                       64 * 2.0**-24 * dy.double().abs().sum(0), 2 * unit_roundoff(bias.dtype))
