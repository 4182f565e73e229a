"""Compile-only checks of the Blackwell GEMM (no Blackwell GPU exists here): every
shipped variant compiles for sm_100a to PTX and a cubin with the tcgen05 / TMA
instruction mix, no local memory, and a shared-memory and TMEM plan that fits."""

import re
import shutil
import subprocess

import pytest
import torch

pytest.importorskip("cutlass")

import cutlass.cute as cute  # noqa: E402

from torch_cute_ops.kernels import COMPILE_OPTIONS  # noqa: E402
from torch_cute_ops.kernels.sm100 import gemm as sm100_gemm  # noqa: E402
from torch_cute_ops.runtime.gemm import SM100 as sm100_host  # noqa: E402
from torch_cute_ops.runtime.gemm import DTYPE_NAMES, scaled_spec  # noqa: E402
from torch_cute_ops.runtime.gemm_config import GemmConfig  # noqa: E402

SHIPPED = sm100_host.shipped()


def _compile(spec, dump_dir):
    """Compile like compile_spec(spec, dump_dir) does, keeping the kernel object to inspect its plan."""
    jit_fn, fake_args = sm100_gemm.build(spec)
    options = f"{COMPILE_OPTIONS} --gpu-arch={spec.arch} --keep-ptx --keep-cubin --dump-dir={dump_dir}"
    compiled = cute.compile(jit_fn, *fake_args, options=options)
    ptx_files, cubins = list(dump_dir.glob("*.ptx")), list(dump_dir.glob("*.cubin"))
    assert len(ptx_files) == 1 and len(cubins) == 1 and cubins[0].stat().st_size > 0
    return compiled, jit_fn.__self__, ptx_files[0].read_text()


_TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _check_call_contract(compiled, spec):
    """launch() calls fn(a, b[, bias], out, alpha, max_clusters) with torch-order tensors and no stream
    (FP8: fn(a, b, scale_a, scale_b[, bias], out, max_clusters)): CPU tensors of the right layouts
    get as far as the device check of the first argument."""
    dtype = _TORCH_DTYPES[spec["ab"]]
    a = torch.empty(1, 64, 32, dtype=dtype)
    a = a if spec["a_major"] == "k" else a.transpose(1, 2).contiguous().transpose(1, 2)
    b = torch.empty(1, 32, 16, dtype=_TORCH_DTYPES[spec.get("b", spec["ab"])])
    b = b if spec["b_major"] == "n" else b.transpose(1, 2).contiguous().transpose(1, 2)
    out_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec["out"]]
    out = torch.empty(1, 64, 16, dtype=out_dtype)
    if spec["rank"] == 2:  # single 2-D operands
        a, b, out = a[0], b[0], out[0]
    bias = (torch.empty(16, dtype=_TORCH_DTYPES[spec.get("bias_dtype", spec["ab"])]),) if spec["bias"] else ()
    if spec.get("scale") is None:
        args = (a, b, *bias, out, 1.0)
    elif spec["scale"] == "tensor":
        args = (a, b, torch.ones(1), torch.ones(1), *bias, out)
    else:
        lead = (1,) if spec["rank"] == 3 else ()
        args = (a, b, torch.ones(*lead, 64, 1), torch.ones(*lead, 1, 16), *bias, out)
    with pytest.raises(ValueError, match=r"argument #0.*max_clusters: int32, mPartials: None, mFlags: None\)`, "
                       r"expected device_type=cuda"):
        compiled(*args, 148, None, None)


