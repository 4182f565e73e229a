"""The grouped extension of the sm90 GEMM (:class:`.gemm.Sm90Gemm` with ``grouped`` set): a
Mixture-of-Experts layer's expert GEMMs in one persistent launch, on the dense kernel's producer,
WGMMA main loop, epilogue and tile scheduler.

Two modes, both driven by a small int32 *group table* the host computes on the device from
``offs`` (a few tiny torch ops, no host sync; ``runtime.grouped_gemm``):

* ``"rows"`` (2D x 3D, the forward and dA; also DeepGEMM's masked layout and, transposed, 3D x
  2D): A (M, K) rows grouped, B (G, K, N), C (M, N). The table is (3, G + 1): group starts,
  ends and cumulative *row-tile* counts (``ceil(rows_g / tile_m)`` summed), column G a pseudo
  group over the rows past the last group, whose tiles store zeros and load nothing. The
  scheduler's M axis is the concatenation of all groups' row tiles: the host sizes the grid from
  the bound ``ceil(M / tile_m) + G + 1`` row tiles (no sync), each CTA reads the real total from
  the table after the programmatic-launch wait and walks only real tiles, and a work item finds
  its group by a binary search over the cumulative counts (log2 G loads, L1/L2 hits). An empty
  group owns no tile, so it costs nothing.
* ``"k"`` (2D x 2D, the weight gradient dB = A^T dY): A (M, K), B (K, N) with K grouped, C (G, M,
  N). The schedule is the dense batched one (a batch per group), the table (3, G) gives each
  group's k range; a tile walks ``ceil(k_g / tile_k)`` k-tiles from the group's first k, and an
  empty group's tiles store zeros.

Gated epilogue (``Sm90Gemm.gated``, rows mode): a Mixture-of-Experts gate/up projection with
SwiGLU (or gpt-oss's clamped variant) fused. Each thread's accumulator holds pairs of adjacent
columns, so with gate and up interleaved (gpt-oss's layout: gate at even columns) a pair is one
output, computed in fp32 and stored from registers (C has half of B's columns). Concatenated
columns ([gate | up], Qwen3 / Mixtral) reach the same epilogue through a view of B, no copy:
column ``2 h + p`` of the view is column ``p * N / 2 + h`` of B (:func:`concat_as_interleaved`),
so the TMA loads each tile's gate and up columns side by side (a 4-D box); fused for a K-major B
(nn.Linear's weight transposed), whose rows the box can interleave.

Group bounds, and why no per-group TMA descriptor. A tile's loads start at its group's first row
(k): TMA coordinates are element-granular, so the global descriptors serve every group through
a coordinate offset. A "rows" tile moves back to end at its group's end where the group holds a
whole tile (as the dense kernel moves its last tile back to end at M), so every tile of such a
group lies inside it, and its stores go through the usual TMA path; a tile of a group smaller
than tile_m is the one case that reaches past its group: it loads the next rows of A (always
inside A: the TMA clips at M), which only feed output rows that are never stored, and stores its
real rows from registers with a row predicate. Only the K-grouped mode needs a hard bound
(rows past a group would enter the reduction): there the last k-tile's columns past the group
are zeroed in shared memory by the consumer warpgroups before its WGMMA (one pass over one
stage per tile, :func:`zero_k_tail`). Replacing the descriptors' extents per group on the device
(``tensormap.replace``) would make the TMA do both without those two paths, at the price of a
descriptor copy and proxy fences per group change in every CTA; that is the route if profiles
show the predicated stores of small groups or the tail zeroing matter.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

GROUPED_MODES = (None, "rows", "k")


class GroupTile(NamedTuple):
    """Where one grouped work item's tile lies."""
    row_start: Int32  # the tile's first row of A and C
    row_end: Int32  # rows of C it may store: [row_start, row_end)
    col_start: Int32
    b_batch: Int32  # B's batch (the group, rows mode)
    c_batch: Int32  # C's batch (the group, K mode)
    k_start: Int32  # the group's first k (K mode)
    k_count: Int32  # k-tiles to walk (0: store zeros)
    k_tail: Int32  # valid columns of the last k-tile


def row_tiles_bound(rows, num_columns, tile_m: int):
    """An upper bound of the row tiles of groups covering ``rows`` rows, the table having
    ``num_columns`` (groups + 1) columns: each group rounds up at most once."""
    return (rows + tile_m - 1) // tile_m + num_columns


def total_row_tiles(mGroups: cute.Tensor) -> Int32:
    """The real row-tile count (rows mode): the last cumulative count."""
    return mGroups[2, mGroups.shape[1] - 1]


def num_groups(gemm, mGroups: cute.Tensor, mC: cute.Tensor):
    """G: the rows mode's table has a pseudo group more; the K mode has C's batch."""
    if cutlass.const_expr(gemm.grouped == "rows"):
        return mGroups.shape[1] - 1
    return mC.shape[2]


