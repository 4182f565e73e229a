"""Compile-only checks of the Hopper attention forward (no GPU needed).

Compiles a few shipped variants for sm_90a and reads the PTX: the kernel must use
the FA3 building blocks (TMA loads and store, WGMMA with Q K^T from smem and P V
with P from registers, setmaxnreg for the producer/consumer split, named-barrier
ping-pong) and must not touch local memory.
"""

import os
import re
import shutil
import subprocess

import pytest

from torch_cute_ops.runtime import attention as flash_host

# (dtype, head_dim, causal): the 2-WG pingpong tile, its causal twin, and the 3-WG tile
VARIANTS = [("bf16", 128, False), ("bf16", 128, True), ("fp16", 64, False)]


@pytest.fixture(scope="module")
def ptx_by_variant(variant_ptx):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    return {(dtype, head_dim, causal): variant_ptx(flash_host.fwd_spec(dtype, head_dim, causal)).read_text()
            for dtype, head_dim, causal in VARIANTS}


def wgmma_lines(ptx: str) -> list[str]:
    return [line for line in ptx.splitlines() if "wgmma.mma_async" in line]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-d{v[1]}-causal{int(v[2])}")
def test_fa3_instruction_mix(ptx_by_variant, variant):
    dtype, head_dim, causal = variant
    ptx = ptx_by_variant[variant]
    assert re.search(r"^\.target\s+sm_90a", ptx, re.M)

    # S = Q K^T: both operands are smem descriptors -> "{acc...}, %rdA, %rdB"
    # O += P V: A is a register list -> "{acc...}, {a0, a1, a2, a3}, %rdB"
    lines = wgmma_lines(ptx)
    ab = "bf16.bf16" if dtype == "bf16" else "f16.f16"
    rs = [line for line in lines if re.search(r"\},\s*\{[^}]*\},\s*%rd", line)]
    ss = [line for line in lines if re.search(r"\},\s*%rd\d+,\s*%rd\d+", line)]
    assert rs and ss, f"expected SS and RS wgmma, got {len(ss)} SS / {len(rs)} RS"
    tile_n = flash_host.config_for(head_dim, causal).tile_n
    assert all(f"m64n{tile_n}k16.f32.{ab}" in line for line in ss)
    assert all(f"m64n{head_dim}k16.f32.{ab}" in line for line in rs)

    # TMA: Q/K/V loads completing on mbarriers, O stored back
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
    assert "mbarrier.try_wait" in ptx
    # producer gives registers away, consumers take them
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32" in ptx
    # exp2 softmax, 16-bit P packed two at a time, O to smem with stmatrix
    assert "ex2.approx" in ptx
    assert ("cvt.rn.bf16x2.f32" if dtype == "bf16" else "cvt.rn.f16x2.f32") in ptx
    assert "stmatrix" in ptx
    # ping-pong: consumer WGs pass the tensor cores on with named barriers
    assert "bar.arrive" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_causal_variant_schedules_dynamically(ptx_by_variant):
    """Causal tiles are claimed from a global counter; equal-length ones are scheduled statically."""
    assert re.search(r"atom(\.\w+)*\.add", ptx_by_variant[("bf16", 128, True)])
    assert not re.search(r"atom(\.\w+)*\.add", ptx_by_variant[("bf16", 128, False)])


def test_causal_variant_masks_more(ptx_by_variant):
    """The causal variant has its own masked loop: more WGMMAs than the full one."""
    full = len(wgmma_lines(ptx_by_variant[("bf16", 128, False)]))
    causal = len(wgmma_lines(ptx_by_variant[("bf16", 128, True)]))
    assert causal > full


def test_shipped_variants():
    from torch_cute_ops.runtime import shipped_specs

    specs = shipped_specs("sm_90a", "flash_fwd_sm90")
    assert flash_host.fwd_spec("bf16", 128, True) in specs and len(specs) <= 48  # a bounded prebuilt set
    assert flash_host.fwd_spec("bf16", 128, False, local=True) in specs  # sliding windows
    assert flash_host.fwd_spec("bf16", 128, True, rows="padded") in specs  # padded batches
    # what decode plans ask for: a contiguous KV cache (pack-GQA: not causal), split or not
    decode = flash_host.kvcache_config(128, None)
    for split in (False, True):
        assert flash_host.fwd_spec("bf16", 128, False, decode, rows="kvcache", split_kv=split) in specs
    # transformers' caches (ranged rows): the prompt against a static cache, one-token decode
    assert flash_host.fwd_spec("bf16", 128, True, rows="ranged") in specs
    ranged = flash_host.config_for(128, False, ragged=True)
    assert flash_host.fwd_spec("bf16", 128, False, ranged, rows="ranged", split_kv=True) in specs
    assert shipped_specs("sm_100a", "flash_fwd_sm90") == []
    for head_dim in flash_host.HEAD_DIMS:
        cfg = flash_host.config_for(head_dim, False)
        o_tile = cfg.tile_m if cfg.separate_o else 0
        smem = 2 * head_dim * (cfg.tile_m + o_tile + 2 * cfg.num_stages * cfg.tile_n)
        assert smem <= 227 * 1024, (head_dim, smem)


