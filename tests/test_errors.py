"""Invalid input raises before anything launches, with a message naming the argument."""

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops import fp8
from torch_cute_ops.runtime.tma import tma_reason


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("args,exc,match", [
    ((r(4), r(4, 3)), ValueError, r"^a: expected a 2 or 3-d tensor"),
    ((r(4, 5), r(2, 5, 3)), ValueError, r"^b: expected a 2-d tensor"),
    ((r(4, 5), r(6, 3)), ValueError, r"^b: expected size 5 at dim -2 \(K"),
    ((r(2, 4, 5), r(3, 5, 3)), ValueError, r"^b: expected size 2 at dim 0 \(L"),
    ((r(4, 5).int(), r(5, 3).int()), TypeError, r"^a: expected dtype in \(float16"),
    ((r(4, 5), r(5, 3, dtype=torch.float16)), TypeError, r"^b: expected dtype torch.float32"),
    ((r(4, 5), r(5, 3), r(4)), ValueError, r"^bias: expected size 3 at dim 0 \(N"),
    ((r(4, 5), r(5, 3), r(1, 3)), ValueError, r"^bias: expected a 1-d tensor"),
    ((r(4, 5), r(5, 3), r(3, dtype=torch.float64)), TypeError, r"^bias: expected dtype torch.float32"),
])
def test_gemm_rejects(args, exc, match):
    with pytest.raises(exc, match=match):
        tco.gemm(*args)


def test_gemm_rejects_unknown_activation_and_out_dtype():
    with pytest.raises(ValueError, match=r"^activation: expected None or one of"):
        tco.gemm(r(4, 5), r(5, 3), activation="tanh")
    with pytest.raises(TypeError, match=r"^out_dtype: expected one of"):
        tco.gemm(r(4, 5), r(5, 3), out_dtype=torch.int32)


def test_gemm_rejects_mixed_devices():
    with pytest.raises(ValueError, match=r"^b: expected device cpu \(the device of a\), got meta"):
        tco.gemm(r(4, 5), torch.empty(5, 3, device="meta"))


def q(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("qkv,match", [
    ((q(2, 8, 4), q(2, 8, 4, 16), q(2, 8, 4, 16)), r"^q: expected a 4-d tensor \(batch, seqlen, heads, head_dim\)"),
    ((q(2, 8, 4, 16), q(3, 8, 4, 16), q(3, 8, 4, 16)), r"^k: expected size 2 at dim 0 \(batch"),
    ((q(2, 8, 4, 16), q(2, 8, 4, 32), q(2, 8, 4, 32)), r"^k: expected size 16 at dim 3 \(head_dim"),
    ((q(2, 8, 4, 16), q(2, 8, 4, 16), q(2, 9, 4, 16)), r"^v: expected size 8 at dim 1 \(seqlen_k"),
    ((q(2, 8, 4, 16), q(2, 8, 4, 16), q(2, 8, 4, 32)), r"^v: expected size 16 at dim 3 \(head_dim"),
    ((q(2, 8, 4, 16), q(2, 8, 3, 16), q(2, 8, 3, 16)), r"^k: the number of kv heads \(3\) must divide"),
    ((q(2, 8, 2, 512), q(2, 8, 2, 512), q(2, 8, 2, 512)), r"^q: head_dim must be in \[1, 256\], got 512"),
])
def test_flash_attn_rejects(qkv, match):
    with pytest.raises(ValueError, match=match):
        tco.flash_attn_func(*qkv)


def test_flash_attn_rejects_dtype_mismatch():
    with pytest.raises(TypeError, match=r"^k: expected dtype torch.float32"):
        tco.flash_attn_func(q(1, 4, 1, 8), q(1, 4, 1, 8, dtype=torch.float16), q(1, 4, 1, 8))
    with pytest.raises(TypeError, match=r"^q: expected dtype in"):
        tco.flash_attn_func(*(torch.ones(1, 4, 1, 8, dtype=torch.int64),) * 3)


def test_flash_attn_bwd_rejects_bad_lse_and_dout():
    qq, kk, vv = q(1, 4, 2, 8), q(1, 6, 1, 8), q(1, 6, 1, 8)
    out, lse = torch.ops.cute.flash_attn_fwd(qq, kk, vv, 0.3, False)
    with pytest.raises(ValueError, match=r"^lse: expected shape \(1, 2, 4\)"):
        torch.ops.cute.flash_attn_bwd(out, qq, kk, vv, out, lse.mT, 0.3, False)
    with pytest.raises(TypeError, match=r"^lse: expected dtype in \(float32\)"):
        torch.ops.cute.flash_attn_bwd(out, qq, kk, vv, out, lse.half(), 0.3, False)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(1, 4, 2, 8\)"):
        torch.ops.cute.flash_attn_bwd(out[:, :3], qq, kk, vv, out, lse, 0.3, False)


def test_linear_rejects():
    with pytest.raises(ValueError, match=r"^input: expected last dim 5"):
        tco.linear(r(3, 4), r(2, 5))
    with pytest.raises(ValueError, match=r"^weight: expected a 2-d tensor"):
        tco.linear(r(3, 5), r(5))


# The TMA conditions: valid input that a kernel cannot address names the argument too.

def test_tma_reason_names_misaligned_leading_stride():
    a = torch.empty(8, 17, dtype=torch.bfloat16)  # 34-byte rows
    msg = tma_reason("a", a, (1,))
    assert msg.startswith("a: stride 17 of dim 0 is 34 bytes, the TMA needs a multiple of 16 bytes")


def test_tma_reason_names_missing_unit_stride():
    msg = tma_reason("q", torch.empty(4, 8, 16)[..., ::2], (2,))
    assert msg.startswith("q: the TMA needs stride 1 on dim 2")


def test_tma_reason_names_misaligned_pointer():
    base = torch.empty(64, 32, dtype=torch.float16)
    assert tma_reason("b", base[:, 1:9], (1,)).startswith("b: data pointer is not 16-byte aligned")


def test_tma_reason_accepts_padded_and_transposed_views():
    padded = torch.empty(8, 24, dtype=torch.bfloat16)[:, :17]  # K=17 with a 48-byte leading stride
    assert tma_reason("a", padded, (0, 1)) is None
    assert tma_reason("a", torch.empty(24, 8, dtype=torch.bfloat16).mT, (0, 1)) is None


def _varlen(qq, kk, vv, **kw):
    cu_q = torch.tensor([0, qq.shape[0]], dtype=torch.int32)
    cu_k = torch.tensor([0, kk.shape[0]], dtype=torch.int32)
    return tco.flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, qq.shape[0], kk.shape[0], **kw)


