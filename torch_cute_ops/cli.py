"""``python -m torch_cute_ops``: the main job, and the ``compile`` command.

    python -m torch_cute_ops [--all | --no-compile]
        environment report, which kernels serve this machine, a self-check of every op
        against its reference, and (with a GPU) a short timing table against PyTorch;
        without a GPU, a compile check for sm_90a: one variant per kernel family (--all:
        every shipped variant; --no-compile: none), built into the on-disk kernel cache, so
        a second run loads them. Ends with a one-line verdict; exit status 1 if anything failed.

    python -m torch_cute_ops compile --arch {sm_90a,sm_100a} [--kernel NAME] --ptx-dir DIR
        compiles every kernel variant the package ships for that arch (no GPU needed), writes
        one .ptx (and .cubin) per variant named by kernel and config, and prints the variants
        with counts of the key instructions.

    python -m torch_cute_ops aot --arch sm_90a [--arch sm_100a] --out DIR [--ptx-dir DIR]
        builds the ahead-of-time kernel library (no GPU needed): every shipped variant of each
        arch in DIR/<arch>/libtorch_cute_ops_<arch>.so plus DIR/<arch>/manifest.json. Point
        TORCH_CUTE_OPS_AOT_DIR at DIR, or build into torch_cute_ops/_aot before building a
        wheel, and processes load those kernels without importing the CuTe DSL.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

KEY_INSTRUCTIONS = ("wgmma.mma_async", "tcgen05.mma", "cp.async.bulk.tensor", "setmaxnreg")


def count_instructions(ptx: str, names=KEY_INSTRUCTIONS) -> dict[str, int]:
    """Instruction lines per mnemonic prefix (an optional ``@p`` predicate may precede)."""
    counts = dict.fromkeys(names, 0)
    for line in ptx.splitlines():
        match = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)", line)
        if match:
            op = match.group(1)
            for name in names:
                if op.startswith(name):
                    counts[name] += 1
    return counts


def _dump_rows(spec, seconds: float, dump: Path, ptx_dir: Path) -> dict:
    """Copy a compiled variant's PTX and cubin to ``ptx_dir``; its row of the report."""
    ptx = "\n".join(p.read_text() for p in sorted(Path(dump).glob("*.ptx")))
    cubins = sorted(Path(dump).glob("*.cubin"))
    (ptx_dir / f"{spec.name}.ptx").write_text(ptx)
    for i, cubin in enumerate(cubins):
        shutil.copy(cubin, ptx_dir / f"{spec.name}{'' if i == 0 else f'.{i}'}.cubin")
    return {"variant": spec.name, "family": spec.family, "seconds": seconds, "cubin": bool(cubins),
            "target": spec.arch in ptx, **count_instructions(ptx)}


def compile_variants(arch: str, ptx_dir: Path, kernel: str | None = None, out=sys.stdout) -> list[dict]:
    """Compile every shipped variant for ``arch`` into ``ptx_dir``; return one row per variant."""
    from .kernels import compile_spec
    from .runtime import shipped_specs

    specs = shipped_specs(arch, kernel)
    if not specs:
        print(f"no kernel variants for {arch}" + (f" matching {kernel!r}" if kernel else ""), file=out)
        return []
    ptx_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in specs:
        with tempfile.TemporaryDirectory() as dump:
            start = time.perf_counter()
            compile_spec(spec, dump_dir=dump)
            rows.append(_dump_rows(spec, time.perf_counter() - start, Path(dump), ptx_dir))
        _print_row(rows[-1], out, header=len(rows) == 1)
    return rows