def test_bool_mask_is_read_as_words_under_the_gemms(tmp_path):
    """A bool attn_mask reaches the forward bit-packed: each thread loads its rows' words of a
    partial key block with one 16-byte load per row, before it waits on the QK GEMM (so the load
    hides under the tensor cores), and tests bits; there is no per-score byte load."""
    import os

    from torch_cute_ops.kernels import compile_spec

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    compile_spec(flash_host.fwd_spec("bf16", 128, False, attn_mask="bool"), dump_dir=tmp_path)
    (ptx,) = (p.read_text() for p in tmp_path.glob("*.ptx"))
    assert "ld.local" not in ptx and "st.local" not in ptx
    # the only byte loads are the block summary's (the first block's kind and the next one's)
    assert len(re.findall(r"ld\.global(\.\w+)*\.[bsu]8\b", ptx)) <= 2, "per-score byte loads"
    vector_loads = [m.start() for m in re.finditer(r"ld\.global\.v4\.b32", ptx)]
    assert len(vector_loads) >= 2
    # in the loop body, the words are loaded before the K barrier wait that precedes the QK WGMMA
    first_wait_after = ptx.find("mbarrier.try_wait", vector_loads[-1])
    first_wgmma_after = ptx.find("wgmma.mma_async", vector_loads[-1])
    assert 0 < first_wait_after < first_wgmma_after


def test_o_rescale_is_skipped_by_whole_warps(ptx_by_variant):
    """The ping-pong variants rescale O only when a row's max grew past the threshold: a
    warp vote decides, so that the skip is a uniform branch."""
    for variant in VARIANTS:
        assert "vote.sync.any.pred" in ptx_by_variant[variant], variant


def test_softcap_kind_picks_the_bounded_softmax_for_bf16_caps_up_to_63():
    """With one fixed max, exp2(softcap * log2(e) * tanh(u) - shift) spans 2 * softcap * log2(e)
    octaves, within [2^-120, 2^64] for caps up to 92 / log2(e): the forward then needs no running
    max. fp16 P would overflow past 2^16, and larger caps could underflow a whole row."""
    import torch

    kind = flash_host.softcap_kind
    assert kind(0.0, torch.bfloat16) == "none"
    assert [kind(c, torch.bfloat16) for c in (1.0, 30.0, 50.0, 63.0)] == ["bounded"] * 4
    assert kind(64.0, torch.bfloat16) == kind(50.0, torch.float16) == "capped"
    assert abs(flash_host.BOUNDED_SOFTCAP_MAX * 1.4426950408889634 - 92.0) < 1e-9


def test_bounded_softcap_forward_has_no_running_max(tmp_path, monkeypatch):
    """The bounded-score variant drops the max reduction (max.f32 and its shuffles) and the O
    rescale that the capped variant keeps."""
    from torch_cute_ops.kernels import compile_spec

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")

    def ptx(bounded):
        dump = tmp_path / str(bounded)
        compile_spec(flash_host.fwd_spec("bf16", 128, True, softcap=True, bounded_scores=bounded), dump_dir=dump)
        (path,) = dump.glob("*.ptx")
        return path.read_text()

    capped, bounded = ptx(False), ptx(True)
    assert "max.f32" in capped or "max.NaN.f32" in capped
    assert "max.f32" not in bounded and "max.NaN.f32" not in bounded
    assert bounded.count("shfl.sync") < capped.count("shfl.sync")
    assert bounded.count("tanh.approx.f32") == capped.count("tanh.approx.f32") > 0


def test_split_kv_combine_is_launched_early(tmp_path, monkeypatch):
    """Split-KV: the forward lets its combine kernel launch at once (launch_dependents), and the
    combine waits (griddepcontrol.wait) for the whole forward grid before it reads a partial;
    unsplit variants launch one kernel and carry neither. The combine merges a row in one warp
    (shuffles, not a load per split in turn) and keeps 8 splits' loads of the partial O in
    flight (8 x 4 columns per lane at D128, plus the remainder loop's 4 and the lse)."""
    from torch_cute_ops.kernels import compile_spec

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")

    def ptx(split_kv):
        dump = tmp_path / str(split_kv)
        config = flash_host.kvcache_config(128, None)
        compile_spec(flash_host.fwd_spec("bf16", 128, False, config, rows="kvcache", split_kv=split_kv),
                     dump_dir=dump)
        (path,) = dump.glob("*.ptx")
        return path.read_text()

    split, whole = ptx(True), ptx(False)
    entries = split.split(".entry")[1:]
    combine = [e for e in entries if "combine" in e.split("(")[0].lower() or "SplitKv" in e.split("(")[0]]
    assert len(combine) == 1 and "griddepcontrol.wait" in combine[0]
    assert combine[0].index("griddepcontrol.wait") < combine[0].index("ld.global")
    assert "shfl.sync.bfly" in combine[0] and "shfl.sync.idx" in combine[0]
    assert combine[0].count("ld.global") >= 8 * 4 + 4 + 1
    assert split.count("griddepcontrol.launch_dependents") == 1
    assert "griddepcontrol" not in whole


def test_gathered_q_rows_are_a_loop_without_spills(tmp_path, monkeypatch):
    """Decode with several query tokens gathers Q rows with cp.async from the producer warp,
    which keeps 24 registers: the copies are a loop over the real rows (an unrolled copy of all
    128 tile rows spilled 588 bytes per thread and cost ~8 us per tile at B8 x 4k on an H100),
    and ptxas, where installed, reports no spills."""
    from torch_cute_ops.kernels import compile_spec

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    spec = flash_host.fwd_spec("bf16", 128, True, flash_host.config_for(128, True), rows="kvcache",
                               rows_per_query=4)
    compile_spec(spec, dump_dir=tmp_path)
    ptx_path = next(tmp_path.glob("*.ptx"))
    ptx = ptx_path.read_text()
    assert 0 < len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)) <= 4
    assert "ld.local" not in ptx and "st.local" not in ptx
    if shutil.which("ptxas"):
        report = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx_path), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
        assert "bytes spill stores" in report
        assert not re.search(r"[1-9]\d* bytes spill stores", report)
