"""Sustained throughput beside the GPU's SM clock and board power.

A provider runs back to back for a few seconds while ``nvidia-smi`` samples the clock and the
power draw; the first samples (the clock still settling) are dropped. Where every provider sits
at the board's power limit, TFLOP/s is energy efficiency times that limit, so the table also
gives TFLOP/s per watt and per GHz: which of the two a gap comes from. ``do_bench`` medians
(the timing tables) stay the figures of record; these loops say why they are what they are.
"""

from __future__ import annotations

import statistics
import subprocess
import time

SMI_QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,power.limit", "--format=csv,noheader,nounits",
             "-lms", "100"]
SETTLE_SAMPLES = 4  # 0.4 s


def parse_samples(text: str, settle: int = SETTLE_SAMPLES) -> list[tuple[float, float, float]]:
    """(SM MHz, watts, power limit W) per sample line of ``SMI_QUERY``'s output, the first
    ``settle`` dropped; lines that are not three numbers (a sampling hiccup: "[N/A]") are skipped."""
    samples = []
    for line in text.strip().splitlines():
        try:
            clock, watts, limit = (float(field) for field in line.split(","))
        except ValueError:
            continue
        samples.append((clock, watts, limit))
    return samples[settle:]


def sustained(fn, seconds: float = 2.0, batch: int = 20) -> dict:
    """Calls per second of ``fn`` run back to back for ``seconds`` (in batches between syncs),
    with the median SM clock, power draw and power limit sampled meanwhile (None without
    nvidia-smi)."""
    import torch

    fn()
    torch.cuda.synchronize()
    try:
        smi = subprocess.Popen(SMI_QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        smi = None
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()
        calls += batch
    elapsed = time.perf_counter() - start
    result = {"calls_per_s": calls / elapsed, "sm_mhz": None, "watts": None, "limit_w": None}
    if smi is not None:
        smi.terminate()
        samples = parse_samples(smi.communicate()[0])
        if samples:
            result.update({key: statistics.median(s[i] for s in samples)
                           for i, key in enumerate(("sm_mhz", "watts", "limit_w"))})
    return result


def power_rows(calls: dict, flops: float, passes: int = 2, seconds: float = 2.0) -> dict:
    """``{name: {tflops, sm_mhz, watts, limit_w, tflops_per_ghz, tflops_per_w}}``: each call's
    sustained loop, the providers alternating over ``passes`` passes, means over the passes."""
    runs = {name: [] for name in calls}
    for _ in range(passes):
        for name, fn in calls.items():
            runs[name].append(sustained(fn, seconds))
    rows = {}
    for name, results in runs.items():
        row = {"tflops": statistics.mean(r["calls_per_s"] for r in results) * flops / 1e12}
        for key in ("sm_mhz", "watts", "limit_w"):
            values = [r[key] for r in results if r[key] is not None]
            row[key] = statistics.mean(values) if values else None
        row["tflops_per_ghz"] = row["tflops"] / row["sm_mhz"] * 1e3 if row["sm_mhz"] else None
        row["tflops_per_w"] = row["tflops"] / row["watts"] if row["watts"] else None
        rows[name] = row
    return rows


def power_table(shapes, make_calls, passes: int = 2) -> list:
    """For each GEMM shape (M, N, K): ``make_calls(m, n, k)``'s providers through
    :func:`power_rows`, printed as they finish; the rows, as JSON-ready dicts."""
    print("\nsustained, back to back (SM clock and board power sampled meanwhile)")
    table = []
    for m, n, k in shapes:
        rows = power_rows(make_calls(m, n, k), 2 * m * n * k, passes)
        table.append({"shape": [m, n, k], "rows": rows})
        print(format_row(f"{m} x {n} x {k}", rows))
    return table


def format_row(label: str, rows: dict) -> str:
    """One line: per provider TFLOP/s, MHz, W and TFLOP/s per watt."""
    parts = [f"{label:>22}"]
    for name, row in rows.items():
        if row["sm_mhz"] is None:
            parts.append(f"{name} {row['tflops']:5.0f}")
        else:
            parts.append(f"{name} {row['tflops']:5.0f} TF {row['sm_mhz']:5.0f} MHz {row['watts']:4.0f} W "
                         f"{row['tflops_per_w']:.3f} TF/W")
    return " | ".join(parts)
