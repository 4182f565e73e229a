"""WGMMA and accumulator pieces shared by the attention kernels (forward, backward, decode).

* WGMMA pieces: the tiled MMA, swizzled smem tiles, one warpgroup GEMM issued as a group;
* accumulator views: a WGMMA accumulator fragment seen as (rows, cols) and as the A operand
  of a register-sourced WGMMA (P in registers for O += P V), and its conversion to 16 bits.

The other shared pieces have a module each: the band and the masks (:mod:`.mask`), the
online softmax (:mod:`.softmax`), sequence bounds and row layouts (:mod:`.seqlen`), the
persistent tile schedulers (:mod:`.tile_scheduler`), the split-KV combine (:mod:`.split_kv`).
Everything here is a ``cute.jit`` helper; nothing launches on its own.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


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
