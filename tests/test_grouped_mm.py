"""grouped_mm / grouped_mm_masked on the CPU (the reference path): torch._grouped_mm's semantics
against a float64 per-group loop written here, gradients, named errors (offs checked before any
launch), fake functions and opcheck, torch.compile without recompiles, and the host's group
tables and launch plans (no GPU: the compiled function stubbed)."""

from __future__ import annotations

import pytest
import torch
from fuzz_support import fuzz_property
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_cute_ops as tco
from grouped_checks import loop64
from torch_cute_ops.runtime import grouped_gemm as host


def offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)


FORMS = {
    # (a shape, b shape) for G groups of the given sizes
    "rows": lambda sizes, k, n: ((sum(sizes) + 3, k), (len(sizes), k, n)),
    "k": lambda sizes, m, n: ((m, sum(sizes) + 2), (sum(sizes) + 2, n)),
    "cols": lambda sizes, m, k: ((len(sizes), m, k), (k, sum(sizes) + 1)),
}
SIZES = [[5, 0, 1, 7, 13, 0], [0], [31], [0, 0, 12]]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_forms_match_the_float64_loop(form, sizes):
    torch.manual_seed(0)
    a_shape, b_shape = FORMS[form](sizes, 24, 16)
    a, b = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
    offs = offsets(sizes)
    out = tco.grouped_mm(a, b, offs)
    torch.testing.assert_close(out, loop64(a, b, offs), rtol=1e-12, atol=1e-12)
    if form == "cols":  # out^T = b^T @ a^T: column-major, as the fake function says
        assert out.stride() == (1, out.shape[0])