def _ptxas_spills(ptx_path):
    """Bytes of spill stores ptxas reports for the PTX (None without a ptxas on PATH)."""
    if shutil.which("ptxas") is None:
        return None
    info = subprocess.run(["ptxas", "-arch=sm_100a", "-v", str(ptx_path), "-o", "/dev/null"],
                          capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", info))


def _count(pattern, ptx):
    return len(re.findall(pattern, ptx))


def _check_variant(spec, tmp_path):
    compiled, gemm, ptx = _compile(spec, tmp_path)
    _check_call_contract(compiled, spec)
    two_cta = spec["tile"][0] == 256
    assert re.search(r"^\.target\s+sm_100a", ptx, re.M)
    group = "cta_group::2" if two_cta else "cta_group::1"
    scale = spec.get("scale")
    # one k-tile (128 bytes of K) = 4 tcgen05.mma (k=16 each, k=32 for FP8) issued by one elected thread
    kind = "f8f6f4" if scale else "f16"
    assert _count(rf"tcgen05\.mma\.{group}\.kind::{kind}", ptx) == 4
    assert _count(r"tcgen05\.mma\.", ptx) == 4
    for instruction in (f"tcgen05.alloc.{group}", f"tcgen05.dealloc.{group}", f"tcgen05.commit.{group}",
                        "tcgen05.relinquish_alloc_permit", "tcgen05.ld.sync.aligned", "tcgen05.wait::ld"):
        assert instruction in ptx, instruction
    # TMA loads into smem completing on an mbarrier, TMA stores of the epilogue sub-tiles
    dims = spec["rank"]  # a 2-D variant's unit batch mode (stride 0) leaves the tensor maps 2-D
    assert _count(rf"cp\.async\.bulk\.tensor\.{dims}d\.shared::(cta|cluster)\.global\.tile\.mbarrier::complete_tx",
                  ptx) >= 2
    assert _count(rf"cp\.async\.bulk\.tensor\.{dims}d\.global\.shared::cta", ptx) >= 1
    assert "cp.async.bulk.wait_group.read" in ptx
    if two_cta:  # the pair's leader commits stage releases to both CTAs
        assert "multicast::cluster" in ptx
    assert ".local" not in ptx, "local memory (stack arrays)"
    assert _ptxas_spills(next(tmp_path.glob("*.ptx"))) in (None, 0), "register spills"
    # bias: staged once per tile through smem (tile_n / 128 loads per thread), nothing without it;
    # per-tensor scales: two loads; rowwise: one per column value and one per row and sub-tile
    loads = _count(r"ld\.global", ptx) - {None: 0, "tensor": 2, "row": 0}[scale]
    if scale == "row":
        assert loads >= spec["tile"][1]
    else:
        assert 0 < loads <= 2 if spec["bias"] else loads == 0
    if spec["act"] == "gelu_tanh":
        assert "tanh.approx" in ptx
    if spec["act"] == "silu":
        assert "ex2.approx" in ptx

    # the plan: a real multi-stage ring, everything inside smem and TMEM
    assert gemm.ab_stages >= 3, "no room for TMA/MMA pipelining"
    assert gemm.epi_stages >= 2
    assert gemm.tmem_cols == 2 * spec["tile"][1] <= 512  # two fp32 accumulator buffers
    tile_m, tile_n = spec["tile"]
    cta_m = tile_m // (2 if two_cta else 1)
    k_tile_bytes = 128  # 64 16-bit or 128 FP8 values of K
    ab_stage = (cta_m + tile_n // (2 if two_cta else 1)) * k_tile_bytes
    out_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[spec["out"]]
    epi_stage = cta_m * 32 * out_bytes
    smem_budget = sm100_gemm.SMEM_CAPACITY - sm100_gemm.SMEM_RESERVED
    assert gemm.ab_stages * ab_stage + gemm.epi_stages * epi_stage <= smem_budget


def test_shipped_variants_cover_the_brief():
    assert all(spec.arch == "sm_100a" for spec in SHIPPED)
    assert any(s.get("scale") == "row" for s in SHIPPED)  # FP8 with rowwise scales
    assert {s["tile"][0] for s in SHIPPED} == {128, 256}  # 1-CTA and 2-CTA
    assert any(s["cluster"] == (4, 1) for s in SHIPPED)  # multicast beyond the pair
    assert {s["bias"] for s in SHIPPED} == {False, True}
    assert len({(s["a_major"], s["b_major"]) for s in SHIPPED}) >= 2
    assert len({s.name for s in SHIPPED}) == len(SHIPPED)


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda s: s.name)
def test_shipped_ptx(spec, tmp_path):
    _check_variant(spec, tmp_path)


# configs the heuristic picks that no shipped variant uses, and the remaining majorness combos
# (a K-major, b K-major)
SWEEP = [
    sm100_host.spec("bf16", "bf16", False, True, True, "silu", GemmConfig(128, 128)),
    sm100_host.spec("fp16", "fp16", True, False, False, None, GemmConfig(128, 64)),
    sm100_host.spec("bf16", "fp32", False, False, True, "gelu_tanh", GemmConfig(256, 256, 2, 1)),
    sm100_host.spec("bf16", "bf16", True, True, True, "relu", GemmConfig(256, 256, 4, 1)),
    sm100_host.spec("fp16", "fp16", True, False, True, "gelu_tanh", GemmConfig(256, 64, 4, 1)),
    sm100_host.spec("bf16", "bf16", False, True, False, None, GemmConfig(256, 128, 2, 1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SWEEP, ids=lambda s: s.name)
def test_sweep_ptx(spec, tmp_path):
    _check_variant(spec, tmp_path)


# FP8 beyond the shipped rowwise one: per-tensor scales on the 1-CTA tile; e4m3 x e5m2 rowwise with an
# fp32 bias into fp32 on a 128 x 128 tile
FP8_SWEEP = [
    scaled_spec(sm100_host, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, None, "tensor", None,
                GemmConfig(128, 256), rank=2),
    scaled_spec(sm100_host, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.float32, "row", "relu",
                GemmConfig(128, 128)),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", FP8_SWEEP, ids=lambda s: s.name)
def test_fp8_ptx(spec, tmp_path):
    _check_variant(spec, tmp_path)


def test_no_blockwise_fp8_variant():
    e4m3 = torch.float8_e4m3fn
    reason = sm100_host.plan((256, 256), (256, 1), (256, 256), (1, 256), e4m3, None, None, torch.bfloat16, 0,
                             b_dtype=e4m3, scale_mode="block")
    assert reason == "sm100 gemm kernel: no FP8 variant with block scales"
    with pytest.raises(ValueError, match="scale_mode"):
        sm100_gemm.GemmSm100(sm100_gemm._DSL_TYPES["e4m3"], sm100_gemm._DSL_TYPES["bf16"], False, None,
                             GemmConfig(128, 256), scale_mode="block")
