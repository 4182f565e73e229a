"""torch-cute-ops: CuTe DSL kernels for PyTorch, as ``torch.ops.cute`` custom ops.

Ops (``torch.ops.cute``): ``gemm``, ``flash_attn_fwd``, ``flash_attn_bwd``,
``flash_attn_varlen_fwd``, ``flash_attn_varlen_bwd``, ``flash_attn_kvcache``, ``flash_attn_varlen_paged``,
``scaled_gemm``, ``grouped_mm``, ``grouped_mm_masked``, ``grouped_mm_swiglu``, ``scaled_grouped_mm``.
Public functions: :func:`gemm`, :func:`linear`, :func:`scaled_mm` (FP8 quantizers and the
differentiable FP8 linear in :mod:`torch_cute_ops.fp8`), :func:`grouped_mm` (Mixture-of-Experts
expert GEMMs), :func:`grouped_mm_masked`, :func:`scaled_grouped_mm`, :func:`flash_attn_func`,
:func:`flash_attn_varlen_func`, :func:`flash_attn_with_kvcache`,
:func:`scaled_dot_product_attention` and the SDPA routing switch.
"""

__version__ = "0.2.0"

from .functional import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, gemm, grouped_mm,
                         grouped_mm_masked, linear, scaled_grouped_mm, scaled_mm)
from .ops.fallback import FallbackError
from .ops.fallback import counts as fallback_counts
from .sdpa import (disable_sdpa_override, enable_sdpa_override, scaled_dot_product_attention,
                   sdpa_override, sdpa_override_enabled)

__all__ = [
    "FallbackError", "disable_sdpa_override", "enable_sdpa_override", "fallback_counts",
    "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "gemm", "grouped_mm",
    "grouped_mm_masked", "linear",
    "scaled_dot_product_attention",
    "scaled_grouped_mm", "scaled_mm", "sdpa_override",
    "sdpa_override_enabled",
]
