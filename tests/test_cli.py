"""The two commands: the main job runs without a GPU, and `compile` builds every shipped variant."""

import subprocess
import sys
from pathlib import Path

import pytest

from torch_cute_ops.cli import count_instructions

ROOT = Path(__file__).resolve().parents[1]


def test_count_instructions_counts_instruction_lines_only():
    ptx = """
    .reg .b32 %r<4>;
    // wgmma.mma_async in a comment
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;
    @%p1 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd3, {%r2, %r3}], [%r4];
    setmaxnreg.inc.sync.aligned.u32 240;
    tcgen05.mma.cta_group::2.kind::f16 [%r1], %rd1, %rd2, %r3, p;
    """
    assert count_instructions(ptx) == {"wgmma.mma_async": 1, "tcgen05.mma": 1, "cp.async.bulk.tensor": 1,
                                       "setmaxnreg": 1}


def test_compile_rejects_unknown_arch():
    proc = subprocess.run([sys.executable, "-m", "torch_cute_ops", "compile", "--arch", "sm_80",
                           "--ptx-dir", "x"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'sm_80'" in proc.stderr


def test_compile_command_writes_one_ptx_per_variant(tmp_path):
    """sm_100a here; the sm_90a variants are compiled (with their PTX) by the aot test below."""
    arch = "sm_100a"
    pytest.importorskip("cutlass")
    from torch_cute_ops.runtime import shipped_specs

    specs = shipped_specs(arch)
    if not specs:
        pytest.skip(f"no kernel family for {arch} in this build")
    proc = subprocess.run([sys.executable, "-m", "torch_cute_ops", "compile", "--arch", arch,
                           "--ptx-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**__import__("os").environ, "TORCH_CUTE_OPS_CACHE_DIR": "off"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = {p.stem for p in tmp_path.glob("*.ptx")}
    assert written == {s.name for s in specs}
    for spec in specs:
        ptx = (tmp_path / f"{spec.name}.ptx").read_text()
        assert f".target {arch}" in ptx
        assert (tmp_path / f"{spec.name}.cubin").exists()
        assert spec.name in proc.stdout
        counts = count_instructions(ptx)
        assert counts["cp.async.bulk.tensor"] > 0
        assert counts["tcgen05.mma"] > 0


def test_aot_builds_the_sm90a_library_that_loads_without_the_dsl(tmp_path):
    """The ahead-of-time library of every shipped sm_90a variant, built with no GPU: one PTX
    and cubin per variant with the Hopper instruction mix, a manifest naming each variant's
    symbol and what it was built from, and a library a fresh process loads through TVM-FFI
    alone (the CuTe DSL never imported, nothing compiled)."""
    pytest.importorskip("cutlass")
    import json
    import os

    from torch_cute_ops.runtime import cache, shipped_specs

    specs = shipped_specs("sm_90a")
    out, ptx_dir = tmp_path / "aot", tmp_path / "ptx"
    proc = subprocess.run([sys.executable, "-m", "torch_cute_ops", "aot", "--arch", "sm_90a", "--out", str(out),
                           "--ptx-dir", str(ptx_dir)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TORCH_CUTE_OPS_CACHE_DIR": "off"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for spec in specs:
        ptx = (ptx_dir / f"{spec.name}.ptx").read_text()
        assert ".target sm_90a" in ptx and (ptx_dir / f"{spec.name}.cubin").exists()
        counts = count_instructions(ptx)
        assert counts["wgmma.mma_async"] > 0 and counts["setmaxnreg"] > 0 and counts["cp.async.bulk.tensor"] > 0

    manifest = json.loads((out / "sm_90a" / "manifest.json").read_text())
    assert manifest["format"] == cache.MANIFEST_FORMAT and manifest["arch"] == "sm_90a"
    assert {k: manifest[k] for k in ("sources", "cutlass_dsl", "tvm_ffi")} == \
        {k: cache.toolchain()[k] for k in ("sources", "cutlass_dsl", "tvm_ffi")}
    assert [v["name"] for v in manifest["variants"]] == [s.name for s in specs]
    assert [v["symbol"] for v in manifest["variants"]] == [s.symbol for s in specs]
    library = out / "sm_90a" / manifest["library"]
    nm = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in nm.stdout.splitlines()}
    assert {f"__tvm_ffi_{s.symbol}" for s in specs} <= exported
    assert not [name for name in exported if name.startswith("__cute_internal")]  # only the entry points

    child = ("import json, sys; from torch_cute_ops.runtime import cache, shipped_specs\n"
             "fns = [cache.get_compiled(s) for s in shipped_specs('sm_90a')]\n"
             "print(json.dumps([cache.stats.aot_hits, cache.stats.compiles, all(map(callable, fns)),"
             " any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules)]))")
    proc = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TORCH_CUTE_OPS_AOT_DIR": str(out), "TORCH_CUTE_OPS_CACHE_DIR": "off"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [len(specs), 0, True, False]