def _kvcache(qq, kk, vv, **kw):
    return tco.flash_attn_with_kvcache(qq, kk, vv, cache_seqlens=kk.shape[1], **kw)


ATTENTION_CALLS = {
    "flash_attn_func": (lambda *qkv, **kw: tco.flash_attn_func(*qkv, **kw), (1, 4, 2)),
    "flash_attn_varlen_func": (_varlen, (4, 2)),
    "flash_attn_with_kvcache": (_kvcache, (1, 4, 2)),
}


@pytest.mark.parametrize("call", ATTENTION_CALLS)
def test_head_dim_zero_is_a_named_error(call):
    """The default scale 1 / sqrt(head_dim) is not computed for a head dim of 0 (it was a
    ZeroDivisionError): the op's validation names q."""
    fn, lead = ATTENTION_CALLS[call]
    qkv = [torch.randn(*lead, 0) for _ in range(3)]
    with pytest.raises(ValueError, match=r"^q: head_dim must be in \[1, 256\], got 0"):
        fn(*qkv)


@pytest.mark.parametrize("call", ATTENTION_CALLS)
@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_softmax_scale_is_a_named_error(call, scale):
    fn, lead = ATTENTION_CALLS[call]
    qkv = [torch.randn(*lead, 8) for _ in range(3)]
    with pytest.raises(ValueError, match=r"^softmax_scale: expected a finite number"):
        fn(*qkv, softmax_scale=scale)
    with pytest.raises(TypeError, match=r"^softmax_scale: expected a float"):
        fn(*qkv, softmax_scale=[0.5])


@pytest.mark.parametrize("lengths", [None, 3, torch.zeros(1, dtype=torch.int32)], ids=["none", "int", "tensor"])
@pytest.mark.parametrize("page_table", [torch.zeros(2, dtype=torch.int32), torch.tensor(0, dtype=torch.int32),
                                        torch.zeros(1, 2, 1, dtype=torch.int32)], ids=["1d", "0d", "3d"])
def test_kvcache_page_table_of_another_rank_is_a_named_error(page_table, lengths):
    """A page table that is not (batch, pages per entry) was an IndexError before validation."""
    q, cache = torch.randn(1, 1, 2, 8), torch.randn(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^page_table: expected an int32 tensor of shape \(1, "):
        tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, page_table=page_table)


@pytest.mark.parametrize("q_shape,cache_shape,match", [
    ((8,), (1, 4, 2, 8), r"^q: expected a 4-d tensor"),
    ((), (1, 4, 2, 8), r"^q: expected a 4-d tensor"),
    ((1, 1, 2, 8), (4, 8), r"^k_cache: expected a 4-d tensor"),
])
@pytest.mark.parametrize("lengths", [None, 3, torch.zeros(1, dtype=torch.int32)], ids=["none", "int", "tensor"])
def test_kvcache_ranks_are_named_errors(q_shape, cache_shape, match, lengths):
    q, cache = torch.randn(q_shape), torch.randn(cache_shape)
    with pytest.raises(ValueError, match=match):
        tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths)


@pytest.mark.parametrize("length", [2**40, 2**31, -1])
def test_kvcache_int_cache_seqlens_must_fit_int32(length):
    """A Python int length is checked before it becomes an int32 tensor (2**40 overflowed)."""
    q, cache = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected a length"):
        tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=length)


@pytest.mark.parametrize("length", [2.0, True, [3]])
def test_kvcache_cache_seqlens_of_another_type_is_a_named_error(length):
    q, cache = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"^cache_seqlens: expected an int32 tensor \(batch,\), an int or None"):
        tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=length)


