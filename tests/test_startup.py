"""Start-up: importing the package is cheap and loads neither torch._dynamo nor the CuTe DSL;
the public functions bypass the dispatcher only when nothing could observe the difference."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_cute_ops as tco
from torch_cute_ops.ops.direct import dispatcher_free

ROOT = Path(__file__).resolve().parents[1]


def _importtime(module: str) -> dict[str, int]:
    """{module: cumulative us} from ``python -X importtime -c 'import module'``."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    found = {}
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line.removeprefix("import time:").split("|")
            if cumulative.strip().isdigit():
                found[name.strip()] = int(cumulative)
    return found


def test_import_loads_neither_dynamo_nor_the_dsl():
    modules = _importtime("torch_cute_ops")
    assert "torch_cute_ops" in modules
    assert "torch._dynamo" not in modules
    assert not [m for m in modules if m == "cutlass" or m.startswith("cutlass.")]


def test_import_adds_little_to_torch():
    modules = _importtime("torch_cute_ops")
    ours = modules["torch_cute_ops"] - modules["torch"]  # torch is imported inside the package
    assert ours < 300_000, f"import torch_cute_ops adds {ours / 1e3:.0f} ms to import torch"


def test_dispatcher_free_only_when_nothing_observes_the_call():
    a = torch.randn(4, 4)
    assert dispatcher_free(a, a, None)
    w = torch.randn(4, 4, requires_grad=True)
    assert not dispatcher_free(a, w)  # autograd must record the op
    with torch.no_grad():
        assert dispatcher_free(a, w)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(a)
        assert not dispatcher_free(fake)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        assert not dispatcher_free(a)
        tco.gemm(a, a)  # goes through the op, so the mode sees it
    assert "cute.gemm.default" in recorder.ops


def test_public_functions_match_the_op_on_both_paths():
    a, b = torch.randn(5, 7, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    torch.testing.assert_close(tco.gemm(a, b, alpha=0.5), torch.ops.cute.gemm(a, b, alpha=0.5))
    q = torch.randn(1, 9, 2, 16, dtype=torch.float64)
    out, lse = tco.flash_attn_func(q, q, q, causal=True, return_lse=True)
    ref_out, ref_lse = torch.ops.cute.flash_attn_fwd(q, q, q, 16 ** -0.5, True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    # with a gradient to record, the public function goes through the op and its autograd
    qg = q.clone().requires_grad_()
    tco.flash_attn_func(qg, qg, qg).sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_invalid_input_still_raises_on_the_direct_path():
    with pytest.raises(ValueError, match="b: expected size 7 at dim -2"):
        tco.gemm(torch.randn(5, 7), torch.randn(6, 3))
    with pytest.raises(ValueError, match="head_dim, as in q"):
        tco.flash_attn_func(torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
