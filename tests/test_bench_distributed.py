"""The multi-GPU training benchmark (bench/bench_distributed.py) as a two-rank gloo smoke run on the
CPU: torchrun launches it, the single-process, FSDP2 and tensor-parallel runs train the recipe
decoder on the reference path, their loss curves agree, no rank falls back, and the summary
reaches DIR/distributed.json. The same script is what runs on two GPUs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_cpu_smoke_run_trains_all_three_ways(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "bench" / "bench_distributed.py"), "--cpu", "--steps", "6", "--timed-steps", "2",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "distributed.json").read_text())
    assert set(result["runs"]) == {"single", "fsdp2", "tp"} and result["world"] == 2
    assert result["problems"] == []
    single = result["runs"]["single"]["losses"]
    assert len(single) == 6 and single[-1] < single[0], single  # it trains
    for name in ("fsdp2", "tp"):
        run = result["runs"][name]
        # float32 on the reference path: the same curve up to reduction order, far inside the tolerance
        assert max(abs(a - b) for a, b in zip(run["losses"], single)) < 1e-3, (name, run["losses"], single)
        assert run["tokens_per_s"] > 0 and run["fallbacks_per_rank"] == [{}, {}]


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_context_parallel_bench_smoke_run(tmp_path):
    """bench/bench_context_parallel.py on two gloo ranks: each rank's part of the output and of
    the gradients matches the unsplit attention's, no fallback, DIR/context_parallel.json written."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "bench" / "bench_context_parallel.py"), "--cpu", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "context_parallel.json").read_text())
    assert result["world"] == 2 and len(result["ranks"]) == 2
    for rank in result["ranks"]:
        assert rank["fallbacks"] == {} and max(rank["errors"].values()) < 1e-5, rank