def grouped_kernel_order(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
    """Torch-order A (M, K), B (G, K, N) or (K, N), C (M, N) or (G, M, N) in the kernel's (M, K, L),
    (N, K, L), (M, N, L) order (a unit batch mode for 2-D ones); layouts only."""
    unit = cute.make_layout(1, stride=0)
    kernel_a = cute.make_tensor(mA.iterator, cute.append(mA.layout, unit))
    if cutlass.const_expr(cute.rank(mB.layout) == 2):
        kernel_b = cute.make_tensor(mB.iterator, cute.append(cute.select(mB.layout, mode=[1, 0]), unit))
    else:
        kernel_b = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[2, 1, 0]))
    if cutlass.const_expr(cute.rank(mC.layout) == 2):
        kernel_c = cute.make_tensor(mC.iterator, cute.append(mC.layout, unit))
    else:
        kernel_c = cute.make_tensor(mC.iterator, cute.select(mC.layout, mode=[1, 2, 0]))
    return kernel_a, kernel_b, kernel_c


def concat_as_interleaved(mB: cute.Tensor) -> cute.Tensor:
    """B (N, K, G) whose N columns are [gate | up] seen with gate and up interleaved: column
    ``2 h + p`` is column ``p * N / 2 + h``, a hierarchical mode ((2, N / 2) : (N / 2 * s, s)),
    so that the TMA loads each tile's gate and up columns side by side (a box of (2, tile_n /
    2) there) and the interleaved epilogue serves both layouts. A layout only."""
    half = mB.shape[0] // 2
    stride_n = mB.layout.stride[0]
    columns = cute.make_layout((2, half), stride=(half * stride_n, stride_n))
    return cute.make_tensor(mB.iterator, cute.make_layout((columns.shape, mB.shape[1], mB.shape[2]),
                                                          stride=(columns.stride, *mB.layout.stride[1:])))


@cute.jit
def _find_group(mGroups: cute.Tensor, row_tile: Int32, last: Int32) -> Int32:
    """The first group whose cumulative row-tile count exceeds ``row_tile`` (``last`` if none
    before it does): a binary search over the table's third row."""
    lo = Int32(0)
    hi = last
    while lo < hi:
        mid = (lo + hi) // 2
        if mGroups[2, mid] <= row_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cute.jit
def group_tile(gemm, mGroups: cute.Tensor, tile_m_idx: Int32, tile_n_idx: Int32, batch_idx: Int32, m, n,
               groups, num_k_tiles: Int32) -> GroupTile:
    """The tile of a grouped work item (``tile_m_idx``: rows mode, the linear row tile over all
    groups; K mode, the tile row of group ``batch_idx``)."""
    tile_m, tile_n, tile_k = gemm.tile_shape_mnk
    col_start = gemm._tile_start(tile_n_idx, n, tile_n, False)
    if cutlass.const_expr(gemm.grouped == "rows"):
        group = _find_group(mGroups, tile_m_idx, groups)
        start, end = mGroups[0, group], mGroups[1, group]
        first_tile = mGroups[2, group] - (end - start + tile_m - 1) // tile_m
        row_start = start + (tile_m_idx - first_tile) * tile_m
        # back to end at the group's end where the group holds a whole tile
        row_start = cutlass.max(start, cutlass.min(row_start, end - tile_m))
        k_count = num_k_tiles
        if group >= groups:  # the rows past the last group: zeros
            k_count = Int32(0)
        return GroupTile(row_start, end, col_start, cutlass.min(group, groups - 1), Int32(0), Int32(0), k_count,
                         Int32(tile_k))
    k_start, k_end = mGroups[0, batch_idx], mGroups[1, batch_idx]
    k_count = (k_end - k_start + tile_k - 1) // tile_k
    k_tail = k_end - k_start - (k_count - 1) * tile_k
    return GroupTile(gemm._tile_start(tile_m_idx, m, tile_m, True), m, col_start, Int32(0), batch_idx, k_start,
                     k_count, k_tail)


# named barrier of the consumer warpgroups around the K tail's zeroing (cooperative tiles: the
# epilogue takes id 1; ids 3 and 4 belong to ping-pong, which grouped variants do not run)
_K_TAIL_BARRIER_ID = 5


@cute.jit
def zero_k_tail(gemm, sA: cute.Tensor, sB: cute.Tensor, k_tail: Int32, group_tidx: Int32, stage: Int32):
    """K grouped: zero the columns ``k_tail..tile_k`` of a k-tile's A and B stages (loaded past the
    group's end: the next group's values, which must not enter the sum), then make the writes
    visible to the WGMMA (async proxy) of every consumer warpgroup of the tile."""
    tile_m, tile_n, tile_k = gemm.tile_shape_mnk
    if k_tail < tile_k:
        for operand, rows in ((sA, tile_m), (sB, tile_n)):
            zero = operand.element_type(0)
            for j in cutlass.range_constexpr(rows * tile_k // gemm.tile_threads):
                index = group_tidx + j * gemm.tile_threads
                row = index // tile_k
                k = index - row * tile_k
                if k >= k_tail:
                    operand[row, k, stage] = zero
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=_K_TAIL_BARRIER_ID, number_of_threads=gemm.tile_threads)
