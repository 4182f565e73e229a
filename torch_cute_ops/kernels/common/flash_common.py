"""Pieces shared by the attention kernels (forward and backward, sm90).

* WGMMA pieces: the tiled MMA, swizzled smem tiles, one warpgroup GEMM issued as a group;
* accumulator views: a WGMMA accumulator fragment seen as (rows, cols) and as
  the A operand of a register-sourced WGMMA (P in registers for O += P V);
* :class:`KeyRange`: which key blocks a query block visits (causal is bottom-right
  aligned: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``; a local
  window bounds the band on both sides) and which of them need a mask;
  :func:`query_block_range` / :func:`key_blocks_reaching`: its transpose, which query blocks
  a key block visits (the backward's loop) and how many key blocks reach a query block;
* :func:`mask_scores`: -inf outside the causal or local band and past ``seqlen_k``;
* :func:`apply_softcap`: logit soft-capping before the mask and the softmax;
* :func:`apply_attn_mask`: PyTorch's ``attn_mask`` (bool or additive) on the key blocks that
  its block summary marks partial (:data:`BLOCK_FULL` blocks need none, empty ones are skipped);
  the forward reads a bool mask bit-packed instead (:func:`load_mask_words`,
  :func:`apply_mask_words`): one vector load per row and block, issued under the GEMMs;
* :class:`OnlineSoftmax`: running row max / row sum in fp32 with exp2 and the
  softmax scale folded into one FFMA per score;
* :class:`AttentionTileScheduler`: a persistent scheduler (static, or dynamic with
  an atomic tile counter) over (query block, head, batch) tiles that orders causal
  tiles longest-first and keeps the heads in flight few enough for their K/V to
  stay in L2; :class:`TileSource` hands its tiles to the producer and consumers.

Everything here is a ``cute.jit`` helper or a plain Python object of DSL values;
nothing launches on its own.
"""

from __future__ import annotations

import copy
import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

class DslState:
    """Lets a helper object live across dynamic ``while``/``range`` loops.

    The DSL carries loop state as MLIR values; the attributes named in
    ``dynamic_fields`` (DSL scalars or register tensors) become those values, the
    others stay compile-time constants.
    """

    dynamic_fields: tuple = ()

    def __extract_mlir_values__(self):
        values, self._value_counts = [], []
        for name in self.dynamic_fields:
            field_values = cutlass.extract_mlir_values(getattr(self, name))
            values += field_values
            self._value_counts.append(len(field_values))
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        for name, count in zip(self.dynamic_fields, self._value_counts):
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[:count]))
            values = values[count:]
        return new


# ---------------------------------------------------------------------------
# WGMMA tiling and operand views
# ---------------------------------------------------------------------------