def test_batched_and_bf16_match_torch_grouped_mm():
    torch.manual_seed(0)
    a, b = torch.randn(3, 9, 16, dtype=torch.bfloat16), torch.randn(3, 16, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(tco.grouped_mm(a, b), torch._grouped_mm(a, b))
    x, w = torch.randn(40, 16, dtype=torch.bfloat16), torch.randn(4, 8, 16, dtype=torch.bfloat16)
    offs = offsets([7, 0, 20, 13])
    torch.testing.assert_close(tco.grouped_mm(x, w.transpose(-2, -1), offs),
                               torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    out = tco.grouped_mm(x, w.transpose(-2, -1), offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, loop64(x, w.transpose(-2, -1), offs).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", [*FORMS, "batched"])
def test_gradients(form):
    torch.manual_seed(0)
    sizes = [3, 0, 4, 1]
    if form == "batched":
        shapes, offs = ((4, 5, 6), (4, 6, 3)), None
    else:
        shapes, offs = FORMS[form](sizes, 6, 5), offsets(sizes)
    a, b = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes)
    assert torch.autograd.gradcheck(lambda a, b: tco.grouped_mm(a, b, offs), (a, b))


def test_bias_and_its_gradient():
    torch.manual_seed(0)
    a = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    offs = offsets([2, 0, 5])
    out = tco.grouped_mm(a, b, offs, bias)
    group = torch.tensor([0, 0, 2, 2, 2, 2, 2])
    torch.testing.assert_close(out[:7], loop64(a, b, offs)[:7] + bias[group])
    assert out[7:].abs().max() == 0  # rows past offs[-1]: zero, bias included
    assert torch.autograd.gradcheck(lambda a, b, c: tco.grouped_mm(a, b, offs, c), (a, b, bias))


def test_masked_layout():
    torch.manual_seed(0)
    a, b = torch.randn(3, 8, 16), torch.randn(3, 16, 4)
    counts = torch.tensor([0, 8, 3], dtype=torch.int32)
    out = tco.grouped_mm_masked(a, b, counts)
    assert out.shape == (3, 8, 4)
    for g, count in enumerate(counts.tolist()):
        torch.testing.assert_close(out[g, :count], (a[g, :count] @ b[g]))
    with pytest.raises(ValueError, match="^counts: every value"):
        tco.grouped_mm_masked(a, b, torch.tensor([0, 9, 3], dtype=torch.int32))


# ------------------------------------------------------------------------------ named errors

def _rows_case():
    return torch.randn(10, 8), torch.randn(3, 8, 4)


@pytest.mark.parametrize("offs,error,match", [
    (torch.tensor([2, 5, 9]), TypeError, "^offs: expected dtype in \\(int32\\)"),
    (torch.tensor([[2, 5, 9]], dtype=torch.int32), ValueError, "^offs: expected a 1-d tensor"),
    (torch.tensor([2, 9], dtype=torch.int32), ValueError, "^offs: expected size 3 at dim 0"),
    (torch.tensor([2, 11, 11], dtype=torch.int32), ValueError, "^offs: every value must lie in \\[0, "),
    (torch.tensor([-1, 5, 9], dtype=torch.int32), ValueError, "^offs: every value must lie in \\[0, "),
    (torch.tensor([5, 2, 9], dtype=torch.int32), ValueError, "^offs: values must be non-decreasing"),
    (None, ValueError, "^offs: expected an int32 tensor"),
])
def test_offs_errors_name_the_argument(offs, error, match):
    a, b = _rows_case()
    with pytest.raises(error, match=match):
        tco.grouped_mm(a, b, offs)


def test_shape_errors_name_the_argument():
    a, b = _rows_case()
    offs = offsets([2, 3, 4])
    with pytest.raises(ValueError, match="^mat_b: expected size 8 at dim -2"):
        tco.grouped_mm(a, torch.randn(3, 7, 4), offs)
    with pytest.raises(TypeError, match="^mat_b: expected dtype"):
        tco.grouped_mm(a, b.double(), offs)
    with pytest.raises(ValueError, match="^offs: expected None"):
        tco.grouped_mm(torch.randn(3, 2, 8), b, offs)
    with pytest.raises(NotImplementedError, match="^bias:"):
        tco.grouped_mm(torch.randn(4, 9), torch.randn(9, 5), offs, torch.randn(3, 5))
    with pytest.raises(ValueError, match="^bias: expected size 4 at dim 1"):
        tco.grouped_mm(a, b, offs, torch.randn(3, 5))
    with pytest.raises(TypeError, match="^out_dtype:"):
        tco.grouped_mm(a, b, offs, out_dtype=torch.int32)


@fuzz_property(60)
def test_offs_values_are_accepted_exactly_when_valid(data):
    """Any int32 offs of the right length: accepted iff non-decreasing within [0, rows], else a
    ValueError naming offs; the result then matches the loop."""
    groups = data.draw(st.integers(1, 5))
    rows = data.draw(st.integers(0, 12))
    values = data.draw(st.lists(st.integers(-2, rows + 2), min_size=groups, max_size=groups))
    offs = torch.tensor(values, dtype=torch.int32)
    a, b = torch.randn(rows, 3, dtype=torch.float64), torch.randn(groups, 3, 2, dtype=torch.float64)
    valid = all(0 <= v <= rows for v in values) and values == sorted(values)
    if not valid:
        with pytest.raises(ValueError, match="^offs: "):
            tco.grouped_mm(a, b, offs)
        return
    torch.testing.assert_close(tco.grouped_mm(a, b, offs), loop64(a, b, offs))


# ------------------------------------------------------------------- fake, opcheck, compile

@pytest.mark.parametrize("form", FORMS)
def test_fake_matches_real_and_opcheck(form):
    sizes = [3, 0, 5]
    a_shape, b_shape = FORMS[form](sizes, 8, 6)
    a, b = torch.randn(a_shape, requires_grad=True), torch.randn(b_shape, requires_grad=True)
    offs = offsets(sizes)
    real = torch.ops.cute.grouped_mm(a, b, offs)
    with FakeTensorMode() as mode:
        fake = torch.ops.cute.grouped_mm(mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(offs))
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    torch.library.opcheck(torch.ops.cute.grouped_mm.default, (a, b, offs))


def test_opcheck_masked_and_batched():
    a, b = torch.randn(2, 4, 8), torch.randn(2, 8, 3)
    torch.library.opcheck(torch.ops.cute.grouped_mm_masked.default, (a, b, torch.tensor([1, 4], dtype=torch.int32)))
    torch.library.opcheck(torch.ops.cute.grouped_mm.default, (a.requires_grad_(), b.requires_grad_()))


def test_compiled_without_recompiles_when_offs_and_rows_change():
    torch._dynamo.reset()
    w = torch.randn(4, 6, 8, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def moe(x, offs):
        return tco.grouped_mm(x, w.transpose(-2, -1), offs).relu().sum()

    frames = []
    for sizes in ([3, 0, 5, 2], [1, 1, 1, 1], [0, 17, 2, 0], [9, 9, 9, 9]):
        x = torch.randn(sum(sizes) + 1, 8, requires_grad=True)
        offs = offsets(sizes)
        loss = moe(x, offs)
        torch.testing.assert_close(loss, tco.grouped_mm(x, w.transpose(-2, -1), offs).relu().sum())
        loss.backward()
        frames.append(counter.frame_count)
    assert frames[1] > 0 and frames[1:] == [frames[1]] * 3, f"recompiled: {frames}"


# ------------------------------------------------------------------ host: tables and plans

def test_group_tables():
    offs = offsets([0, 100, 0, 200, 1, 299])
    table = host.rows_table(offs, 650, 128)
    tiles = [0, 1, 0, 2, 1, 3, 1]  # the last column: rows 600..650 past the groups
    assert table[0].tolist() == [0, 0, 100, 100, 300, 301, 600]
    assert table[1].tolist() == [0, 100, 100, 300, 301, 600, 650]
    assert table[2].tolist() == torch.tensor(tiles).cumsum(0).tolist()
    assert host.k_table(offs).tolist() == [[0, 0, 100, 100, 300, 301], [0, 100, 100, 300, 301, 600]]
    masked = host.masked_table(torch.tensor([0, 64, 65], dtype=torch.int32), 96, 64)
    assert masked.tolist() == [[0, 96, 192, 288], [0, 160, 257, 288], [0, 1, 3, 3]]
    # the grid's bound holds for any sizes: at most one partial tile per group, plus the tail
    for sizes in ([1] * 50, [127, 129, 0, 1], [1000]):
        rows = sum(sizes) + 7
        real = host.rows_table(offsets(sizes), rows, 128)[2, -1].item()
        assert real <= -(-rows // 128) + len(sizes) + 1


def test_launch_plans(monkeypatch):
    calls = []
    monkeypatch.setattr(host, "get_compiled", lambda spec: lambda *args: calls.append(args))
    monkeypatch.setattr(host, "sm_count", lambda index: 132)
    x, w = torch.randn(1000, 512, dtype=torch.bfloat16), torch.randn(8, 1024, 512, dtype=torch.bfloat16)
    b = w.transpose(-2, -1)
    launch = host.SM90.plan("rows", tuple(x.shape), x.stride(), tuple(b.shape), b.stride(), x.dtype, x.dtype, 8, 0)
    assert launch.spec["grouped"] == "rows" and launch.spec["b_major"] == "k" and launch.spec["tile"] == (128, 256)
    assert launch.grid == (8 + 9) * 4  # ceil(1000 / 128) + G + 1 row tiles, 4 column tiles
    offs = offsets([100, 0, 300, 600])
    launch(x, b, offs, torch.empty(1000, 1024))
    assert calls[-1][2].tolist() == host.rows_table(offs, 1000, 128).tolist() and calls[-1][4] == launch.grid
    dy = torch.randn(1000, 1024, dtype=torch.bfloat16)  # the weight gradient: x^T (M-major) @ dY (N-major)
    launch = host.SM90.plan("k", (512, 1000), x.mT.stride(), tuple(dy.shape), dy.stride(), x.dtype, x.dtype, 4, 0)
    assert (launch.spec["grouped"], launch.spec["a_major"], launch.spec["b_major"]) == ("k", "m", "n")
    assert {s.name for s in host.SM90.shipped()} >= {launch.spec.name}
    misaligned = host.SM90.plan("rows", (1000, 3), (3, 1), (8, 3, 1024), (3072, 1024, 1), x.dtype, x.dtype, 8, 0)
    assert isinstance(misaligned, str)


# ------------------------------------------------------------------------------ gated forms

def swiglu64(pre, layout, activation, alpha=1.702, limit=7.0):
    """Written out here (independent of the package's reference)."""
    if layout == "interleaved":
        gate, up = pre[:, 0::2], pre[:, 1::2]
    else:
        gate, up = pre.chunk(2, dim=1)
    if activation == "swiglu":
        return gate / (1 + torch.exp(-gate)) * up
    gate, up = torch.minimum(gate, torch.tensor(limit, dtype=pre.dtype)), up.clamp(-limit, limit)
    return (up + 1) * gate / (1 + torch.exp(-alpha * gate))


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
def test_gated_forward_and_backward(activation, layout):
    torch.manual_seed(0)
    offs = offsets([3, 0, 6, 1])
    a = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    b = (2 * torch.randn(4, 5, 8, dtype=torch.float64)).requires_grad_()
    out = tco.grouped_mm(a, b, offs, activation=activation, gate_up_layout=layout, alpha=1.5, limit=2.0)
    assert out.shape == (12, 4)
    torch.testing.assert_close(out, swiglu64(loop64(a, b, offs), layout, activation, 1.5, 2.0))
    assert torch.autograd.gradcheck(
        lambda a, b: tco.grouped_mm(a, b, offs, activation=activation, gate_up_layout=layout, alpha=1.5, limit=2.0),
        (a, b))
    torch.library.opcheck(torch.ops.cute.grouped_mm_swiglu.default, (a, b, offs, activation, layout, 1.5, 2.0))


def test_gated_errors_name_the_argument():
    a, b, offs = torch.randn(6, 4), torch.randn(2, 4, 6), offsets([2, 4])
    with pytest.raises(ValueError, match="^activation: expected one of"):
        tco.grouped_mm(a, b, offs, activation="gelu")
    with pytest.raises(ValueError, match="^gate_up_layout: expected one of"):
        tco.grouped_mm(a, b, offs, activation="swiglu", gate_up_layout="split")
    with pytest.raises(ValueError, match="^mat_b: expected an even N"):
        tco.grouped_mm(a, torch.randn(2, 4, 5), offs, activation="swiglu")
    with pytest.raises(NotImplementedError, match="^activation: swiglu needs the 2D x 3D form"):
        tco.grouped_mm(torch.randn(4, 6), torch.randn(6, 4), offs, activation="swiglu")


def test_gated_launch_plan(monkeypatch):
    """Interleaved gate/up columns plan the fused variant: out has half of b's columns, the grid
    tiles b's."""
    monkeypatch.setattr(host, "get_compiled", lambda spec: lambda *args: None)
    monkeypatch.setattr(host, "sm_count", lambda index: 132)
    x, w = torch.randn(1000, 512, dtype=torch.bfloat16), torch.randn(8, 1024, 512, dtype=torch.bfloat16)
    b = w.transpose(-2, -1)
    launch = host.SM90.plan("rows", tuple(x.shape), x.stride(), tuple(b.shape), b.stride(), x.dtype, x.dtype, 8, 0,
                            gated=("swiglu_oai", 1.702, 7.0, "interleaved"))
    assert (launch.spec["gated"], launch.spec["gate_alpha"], launch.spec["gate_limit"], launch.spec["gate_up"]) == (
        "swiglu_oai", 1.702, 7.0, "interleaved")
    assert launch.grid == (8 + 9) * 4 and launch.out_view is None
    assert launch.spec in host.SM90.shipped()


def test_gated_out_rows_must_suit_the_tma_store(monkeypatch):
    """The gated out has half of b's columns: 264 gate/up columns align, the 132 out columns (264
    bytes) do not, so no kernel (a compiled MoE step once launched one: an invalid out stride)."""
    monkeypatch.setattr(host, "get_compiled", lambda spec: lambda *args: None)
    monkeypatch.setattr(host, "sm_count", lambda index: 132)
    x, w = torch.randn(150, 136, dtype=torch.bfloat16), torch.randn(4, 264, 136, dtype=torch.bfloat16)
    b = w.transpose(-2, -1)
    reason = host.SM90.plan("rows", tuple(x.shape), x.stride(), tuple(b.shape), b.stride(), x.dtype, x.dtype, 4, 0,
                            gated=("swiglu", 1.702, 7.0, "concat"))
    assert isinstance(reason, str) and "N=132" in reason
    assert not isinstance(host.SM90.plan("rows", tuple(x.shape), x.stride(), tuple(b.shape), b.stride(), x.dtype,
                                         x.dtype, 4, 0), str)


# --------------------------------------------------------------------------------------- FP8

def _fp8_case(sizes, k=32, n=16):
    torch.manual_seed(0)
    a = torch.randn(sum(sizes) + 2, k).to(torch.float8_e4m3fn)
    w = torch.randn(len(sizes), n, k).to(torch.float8_e4m3fn)
    return a, w.transpose(-2, -1), torch.rand(a.shape[0]) + 0.5, torch.rand(len(sizes), n) + 0.5, offsets(sizes)


def test_scaled_grouped_mm_matches_the_dequantized_loop():
    a, b, scale_a, scale_b, offs = _fp8_case([5, 0, 13, 1])
    out = tco.scaled_grouped_mm(a, b, scale_a, scale_b, offs)
    assert out.dtype == torch.bfloat16
    ref = loop64(a.double() * scale_a.double()[:, None], b.double() * scale_b.double()[:, None, :], offs)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    assert out[19:].abs().max() == 0
    # (opcheck's schema test compares FP8 inputs with a multiply the CPU lacks for them)
    torch.library.opcheck(torch.ops.cute.scaled_grouped_mm.default, (a, b, scale_a, scale_b, offs),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    with FakeTensorMode() as mode:
        fake = torch.ops.cute.scaled_grouped_mm(*(mode.from_tensor(t) for t in (a, b, scale_a, scale_b, offs)))
    assert (fake.shape, fake.dtype) == (out.shape, out.dtype)


def test_scaled_grouped_mm_errors_name_the_argument():
    a, b, scale_a, scale_b, offs = _fp8_case([5, 0, 13, 1])
    with pytest.raises(ValueError, match="^scale_a: expected shape \\(21,\\)"):
        tco.scaled_grouped_mm(a, b, scale_a[:-1], scale_b, offs)
    with pytest.raises(ValueError, match="^scale_b: expected shape \\(4, 16\\)"):
        tco.scaled_grouped_mm(a, b, scale_a, scale_b.t(), offs)
    with pytest.raises(ValueError, match="^b: FP8 matmul needs K-major operands"):
        tco.scaled_grouped_mm(a, b.contiguous(), scale_a, scale_b, offs)
    with pytest.raises(TypeError, match="^mat_a: expected dtype in \\(float8_e4m3fn\\)"):
        tco.scaled_grouped_mm(a.float(), b, scale_a, scale_b, offs)
    with pytest.raises(NotImplementedError, match="^mat_a, mat_b: scaled_grouped_mm takes the 2D x 3D form"):
        tco.scaled_grouped_mm(a[None], b, scale_a, scale_b)
    with pytest.raises(ValueError, match="^offs: values must be non-decreasing"):
        tco.scaled_grouped_mm(a, b, scale_a, scale_b, offs.flip(0))