def build_aot(arches: list[str], out_dir: Path, ptx_dir: Path | None = None, out=sys.stdout) -> list[Path]:
    """``aot``: one library + manifest per arch under ``out_dir``; PTX/cubin to ``ptx_dir`` too."""
    from .runtime import aot, shipped_specs

    manifests = []
    for arch in arches:
        rows: list[dict] = []

        def report(spec, seconds, dump):
            if ptx_dir is not None:
                ptx_dir.mkdir(parents=True, exist_ok=True)
                rows.append(_dump_rows(spec, seconds, dump, ptx_dir))
                _print_row(rows[-1], out, header=len(rows) == 1)
            else:
                print(f"{seconds:5.1f}  {spec.symbol}  {spec.name}", file=out)

        manifest = aot.build_library(arch, out_dir, shipped_specs(arch), report, ptx_dir)
        library = aot.library_path(out_dir, arch)
        print(f"{arch}: {library} ({library.stat().st_size / 1024:.0f} KiB), manifest {manifest}", file=out)
        manifests.append(manifest)
    return manifests


def _print_row(row: dict, out, header: bool) -> None:
    """Counts first, then the variant's full name (names are long: tile, cluster, flags)."""
    if header:
        print(f"{'s':>5} " + " ".join(f"{c:>20}" for c in KEY_INSTRUCTIONS) + "  variant", file=out)
    print(f"{row['seconds']:5.1f} " + " ".join(f"{row[c]:>20}" for c in KEY_INSTRUCTIONS) + f"  {row['variant']}",
          file=out)


# ----------------------------------------------------------------------------- main job

def _environment() -> list[tuple[str, str]]:
    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("torch CUDA", str(torch.version.cuda))]
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            from importlib.metadata import version

            rows.append((dist, version(dist)))
        except Exception:
            rows.append((dist, "not installed"))
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        rows.append(("GPU", f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}, "
                            f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)"))
    else:
        rows.append(("GPU", "none"))
    return rows


def _kernels_here(device: torch.device) -> list[tuple[str, str]]:
    from .ops import dispatch

    rows = []
    for op in ("gemm", "grouped_mm", "flash_attn_fwd", "flash_attn_bwd"):
        host = dispatch.kernel_for(op, device)
        rows.append((op, host if isinstance(host, str) else f"kernel ({getattr(host, 'arch', 'sm_90a')})"))
    gemm_row = rows[0][1]  # FP8 rides on the GEMM kernel of sm_90a only
    rows.append(("scaled_gemm", "kernel (sm_90a)" if _fp8_kernel_here(device) else
                 gemm_row if not gemm_row.startswith("kernel") else "no FP8 variant here: the reference path"))
    return rows


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def self_check(device: torch.device) -> list[tuple[str, float, float]]:
    """(check, relative error, bound) for every op on fresh random inputs vs the fp64 reference."""
    from . import functional
    from .reference import attention as ref_attn
    from .reference import gemm as ref_gemm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bound = 2e-2 if dtype == torch.bfloat16 else 1e-5
    gen = torch.Generator(device=device).manual_seed(int(time.time()))

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    rows = []
    a, b, bias = randn(2, 333, 264), randn(2, 264, 520), randn(520)
    for act, alpha in ((None, 1.0), ("gelu_tanh", 1.0), ("gelu_tanh", 0.5)):
        out = functional.gemm(a, b, bias, act, alpha=alpha)
        ref = ref_gemm.gemm(a.double(), b.double(), bias.double(), act, torch.float64, alpha)
        rows.append((f"gemm bias act={act} alpha={alpha} (2x333x520x264)", _rel_err(out, ref), bound))
    # column-major operands need a 16-byte-aligned leading dim (M, K) for the TMA: 344, 264
    a_cm, b_cm = randn(264, 344).mT, randn(520, 264).mT
    out = functional.gemm(a_cm, b_cm)
    rows.append(("gemm column-major a, b (344x520x264)", _rel_err(out, a_cm.double() @ b_cm.double()), bound))

    rows += _fp8_self_check(device, gen)
    rows += _grouped_self_check(randn, bound)

    q, k, v = randn(2, 300, 8, 128), randn(2, 257, 2, 128), randn(2, 257, 2, 128)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    for causal in (False, True):
        out, lse = functional.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        ref_out, ref_lse = ref_attn.flash_attn_fwd(q.double(), k.double(), v.double(), 128 ** -0.5, causal)
        rows.append((f"flash_attn fwd out causal={causal} (GQA 4, 300x257)", _rel_err(out, ref_out), bound))
        finite = torch.isfinite(ref_lse)
        rows.append((f"flash_attn fwd lse causal={causal}", _rel_err(lse[finite], ref_lse[finite]), bound))
        dout = randn(*out.shape)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref_grads = ref_attn.flash_attn_bwd(dout.double(), q.double(), k.double(), v.double(), ref_out,
                                            ref_lse, 128 ** -0.5, causal)
        for name, g, r in zip("qkv", grads, ref_grads):
            rows.append((f"flash_attn bwd d{name} causal={causal}", _rel_err(g, r), 2 * bound))
    # a sliding window with soft-capping (Gemma 2's layers), forward and backward
    out = functional.flash_attn_func(q, k, v, causal=True, window_size=(63, 0), softcap=20.0)
    ref_out, ref_lse = ref_attn.flash_attn_fwd(q.double(), k.double(), v.double(), 128 ** -0.5, True, 63, None, 20.0)
    rows.append(("flash_attn fwd window (63, 0) softcap 20", _rel_err(out, ref_out), bound))
    dout = randn(*out.shape)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = ref_attn.flash_attn_bwd(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse,
                                        128 ** -0.5, True, 63, None, 20.0)
    for name, g, r in zip("qkv", grads, ref_grads):
        rows.append((f"flash_attn bwd d{name} window (63, 0) softcap 20", _rel_err(g, r), 2 * bound))
    return rows


