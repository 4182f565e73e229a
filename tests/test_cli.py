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


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_command_writes_one_ptx_per_variant(arch, tmp_path):
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
        if arch == "sm_90a":
            assert counts["wgmma.mma_async"] > 0 and counts["setmaxnreg"] > 0
        else:
            assert counts["tcgen05.mma"] > 0
