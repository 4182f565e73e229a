"""bench/power.py's reading of nvidia-smi samples and its summary, on the CPU: the settling
samples are dropped, unreadable lines skipped, and TFLOP/s per watt and per GHz follow from the
loop's call rate and the medians."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import power  # noqa: E402


def test_parse_samples_drops_settling_and_unreadable_lines():
    text = "\n".join(["1980, 120.5, 700.00"] * 4 + ["1350, 698.2, 700.00", "[N/A], [N/A], [N/A]",
                                                     "1365, 699.9, 700.00", ""])
    assert power.parse_samples(text) == [(1350.0, 698.2, 700.0), (1365.0, 699.9, 700.0)]
    assert power.parse_samples(text, settle=0)[0] == (1980.0, 120.5, 700.0)


def test_power_rows_average_passes(monkeypatch):
    readings = iter([{"calls_per_s": 100.0, "sm_mhz": 1400.0, "watts": 700.0, "limit_w": 700.0},
                     {"calls_per_s": 50.0, "sm_mhz": None, "watts": None, "limit_w": None},
                     {"calls_per_s": 120.0, "sm_mhz": 1600.0, "watts": 690.0, "limit_w": 700.0},
                     {"calls_per_s": 70.0, "sm_mhz": None, "watts": None, "limit_w": None}])
    monkeypatch.setattr(power, "sustained", lambda fn, seconds: next(readings))
    rows = power.power_rows({"a": None, "b": None}, flops=1e12, passes=2)
    assert rows["a"]["tflops"] == 110.0 and rows["a"]["sm_mhz"] == 1500.0 and rows["a"]["watts"] == 695.0
    assert abs(rows["a"]["tflops_per_w"] - 110.0 / 695.0) < 1e-12
    assert abs(rows["a"]["tflops_per_ghz"] - 110.0 / 1.5) < 1e-9
    # no samples (no nvidia-smi): the rate alone, the rest None, and the line still prints
    assert rows["b"]["tflops"] == 60.0 and rows["b"]["tflops_per_w"] is None
    line = power.format_row("8192 x 8192 x 8192", rows)
    assert "a   110 TF  1500 MHz  695 W 0.158 TF/W" in line and line.endswith("b    60")


def test_power_table_runs_each_shape_once(monkeypatch, capsys):
    built = []

    def make_calls(m, n, k):
        built.append((m, n, k))
        return {"p": None}

    monkeypatch.setattr(power, "sustained", lambda fn, seconds: {"calls_per_s": 10.0, "sm_mhz": None,
                                                                  "watts": None, "limit_w": None})
    table = power.power_table([(2, 3, 5), (7, 11, 13)], make_calls, passes=1)
    assert built == [(2, 3, 5), (7, 11, 13)]
    assert [row["shape"] for row in table] == [[2, 3, 5], [7, 11, 13]]
    assert table[1]["rows"]["p"]["tflops"] == 10.0 * 2 * 7 * 11 * 13 / 1e12
    assert "7 x 11 x 13" in capsys.readouterr().out
