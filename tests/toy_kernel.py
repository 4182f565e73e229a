"""A tiny kernel family (y = x * factor) for the cache tests: compiles in about a second."""

import cutlass
import cutlass.cute as cute


@cute.kernel
def _scale_kernel(x: cute.Tensor, y: cute.Tensor, factor: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < cute.size(x):
        y[i] = (x[i].to(cutlass.Float32) * factor).to(y.element_type)


def build(spec):
    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, stream):
        _scale_kernel(x, y, spec["factor"]).launch(grid=[(cute.size(x) + 127) // 128, 1, 1],
                                                   block=[128, 1, 1], stream=stream)

    n = cute.sym_int64()
    dtype = getattr(cutlass, spec["dtype"])
    fake = [cute.runtime.make_fake_compact_tensor(dtype, (n,), assumed_align=16) for _ in range(2)]
    return launch, (*fake, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
