"""Benchmark results as PNG charts: one group of bars per shape, one bar per provider.

    python bench/plot.py RESULT.json [RESULT.json ...] [--out DIR] [--device D] [--date YYYY-MM-DD]

Each input is either a chart file (the format below, as docs/results/ keeps them) or the JSON a
benchmark script writes (bench_gemm.py's gemm.json, bench_fp8.py's fp8.json, bench_attention.py's
attention_fwd.json / attention_bwd.json, bench_decode.py's decode.json), converted to a chart file
first. Writes DIR/<input name>.png (default DIR: the input's folder) and prints its path.

Chart format::

    {"title": "GEMM, bf16", "unit": "TFLOP/s", "device": "NVIDIA H200", "date": "2026-11-28",
     "shapes": ["4096 x 4096 x 4096", ...],
     "providers": {"cuBLAS": [726.6, ...], "torch-cute-ops": [721.4, ...]},
     "note": "optional line under the chart"}

``providers[name][i]`` is the value at ``shapes[i]``; null where a provider did not run a shape
(no bar). Providers named ``torch-cute-ops`` or ``tco ...`` are ours: drawn in warm colours, the
anchors in cool ones, in the order given.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

OURS_COLOURS = ["#d9480f", "#f08c00", "#c2255c", "#e8590c"]
ANCHOR_COLOURS = ["#1c7ed6", "#2b8a3e", "#868e96", "#5f3dc4", "#0b7285"]


def _shape_label(shape) -> str:
    return " x ".join(map(str, shape))


def _from_gemm(raw: dict) -> dict:
    rows = raw["gemm"]
    return {"title": "GEMM, bf16, A (M, K) x B (K, N)", "unit": "TFLOP/s", "device": raw.get("device"),
            "shapes": [_shape_label(r["shape"]) for r in rows],
            "providers": {"cuBLAS": [r.get("cublas") for r in rows], "QuACK": [r.get("quack") for r in rows],
                          "torch-cute-ops": [r.get("ours") for r in rows]}}


def _from_fp8(raw: dict) -> dict:
    rows = raw["rows"]
    columns = {"torch._scaled_mm rowwise": "torch row", "tco rowwise": "tco row", "tco per-tensor": "tco tensor",
               "tco blockwise": "tco block", "tco bf16": "tco bf16"}
    return {"title": "FP8 e4m3 GEMM, bf16 out", "unit": "TFLOP/s", "device": raw.get("device"),
            "shapes": [_shape_label(r["shape"]) for r in rows],
            "providers": {name: [r.get(key) for r in rows] for name, key in columns.items()}}


def _from_attention(raw: dict) -> dict:
    rows = raw["rows"]
    backward = raw.get("kind") == "bwd"
    providers = {"cudnn": "cuDNN", "fa4": "FA4", "sdpa_flash": "SDPA flash", "cute": "torch-cute-ops"}
    present = [key for key in providers if any(key in r["tflops"] for r in rows)]
    return {"title": "attention " + ("backward" if backward else "forward") + ", bf16", "unit": "TFLOP/s",
            "device": raw.get("meta", {}).get("device"),
            "shapes": [f"B{r['batch']} S{r['seqlen']} H{r['heads']} D{r['head_dim']} "
                       f"{'causal' if r['causal'] else 'full'}" for r in rows],
            "providers": {providers[key]: [r["tflops"].get(key) for r in rows] for key in present}}


def _from_decode(rows: list) -> dict:
    names = {"torch graph": "torch SDPA", "fa4 graph": "FA4", "kvcache graph": "torch-cute-ops"}
    return {"title": "decode, one query token, bf16, CUDA-graph replays", "unit": "K/V GB/s", "device": None,
            "shapes": [f"B{b} Sk{s} {hq}/{hkv}" for b, s, hq, hkv in (r["shape"] for r in rows)],
            "providers": {label: [r["kv_gb_s"].get(key) for r in rows] for key, label in names.items()
                          if any(key in r["kv_gb_s"] for r in rows)}}


def load(path: Path, tag: str = "") -> dict:
    """A chart file, or a benchmark script's JSON converted to one (``tag``: "bwd" marks an
    attention file as the backward's, as its name attention_bwd.json does)."""
    raw = json.loads(path.read_text())
    if isinstance(raw, list):
        return _from_decode(raw)
    if "providers" in raw:
        return raw
    if "gemm" in raw:
        return _from_gemm(raw)
    if "rows" in raw and "meta" in raw:
        return _from_attention({**raw, "kind": tag})
    if "rows" in raw:
        return _from_fp8(raw)
    raise ValueError(f"{path}: neither a chart file nor a known benchmark result")


