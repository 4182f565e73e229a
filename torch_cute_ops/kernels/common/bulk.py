"""PTX the DSL does not wrap, for kernels that hand data between CTAs through global memory.

* :func:`bulk_reduce_add_f32`: a 1-D asynchronous bulk reduce-add (``cp.reduce.async.bulk``)
  of a contiguous fp32 range of shared memory into global memory, in the issuing thread's bulk
  group (commit and wait with ``cute.arch.cp_async_bulk_commit_group`` / ``..._wait_group``);
* :func:`nanosleep`: back-off inside a polling loop;
* :func:`wait_for_value`: poll an int32 in global memory (acquire loads) until it holds a value.

The turn-taking around such an add (an acquire load, a release add, the async-proxy fence) uses
``cute.arch.load`` / ``cute.arch.red`` / ``cute.arch.fence_proxy``, which the DSL provides.

Addresses are the integers of ``Pointer.toint()``: 64-bit global, 32-bit shared.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


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
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [], f"nanosleep.u32 {ns};", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)



@cute.jit
def wait_for_value(ptr, value: Int32) -> None:
    """Spin (one thread) until the int32 at ``ptr`` is ``value``; the acquire load that sees it
    orders this thread's later reads after the writes its releaser made before raising it."""
    while cute.arch.load(ptr, Int32, sem="acquire", scope="gpu") != value:
        nanosleep(32)