# ----------------------------------------------------------- found by the fuzz tests (test_fuzz_*.py)

@pytest.mark.parametrize("fn", [tco.linear, fp8.linear], ids=["linear", "fp8.linear"])
@pytest.mark.parametrize("lead", [(3,), (0,), ()], ids=["rows", "no rows", "1-d"])
def test_linear_with_no_in_features(fn, lead):
    """K = 0: input.reshape(-1, 0) was ambiguous (a RuntimeError); the result is 0 (or the bias)."""
    out = fn(torch.randn(*lead, 0), torch.randn(5, 0))
    assert out.shape == (*lead, 5) and not out.any()


def test_linear_names_its_own_arguments():
    """The gemm op's errors name a and b; linear's name input and weight."""
    with pytest.raises(TypeError, match=r"^weight: expected dtype torch.float32 \(the dtype of input\)"):
        tco.linear(r(3, 4), r(2, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"^input: expected dtype in"):
        tco.linear(torch.ones(3, 4, dtype=torch.int32), torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^weight: expected device cpu \(the device of input\)"):
        tco.linear(r(3, 4), torch.empty(2, 4, device="meta"))


@pytest.mark.parametrize("alpha", [float("nan"), float("inf")])
def test_gemm_alpha_must_be_finite(alpha):
    with pytest.raises(ValueError, match=r"^alpha: expected a finite number"):
        tco.gemm(r(4, 5), r(5, 3), alpha=alpha)


def test_fp8_linear_names_input_and_weight_dtypes():
    """A float64 input was quantized, then refused by scaled_mm as an out_dtype it was never given."""
    with pytest.raises(TypeError, match=r"^input: expected a bf16, fp16 or fp32 tensor, got torch.float64"):
        fp8.linear(r(3, 16, dtype=torch.float64), r(16, 16))
    with pytest.raises(TypeError, match=r"^weight: expected a bf16, fp16 or fp32 tensor, got torch.int64"):
        fp8.linear(r(3, 16), torch.ones(16, 16, dtype=torch.int64))


@pytest.mark.parametrize("quantize,shape,scale_shape", [
    ("tensorwise", (0,), ()), ("tensorwise", (0, 4), ()), ("rowwise", (3, 0), (3, 1)),
    ("rowwise", (2, 0, 4), (2, 0, 1)),
])
def test_fp8_quantizers_take_empty_groups(quantize, shape, scale_shape):
    """amax refuses to reduce an empty dim (IndexError / RuntimeError): an empty group's scale is 1."""
    stored, scale = getattr(fp8, f"quantize_{quantize}")(torch.randn(shape))
    assert stored.shape == shape and scale.shape == scale_shape and (scale == 1).all()


@pytest.mark.parametrize("m,k,n", [(0, 0, 0), (4, 0, 16), (0, 16, 16), (4, 16, 0)])
def test_scaled_mm_takes_empty_operands(m, k, n):
    """Operands with no elements (or K = 0) were refused as not K-major, their strides being
    arbitrary."""
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()
    out = tco.scaled_mm(a, b, torch.ones(()), torch.ones(()))
    assert out.shape == (m, n) and not out.float().any()


def test_kvcache_empty_batch():
    """cache_seqlens.min() of an empty batch was a RuntimeError, and the reference's torch.cat of
    no entries a ValueError naming nothing."""
    q, cache = torch.randn(0, 1, 2, 8), torch.randn(2, 4, 2, 8)
    out, lse = tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.zeros(0, dtype=torch.int32),
                                           return_lse=True)
    assert out.shape == (0, 1, 2, 8) and lse.shape == (0, 2, 1)


def test_kvcache_expanded_cache_cannot_take_new_keys():
    """Appending into an expanded (stride 0) cache wrote every entry's keys into one row."""
    q, cache = torch.randn(2, 1, 2, 8), torch.randn(1, 4, 2, 8).expand(2, 4, 2, 8)
    new = torch.randn(2, 1, 2, 8)
    with pytest.raises(ValueError, match=r"^k_cache: an expanded view \(stride 0\) cannot take new keys"):
        tco.flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=1)
    tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=1)  # read only: fine


def test_kvcache_negative_length_is_named_before_leftpad():
    q, cache = torch.randn(2, 1, 2, 8), torch.randn(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^cache_seqlens: "):
        tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32),
                                    cache_leftpad=torch.zeros(2, dtype=torch.int32))


def test_sdpa_without_kv_heads():
    """enable_gqa with no kv heads divided by zero; no heads at all went to the kernel's validation,
    which refuses what PyTorch computes (an empty result)."""
    with pytest.raises(ValueError, match=r"^key: with enable_gqa its heads \(0\) must divide"):
        tco.scaled_dot_product_attention(r(1, 2, 4, 8), r(1, 0, 4, 8), r(1, 0, 4, 8), enable_gqa=True)
    assert tco.scaled_dot_product_attention(r(1, 0, 4, 8), r(1, 0, 4, 8), r(1, 0, 4, 8)).shape == (1, 0, 4, 8)