def check(chart: dict, path: Path) -> None:
    for key in ("title", "unit", "shapes", "providers"):
        if key not in chart:
            raise ValueError(f"{path}: missing {key!r}")
    for name, values in chart["providers"].items():
        if len(values) != len(chart["shapes"]):
            raise ValueError(f"{path}: provider {name!r} has {len(values)} values for {len(chart['shapes'])} shapes")


def is_ours(name: str) -> bool:
    return name == "torch-cute-ops" or name.startswith("tco")


def draw(chart: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, providers = chart["shapes"], chart["providers"]
    count = len(providers)
    width = 0.8 / count
    ours, anchors = iter(OURS_COLOURS), iter(ANCHOR_COLOURS)
    fig_width = max(7.0, 0.5 + len(shapes) * (0.35 + 0.28 * count))
    note = textwrap.wrap(chart.get("note") or "", int(fig_width * 17))
    fig, ax = plt.subplots(figsize=(fig_width, 4.6 + 0.14 * len(note)))
    top = max((v for values in providers.values() for v in values if v is not None), default=1.0)
    for i, (name, values) in enumerate(providers.items()):
        colour = next(ours) if is_ours(name) else next(anchors)
        xs = [x + (i - (count - 1) / 2) * width for x in range(len(shapes))]
        kept = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not kept:
            continue
        bars = ax.bar([x for x, _ in kept], [v for _, v in kept], width * 0.95, label=name, color=colour,
                      edgecolor="white", linewidth=0.4)
        for bar, (_, value) in zip(bars, kept):
            ax.text(bar.get_x() + bar.get_width() / 2, value + top * 0.01, f"{value:.0f}", ha="center",
                    va="bottom", rotation=90, fontsize=6.5, color="#343a40")
    ax.set_xticks(range(len(shapes)), shapes, rotation=30 if len(shapes) > 4 else 0, ha="right"
                  if len(shapes) > 4 else "center", fontsize=8)
    ax.set_ylabel(chart["unit"])
    ax.set_ylim(0, top * 1.18)
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#e9ecef", linewidth=0.8)
    ax.set_axisbelow(True)
    where = ", ".join(part for part in (chart.get("device"), chart.get("date")) if part)
    ax.set_title(chart["title"] + (f" \N{EM DASH} {where}" if where else ""), fontsize=11, pad=24)
    ax.legend(fontsize=8, ncol=min(count, 6), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    reserved = 0.03 * len(note) / fig.get_figheight() * 4.6
    if note:
        fig.text(0.01, 0.01, "\n".join(note), fontsize=7, color="#495057", va="bottom")
    fig.tight_layout(rect=(0, reserved, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="chart files or benchmark JSON")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: beside each input)")
    parser.add_argument("--device", default=None, help="device named in the title (benchmark JSON without one)")
    parser.add_argument("--date", default=None, help="date named in the title, YYYY-MM-DD")
    args = parser.parse_args(argv)
    for path in args.inputs:
        chart = load(path, "bwd" if "bwd" in path.stem else "")
        for key in ("device", "date"):
            if getattr(args, key):
                chart[key] = getattr(args, key)
        check(chart, path)
        folder = args.out or path.parent
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / f"{path.stem}.png"
        draw(chart, out)
        print(out)


if __name__ == "__main__":
    main()
