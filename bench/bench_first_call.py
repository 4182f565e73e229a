"""Start-up: import cost, and the first call of each op in fresh processes, three ways.

    python bench/bench_first_call.py [--aot-dir DIR] [--out DIR]

* cold: an empty on-disk cache, so the CuTe DSL compiles each variant;
* warm: the cache the cold process left (shared libraries loaded through TVM-FFI);
* AOT: a prebuilt kernel library (``python -m torch_cute_ops aot``) in ``--aot-dir`` and an
  empty cache; built into a temporary folder first when no folder is given.
Each row also says whether the process imported the CuTe DSL.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch_cute_ops import measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aot-dir", default=None, help="prebuilt library folder (else built here first)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {"import": measure.import_cost()}
    imp = results["import"]
    print(f"import torch {imp['import_torch_s']:.2f} s; "
          f"import torch_cute_ops adds {imp['import_package_s'] * 1e3:.0f} ms"
          f" (heavy modules loaded: {', '.join(imp['heavy_modules']) or 'none'})")
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as aot_tmp, \
            tempfile.TemporaryDirectory() as empty:
        results["cold"] = measure.first_calls(cache)
        results["warm"] = measure.first_calls(cache)
        aot_dir = args.aot_dir
        if aot_dir is None:
            subprocess.run([sys.executable, "-m", "torch_cute_ops", "aot", "--arch", "sm_90a", "--out", aot_tmp],
                           check=True, cwd=ROOT, capture_output=True)
            aot_dir = aot_tmp
        results["aot"] = measure.first_calls(empty, aot_dir)
    print(f"{'op':<16} {'cold: first call':>17} {'warm cache':>11} {'AOT':>9} {'steady (AOT)':>13}")
    for name in (k for k in results["cold"] if not k.startswith("_")):
        cold, warm, aot = (results[m][name] for m in ("cold", "warm", "aot"))
        print(f"{name:<16} {cold['first_s']:>15.2f} s {warm['first_s'] * 1e3:>8.1f} ms {aot['first_s'] * 1e3:>6.1f} ms "
              f"{aot['second_s'] * 1e3:>10.2f} ms")
    for mode in ("cold", "warm", "aot"):
        print(f"{mode}: {results[mode]['_cache']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "first_call.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