def _grouped_self_check(randn, bound: float) -> list[tuple[str, float, float]]:
    """grouped_mm's MoE forms (groups of 0, 1, a prime and more than a tile of rows) and fused
    SwiGLU against the float64 reference loop."""
    from . import functional
    from .reference import grouped_gemm as ref_grouped

    offs = torch.tensor([0, 1, 131, 131, 300], dtype=torch.int32, device=randn(1).device).cumsum(0, dtype=torch.int32)
    x, w, dy = randn(600, 264), randn(5, 520, 264), randn(600, 520)
    rows = []
    out = functional.grouped_mm(x, w.transpose(-2, -1), offs)
    ref = ref_grouped.grouped_mm(x.double(), w.transpose(-2, -1).double(), offs, None, torch.float64)
    rows.append(("grouped_mm rows grouped (5 experts, 563 of 600 rows, 520x264)", _rel_err(out, ref), bound))
    out = functional.grouped_mm(x.t(), dy, offs)
    ref = ref_grouped.grouped_mm(x.t().double(), dy.double(), offs, None, torch.float64)
    rows.append(("grouped_mm K grouped, a weight gradient (5x264x520)", _rel_err(out, ref), bound))
    for layout in ("concat", "interleaved"):
        out = functional.grouped_mm(x, w.transpose(-2, -1), offs, activation="swiglu", gate_up_layout=layout)
        pre = ref_grouped.grouped_mm(x.double(), w.transpose(-2, -1).double(), offs, None, torch.float64)
        ref = ref_grouped.swiglu(pre, layout)
        rows.append((f"grouped_mm swiglu {layout} gate/up", _rel_err(out, ref), bound))
    return rows


def _fp8_self_check(device: torch.device, gen: torch.Generator) -> list[tuple[str, float, float]]:
    """scaled_mm in each scale mode (fp32 out) against float64 of the dequantized operands."""
    from . import fp8, functional
    from .reference.scaled_gemm import dequantize

    # fp32 out: what is left is the FP8 tensor cores' accumulation (kernel) or fp32 rounding (CPU)
    bound = 2e-3 if device.type == "cuda" else 1e-5
    x = torch.randn(333, 512, device=device, generator=gen)
    w = torch.randn(264, 512, device=device, generator=gen)  # an nn.Linear (N, K) weight
    rows = []
    for mode, quantize in (("tensor", fp8.quantize_tensorwise), ("row", fp8.quantize_rowwise),
                           ("block", fp8.quantize_blockwise)):
        (qa, sa), (qb, sb) = quantize(x), quantize(w.t(), operand="b")
        out = functional.scaled_mm(qa, qb, sa, sb, out_dtype=torch.float32)
        ref = dequantize(qa, sa, mode, "a").double() @ dequantize(qb, sb, mode, "b").double()
        rows.append((f"scaled_mm e4m3 {mode} scales (333x264x512)", _rel_err(out, ref), bound))
    return rows


