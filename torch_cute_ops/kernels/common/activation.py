"""Epilogue activations, applied to fp32 accumulator fragments in registers.

Shared by every GEMM family (sm90, sm100). The activation is a compile-time
constant: each one is its own kernel variant, so no branch survives in the code.
The formulas are ``torch_cute_ops.reference.gemm.ACTIVATIONS``' (gelu_tanh's factored for an
input the epilogue may already have halved).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

ACTIVATIONS = ("relu", "gelu_tanh", "silu")

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715
_LOG2_E = 1.4426950408889634


@cute.jit
def _relu(x: cutlass.Float32) -> cutlass.Float32:
    return cute.arch.fmax(x, cutlass.Float32(0.0))


@cute.jit
def _gelu_tanh_of_half(h: cutlass.Float32) -> cutlass.Float32:
    # gelu_tanh of x = 2 h, factored for the FMA pipe: 0.5 x (1 + tanh(u)) = h + h tanh(u) as one
    # FFMA, u = h (2 c + 8 c k h^2). An epilogue's alpha / bias FFMA can make h for free
    # (input_scale); scaling by 1/2 is exact.
    inner = h * ((2.0 * _SQRT_2_OVER_PI) + (8.0 * _SQRT_2_OVER_PI * _GELU_CUBIC) * (h * h))
    return h + h * cute.math.tanh(inner, fastmath=True)


@cute.jit
def _gelu_tanh(x: cutlass.Float32) -> cutlass.Float32:
    return _gelu_tanh_of_half(x * 0.5)


@cute.jit
def _silu(x: cutlass.Float32) -> cutlass.Float32:
    # x * sigmoid(x), with exp via ex2.approx and a fast reciprocal
    return x * cute.arch.rcp_approx(1.0 + cute.math.exp2(-x * _LOG2_E, fastmath=True))


_BY_NAME = {"relu": _relu, "gelu_tanh": _gelu_tanh, "silu": _silu}
# activations that read their input pre-scaled (by input_scale), and how
_OF_SCALED = {"gelu_tanh": (0.5, _gelu_tanh_of_half)}


def input_scale(activation) -> float:
    """The factor an epilogue may fold into its alpha and bias (one FFMA either way) before
    ``apply_activation(..., prescaled=True)``: 1 unless the activation's formula is cheaper on
    a scaled input."""
    return _OF_SCALED[activation][0] if activation in _OF_SCALED else 1.0


@cute.jit
def apply_activation(frag: cute.Tensor, activation: cutlass.Constexpr, prescaled: cutlass.Constexpr = False):
    """In place over a register fragment of fp32 values; ``activation`` may be None. With
    ``prescaled`` the fragment holds the inputs times :func:`input_scale`."""
    if cutlass.const_expr(activation is not None):
        fn = _BY_NAME[activation]
        if cutlass.const_expr(prescaled and activation in _OF_SCALED):
            fn = _OF_SCALED[activation][1]
        for i in cutlass.range_constexpr(cute.size(frag)):
            frag[i] = fn(frag[i])


GATED_ACTIVATIONS = ("swiglu", "swiglu_oai")


@cute.jit
def gated_activation(gate: cutlass.Float32, up: cutlass.Float32, activation: cutlass.Constexpr,
                     alpha: cutlass.Constexpr, limit: cutlass.Constexpr) -> cutlass.Float32:
    """A gate/up pair's output (``torch_cute_ops.reference.grouped_gemm.swiglu``): "swiglu",
    silu(gate) * up; "swiglu_oai" (gpt-oss), gate clamped above at ``limit``, up to [-limit,
    limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    if cutlass.const_expr(activation == "swiglu"):
        return _silu(gate) * up
    gate = cute.arch.fmin(gate, cutlass.Float32(limit))
    up = cute.arch.fmax(cute.arch.fmin(up, cutlass.Float32(limit)), cutlass.Float32(-limit))
    sigmoid = cute.arch.rcp_approx(1.0 + cute.math.exp2(gate * (-alpha * _LOG2_E), fastmath=True))
    return (up + 1.0) * gate * sigmoid
