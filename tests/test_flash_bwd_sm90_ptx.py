"""Compile-only checks of the sm_90a attention backward (no GPU needed)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

cutlass = pytest.importorskip("cutlass")

from torch_cute_ops.runtime import attention as flash_host  # noqa: E402
from torch_cute_ops.runtime import shipped_specs  # noqa: E402


@pytest.fixture(autouse=True)
def _arch(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


@pytest.mark.parametrize("spec_args", [("bf16", 64, False), ("bf16", 128, True), ("fp16", 256, False)],
                         ids=["bf16-d64", "bf16-d128-causal", "fp16-d256"])
def test_ptx_is_warp_specialized_wgmma_with_tma(spec_args, variant_ptx):
    dtype, head_dim, causal = spec_args
    ptx_path = variant_ptx(flash_host.bwd_spec(dtype, head_dim, causal))
    ptx = ptx_path.read_text()
    assert ".target sm_90a" in ptx
    tile_m, tile_n, _ = flash_host.BWD_TILES[head_dim]
    # per query block, per 64-row WGMMA atom of a warpgroup: S and dP (head_dim / 16 k-steps;
    # transposed (128-key blocks), one 64-key atom; else tile_m / 64 query atoms), dQ
    # (tile_n / 16), dV and dK (tile_m / 16; transposed one 64-key atom, else tile_n / 64)
    swap = tile_n == 128
    sdp_atoms = 1 if swap else tile_m // 64
    dkv_atoms = 1 if swap else tile_n // 64
    expected_wgmma = (2 * sdp_atoms * head_dim // 16 + (tile_m // 64) * tile_n // 16
                      + 2 * dkv_atoms * tile_m // 16)
    assert ptx.count("wgmma.mma_async") == expected_wgmma
    assert "cp.async.bulk.tensor" in ptx  # TMA loads/stores
    # dQ: each warpgroup's tile stored in accumulator order (16-byte vectors) and added with one
    # 1-D bulk reduce-add
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert "st.shared.v4.b32" in ptx
    assert ptx.count("setmaxnreg") == 2  # producer down, MMA warpgroups up
    assert "stmatrix" in ptx
    if shutil.which("ptxas"):  # SASS-level checks where the toolkit is installed
        report = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx_path), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
        assert "C7515" not in report and "C7512" not in report, "ptxas serialized the WGMMAs"
        assert " 0 bytes spill stores" in report.split("_main_kernel")[-1]


def _entry(ptx: str, name_part: str) -> str:
    """The body of the one kernel entry whose name contains ``name_part``."""
    starts = [i for i in range(len(ptx)) if ptx.startswith(".entry ", i)] + [len(ptx)]
    (body,) = [ptx[a:b] for a, b in zip(starts, starts[1:]) if name_part in ptx[a:b].split("(")[0]]
    return body


@pytest.mark.parametrize("rows", ["dense", "packed"])
def test_dq_postprocess_stores_whole_vectors(rows, variant_ptx):
    """The postprocess moves dQ through shared memory and writes it to global memory in 16-byte
    vectors only: storing each value at its MMA coordinate (2 bytes at a time) made it take
    three times FA4's postprocess (bench/NOTES.md, 2026-11-23,
    "The backward's dQ postprocess; FSDP2 on two H200s")."""
    post = _entry(variant_ptx(flash_host.bwd_spec("bf16", 128, False, rows=rows)).read_text(), "postprocess")
    stores = {line.split()[0] for line in post.splitlines() if line.strip().startswith("st.global")}
    assert stores == {"st.global.v4.b32"}
    assert "ld.global.v4.b32" in post  # the fp32 accumulator read in 16-byte groups
    assert "st.shared" in post and "bar.sync" in post


def test_preprocess_zeroes_the_dq_accumulator(variant_ptx):
    """The host leaves the fp32 dQ accumulator uninitialized: the preprocess's CTAs zero an even
    share of it each (16-byte stores, the share from the grid's size), saving a fill launch."""
    import torch

    from torch_cute_ops.runtime.attention import _bwd_workspaces

    pre = _entry(variant_ptx(flash_host.bwd_spec("bf16", 128, True)).read_text(), "preprocess")
    assert "st.global.v4.b32" in pre and "%nctaid.x" in pre and "%nctaid.y" in pre
    calls = []
    real_empty = torch.empty
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "zeros", lambda *a, **k: calls.append(a) or real_empty(*a, **k))
        _bwd_workspaces(2, 4, 256, 200, 128, 64, "cpu")
    assert not calls


