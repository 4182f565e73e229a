"""Invalid input raises before anything launches, with a message naming the argument."""

import pytest
import torch

import torch_cute_ops as tco
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
