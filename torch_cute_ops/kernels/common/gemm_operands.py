"""The GEMM kernels' view of the torch tensors they are handed (shared by sm90 and sm100).

The op layer passes torch-order operands as they are: a (L, M, K) or (M, K), b (L, K, N) or
(K, N), out (L, M, N) or (M, N). The kernels work in CuTe's (M, K, L) / (N, K, L) / (M, N, L)
order (with swapped operands, b^T's, a^T's and out^T's); these are layout changes only, no
data moves. 2-D operands (the common single GEMM)
get a unit batch mode here, so the host passes them without building 3-D views per call.
"""

import cutlass
import cutlass.cute as cute

from ...runtime.tma import TMA_ALIGN_BYTES


def to_kernel_order(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
    """(mA, mB, mC) in (M, K, L), (N, K, L), (M, N, L) order, from 2-D or 3-D torch order."""
    if cutlass.const_expr(cute.rank(mA.layout) == 2):
        unit = cute.make_layout(1, stride=0)
        return (cute.make_tensor(mA.iterator, cute.append(mA.layout, unit)),
                cute.make_tensor(mB.iterator, cute.append(cute.select(mB.layout, mode=[1, 0]), unit)),
                cute.make_tensor(mC.iterator, cute.append(mC.layout, unit)))
    return (cute.make_tensor(mA.iterator, cute.select(mA.layout, mode=[1, 2, 0])),
            cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[2, 1, 0])),
            cute.make_tensor(mC.iterator, cute.select(mC.layout, mode=[1, 2, 0])))


def _swap_mn(t: cute.Tensor) -> cute.Tensor:
    """(R, C, L) seen as (C, R, L)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0, 2]))


def to_swapped_kernel_order(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
    """Swapped operands (out^T = b^T @ a^T) from the caller's torch-order a, b, out: the
    kernel's A is b^T (N, K, L), its B a^T (M, K, L), its out out^T (N, M, L); still no data
    moves."""
    mA, mB, mC = to_kernel_order(mA, mB, mC)
    return mB, mA, _swap_mn(mC)


def swapped_scales(mScaleA: cute.Tensor, mScaleB: cute.Tensor):
    """Rowwise scales of swapped operands, in kernel order: the kernel's rows take b's (1, N)
    scales seen as (N, 1), its columns a's (M, 1) seen as (1, M)."""
    return _swap_mn(scales_to_kernel_order(mScaleB)), _swap_mn(scales_to_kernel_order(mScaleA))


def fake_operand(dtype, cols_major: bool, rank: int = 3):
    """A fake torch-order ([L,] R, C) operand with symbolic sizes: C contiguous when
    ``cols_major``, else R; every other stride 16-byte divisible (what the TMA needs)."""
    per_16b = TMA_ALIGN_BYTES * 8 // dtype.width
    ld = cute.sym_int64(divisibility=per_16b)
    stride = (ld, 1) if cols_major else (1, ld)
    if rank == 3:
        stride = (cute.sym_int64(divisibility=per_16b), *stride)
    shape = tuple(cute.sym_int32() for _ in range(rank))
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=TMA_ALIGN_BYTES)


def scales_to_kernel_order(mS: cute.Tensor) -> cute.Tensor:
    """FP8 scales ([L,] R, C) in (R, C, L) order, like the operands they scale."""
    if cutlass.const_expr(cute.rank(mS.layout) == 2):
        return cute.make_tensor(mS.iterator, cute.append(mS.layout, cute.make_layout(1, stride=0)))
    return cute.make_tensor(mS.iterator, cute.select(mS.layout, mode=[1, 2, 0]))


def fake_block_scales(rank: int, inner: int):
    """Fake blockwise scales ([L,] R, C) as the Hopper kernel's TMA reads them: dim ``inner`` (-2:
    scale_a's M, -1: scale_b's N blocks) contiguous, every other stride 16-byte divisible
    (``runtime.gemm.tma_block_scales`` makes them so)."""
    per_16b = TMA_ALIGN_BYTES // 4
    stride = [cute.sym_int64(divisibility=per_16b) for _ in range(rank)]
    stride[inner] = 1
    shape = tuple(cute.sym_int32() for _ in range(rank))
    return cute.runtime.make_fake_tensor(cutlass.Float32, shape, tuple(stride), assumed_align=TMA_ALIGN_BYTES)


def fake_scales(scale_mode: str, rank: int):
    """Fake fp32 scales: one value (mode "tensor", a 1-element vector), else ([L,] R, C) of
    any strides (rowwise (M, 1) / (1, N), blockwise (M, K/128) / (K/128, N/128))."""
    if scale_mode == "tensor":
        return cute.runtime.make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
    shape = tuple(cute.sym_int32() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank))
    return cute.runtime.make_fake_tensor(cutlass.Float32, shape, stride, assumed_align=4)
