"""Online softmax in fp32 over the rows of a WGMMA accumulator, shared by the forward and
decode (the backward recomputes P from the forward's log-sum-exp instead)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, const_expr

from .dsl_state import DslState
from .flash_common import LN_2, LOG2_E, acc_as_rows_cols


# ---------------------------------------------------------------------------
# online softmax
# ---------------------------------------------------------------------------


class OnlineSoftmax(DslState):
    """Running max and sum of the rows a thread owns (4 lanes share a row).

    Scores stay unscaled in the accumulator; ``exp2(s * scale_log2 - max * scale_log2)``
    is one FFMA and one MUFU.EX2 per score. Rows that have seen only -inf use 0 as
    their max so that they produce zeros, never NaN.

    ``rescale_threshold`` > 0 (log2 units): a row keeps its stale max until a block's
    max exceeds it by more than that, so its exponentials stay below
    ``2**rescale_threshold`` (fp32 sums, and P in 16 bits, hold that easily) and O needs
    no rescale in most blocks; :meth:`step` says when a warp's rows need one.

    ``fixed_max``: the scores are bounded, |s| < 1 with ``scale_log2`` <= 92 (soft-capped
    scores: tanh values, the cap's log2(e) multiple as the scale), so one fixed max for good,
    ``max(0, 1 - 64 / scale_log2)``, keeps every exponential within [2^-120, 2^64]: no fp32
    underflow of a row's sum, and 2^64 of headroom for O's sums. No max reduction, no
    shuffles, no rescale of O. P in bf16 holds 2^64 (fp16 does not).
    """

    dynamic_fields = ("scale_log2", "row_max", "row_sum")

    def __init__(self, scale_log2: Float32, num_rows: int, rescale_threshold: float = 0.0,
                 fixed_max: bool = False):
        self.scale_log2 = scale_log2
        self.rescale_threshold = rescale_threshold
        self.fixed_max = fixed_max
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    @cute.jit
    def reset(self):
        if const_expr(self.fixed_max):
            # (any shift near this one would do: lse reads the same stored value back)
            self.row_max.fill(cutlass.max(Float32(0.0), 1.0 - 64.0 * cute.arch.rcp_approx(self.scale_log2)))
        else:
            self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def _step_fixed_max(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> tuple:
        acc = acc_as_rows_cols(acc_s)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        row_scale.fill(1.0)
        max_scaled = self.row_max[0] * self.scale_log2  # the same for every row
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            exp_row = cute.math.exp2(acc[r, None].load() * self.scale_log2 - max_scaled, fastmath=True)
            acc[r, None].store(exp_row)
            self.row_sum[r] = exp_row.reduce(
                cute.ReductionOp.ADD, Float32(0.0) if const_expr(is_first) else self.row_sum[r], 0)
        return row_scale, False

    @cute.jit
    def step(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> tuple:
        """Exponentiate ``acc_s`` in place. Return the factors to rescale O's rows by and
        whether any row of this warp has one other than 1 (warp-uniform: O's rescale can
        be skipped as a whole; with ``fixed_max`` the Python constant False)."""
        if const_expr(self.fixed_max):
            return self._step_fixed_max(acc_s, is_first)
        acc = acc_as_rows_cols(acc_s)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        conditional = const_expr(not is_first and self.rescale_threshold > 0.0)
        grew = Boolean(False) if conditional else True
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = acc[r, None].load()
            prev_max = self.row_max[r]
            new_max = row.reduce(
                cute.ReductionOp.MAX, -Float32.inf if const_expr(is_first) else prev_max, 0
            )
            # fmax (one FMNMX per step): the NaN-propagating max costs three instructions on
            # the softmax's critical path, and a NaN score still reaches O through its exp
            new_max = cute.arch.warp_reduction(new_max, cute.arch.fmax, threads_in_group=4)
            if const_expr(conditional):
                # -inf -> finite grows (inf > threshold); -inf -> -inf is NaN: stays
                row_grew = (new_max - prev_max) * self.scale_log2 > self.rescale_threshold
                new_max = new_max if row_grew else prev_max
                grew = grew | row_grew
            self.row_max[r] = new_max
            safe_max = 0.0 if new_max == -Float32.inf else new_max
            max_scaled = safe_max * self.scale_log2
            exp_row = cute.math.exp2(row * self.scale_log2 - max_scaled, fastmath=True)
            acc[r, None].store(exp_row)
            # per-thread partial sums; the 4 lanes of a row are combined in finalize
            if const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = exp_row.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            else:
                # a row that saw only -inf so far has O = 0 and sum = 0: its factor is
                # exp2(-inf) = 0, never exp2(+huge) = inf (0 * inf would be NaN)
                row_scale[r] = cute.math.exp2((prev_max - safe_max) * self.scale_log2, fastmath=True)
                self.row_sum[r] = exp_row.reduce(
                    cute.ReductionOp.ADD, self.row_sum[r] * row_scale[r], 0
                )
        if const_expr(conditional):
            grew = cute.arch.vote_any_sync(grew)
        return row_scale, grew

    @cute.jit
    def finalize(self, sink: cute.Tensor = None) -> tuple:
        """Return (1/row_sum, natural-log LSE); an empty row gives (0, -inf).

        ``sink``: each row's sink logit (natural log, never capped; rmem, one per row), a key
        that joins the denominator and attends to nothing: the row's max is taken over it too,
        so a sink far above the scores gives factors near 0 and no overflow. An empty row then
        gives (0, sink)."""
        out_scale = cute.make_rmem_tensor_like(self.row_sum, Float32)
        lse = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            empty = total == 0.0
            max_scaled = self.row_max[r] * self.scale_log2
            if const_expr(sink is not None):
                sink_scaled = sink[r] * LOG2_E
                both_max = cute.arch.fmax(max_scaled, sink_scaled)
                kept = cute.math.exp2(max_scaled - both_max, fastmath=True)  # 0 for a -inf max
                total = total * kept + cute.math.exp2(sink_scaled - both_max, fastmath=True)
                out_scale[r] = 0.0 if empty else kept * cute.arch.rcp_approx(total)
                lse[r] = sink[r] if empty else (both_max + cute.math.log2(total, fastmath=True)) * LN_2
            else:
                out_scale[r] = 0.0 if empty else cute.arch.rcp_approx(total)
                lse[r] = -Float32.inf if empty else (max_scaled + cute.math.log2(total, fastmath=True)) * LN_2
        return out_scale, lse


@cute.jit
def scale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor, when=True):
    """Multiply each row of an accumulator by its factor (O rescale / normalize); ``when``
    (a warp-uniform flag, as :meth:`OnlineSoftmax.step` returns) skips it as a whole."""
    acc = acc_as_rows_cols(acc_o)
    if when:
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            acc[r, None].store(acc[r, None].load() * row_scale[r])
