"""Per-call host time of thin eager calls, through the public API, against PyTorch.

    python bench/bench_host.py [--calls N] [--out DIR] [--decode]

Tiny problems (gemm 64^3 bf16, attention B1 S128 H8 D64), where the host path is all there
is: wall time per call of an eager loop ending on a sync, median of 5 rounds. Columns: the
PyTorch call, the public function, the op through the dispatcher, the bare kernel launch.
``--decode``: one decode step's attention (B8, GQA 32/8, D128, 256 keys), wall and GPU-stream
time per call (where the time goes: host or device), and with the keys growing every call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_cute_ops import measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--decode", action="store_true", help="the decode-step breakdown instead")
    args = parser.parse_args()
    if args.decode:
        decode = measure.decode_host_times(args.calls)
        for name, (wall, gpu) in decode.items():
            print(f"decode B8 GQA 32/8 D128, 256 keys: {name}: wall {wall:.1f} us, GPU stream {gpu:.1f} us per call")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "host_decode.json").write_text(json.dumps(decode, indent=2))
        return
    results = measure.host_times(args.calls)
    for case, row in results.items():
        base = next(iter(row.values()))
        print(f"{case}: " + ", ".join(f"{name} {us:.1f} us ({us / base:.2f}x)" for name, us in row.items()))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
