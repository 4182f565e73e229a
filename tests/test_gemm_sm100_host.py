"""Host-side logic of the Blackwell GEMM as plain Python (no GPU, no compile): the
sm_100a config heuristic, the persistent schedule of 1-CTA and 2-CTA tiles, the
coverage reasons and the launch contract (argument order, views, cached plans)."""

import itertools

import pytest
import torch

pytest.importorskip("cutlass")

from torch_cute_ops.kernels.common.tile_scheduler import PersistentTileScheduler  # noqa: E402
from torch_cute_ops.kernels.sm100 import gemm as sm100_kernel  # noqa: E402
from torch_cute_ops.runtime import gemm as gemm_runtime  # noqa: E402
from torch_cute_ops.runtime import shipped_specs  # noqa: E402
from torch_cute_ops.runtime.gemm import SM100 as sm100_gemm  # noqa: E402
from torch_cute_ops.runtime.gemm_config import GemmConfig, choose_config  # noqa: E402

B200_SMS = 148
SHAPES = [(8192, 8192, 8192, 1), (4096, 4096, 4096, 1), (2048, 2048, 2048, 1), (8192, 1024, 1024, 1),
          (1024, 1024, 1024, 1), (4096, 4096, 4096, 8), (256, 512, 512, 1), (64, 4096, 4096, 1),
          (1, 8192, 8192, 1), (300, 200, 100, 3), (65536, 64, 4096, 1), (8192, 128, 1024, 1)]


@pytest.mark.parametrize("m,n,k,batch", SHAPES)
def test_heuristic_picks_a_runnable_config(m, n, k, batch):
    config = choose_config("sm_100a", m, n, k, batch, B200_SMS)
    assert sm100_kernel.config_supported(config), config
    assert 2 * config.tile_n <= sm100_kernel.TMEM_COLUMNS  # two fp32 accumulator buffers


def test_config_supported():
    assert sm100_kernel.config_supported(GemmConfig(256, 128, 2, 1))
    assert not sm100_kernel.config_supported(GemmConfig(256, 128, 1, 2))  # no CTA pair along M
    assert not sm100_kernel.config_supported(GemmConfig(64, 128))
    assert not sm100_kernel.config_supported(GemmConfig(128, 256, pingpong=True))
    with pytest.raises(ValueError):
        sm100_kernel.GemmSm100(None, None, False, None, GemmConfig(128, 512))


def test_heuristic_tile_sizes_follow_the_problem():
    big = choose_config("sm_100a", 8192, 8192, 8192, 1, B200_SMS)
    assert sm100_kernel.is_two_cta(big) and big.tile_mn == (256, 256) and big.cluster_mn == (4, 1)
    assert choose_config("sm_100a", 1024, 8192, 4096, 1, B200_SMS).cluster_mn == (2, 1)
    assert choose_config("sm_100a", 128, 32768, 4096, 1, B200_SMS).tile_mn == (128, 256)
    small = choose_config("sm_100a", 64, 4096, 4096, 1, B200_SMS)
    assert not sm100_kernel.is_two_cta(small) and small.tile_n <= 128
    narrow = choose_config("sm_100a", 65536, 64, 4096, 1, B200_SMS)  # no MMA columns past N
    assert sm100_kernel.is_two_cta(narrow) and narrow.tile_n == 64


