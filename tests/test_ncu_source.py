"""bench/ncu_source.py: Nsight Compute's SASS source page (CSV) read into stall reasons, an opcode
mix and the hottest instructions (the parsing is what can break; a GPU is not needed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ncu_source  # noqa: E402

HEADER_A = ",".join(f'"{c}"' for c in ("Address", "Source", "Warp Stall Sampling (All Samples)",
                                           "Instructions Executed", "stall_barrier", "stall_barrier (Not Issued)",
                                           "stall_wait"))
CSV = '''==PROF== Connected to process 1
"Kernel Name","kernel_gemm_a",
{header_a}
"0x10","FFMA R1, R2, R3, R1","5","1,024","0","0","5"
"0x20","WARPGROUP.DEPBAR.LE gsb0, 0x0","30","16","30","12","0"
"0x30","@!P0  SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [R6+URZ], RZ","1","16","0","0","1"
"Kernel Name","kernel_gemm_b",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait"
"0x10","QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ","2","8","2"
'''.format(header_a=HEADER_A)


def test_kernels_rows_and_opcodes():
    first, second = ncu_source.parse(CSV)
    assert (first.name, second.name) == ("kernel_gemm_a", "kernel_gemm_b")
    assert len(first.rows) == 3 and len(second.rows) == 1
    assert first.opcode_counts() == {"FFMA": 1024.0, "WARPGROUP": 16.0, "SYNCS": 16.0}
    assert second.opcode_counts() == {"QGMMA": 8.0}


def test_stalls_exclude_the_not_issued_columns():
    first = ncu_source.parse(CSV)[0]
    assert first.stall_reasons() == {"barrier": 30.0, "wait": 6.0}


def test_hottest_and_report():
    first = ncu_source.parse(CSV)[0]
    (samples, row), = first.hottest(1)
    assert samples == 30.0 and row["Source"].startswith("WARPGROUP.DEPBAR")
    text = ncu_source.report(first, top=2)
    assert "barrier=83.3%" in text and "WARPGROUP.DEPBAR" in text and "FFMA=0.00M" in text


def test_predicated_opcode():
    assert ncu_source.opcode("@!P0  NANOSLEEP.SYNCS 0x989680") == "NANOSLEEP"
    assert ncu_source.opcode("") == ""
