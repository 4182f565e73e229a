"""Epilogue activations, applied to fp32 accumulator fragments in registers.

Shared by every GEMM family (sm90, sm100). The activation is a compile-time
constant: each one is its own kernel variant, so no branch survives in the code.
The formulas match ``torch_cute_ops.reference.gemm.ACTIVATIONS`` exactly.
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
def _gelu_tanh(x: cutlass.Float32) -> cutlass.Float32:
    inner = x * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * _GELU_CUBIC) * (x * x))
    return 0.5 * x * (1.0 + cute.math.tanh(inner, fastmath=True))


@cute.jit
def _silu(x: cutlass.Float32) -> cutlass.Float32:
    # x * sigmoid(x), with exp via ex2.approx and a fast reciprocal
    return x * cute.arch.rcp_approx(1.0 + cute.math.exp2(-x * _LOG2_E, fastmath=True))


_BY_NAME = {"relu": _relu, "gelu_tanh": _gelu_tanh, "silu": _silu}


@cute.jit
def apply_activation(frag: cute.Tensor, activation: cutlass.Constexpr):
    """In place over a register fragment of fp32 values; ``activation`` may be None."""
    if cutlass.const_expr(activation is not None):
        fn = _BY_NAME[activation]
        for i in cutlass.range_constexpr(cute.size(frag)):
            frag[i] = fn(frag[i])