def _simulate(m, n, batch, config: GemmConfig, max_clusters: int):
    """Run the kernel's schedule on the host: which CTA computes which 128-row CTA tile."""
    two_cta = sm100_kernel.is_two_cta(config)
    cta_tile = (config.tile_m // (2 if two_cta else 1), config.tile_n)
    sched = PersistentTileScheduler.create((m, n, batch), cta_tile, config.cluster_mn,
                                           config.group_size, config.band_along_m)
    num_units = int(sched.num_work_units)
    grid_z = max(min(num_units, max_clusters), 1)
    done = {}
    for z, x, y in itertools.product(range(grid_z), range(config.cluster_m), range(config.cluster_n)):
        for work_idx in range(z, num_units, grid_z):
            cm, cn, l = (int(v) for v in sched.cluster_coord(work_idx))
            tile_m_idx, tile_n_idx = cm * config.cluster_m + x, cn * config.cluster_n + y
            # the kernel: MMA tile = tile_m_idx // 2, and the CTA's half of it is block_idx.x % 2
            if two_cta:
                assert tile_m_idx % 2 == x % 2
            key = (tile_m_idx, tile_n_idx, l)
            assert key not in done, f"tile {key} computed twice"
            done[key] = (z, work_idx)
    return done, cta_tile


@pytest.mark.parametrize("config", [GemmConfig(128, 256), GemmConfig(128, 64, group_size=3),
                                    GemmConfig(256, 256, 2, 1), GemmConfig(256, 256, 4, 1, band_along_m=False),
                                    GemmConfig(256, 128, 2, 2)])
@pytest.mark.parametrize("m,n,batch", [(1000, 777, 3), (128, 256, 1), (4096, 4096, 1), (1, 8, 2)])
def test_schedule_covers_every_output_tile_once(config, m, n, batch):
    for max_clusters in (B200_SMS // (config.cluster_m * config.cluster_n), 3):
        done, (cta_m, cta_n) = _simulate(m, n, batch, config, max_clusters)
        needed = {(i, j, l) for i in range(-(-m // cta_m)) for j in range(-(-n // cta_n)) for l in range(batch)}
        assert needed <= set(done)  # every output element is written
        # only whole clusters past the edge are extra (their TMA stores are clipped away)
        assert all(i < -(-m // cta_m) + config.cluster_m and j < -(-n // cta_n) + config.cluster_n
                   for i, j, _ in done)
        if sm100_kernel.is_two_cta(config):  # both halves of an MMA tile run in one cluster, same unit
            for (i, j, l), where in done.items():
                assert done[(i ^ 1, j, l)] == where


def test_specs_round_trip_and_register():
    torch_dtypes = {name: dtype for dtype, name in gemm_runtime.DTYPE_NAMES.items()}
    for spec in sm100_gemm.shipped():
        config = GemmConfig.from_spec_params(spec)
        activation = None if spec["act"] == "none" else spec["act"]
        if spec.get("scale"):
            rebuilt = gemm_runtime.scaled_spec(sm100_gemm, torch_dtypes[spec["ab"]], torch_dtypes[spec["b"]],
                                               torch_dtypes[spec["out"]], None, spec["scale"], activation, config,
                                               spec["rank"])
        else:
            rebuilt = sm100_gemm.spec(spec["ab"], spec["out"], spec["a_major"] == "k", spec["b_major"] == "k",
                                      spec["bias"], activation, config, spec["rank"])
        assert rebuilt == spec
    assert set(shipped_specs("sm_100a", "gemm_sm100")) == set(sm100_gemm.shipped())


def _operand(batch, rows, cols, cols_major, dtype=torch.bfloat16):
    t = torch.randn(batch, rows, cols) if cols_major else torch.randn(batch, cols, rows).transpose(1, 2)
    return t.to(dtype)


def test_unsupported_reasons():
    bf16 = torch.bfloat16
    a, b = _operand(2, 64, 64, True), _operand(2, 64, 64, False)
    assert sm100_gemm.unsupported_reason(a, b, None, "gelu_tanh", torch.float32) is None
    assert sm100_gemm.unsupported_reason(a, b, torch.randn(64).to(bf16), "relu", bf16) is None
    reason = sm100_gemm.unsupported_reason(a.float(), b.float(), None, None, None)
    assert reason.startswith("sm100 gemm kernel") and "bf16 or fp16" in reason
    assert "16 bytes" in sm100_gemm.unsupported_reason(_operand(1, 64, 17, True), _operand(1, 17, 64, True),
                                                       None, None, bf16)
    assert "K == 0" in sm100_gemm.unsupported_reason(_operand(1, 64, 0, True), _operand(1, 0, 64, True),
                                                     None, None, bf16)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_launch_contract(monkeypatch):
    """The compiled function gets (a, b[, bias], out, alpha, max_clusters, partials, flags) in torch
    order, the stream-K workspace None (this arch has no stream-K variant)."""
    compiled = {}

    def fake_get_compiled(spec):
        return compiled.setdefault(spec, _Recorder())

    monkeypatch.setattr(gemm_runtime, "get_compiled", fake_get_compiled)
    monkeypatch.setattr(gemm_runtime, "sm_count", lambda index: B200_SMS)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    a, b = _operand(1, 4096, 4096, True), _operand(1, 4096, 4096, False)  # b K-major: x @ W.T
    bias = torch.randn(4096).to(torch.bfloat16)
    out = torch.empty(1, 4096, 4096, dtype=torch.bfloat16)
    sm100_gemm.launch(a, b, bias, "gelu_tanh", out)
    sm100_gemm.launch(a, b, bias, "gelu_tanh", out)
    (spec, fn), = compiled.items()
    assert (spec["a_major"], spec["b_major"], spec["bias"], spec["act"]) == ("k", "k", True, "gelu_tanh")
    assert spec["tile"] == (256, 256) and spec["cluster"] == (4, 1)
    args = fn.calls[0]
    assert len(args) == 8 and args[2] is bias and args[4] == 1.0 and args[5] == B200_SMS // 4
    assert args[6:] == (None, None)
    assert args[0].shape == a.shape and args[1].shape == b.shape and args[3].data_ptr() == out.data_ptr()

    sm100_gemm.launch(a, b, None, None, out, config=GemmConfig(128, 128))
    spec = [s for s in compiled if s["tile"] == (128, 128)][0]
    assert len(compiled[spec].calls[0]) == 7 and compiled[spec].calls[0][4] == B200_SMS
    sm100_gemm.launch(a, b, None, None, out[:, :0])  # empty output: nothing to launch
    assert sum(len(r.calls) for r in compiled.values()) == 3
    assert sm100_gemm.spec("bf16", "bf16", True, True, False, None, GemmConfig(128, 128)).family == "gemm_sm100"


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_fp8_launch_plan(monkeypatch, mode):
    """An FP8 call's plan on sm_100a (no GPU: SM count and compiled function stubbed): the variant
    carries the scale mode and B's and the bias' dtypes on the heuristic's tile; the function gets
    (a, b, scale_a, scale_b, bias, out, max_clusters), per-tensor scales as 1-vectors. Blockwise
    scales have no sm_100a variant (the op falls back, counted)."""
    calls = []
    monkeypatch.setattr(gemm_runtime, "sm_count", lambda index: B200_SMS)
    monkeypatch.setattr(gemm_runtime, "get_compiled", lambda spec: lambda *args: calls.append(args))
    m, n, k = 4096, 4096, 4096
    plan = sm100_gemm.plan((m, k), (k, 1), (k, n), (1, k), torch.float8_e4m3fn, ((n,), (1,)), "relu",
                           torch.bfloat16, 0, b_dtype=torch.float8_e5m2, bias_dtype=torch.float32, scale_mode=mode)
    assert isinstance(plan, gemm_runtime.ScaledGemmLaunch), plan
    spec = plan.spec
    assert spec.arch == "sm_100a"
    assert (spec["scale"], spec["ab"], spec["b"], spec["bias_dtype"], spec["act"]) == (mode, "e4m3", "e5m2",
                                                                                    "fp32", "relu")
    assert spec["tile"] == choose_config("sm_100a", m, n, k, 1, B200_SMS).tile_mn
    scale = torch.ones(()) if mode == "tensor" else torch.ones(m, 1)
    plan(torch.empty(m, k), torch.empty(n, k).t(), scale, scale, torch.empty(n), torch.empty(m, n))
    (args,) = calls
    assert len(args) == 9 and args[2].shape == ((1,) if mode == "tensor" else (m, 1))
    assert args[-3] == B200_SMS // (spec["cluster"][0] * spec["cluster"][1]) and args[-2:] == (None, None)
    reason = sm100_gemm.plan((m, k), (k, 1), (k, n), (1, k), torch.float8_e4m3fn, None, None, torch.bfloat16, 0,
                             b_dtype=torch.float8_e4m3fn, scale_mode="block")
    assert reason == "sm100 gemm kernel: no FP8 variant with block scales"
