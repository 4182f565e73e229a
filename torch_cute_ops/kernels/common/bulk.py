"""PTX the DSL does not wrap, for kernels that hand data between CTAs through global memory.

* :func:`bulk_reduce_add_f32`: a 1-D asynchronous bulk reduce-add (``cp.reduce.async.bulk``)
  of a contiguous fp32 range of shared memory into global memory, in the issuing thread's bulk
  group (commit and wait with ``cute.arch.cp_async_bulk_commit_group`` / ``..._wait_group``);
* :func:`load_acquire_gpu`, :func:`add_release_gpu`: an int32 count acquired and released at
  GPU scope (one CTA waits for its turn, another passes it on);
* :func:`fence_proxy_async_global`: orders a thread's generic-proxy global accesses with its
  bulk (async-proxy) ones, on either side of such a hand-over;
* :func:`nanosleep`: back-off inside a polling loop.

Addresses are the integers of ``Pointer.toint()``: 64-bit global, 32-bit shared.
"""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def bulk_reduce_add_f32(dst: Int64, src: Int32, num_bytes: int, *, loc=None, ip=None) -> None:
    """``num_bytes`` of fp32 from shared (``src``) added into global memory (``dst``), one
    asynchronous bulk operation of the issuing thread's bulk group."""
    llvm.inline_asm(
        None,
        [Int64(dst).ir_value(loc=loc, ip=ip), Int32(src).ir_value(loc=loc, ip=ip),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r,~{memory}",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def load_acquire_gpu(addr: Int64, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def add_release_gpu(addr: Int64, value: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;", "l,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [], f"nanosleep.u32 {ns};", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def fence_proxy_async_global(*, loc=None, ip=None) -> None:
    """Orders this thread's generic-proxy global accesses with its bulk (async-proxy) ones."""
    llvm.inline_asm(None, [], "fence.proxy.async.global;", "~{memory}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
