"""The ``cute`` operator library: one schema per op, shared with csrc_stubs/cute_ops.cpp.

A CPU test parses the C++ fragment and compares it with ``SCHEMAS`` so the two cannot drift.
"""

from __future__ import annotations

import torch

NAMESPACE = "cute"

SCHEMAS = {
    "gemm": "gemm(Tensor a, Tensor b, Tensor? bias=None, str? activation=None, "
            "ScalarType? out_dtype=None, float alpha=1.0) -> Tensor",
    "flash_attn_fwd": "flash_attn_fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
                      "SymInt? window_left=None, SymInt? window_right=None, float softcap=0.0, "
                      "Tensor? key_start=None, Tensor? key_end=None, Tensor? attn_mask=None, "
                      "Tensor? learnable_sink=None, *, bool deterministic=False) -> (Tensor out, Tensor lse)",
    "flash_attn_bwd": "flash_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                      "Tensor lse, float softmax_scale, bool causal, SymInt? window_left=None, "
                      "SymInt? window_right=None, float softcap=0.0, Tensor? key_start=None, "
                      "Tensor? key_end=None, Tensor? attn_mask=None, Tensor? learnable_sink=None, "
                      "Tensor(a!)? dsink=None, *, bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)",
    "flash_attn_varlen_fwd": "flash_attn_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
                             "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, "
                             "bool causal, SymInt? window_left=None, SymInt? window_right=None, "
                             "float softcap=0.0, Tensor? learnable_sink=None, *, bool deterministic=False) "
                             "-> (Tensor out, Tensor lse)",
    "flash_attn_varlen_bwd": "flash_attn_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                             "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
                             "SymInt max_seqlen_k, float softmax_scale, bool causal, SymInt? window_left=None, "
                             "SymInt? window_right=None, float softcap=0.0, Tensor? learnable_sink=None, "
                             "Tensor(a!)? dsink=None, *, bool deterministic=False) "
                             "-> (Tensor dq, Tensor dk, Tensor dv)",
    "flash_attn_kvcache": "flash_attn_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, "
                          "Tensor? v, Tensor cache_seqlens, Tensor? cache_batch_idx, Tensor? page_table, "
                          "float softmax_scale, bool causal, SymInt? window_left=None, SymInt? window_right=None, "
                          "float softcap=0.0, Tensor? cache_leftpad=None, Tensor? learnable_sink=None) "
                          "-> (Tensor out, Tensor lse)",
    "flash_attn_varlen_paged": "flash_attn_varlen_paged(Tensor q, Tensor k_cache, Tensor v_cache, "
                               "Tensor cu_seqlens_q, Tensor? seqused_q, Tensor seqused_k, Tensor page_table, "
                               "SymInt max_seqlen_q, float softmax_scale, bool causal, SymInt? window_left=None, "
                               "SymInt? window_right=None, float softcap=0.0) -> (Tensor out, Tensor lse)",
    "scaled_gemm": "scaled_gemm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, "
                   "ScalarType? out_dtype=None, str? activation=None) -> Tensor",
    "grouped_mm": "grouped_mm(Tensor mat_a, Tensor mat_b, Tensor? offs=None, Tensor? bias=None, "
                  "ScalarType? out_dtype=None) -> Tensor",
    "grouped_mm_masked": "grouped_mm_masked(Tensor a, Tensor b, Tensor counts, ScalarType? out_dtype=None) -> Tensor",
    "scaled_grouped_mm": "scaled_grouped_mm(Tensor mat_a, Tensor mat_b, Tensor scale_a, Tensor scale_b, "
                         "Tensor? offs=None, ScalarType? out_dtype=None) -> Tensor",
    "grouped_mm_swiglu": "grouped_mm_swiglu(Tensor mat_a, Tensor mat_b, Tensor offs, str activation, "
                         "str gate_up_layout, float alpha=1.702, float limit=7.0, ScalarType? out_dtype=None) "
                         "-> Tensor",
}

# Kernels never take the reference's CPU path, but CPU tensors must work everywhere.
DEVICE_KEYS = ("CPU", "CUDA")

lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    lib.define(_schema)


def qualname(op: str) -> str:
    return f"{NAMESPACE}::{op}"


def register_impl(op: str, fn) -> None:
    for key in DEVICE_KEYS:
        lib.impl(op, fn, key)
