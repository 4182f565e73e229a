"""Pack-GQA with several query tokens: the kernel's (token, head) row view of q, out and lse
(kernels.common.seqlen.gqa_rows), checked offset by offset on static layouts (no GPU needed)."""

import pytest

cute = pytest.importorskip("cutlass.cute")
import cutlass  # noqa: E402

from torch_cute_ops.kernels.common.seqlen import gqa_rows_layout  # noqa: E402

B, S, H_Q, D, GROUP = 2, 3, 8, 16, 4


@cute.jit
def _check_q_like():
    # q stored (B, H, S, D), as a (B, H, S, D) projection transposed to (B, S, H, D), seen as (S, D, H, B)
    s_b, s_h, s_s = H_Q * S * D, S * D, D
    rows = gqa_rows_layout(cute.make_layout((S, D, H_Q, B), stride=(s_s, 1, s_h, s_b)), GROUP, 2)
    assert cute.size(rows, mode=[0]) == S * GROUP and cute.size(rows, mode=[2]) == H_Q // GROUP
    for t in cutlass.range_constexpr(S):
        for j in cutlass.range_constexpr(GROUP):
            for h in cutlass.range_constexpr(H_Q // GROUP):
                for b in cutlass.range_constexpr(B):
                    # row t * g + j of kv head h is token t of query head h * g + j
                    got = cute.crd2idx((t * GROUP + j, 5, h, b), rows)
                    assert got == t * s_s + 5 + (h * GROUP + j) * s_h + b * s_b, (t, j, h, b, got)


@cute.jit
def _check_lse_like():
    # lse (B, H, S) contiguous, seen as (S, H, B)
    rows = gqa_rows_layout(cute.make_layout((S, H_Q, B), stride=(1, S, H_Q * S)), GROUP, 1)
    for t in cutlass.range_constexpr(S):
        for j in cutlass.range_constexpr(GROUP):
            for h in cutlass.range_constexpr(H_Q // GROUP):
                got = cute.crd2idx((t * GROUP + j, h, 1), rows)
                assert got == t + (h * GROUP + j) * S + H_Q * S, (t, j, h, got)


def test_rows_are_token_head_pairs_of_one_kv_head():
    """Row ``t * group + j`` of kv head ``h`` addresses token t of query head ``h * group + j``,
    for q-like (S, D, H, B) views of any strides and for (S, H, B) statistics."""
    _check_q_like()
    _check_lse_like()