def test_family_registered_and_shipped():
    specs = shipped_specs("sm_90a", "flash_bwd_sm90")
    assert specs and all(s.family == "flash_bwd_sm90" for s in specs)
    assert not shipped_specs("sm_100a", "flash_bwd_sm90")
    assert os.environ.get("CUTE_DSL_ARCH") == "sm_90a"


def test_deterministic_variant_orders_the_dq_adds(variant_ptx):
    """deterministic: the writer waits for its turn (acquire loads of the tile's add count), waits
    for its bulk add to be performed, and releases the count; the default variant does none of it."""
    ordered = variant_ptx(flash_host.bwd_spec("bf16", 128, True, deterministic=True)).read_text()
    plain = variant_ptx(flash_host.bwd_spec("bf16", 128, True)).read_text()
    assert "ld.acquire.gpu.global.b32" in ordered and "red.release.gpu.global.add.s32" in ordered
    assert "fence.proxy.async.global" in ordered
    assert "ld.acquire.gpu" not in plain and "red.release.gpu" not in plain


def test_deterministic_plan_allocates_the_add_counts(monkeypatch):
    """plan_bwd(deterministic=True) picks the ordered variant, whose launch hands the kernel one
    zeroed int32 per dQ accumulator tile; the default plan hands a placeholder of the same rank
    (the compiled signature checks ranks: a 1-D placeholder fails every default launch), and how
    many heads' key blocks launch in turn: the resident CTAs (one per SM) over a head's key
    blocks, rounded up."""
    import torch

    calls = []
    monkeypatch.setattr(flash_host, "get_compiled", lambda spec: lambda *args: calls.append((spec, args)))
    placeholder = torch.empty(1, dtype=torch.int32)
    monkeypatch.setattr(flash_host, "_unused_counter", lambda index: placeholder)
    monkeypatch.setattr(flash_host, "_mask_placeholders", lambda index: ("mask", "blocks", "ranges"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(flash_host, "num_sms", lambda index: 132)
    q = torch.randn(2, 300, 4, 128).bfloat16()
    grads = [torch.empty_like(q) for _ in range(3)]
    for deterministic in (True, False):
        plan = flash_host.plan_bwd(q, q, q, True, deterministic=deterministic)
        plan(q, q, q, q, q, torch.zeros(2, 4, 300), *grads, 0.1)
        spec, args = calls[-1]
        assert spec.get("deterministic", False) == deterministic
        dq_accum, order, interleave = args[11], args[12], args[14]
        assert interleave == (44 if deterministic else 1)  # 132 SMs over 3 key blocks of 128
        if deterministic:
            assert order.dtype == torch.int32 and tuple(order.shape) == tuple(dq_accum.shape[:4])
            assert not order.any()
        else:
            assert order.dim() == 4 and order.numel() == 1
            assert order.untyped_storage().data_ptr() == placeholder.untyped_storage().data_ptr()


def test_kernels_hand_over_with_programmatic_dependent_launch(variant_ptx):
    """The main kernel and the postprocess are launched early (programmatic dependent launch):
    each waits (griddepcontrol.wait) for the grid before it ahead of its first read of that
    grid's output, and the grid before lets them launch (launch_dependents) once its CTAs are
    under way, so launch latency overlaps the previous kernel's tail instead of following it."""
    ptx = variant_ptx(flash_host.bwd_spec("bf16", 128, True)).read_text()
    pre, main, post = (_entry(ptx, name) for name in ("preprocess", "_main_kernel", "postprocess"))
    assert "griddepcontrol.launch_dependents" in pre and "griddepcontrol.wait" not in pre
    # the producer before the first lse/delta load, each dQ writer warp before its first add
    assert main.count("griddepcontrol.wait") == 2 and "griddepcontrol.launch_dependents" in main
    first_wait = main.index("griddepcontrol.wait")
    assert first_wait < main.index("cp.reduce.async.bulk")
    assert "griddepcontrol.wait" in post and post.index("griddepcontrol.wait") < post.index("ld.global")
