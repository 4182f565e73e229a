"""Compile-only checks of the grouped sm90 GEMM (no GPU): the shipped variants have the dense
kernel's instruction mix plus what the grouped extension adds (group-table loads after the
programmatic-launch wait, predicated stores of small groups, the K tail zeroed in smem)."""

import re

import pytest

pytest.importorskip("cutlass")

from torch_cute_ops.runtime import grouped_gemm  # noqa: E402
from torch_cute_ops.runtime.gemm_config import GemmConfig  # noqa: E402

SHIPPED = grouped_gemm.SM90.shipped()


PLAIN = [s for s in SHIPPED if not s.get("gated")]
GATED = [s for s in SHIPPED if s.get("gated")]


@pytest.mark.parametrize("spec", PLAIN, ids=lambda s: f"{s['grouped']}_{s['ab']}_{s['a_major']}{s['b_major']}")
def test_grouped_ptx(spec, variant_ptx):
    ptx = variant_ptx(spec).read_text()
    assert re.search(r"^\.target\s+sm_90a", ptx, re.M)
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "stmatrix", "ld.global"):
        assert instruction in ptx, instruction
    assert ".multicast::cluster" not in ptx  # 1 x 1 clusters: the CTAs of a pair may serve two groups
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"
    # every global access, the group table's loads included, after the previous grid is done
    assert ptx.count("griddepcontrol.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    for access in ("cp.async.bulk.tensor", "ld.global", "st.global"):
        assert wait < ptx.index(access), access
    # a group smaller than a tile: its rows stored from registers (each thread's 64 x 256 / 128
    # values of its warpgroup's half), each behind a row and column bound
    assert ptx.count("st.global.b16") == 64 * 256 // 128
    if spec.get("scale"):  # FP8 operands, rowwise scales read in the epilogue
        assert "e4m3" in ptx
    zeroing = re.findall(r"st\.shared\.b16", ptx)
    if spec["grouped"] == "k":
        # the last k-tile's columns past the group zeroed (A 128 x 64 and B 256 x 64 over 256
        # threads, at the peeled and the looped k-tile), then fenced for the async proxy
        assert len(zeroing) == 2 * (128 + 256) * 64 // 256
        assert "fence.proxy.async.shared::cta" in ptx
        assert re.search(r"bar\.sync\s+5, 256", ptx)
    else:
        assert not zeroing


@pytest.mark.parametrize("spec", GATED, ids=lambda s: f"{s['gated']}_{s['gate_up']}")
def test_gated_ptx(spec, variant_ptx):
    """Interleaved gate/up columns: one output per column pair of each thread (64 x 256 / 128 / 2
    values), each through exp2 and a reciprocal, stored from registers; no smem ring."""
    ptx = variant_ptx(spec).read_text()
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "stmatrix" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"
    pairs = 64 * 256 // 128 // 2
    assert ptx.count("st.global.b16") == pairs
    assert ptx.count("ex2.approx") == pairs and ptx.count("rcp.approx") == pairs
    # concatenated columns: B's TMA walks (k, gate or up, column, group), one box per stage
    b_box = "cp.async.bulk.tensor.4d" if spec["gate_up"] == "concat" else "cp.async.bulk.tensor.3d"
    assert ptx.count(b_box) == 1 and ptx.count("cp.async.bulk.tensor.2d") == 1


def test_grouped_variants_are_cooperative_and_plain():
    from torch_cute_ops.kernels.sm90.gemm import Sm90Gemm
    import cutlass

    bf16 = cutlass.BFloat16
    for config in (GemmConfig(128, 192, pingpong=True), GemmConfig(128, 256, 2, 1),
                   GemmConfig(128, 256, stream_k=True), GemmConfig(128, 32, swap_ab=True)):
        with pytest.raises(ValueError, match="grouped GEMMs run cooperative 1 x 1 tiles"):
            Sm90Gemm(bf16, bf16, True, False, False, None, config, grouped="rows")
    with pytest.raises(ValueError, match="grouped GEMMs"):
        Sm90Gemm(bf16, bf16, True, False, True, None, GemmConfig(128, 256), grouped="k")
    with pytest.raises(ValueError, match="grouped must be one of"):
        Sm90Gemm(bf16, bf16, True, False, False, None, GemmConfig(128, 256), grouped="cols")
    with pytest.raises(ValueError, match="gated epilogues"):
        Sm90Gemm(bf16, bf16, True, False, False, None, GemmConfig(128, 256), grouped="k",
                 gated=("swiglu", 1.0, 7.0, "concat"))