def _timing_table(device: torch.device) -> list[tuple[str, float, float]]:
    """(case, ms of torch_cute_ops, ms of PyTorch) on a few representative sizes."""
    import torch.nn.functional as F

    from . import functional

    try:
        from triton.testing import do_bench
    except ImportError:
        return []

    def bench(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    dt = torch.bfloat16
    a, b = torch.randn(4096, 4096, device=device, dtype=dt), torch.randn(4096, 4096, device=device, dtype=dt)
    bias = torch.randn(4096, device=device, dtype=dt)
    rows = [("gemm 4096^3 bf16", bench(lambda: functional.gemm(a, b)), bench(lambda: a @ b)),
            ("gemm+bias+gelu 4096^3", bench(lambda: functional.gemm(a, b, bias, "gelu_tanh")),
             bench(lambda: F.gelu(torch.addmm(bias, a, b), approximate="tanh")))]
    if _fp8_kernel_here(device):
        from . import fp8

        (qa, sa), (qb, sb) = fp8.quantize_rowwise(a), fp8.quantize_rowwise(b.t().contiguous().t(), operand="b")
        rows.append(("scaled_mm 4096^3 e4m3 rowwise", bench(lambda: functional.scaled_mm(qa, qb, sa, sb)),
                     bench(lambda: torch._scaled_mm(qa, qb, sa, sb, out_dtype=dt))))
    q = torch.randn(4, 16, 4096, 128, device=device, dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)
    for causal in (False, True):
        rows.append((f"sdpa fwd B4 H16 S4096 D128 causal={causal}",
                     bench(lambda: functional_sdpa(q, k, v, causal)),
                     bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))))
    return rows


def _fp8_kernel_here(device: torch.device) -> bool:
    from .ops import dispatch

    host = dispatch.kernel_for("gemm", device)
    return not isinstance(host, str) and host.arch == "sm_90a"


def functional_sdpa(q, k, v, causal):
    from .sdpa import scaled_dot_product_attention

    return scaled_dot_product_attention(q, k, v, is_causal=causal)


def _kernel_sources(arch: str) -> list[tuple[str, str]]:
    """Where kernels come from in a new process: prebuilt libraries, then the on-disk cache."""
    from .runtime import cache

    rows = []
    for folder in cache.aot_dirs():
        found = cache.check_prebuilt(folder / arch / "manifest.json")  # what get_compiled would make of it
        if found is None:
            rows.append((f"prebuilt ({arch})", f"none in {folder}"))
        elif isinstance(found, str):
            rows.append((f"prebuilt ({arch})", f"in {folder}, not used: {found}"))
        else:
            rows.append((f"prebuilt ({arch})", f"{len(found.symbols)} variants in {folder} (used)"))
    root = cache.cache_dir()
    libraries = len(list(root.glob("v*/*.so"))) if root is not None and root.is_dir() else 0
    rows.append(("on-disk cache", "off" if root is None else f"{root} ({libraries} kernel libraries)"))
    return rows


