"""Summarize Nsight Compute's SASS source page: where a kernel's warps stall, and its instruction mix.

    ncu --clock-control none --nvtx --nvtx-include target/ --section WarpStateStats \\
        --section SourceCounters --page source --print-source sass --csv \\
        python bench/profile_call.py scaled_mm_block > block.csv
    python bench/ncu_source.py block.csv [--top 25]

Prints, per profiled kernel: the stall reasons summed over all instructions (share of the
samples), the executed warp instructions by opcode, and the instructions with the most stall
samples (their top reasons beside them). This is how the blockwise FP8 loop was found
issue-bound (bench/NOTES.md, 2026-11-23, "FP8 under Nsight; first two-GPU run").
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class KernelSource:
    name: str
    rows: list[dict[str, str]] = field(default_factory=list)

    @staticmethod
    def _number(text: str) -> float:
        return float(text.replace(",", "")) if text and text.strip() else 0.0

    def stall_reasons(self) -> dict[str, float]:
        """Samples per stall reason (issued and not), summed over the kernel."""
        totals = collections.Counter()
        for row in self.rows:
            for column, value in row.items():
                if column.startswith("stall_") and "Not Issued" not in column:
                    totals[column.removeprefix("stall_")] += self._number(value)
        return dict(totals.most_common())

    def opcode_counts(self) -> dict[str, float]:
        """Executed warp instructions per opcode (the mnemonic before its first '.')."""
        counts = collections.Counter()
        for row in self.rows:
            counts[opcode(row["Source"])] += self._number(row.get(EXECUTED, ""))
        return dict(counts.most_common())

    def hottest(self, top: int) -> list[tuple[float, dict[str, str]]]:
        """The ``top`` instructions by stall samples, with their sample count."""
        ranked = sorted(((self._number(row.get(SAMPLES, "")), row) for row in self.rows), key=lambda x: -x[0])
        return ranked[:top]


def opcode(source: str) -> str:
    """``@!P0 SYNCS.ARRIVE.TRANS64 RZ, [R6]`` -> ``SYNCS``."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse(text: str) -> list[KernelSource]:
    """The kernels of an ``ncu --page source --csv`` output (ncu's own log lines are skipped)."""
    kernels: list[KernelSource] = []
    header = None
    for record in csv.reader(io.StringIO(text)):
        if not record or record[0].startswith("=="):
            continue
        if record[0] == "Kernel Name":
            kernels.append(KernelSource(record[1] if len(record) > 1 else ""))
            header = None
        elif record[0] == "Address" and kernels:
            header = record
        elif header is not None and len(record) == len(header):
            kernels[-1].rows.append(dict(zip(header, record)))
    return kernels


def report(kernel: KernelSource, top: int) -> str:
    lines = [f"== {kernel.name[:100]}"]
    stalls = kernel.stall_reasons()
    total = sum(stalls.values()) or 1.0
    lines.append("stalls: " + " ".join(f"{name}={value / total:.1%}" for name, value in list(stalls.items())[:10]))
    ops = kernel.opcode_counts()
    lines.append(f"executed: {sum(ops.values()) / 1e6:.1f} M warp instructions; "
                 + " ".join(f"{name}={value / 1e6:.2f}M" for name, value in list(ops.items())[:14]))
    all_samples = sum(KernelSource._number(row.get(SAMPLES, "")) for row in kernel.rows) or 1.0
    for samples, row in kernel.hottest(top):
        reasons = sorted(((KernelSource._number(v), k.removeprefix("stall_")) for k, v in row.items()
                          if k.startswith("stall_") and "Not Issued" not in k), reverse=True)[:3]
        detail = ", ".join(f"{name} {value:.0f}" for value, name in reasons if value > 0)
        lines.append(f"{samples / all_samples:6.1%}  x{KernelSource._number(row.get(EXECUTED, '')):>10.0f}  "
                     f"{row['Source'].strip()[:64]:64}  {detail}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.csv, encoding="utf-8", errors="replace") as f:
        kernels = parse(f.read())
    if not kernels:
        raise SystemExit(f"{args.csv}: no kernel in it (was ncu run with --page source --csv?)")
    print("\n\n".join(report(kernel, args.top) for kernel in kernels))


if __name__ == "__main__":
    main()
