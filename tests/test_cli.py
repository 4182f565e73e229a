"""The commands: the main job runs without a GPU (a self-check, and a compile check into the
kernel cache that a second run loads), `compile` builds every shipped variant, `aot` a library."""

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_cute_ops import cli
from torch_cute_ops.cli import count_instructions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def quick_main_job(monkeypatch):
    """The main job without its start-up timing (fresh processes importing torch: test_startup's)."""
    from torch_cute_ops import measure

    if torch.cuda.is_available():
        pytest.skip("the compile check is the main job's CPU path")
    monkeypatch.setattr(measure, "import_cost", lambda runs: {"import_torch_s": 1.0, "import_package_s": 0.05,
                                                              "heavy_modules": []})


def _verdict(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_main_job_builds_one_variant_per_family_into_the_cache_then_loads_them(quick_main_job, monkeypatch,
                                                                                 tmp_path, capsys):
    pytest.importorskip("cutlass")
    from torch_cute_ops.runtime import cache, shipped_specs

    monkeypatch.setenv("TORCH_CUTE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_CUTE_OPS_AOT_DIR", str(tmp_path / "no-aot"))
    cache.clear_memory_cache()
    families = {spec.family for spec in shipped_specs("sm_90a")}
    assert cli.main_job() == 0
    out = capsys.readouterr().out
    checks = out.count("  PASS  ")
    assert _verdict(out).startswith(f"verdict: OK - self-check {checks}/{checks}, compile {len(families)}/"
                                    f"{len(families)} sm_90a ({len(families)} compiled, 0 loaded")
    assert len(list((tmp_path / "cache").rglob("*.so"))) == len(families)
    compile_section = out[out.index("== compile check"):]
    assert max(map(len, compile_section.splitlines())) <= 100
    assert not any(spec.name in out for spec in shipped_specs("sm_90a"))  # full names run past 150
    cache.clear_memory_cache()  # what a second run sees: the on-disk cache
    assert cli.main_job() == 0
    assert f"(0 compiled, {len(families)} loaded" in _verdict(capsys.readouterr().out)
    cache.clear_memory_cache()


@pytest.mark.parametrize("scope", ["all", "none"])
def test_main_job_compiles_every_variant_or_none_and_counts_failures(quick_main_job, monkeypatch, capsys, scope):
    from torch_cute_ops.runtime import cache, shipped_specs

    asked = []

    def get_compiled(spec):
        asked.append(spec)
        if spec.family == "flash_bwd_sm90":
            raise RuntimeError("no backward today\nsecond line")
        return lambda *args: None

    monkeypatch.setattr(cache, "get_compiled", get_compiled)
    monkeypatch.setattr(cli, "self_check", lambda device: [("stub check", 0.0, 1e-5)])
    code = cli.main([f"--{'all' if scope == 'all' else 'no-compile'}"])
    out = capsys.readouterr().out
    if scope == "none":
        assert code == 0 and not asked and _verdict(out) == "verdict: OK - self-check 1/1"
        return
    specs = shipped_specs("sm_90a")
    failures = [spec for spec in specs if spec.family == "flash_bwd_sm90"]
    assert code == 1 and asked == specs
    assert _verdict(out).startswith(f"verdict: FAILED - self-check 1/1, compile {len(specs) - len(failures)}/"
                                     f"{len(specs)} sm_90a (0 compiled, {len(specs) - len(failures)} loaded")
    assert out.count("  FAIL  flash_bwd_sm90 ") == len(failures)
    assert "RuntimeError: no backward today" in out and "second line" not in out
    assert out.count("/{len(specs)} ") <= 11  # the progress: a line per tenth, not one per variant


def test_main_job_options_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--all", "--no-compile"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_progress_redraws_on_a_terminal_and_prints_tenths_elsewhere():
    log = io.StringIO()
    progress = cli.Progress(25, log)
    for done in range(1, 26):
        progress.update(done, "variant " + "x" * 200)
    lines = log.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("  [" + "#" * 24 + "] 25/25")
    assert max(map(len, lines)) <= 100 and "left" in lines[0]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    progress = cli.Progress(3, screen)
    for done in range(1, 4):
        progress.update(done)
    assert screen.getvalue().count("\r") == 3 and screen.getvalue().count("\n") == 1


def test_short_names_are_short_distinct_and_one_per_family():
    from torch_cute_ops.runtime import shipped_specs

    for arch in ("sm_90a", "sm_100a"):
        specs = shipped_specs(arch)
        names = [cli.short_name(spec) for spec in specs]
        assert len(set(names)) == len(specs) and max(map(len, names)) <= 90
        assert [spec.family for spec in cli.representative_specs(arch)] == list(dict.fromkeys(
            spec.family for spec in specs))
    gemm = shipped_specs("sm_90a", "gemm_sm90")[0]
    assert cli.short_name(gemm) == f"gemm_sm90 ab=bf16 out=bf16 tile=128x256 #{gemm.digest[:8]}"


def test_help_prints_no_warning():
    proc = subprocess.run([sys.executable, "-W", "default", "-m", "torch_cute_ops", "--help"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--no-compile" in proc.stdout
    assert proc.stderr == ""


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


@pytest.mark.slow
def test_compile_command_writes_one_ptx_per_variant(tmp_path):
    """sm_100a here (test_gemm_sm100_ptx compiles the same variants in-process by default); the
    sm_90a variants are compiled (with their PTX) by the aot test below."""
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


@pytest.mark.slow
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