def _startup_report(device: torch.device) -> None:
    from . import measure
    from .runtime import cache

    print("== start-up")
    # a run is two fresh processes importing torch (seconds on a small CPU): one run without a GPU
    imp = measure.import_cost(runs=3 if device.type == "cuda" else 1)
    heavy = ", ".join(imp["heavy_modules"]) or "neither torch._dynamo nor the CuTe DSL"
    print(f"  {'import torch_cute_ops':<20} +{imp['import_package_s'] * 1e3:.0f} ms over import torch "
          f"({imp['import_torch_s']:.2f} s); loads {heavy}")
    for key, value in _kernel_sources("sm_90a" if device.type != "cuda" or torch.cuda.get_device_capability()[0] == 9
                                      else "sm_100a"):
        print(f"  {key:<20} {value}")
    if device.type != "cuda":
        return
    root = cache.cache_dir()
    first = measure.first_calls(str(root) if root is not None else "off")
    print(f"  {'first call':<20} fresh process with this machine's caches: " + ", ".join(
        f"{name} {row['first_s'] * 1e3:.1f} ms" for name, row in first.items() if not name.startswith("_"))
        + f" ({first['_cache']})")
    for case, row in measure.host_times().items():
        base_name, base = next(iter(row.items()))
        print(f"  {'host us/call':<20} {case}: " + ", ".join(
            f"{name} {us:.1f} ({us / base:.2f}x)" for name, us in row.items()))


SHORT_NAME_KEYS = ("ab", "dtype", "out", "scale", "head_dim", "causal", "rows", "tile")


def short_name(spec) -> str:
    """A variant in a few words (full names run past 150 characters): its family, its main
    parameters and the start of its digest (which the kernel cache's file names carry)."""
    words = [spec.family]
    for key in SHORT_NAME_KEYS:
        value = spec.get(key)
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, (tuple, list)):
            value = "x".join(map(str, value))
        if value is not None:
            words.append(f"{key}={value}")
    return " ".join(words) + f" #{spec.digest[:8]}"


def representative_specs(arch: str) -> list:
    """The first shipped variant of each kernel family of ``arch``."""
    from .runtime import shipped_specs

    first: dict = {}
    for spec in shipped_specs(arch):
        first.setdefault(spec.family, spec)
    return list(first.values())


class Progress:
    """A one-line progress bar: redrawn in place on a terminal, else printed at each tenth."""

    def __init__(self, total: int, out=None, width: int = 24):
        self.total, self.out, self.width = total, out or sys.stdout, width
        self.start = time.perf_counter()
        self.tty = getattr(self.out, "isatty", lambda: False)()
        self.tenths_shown = 0

    def update(self, done: int, note: str = "") -> None:
        elapsed = time.perf_counter() - self.start
        filled = self.width * done // self.total
        line = f"  [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {elapsed:.0f} s"
        if 0 < done < self.total:
            line += f", ~{elapsed / done * (self.total - done):.0f} s left"
        line = (line + f"  {note}")[:100] if note else line
        if self.tty:
            print("\r" + line.ljust(100), end="\n" if done == self.total else "", file=self.out, flush=True)
        elif done == self.total or 10 * done // self.total > self.tenths_shown:
            self.tenths_shown = 10 * done // self.total
            print(line, file=self.out, flush=True)


def compile_check(specs: list, out=None) -> list[tuple]:
    """Build each variant through the kernel cache (memory, prebuilt, on-disk, else compile and
    store); one (variant, seconds, where it came from, error or None) per variant."""
    from .runtime import cache

    progress = Progress(len(specs), out)
    rows = []
    for done, spec in enumerate(specs, 1):
        before = (cache.stats.memory_hits, cache.stats.aot_hits, cache.stats.disk_hits, cache.stats.compiles)
        start, error = time.perf_counter(), None
        try:
            cache.get_compiled(spec)
        except Exception as err:  # noqa: BLE001 (reported per variant; the verdict counts it)
            first_line = (str(err).strip().splitlines() or [""])[0]
            error = f"{type(err).__name__}: {first_line[:200]}"
        after = (cache.stats.memory_hits, cache.stats.aot_hits, cache.stats.disk_hits, cache.stats.compiles)
        grown = [name for name, b, a in zip(("in memory", "prebuilt", "cached", "compiled"), before, after) if a > b]
        source = "failed" if error else grown[-1] if grown else "ready"
        rows.append((spec, time.perf_counter() - start, source, error))
        progress.update(done, f"{spec.family} #{spec.digest[:8]}")
    return rows


