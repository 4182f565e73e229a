"""The compile cache: keys carry what changes code (never sizes), memory and disk levels, no
compiles under fake tensors."""

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")
import cutlass  # noqa: E402

from torch_cute_ops import kernels  # noqa: E402
from torch_cute_ops.kernels.common import compile_cache  # noqa: E402
from torch_cute_ops.kernels.common.compile_cache import KernelSpec  # noqa: E402


@cute.kernel
def _scale_kernel(x: cute.Tensor, y: cute.Tensor, factor: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < cute.size(x):
        y[i] = (x[i].to(cutlass.Float32) * factor).to(y.element_type)


def _build(spec):
    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, stream):
        _scale_kernel(x, y, spec["factor"]).launch(grid=[(cute.size(x) + 127) // 128, 1, 1],
                                                   block=[128, 1, 1], stream=stream)

    n = cute.sym_int64()
    dtype = getattr(cutlass, spec["dtype"])
    fake = [cute.runtime.make_fake_compact_tensor(dtype, (n,), assumed_align=16) for _ in range(2)]
    return launch, (*fake, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))


FAMILY = kernels.KernelFamily(name="toy", arch="sm_90a", build=_build,
                              shipped=lambda arch: [KernelSpec.make("toy", arch, dtype="BFloat16", factor=2.0)])


@pytest.fixture
def toy_family(monkeypatch, tmp_path):
    monkeypatch.setitem(kernels._FAMILY_MODULES, "toy", __name__)
    monkeypatch.setenv("TORCH_CUTE_OPS_CACHE_DIR", str(tmp_path))
    compile_cache.clear_memory_cache()
    yield tmp_path
    compile_cache.clear_memory_cache()


def test_spec_is_ordered_named_and_validated():
    a = KernelSpec.make("gemm_sm90", "sm_90a", tile=(128, 256), dtype="bf16", bias=True)
    b = KernelSpec.make("gemm_sm90", "sm_90a", dtype="bf16", bias=True, tile=(128, 256))
    assert a == b and hash(a) == hash(b)
    assert a.name == "gemm_sm90_sm90a_bias=1_dtype=bf16_tile=128x256"
    assert a != KernelSpec.make("gemm_sm90", "sm_100a", tile=(128, 256), dtype="bf16", bias=True)
    with pytest.raises(ValueError, match="arch must be one of"):
        KernelSpec.make("gemm_sm90", "sm_80", dtype="bf16")


def test_memory_then_disk_then_compile(toy_family):
    spec = KernelSpec.make("toy", "sm_90a", dtype="BFloat16", factor=2.0)
    before = compile_cache.stats.compiles
    fn = compile_cache.get_compiled(spec)
    assert compile_cache.stats.compiles == before + 1
    assert compile_cache.get_compiled(spec) is fn  # memory hit
    stored = list(toy_family.rglob("*.o"))
    assert len(stored) == 1 and spec.digest in stored[0].name
    compile_cache.clear_memory_cache()  # what a new process sees
    disk_hits = compile_cache.stats.disk_hits
    assert callable(compile_cache.get_compiled(spec))
    assert compile_cache.stats.compiles == before + 1 and compile_cache.stats.disk_hits == disk_hits + 1


def test_other_code_changing_params_compile_separately(toy_family):
    first = compile_cache.get_compiled(KernelSpec.make("toy", "sm_90a", dtype="BFloat16", factor=2.0))
    other = compile_cache.get_compiled(KernelSpec.make("toy", "sm_90a", dtype="BFloat16", factor=3.0))
    assert first is not other and len(list(toy_family.rglob("*.o"))) == 2


def test_no_compile_under_fake_tensors(toy_family):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(RuntimeError, match="never compiled under FakeTensorMode"):
            compile_cache.get_compiled(KernelSpec.make("toy", "sm_90a", dtype="BFloat16", factor=2.0))


def test_no_compile_while_tracing(toy_family):
    spec = KernelSpec.make("toy", "sm_90a", dtype="BFloat16", factor=5.0)

    def fn(x):
        compile_cache.get_compiled(spec)
        return x + 1

    with pytest.raises(Exception, match="never compiled while torch.compile traces"):
        torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
