"""bench/plot.py: benchmark JSON (each script's own format, or the chart format docs/results/ keeps)
into one chart's shapes and provider columns, and the PNG drawn from it (no GPU needed)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import plot  # noqa: E402


def _write(tmp_path, name, data) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_gemm_json_keeps_each_provider_and_a_refused_shape_as_none(tmp_path):
    raw = {"device": "GPU", "gemm": [{"shape": [128, 4096, 4096], "ours": 300.0, "cublas": 310.0, "quack": None},
                                     {"shape": [4096, 4096, 4096], "ours": 720.0, "cublas": 726.0, "quack": 650.0}]}
    chart = plot.load(_write(tmp_path, "gemm.json", raw))
    assert chart["shapes"] == ["128 x 4096 x 4096", "4096 x 4096 x 4096"]
    assert chart["providers"] == {"cuBLAS": [310.0, 726.0], "QuACK": [None, 650.0], "torch-cute-ops": [300.0, 720.0]}
    assert chart["device"] == "GPU"


def test_attention_json_names_the_pass_and_only_the_providers_that_ran(tmp_path):
    row = {"batch": 4, "seqlen": 4096, "heads": 16, "head_dim": 128, "causal": True,
           "tflops": {"cute": 611.3, "fa4": 575.8}}
    raw = {"meta": {"device": "GPU"}, "rows": [row]}
    chart = plot.load(_write(tmp_path, "attention_bwd.json", raw), "bwd")
    assert chart["title"].startswith("attention backward")
    assert chart["shapes"] == ["B4 S4096 H16 D128 causal"]
    assert chart["providers"] == {"FA4": [575.8], "torch-cute-ops": [611.3]}
    assert plot.load(_write(tmp_path, "attention_fwd.json", raw))["title"].startswith("attention forward")


def test_fp8_and_decode_json(tmp_path):
    fp8 = {"device": "GPU", "rows": [{"shape": [1024, 4096, 4096], "tco row": 1178.6, "torch row": 1110.4,
                                      "tco tensor": 1209.2, "tco block": None, "tco bf16": 720.0}]}
    chart = plot.load(_write(tmp_path, "fp8.json", fp8))
    assert chart["providers"]["tco rowwise"] == [1178.6] and chart["providers"]["tco blockwise"] == [None]
    decode = [{"shape": [8, 4096, 32, 8], "kv_gb_s": {"kvcache graph": 2476.0, "torch graph": 2774.0}}]
    chart = plot.load(_write(tmp_path, "decode.json", decode))
    assert chart["shapes"] == ["B8 Sk4096 32/8"]
    assert chart["providers"] == {"torch SDPA": [2774.0], "torch-cute-ops": [2476.0]}


def test_a_column_of_the_wrong_length_is_refused(tmp_path):
    chart = {"title": "t", "unit": "TFLOP/s", "shapes": ["a", "b"], "providers": {"x": [1.0]}}
    with pytest.raises(ValueError, match="provider 'x' has 1 values for 2 shapes"):
        plot.check(chart, tmp_path / "c.json")
    with pytest.raises(ValueError, match="neither a chart file"):
        plot.load(_write(tmp_path, "other.json", {"something": 1}))


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "results").glob("*.json")), ids=lambda p: p.name)
def test_recorded_results_are_chart_files(path):
    chart = plot.load(path)
    plot.check(chart, path)
    assert chart["device"] and chart["date"]
    assert (ROOT / "docs" / "images" / f"{path.stem}.png").exists()


def test_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    chart = {"title": "t", "unit": "TFLOP/s", "device": "GPU", "date": "2026-11-28", "shapes": ["a", "b"],
             "providers": {"cuBLAS": [1.0, 2.0], "torch-cute-ops": [1.5, None]}, "note": "n"}
    source = _write(tmp_path, "chart.json", chart)
    plot.main([str(source), "--out", str(tmp_path / "images")])
    assert (tmp_path / "images" / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