def _compile_arch(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "sm_90a"
    return {9: "sm_90a", 10: "sm_100a"}.get(torch.cuda.get_device_capability()[0])


def _run_compile_check(arch: str, every: bool) -> tuple[int, str]:
    """The compile check's section; (failures, its words for the verdict)."""
    from .runtime import cache, shipped_specs

    total = len(shipped_specs(arch))
    specs = shipped_specs(arch) if every else representative_specs(arch)
    which = f"all {total}" if every else f"{len(specs)} of {total}"
    note = "" if every else " (one per kernel family; --all: every one)"
    if cache.cache_dir() is None:
        note += " (on-disk cache off: nothing kept)"
    print(f"== compile check: {which} {arch} variants{note}")
    rows = compile_check(specs)
    if len(rows) <= 8:
        for spec, seconds, source, _ in rows:
            print(f"  {seconds:4.1f} s {source:<9} {short_name(spec)}")
    failed = [(spec, error) for spec, _, _, error in rows if error is not None]
    for spec, error in failed:
        print(f"  FAIL  {short_name(spec)}: {error}")
    built = sum(source == "compiled" for _, _, source, _ in rows)
    summary = (f"compile {len(rows) - len(failed)}/{len(rows)} {arch} ({built} compiled, "
               f"{len(rows) - built - len(failed)} loaded, {sum(row[1] for row in rows):.0f} s)")
    return len(failed), summary


def main_job(compile_scope: str = "few") -> int:
    """``compile_scope``: "few" (one variant per family, without a GPU), "all" or "none"."""
    print("== environment")
    for key, value in _environment():
        print(f"  {key:<20} {value}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _startup_report(device)
    print(f"== kernels serving {device}")
    for op, what in _kernels_here(device):
        print(f"  {op:<20} {what}")
    print(f"== self-check on {device} against the float64 reference")
    checks = self_check(device)
    failed = 0
    for name, err, bound in checks:
        ok = err <= bound
        failed += not ok
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<52} rel err {err:.2e} (bound {bound:.0e})")
    verdict = [f"self-check {len(checks) - failed}/{len(checks)}"]
    if device.type == "cuda":
        print("== timing (median ms, triton.testing.do_bench)")
        print(f"  {'case':<44} {'cute':>8} {'torch':>8} {'speedup':>8}")
        for name, ours, theirs in _timing_table(device):
            print(f"  {name:<44} {ours:8.3f} {theirs:8.3f} {theirs / ours:7.2f}x")
    arch = _compile_arch(device)
    compile_failed = 0
    if arch is not None and (compile_scope == "all" or (compile_scope == "few" and device.type != "cuda")):
        compile_failed, summary = _run_compile_check(arch, compile_scope == "all")
        verdict.append(summary)
    bad = failed + compile_failed
    print(f"verdict: {'OK' if not bad else 'FAILED'} - " + ", ".join(verdict))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_cute_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    comp = sub.add_parser("compile", help="compile every shipped kernel variant for an arch, without a GPU")
    comp.add_argument("--arch", required=True, choices=("sm_90a", "sm_100a"))
    comp.add_argument("--kernel", default=None, help="only the variants of this family (e.g. gemm, gemm_sm90)")
    comp.add_argument("--ptx-dir", required=True, type=Path)
    aot = sub.add_parser("aot", help="build the ahead-of-time kernel library of every shipped variant")
    aot.add_argument("--arch", required=True, action="append", choices=("sm_90a", "sm_100a"))
    aot.add_argument("--out", required=True, type=Path)
    aot.add_argument("--ptx-dir", type=Path, default=None, help="also keep each variant's PTX and cubin here")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--all", dest="compile_scope", action="store_const", const="all", default="few",
                       help="main job: compile every shipped variant, not one per kernel family")
    scope.add_argument("--no-compile", dest="compile_scope", action="store_const", const="none",
                       help="main job: skip the compile check")
    args = parser.parse_args(argv)
    if args.command == "compile":
        rows = compile_variants(args.arch, args.ptx_dir, args.kernel)
        return 0 if rows else 1
    if args.command == "aot":
        build_aot(list(dict.fromkeys(args.arch)), args.out, args.ptx_dir)
        return 0
    return main_job(args.compile_scope)