def tiled_wgmma(dtype, a_major, b_major, tile_mn, atoms_mn=(1, 1),
                a_source=warpgroup.OperandSource.SMEM) -> cute.TiledMma:
    """fp32-accumulating WGMMA over a (tile_m, tile_n) tile, ``atoms_mn`` warpgroups along
    M and N; a WGMMA atom is 64 rows high, so taller per-warpgroup tiles repeat it."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, a_major, b_major, Float32,
        atom_layout_mnk=(*atoms_mn, 1),
        tiler_mn=(min(64, tile_mn[0] // atoms_mn[0]), tile_mn[1] // atoms_mn[1]),
        a_source=a_source,
    )


def swizzled_smem_layout(dtype, rows: int, cols: int, stages: int | None = None, slice_cols: int | None = None):
    """Row-major (cols contiguous) swizzled (rows, cols[, stages]) tile for WGMMA and TMA, readable
    by WGMMA as a K- or (through :func:`transposed_view`) MN-major operand.

    The swizzle atom (64, 32, 16 or 8 16-bit columns) must divide ``slice_cols``, the column
    count one warpgroup reads when it takes this tile as an MN-major operand (default: all).
    """
    bits = math.gcd(cols, slice_cols or cols) * dtype.width
    kinds = warpgroup.SmemLayoutAtomKind
    kind = (kinds.K_SW128 if bits % 1024 == 0 else kinds.K_SW64 if bits % 512 == 0
            else kinds.K_SW32 if bits % 256 == 0 else kinds.K_INTER)
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


@cute.jit
def warpgroup_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                   zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[int] = -1):
    """Issue one warpgroup GEMM over all its k blocks as one commit group; ``wait`` >= 0 then
    waits until at most that many groups are in flight."""
    warpgroup.fence()
    # a fresh atom per call: its ACCUMULATE flag is state that must not leak across loops
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(mma_atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        mma_atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)


def transposed_view(t: cute.Tensor) -> cute.Tensor:
    """An smem tile with its first two modes swapped, trailing (stage) modes kept: a
    row-major tile read as an MN-major operand."""
    rows, cols = cute.size(t, mode=[0]), cute.size(t, mode=[1])
    shape = (cols, rows, *[cute.size(t, mode=[i]) for i in range(2, cute.rank(t))])
    stride = (rows, 1, *[rows * cols] * (cute.rank(t) - 2))
    return cute.composition(t, cute.make_layout(shape, stride=stride))


# ---------------------------------------------------------------------------
# accumulator views
# ---------------------------------------------------------------------------


def acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 accumulator ``((2, 2, N/8), MMA_M, MMA_N)`` as ``((2, MMA_M), (2, N/8, MMA_N))``.

    Mode 0 walks the rows a thread owns, mode 1 its columns, so row reductions are
    loops over mode 1 followed by a shuffle across the 4 lanes that share a row.
    """
    flat = cute.make_layout(acc.layout.shape)
    rows = (flat.shape[0][1], flat.shape[1])
    rows_stride = (flat.stride[0][1], flat.stride[1])
    cols = (flat.shape[0][0], flat.shape[0][2], flat.shape[2])
    cols_stride = (flat.stride[0][0], flat.stride[0][2], flat.stride[2])
    view = cute.make_layout((rows, cols), stride=(rows_stride, cols_stride))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, view))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View a 16-bit sm90 accumulator as the A fragment of the next WGMMA (RS form).

    ``((2, 2, N/8), MMA_M, MMA_N)`` becomes ``((2, 2, 2), MMA_M, (N/16, MMA_N))``: the
    C layout of one GEMM holds exactly the registers the A operand of the next one
    wants, two 8-column groups per 16-wide k block.
    """
    assert acc.layout.shape[0][2] % 2 == 0, "tile_n must be a multiple of 16"
    split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    shape = (
        (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
        split.shape[1],
        (split.shape[0][2][1], split.shape[2]),
    )
    stride = (
        (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
        split.stride[1],
        (split.stride[0][2][1], split.stride[2]),
    )
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


@dsl_user_op
def _cvt_pair(lo: Float32, hi: Float32, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    kind = "bf16x2" if to_bf16 else "f16x2"
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """fp32 fragment -> bf16/fp16 fragment of the same size, two values per cvt.

    ``TensorSSA.to`` converts one value at a time for some tile widths, and the
    scattered 16-bit moves then sit between the WGMMAs that read the result.
    """
    dst_pairs = cute.recast_tensor(dst, Int32)
    to_bf16 = dst.element_type is cutlass.BFloat16
    for i in cutlass.range(cute.size(dst_pairs), unroll_full=True):
        dst_pairs[i] = _cvt_pair(src[2 * i], src[2 * i + 1], to_bf16)


# ---------------------------------------------------------------------------
# which key blocks a query block visits
# ---------------------------------------------------------------------------


class KeyRange(DslState):
    """Key-block bounds of one (query block, batch) pair; plain DSL integers.

    Visible keys are a band per query row ``i``: with ``offset = seqlen_k - seqlen_q``,
    causal (bottom-right aligned) sees ``j <= i + offset``; a local window (``local``,
    FlashAttention's ``(left, right)``, both finite here) sees
    ``i + offset - left <= j <= i + offset + right``.

    ``[n_block_min, n_block_max)``: the key blocks with any visible key (empty when
    ``n_block_max <= n_block_min``); they are never loaded outside it. Blocks at or past
    ``n_block_min_masked`` cross the band's right edge, blocks below
    ``n_block_min_unmasked`` its left edge: only those need a mask.
    """

    dynamic_fields = ("n_block_min", "n_block_max", "n_block_min_masked", "n_block_min_unmasked")

    def __init__(self, tile_m: int, tile_n: int, causal: bool, m_block, seqlen_q, seqlen_k,
                 local: bool = False, left=None, right=None, rows_per_query: int = 1):
        n_blocks_k = (seqlen_k + tile_n - 1) // tile_n
        self.n_block_min = Int32(0)
        self.n_block_max = n_blocks_k
        self.n_block_min_masked = n_blocks_k
        self.n_block_min_unmasked = Int32(0)
        if const_expr(causal or local):
            first_row = m_block * tile_m
            last_row = cutlass.min((m_block + 1) * tile_m, seqlen_q) - 1
            if const_expr(rows_per_query > 1):  # rows are (token, head) pairs: the band is per token
                seqlen_q, first_row, last_row = (seqlen_q // rows_per_query, first_row // rows_per_query,
                                                 last_row // rows_per_query)
            offset = seqlen_k - seqlen_q
            right_edge = offset if const_expr(causal) else offset + right
            # keys visible to the last row of the block, and to its first row
            last_row_keys = last_row + right_edge + 1
            first_row_keys = first_row + right_edge + 1
            self.n_block_max = cutlass.min(
                n_blocks_k, (cutlass.max(last_row_keys, 0) + tile_n - 1) // tile_n
            )
            self.n_block_min_masked = cutlass.min(
                self.n_block_max, cutlass.max(first_row_keys, 0) // tile_n
            )
            if const_expr(local):
                # the first key the first row sees, and the first the last row sees
                first_key_first_row = first_row + offset - left
                first_key_last_row = last_row + offset - left
                self.n_block_min = cutlass.max(first_key_first_row, 0) // tile_n
                self.n_block_min_unmasked = (cutlass.max(first_key_last_row, 0) + tile_n - 1) // tile_n


@cute.jit
def query_block_range(n_block: Int32, seqlen_q, seqlen_k, left: Int32, right: Int32, tile_m: cutlass.Constexpr[int],
                      tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool],
                      local: cutlass.Constexpr[bool]):
    """``(m_block_min, m_block_max)``: the query blocks with a row that sees a key of key block
    ``n_block`` (the band of :class:`KeyRange`, transposed); empty (max == min) when no query
    sees these keys. Both ends grow with ``n_block``."""
    m_block_max = cute.ceil_div(seqlen_q, tile_m)
    m_block_min = Int32(0)
    offset = seqlen_k - seqlen_q
    if const_expr(causal or local):
        right = Int32(0) if const_expr(causal) else right
        first_row = n_block * tile_n - offset - right
        m_block_min = cutlass.max(first_row, 0) // tile_m
    if const_expr(local):
        last_key = cutlass.min((n_block + 1) * tile_n, seqlen_k) - 1
        rows_end = last_key - offset + left + 1  # one past the last row that sees it
        m_block_max = cutlass.min(m_block_max, (cutlass.max(rows_end, 0) + tile_m - 1) // tile_m)
        m_block_max = cutlass.max(m_block_max, m_block_min)
    return m_block_min, m_block_max


@cute.jit
def key_blocks_reaching(m_block: Int32, seqlen_q, seqlen_k, right: Int32, tile_m: cutlass.Constexpr[int],
                        tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool]):
    """Causal or local bands: one past the last key block whose :func:`query_block_range`
    holds query block ``m_block`` (not capped at the key blocks that exist). Since both ends of
    that range grow with the key block, the key blocks reaching a query block are one run: key
    block j reaches it iff its first row ``j * tile_n - offset - right`` lies before the query
    block's end."""
    right = Int32(0) if const_expr(causal) else right
    end = (m_block + 1) * tile_m + seqlen_k - seqlen_q + right
    return cute.ceil_div(cutlass.max(end, 0), tile_n)


@cute.jit
def mask_scores(
    acc_s: cute.Tensor,
    tScS: cute.Tensor,
    t0ScS: cute.Tensor,
    row_start: Int32,
    col_start: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
    mask_seqlen: cutlass.Constexpr[bool],
    keys_in_rows: cutlass.Constexpr[bool] = False,
    local: cutlass.Constexpr[bool] = False,
    left: Int32 = None,
    right: Int32 = None,
    rows_per_query: cutlass.Constexpr[int] = 1,
):
    """Set scores outside the visible band (see :class:`KeyRange`) to -inf, in place.

    ``row_start``/``col_start``: the query row and key column of the fragment's
    tile origin. ``tScS``/``t0ScS``: (row, col) coordinates within the tile of this
    thread's and of thread 0's accumulator, both in :func:`acc_as_rows_cols` form.
    Columns are compared through thread 0's coordinates (compile-time constants)
    against limits shifted by this thread's column offset: one or two compares per
    score. ``keys_in_rows``: the fragment holds S^T (rows are keys, columns queries);
    the origins keep their meaning (``row_start`` is still the first query).
    ``local``: the band of a (left, right) window; ``causal`` is right = 0, no left edge.
    ``rows_per_query`` > 1 (forward): each query token is that many consecutive rows.
    """
    acc = acc_as_rows_cols(acc_s)
    col_offset = tScS[0, 0][1]
    offset = seqlen_k - (seqlen_q // rows_per_query if const_expr(rows_per_query > 1) else seqlen_q)
    hidden = Int32(1 << 30)  # past every column: the whole row is masked
    if const_expr(keys_in_rows):
        # key j is visible to the queries i in [j - offset - right, j - offset + left]
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            key = col_start + tScS[r, 0][0]
            first_col = Int32(-1)
            last_col = hidden
            if const_expr(causal):
                first_col = key - offset - row_start - col_offset
            if const_expr(local):
                first_col = key - offset - right - row_start - col_offset
                last_col = key - offset + left - row_start - col_offset
            if const_expr(mask_seqlen):
                first_col = cutlass.select_(key < seqlen_k, first_col, hidden)
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                col = t0ScS[0, c][1]
                acc[r, c] = acc[r, c] if col >= first_col else -Float32.inf
                if const_expr(local):
                    acc[r, c] = acc[r, c] if col <= last_col else -Float32.inf
    else:
        seqlen_limit = seqlen_k - col_start - col_offset
        if const_expr(not causal and not local):
            if const_expr(mask_seqlen):
                for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                    keep = t0ScS[0, c][1] < seqlen_limit
                    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
                        acc[r, c] = acc[r, c] if keep else -Float32.inf
        else:
            # query row i sees keys j <= i + offset (+ right), and (local) j >= i + offset - left
            right_edge = offset if const_expr(causal) else offset + right
            diag = row_start + 1 + right_edge - col_start - col_offset
            for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
                limit = diag + tScS[r, 0][0]
                if const_expr(rows_per_query > 1):
                    limit = diag - row_start + (row_start + tScS[r, 0][0]) // rows_per_query
                first = limit - 1 - right - left if const_expr(local) else None  # i + offset - left
                if const_expr(mask_seqlen):
                    limit = cutlass.min(limit, seqlen_limit)
                if const_expr(local):
                    for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                        col = t0ScS[0, c][1]
                        acc[r, c] = acc[r, c] if col < limit else -Float32.inf
                        acc[r, c] = acc[r, c] if col >= first else -Float32.inf
                else:
                    for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                        acc[r, c] = acc[r, c] if t0ScS[0, c][1] < limit else -Float32.inf


# a key block's status in an attn_mask's block summary (runtime.attention_mask.mask_summary)
BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL = 0, 1, 2


@cute.jit
def apply_attn_mask(acc_s: cute.Tensor, tScS: cute.Tensor, mMask: cute.Tensor, row_start: Int32,
                    col_start: Int32, seqlen_q: Int32, seqlen_k: Int32, additive: cutlass.Constexpr[bool],
                    inv_scale: Float32, keys_in_rows: cutlass.Constexpr[bool] = False):
    """PyTorch's attn_mask on one block of scores, in place. ``mMask``: this (batch, head)'s
    (S_q, S_k) view (any strides, broadcast dims stride 0). A bool mask (as uint8) sets -inf
    where it is 0; an additive one adds ``mask / softmax_scale`` to the unscaled score, i.e.
    ``mask`` to the scaled one. Scores outside (S_q, S_k) are left to the seqlen mask."""
    acc = acc_as_rows_cols(acc_s)
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            row = row_start + tScS[r, c][0]
            key = col_start + tScS[r, c][1]
            if const_expr(keys_in_rows):
                row = row_start + tScS[r, c][1]
                key = col_start + tScS[r, c][0]
            if (row < seqlen_q) & (key < seqlen_k):
                if const_expr(additive):
                    acc[r, c] = acc[r, c] + mMask[row, key].to(Float32) * inv_scale
                else:
                    acc[r, c] = acc[r, c] if mMask[row, key] != 0 else -Float32.inf


@cute.jit
def load_mask_words(mBits: cute.Tensor, tScS: cute.Tensor, row_start: Int32, col_start: Int32,
                    tile_n: cutlass.Constexpr[int]) -> cute.Tensor:
    """A bit-packed bool mask's words for this thread's rows over one key block: (rows, tile_n /
    32) Int32, one vector load per row. ``mBits``: this (batch, head)'s (rows, words) view, bit
    ``i`` of word ``w`` is key ``32 w + i``, padded to whole tiles with zero bits, so no bounds
    check is needed and keys past ``seqlen_k`` read as hidden. Issued before the QK GEMM is
    waited on, its latency hides under the tensor cores."""
    num_rows = cute.size(tScS, mode=[0])
    per_row = tile_n // 32
    words = cute.make_rmem_tensor(cute.make_layout((num_rows, per_row), stride=(per_row, 1)), Int32)
    for r in cutlass.range_constexpr(num_rows):
        row_words = cute.local_tile(mBits[row_start + tScS[r, 0][0], None], (per_row,), (col_start // tile_n,))
        # rows are 16-byte aligned (mask_args), blocks as their size allows; the DSL cannot see
        # it through the indexing
        aligned = cute.make_ptr(Int32, row_words.iterator.toint(), cute.AddressSpace.gmem,
                                assumed_align=math.gcd(16, 4 * per_row))
        cute.autovec_copy(cute.make_tensor(aligned, row_words.layout), words[r, None])
    return words


@cute.jit
def apply_mask_words(acc_s: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor, words: cute.Tensor):
    """A bool attn_mask from :func:`load_mask_words` on one block of scores: -inf where the bit is
    0. A thread's columns are thread 0's plus an offset below 8 (WGMMA accumulator layout), so
    one shift per word aligns them and every bit index is static."""
    acc = acc_as_rows_cols(acc_s)
    lane_cols = tScS[0, 0][1] - t0ScS[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        aligned = cute.make_rmem_tensor(cute.size(words, mode=[1]), Int32)
        for w in cutlass.range_constexpr(cute.size(words, mode=[1])):
            aligned[w] = words[r, w] >> lane_cols
        for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            col = t0ScS[r, c][1]
            visible = (aligned[col // 32] >> (col % 32)) & 1
            acc[r, c] = acc[r, c] if visible != 0 else -Float32.inf


@cute.jit
def apply_softcap(acc_s: cute.Tensor, scale: Float32):
    """Soft-capping in place: ``acc <- tanh(acc * scale)`` with ``scale = softmax_scale /
    softcap``; the softmax then takes ``softcap`` as its scale, so that the scores it sees are
    ``softcap * tanh(softmax_scale * s / softcap)``."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        acc_s[i] = cute.math.tanh(acc_s[i] * scale, fastmath=True)


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
    def finalize(self) -> tuple:
        """Return (1/row_sum, natural-log LSE); an empty row gives (0, -inf)."""
        out_scale = cute.make_rmem_tensor_like(self.row_sum, Float32)
        lse = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            empty = total == 0.0
            out_scale[r] = 0.0 if empty else cute.arch.rcp_approx(total)
            row_max = self.row_max[r]
            lse[r] = (
                -Float32.inf
                if empty
                else (row_max * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            )
        return out_scale, lse


@cute.jit
def scale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor, when=True):
    """Multiply each row of an accumulator by its factor (O rescale / normalize); ``when``
    (a warp-uniform flag, as :meth:`OnlineSoftmax.step` returns) skips it as a whole."""
    acc = acc_as_rows_cols(acc_o)
    if when:
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            acc[r, None].store(acc[r, None].load() * row_scale[r])


# ---------------------------------------------------------------------------
# tile scheduler
# ---------------------------------------------------------------------------


class AttentionTileScheduler(DslState):
    """Persistent schedule of (m_block, head, batch) tiles, static or dynamic.

    Tiles are numbered in sections of ``heads_per_section`` (batch, head) pairs;
    inside a section the query block is the slow index and the head the fast one,
    so the CTAs in flight share the K/V of a few heads (L2 reuse). With
    ``longest_first`` (causal) query blocks run from the last (most keys) to the
    first, so short tiles fill the tail of the schedule.

    * static: CTA ``c`` of ``G`` takes one tile per wave of ``G`` tiles, in snake
      order (:meth:`tile_of`); the work index advances by one.
    * dynamic: the work index is the tile itself. A CTA starts at its block index
      and then takes ``G + atomic_add(counter, 1)``: tiles are handed out in order
      to whichever CTA frees up first (longest-processing-time first for causal),
      and the kernel still prefetches the next tile under the current one.
    """

    dynamic_fields = ("num_m_blocks", "num_heads", "num_bh", "heads_per_section", "num_tiles")

    def __init__(
        self,
        num_m_blocks: Int32,
        num_heads: Int32,
        num_batch: Int32,
        heads_per_section: Int32,
        longest_first: bool,
        dynamic: bool = False,
    ):
        self.num_m_blocks = num_m_blocks
        self.num_heads = num_heads
        self.num_bh = num_heads * num_batch
        self.heads_per_section = heads_per_section
        self.longest_first = longest_first
        self.dynamic = dynamic
        self.num_tiles = num_m_blocks * self.num_bh

    @staticmethod
    def heads_per_section_for(seqlen_k: Int32, kv_bytes_per_key: int, num_bh: Int32,
                              budget_bytes: int) -> Int32:
        """How many (batch, head) pairs' K/V fit ``budget_bytes`` (at least 1), so that the
        query blocks of one head reuse its K/V from L2 (H100/H200: 50 MB)."""
        per_head = cutlass.max(seqlen_k, 1) * kv_bytes_per_key
        return cutlass.max(cutlass.min(budget_bytes // per_head, num_bh), 1)

    # Static: work w of CTA c is tile w * G + c on even waves and w * G + (G - 1 - c) on
    # odd ones (snake order), so that a CTA that got one of the longest tiles of a wave
    # gets one of the shortest of the next.
    def first_tile(self) -> Int32:
        if const_expr(self.dynamic):
            return Int32(cute.arch.block_idx()[0])
        return Int32(0)

    def next_tile(self, work: Int32) -> Int32:
        """Static schedules only; a dynamic one asks :meth:`claim_tile`."""
        return work + 1

    @cute.jit
    def claim_tile(self, counter: cute.Tensor) -> Int32:
        """Dynamic schedules: the next unclaimed tile (call from one whole warp).

        Every CTA that starts on a tile claims once per tile it runs, the last claim returning
        the end, so a launch makes exactly ``num_tiles`` claims: the one that returns
        ``num_tiles - 1`` is the last of the launch, and it zeroes the counter for the next
        launch on the stream (the host keeps one counter per stream instead of a fresh
        zeroed one per call)."""
        claimed = Int32(0)
        if cute.arch.lane_idx() == 0:
            claimed = cute.arch.atomic_add(counter.iterator, Int32(1))
            if claimed == self.num_tiles - 1:
                counter[0] = Int32(0)
        return Int32(cute.arch.grid_dim()[0]) + cute.arch.shuffle_sync(claimed, 0)

    def tile_of(self, work: Int32) -> Int32:
        if const_expr(self.dynamic):
            return work
        ctas = Int32(cute.arch.grid_dim()[0])
        cta = Int32(cute.arch.block_idx()[0])
        odd = work % 2
        return work * ctas + cta + odd * (ctas - 1 - 2 * cta)

    def is_valid(self, work: Int32):
        return self.tile_of(work) < self.num_tiles

    def coords(self, work: Int32) -> tuple:
        """(m_block, head, batch) of this CTA's work item."""
        tile = self.tile_of(work)
        section_tiles = self.heads_per_section * self.num_m_blocks
        section = tile // section_tiles
        within = tile - section * section_tiles
        first_bh = section * self.heads_per_section
        heads_here = cutlass.min(self.heads_per_section, self.num_bh - first_bh)
        m_idx = within // heads_here
        bh = first_bh + within - m_idx * heads_here
        m_block = m_idx
        if const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_idx
        batch = bh // self.num_heads
        head = bh - batch * self.num_heads
        return m_block, head, batch


class TileSource(DslState):
    """Where the producer warp and the consumer warpgroups of a kernel get their next tile.

    A static schedule computes it in every role. A dynamic one has the producer warp
    claim it right after issuing the current tile's loads and pass it on through a
    two-slot smem pipeline, so the consumers walk the same tiles one step behind.
    """

    dynamic_fields = ("scheduler", "pipe", "slots", "counter")

    def __init__(self, scheduler: AttentionTileScheduler, pipe, slots: cute.Tensor, counter: cute.Tensor):
        self.scheduler = scheduler
        self.pipe = pipe  # PipelineAsync(2 stages): producer warp -> consumer threads
        self.slots = slots  # (2,) Int32 in smem
        self.counter = counter

    @cute.jit
    def produce_next(self, tile: Int32, state) -> tuple:
        """The producer warp's next tile (published to the consumers when dynamic) and the
        advanced slot state; the caller reassigns both (a loop carries only what it assigns)."""
        next_tile = tile
        if const_expr(self.scheduler.dynamic):
            next_tile = self.scheduler.claim_tile(self.counter)
            self.pipe.producer_acquire(state)
            if cute.arch.lane_idx() == 0:
                self.slots[state.index] = next_tile
            self.pipe.producer_commit(state)
            state.advance()
        else:
            next_tile = self.scheduler.next_tile(tile)
        return next_tile, state

    @cute.jit
    def consume_next(self, tile: Int32, state) -> tuple:
        """A consumer thread's next tile (the one the producer warp published) and the
        advanced slot state."""
        next_tile = tile
        if const_expr(self.scheduler.dynamic):
            self.pipe.consumer_wait(state)
            next_tile = self.slots[state.index]
            self.pipe.consumer_release(state)
            state.advance()
        else:
            next_tile = self.scheduler.next_tile(tile)
        return next_tile, state
