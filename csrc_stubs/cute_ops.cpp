// The `cute` operator library, declared for C++/libtorch users.
//
// Compile this fragment into your own extension (or libtorch program) to get the same
// schemas that `import torch_cute_ops` registers from Python; then provide kernels with
// TORCH_LIBRARY_IMPL(cute, CUDA, m) { m.impl("gemm", &my_gemm); ... }. Do not load it into a
// process that also imports torch_cute_ops: a library may be defined only once.
// tests/test_schemas.py checks that these schemas match torch_cute_ops/ops/schemas.py.
#include <torch/library.h>

TORCH_LIBRARY(cute, m) {
  m.def("gemm(Tensor a, Tensor b, Tensor? bias=None, str? activation=None, ScalarType? out_dtype=None, float alpha=1.0) -> Tensor");
  m.def("flash_attn_fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, SymInt? window_left=None, SymInt? window_right=None, float softcap=0.0, Tensor? key_start=None, Tensor? key_end=None, Tensor? attn_mask=None, Tensor? learnable_sink=None, *, bool deterministic=False) -> (Tensor out, Tensor lse)");
  m.def("flash_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, bool causal, SymInt? window_left=None, SymInt? window_right=None, float softcap=0.0, Tensor? key_start=None, Tensor? key_end=None, Tensor? attn_mask=None, Tensor? learnable_sink=None, Tensor(a!)? dsink=None, *, bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("flash_attn_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, SymInt? window_left=None, SymInt? window_right=None, float softcap=0.0, Tensor? learnable_sink=None, *, bool deterministic=False) -> (Tensor out, Tensor lse)");
  m.def("flash_attn_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, SymInt? window_left=None, SymInt? window_right=None, float softcap=0.0, Tensor? learnable_sink=None, Tensor(a!)? dsink=None, *, bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("flash_attn_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor cache_seqlens, Tensor? cache_batch_idx, Tensor? page_table, float softmax_scale, bool causal, SymInt? window_left=None, SymInt? window_right=None, float softcap=0.0, Tensor? cache_leftpad=None, Tensor? learnable_sink=None) -> (Tensor out, Tensor lse)");
  m.def("flash_attn_varlen_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor? seqused_q, Tensor seqused_k, Tensor page_table, SymInt max_seqlen_q, float softmax_scale, bool causal, SymInt? window_left=None, SymInt? window_right=None, float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def("scaled_gemm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, ScalarType? out_dtype=None, str? activation=None) -> Tensor");
  m.def("grouped_mm(Tensor mat_a, Tensor mat_b, Tensor? offs=None, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_mm_masked(Tensor a, Tensor b, Tensor counts, ScalarType? out_dtype=None) -> Tensor");
  m.def("scaled_grouped_mm(Tensor mat_a, Tensor mat_b, Tensor scale_a, Tensor scale_b, Tensor? offs=None, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_mm_swiglu(Tensor mat_a, Tensor mat_b, Tensor offs, str activation, str gate_up_layout, float alpha=1.702, float limit=7.0, ScalarType? out_dtype=None) -> Tensor");
}
