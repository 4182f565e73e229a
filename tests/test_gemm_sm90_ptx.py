"""Compile-only checks of the Hopper GEMM (no GPU needed): the PTX has the intended
instruction mix, and the host-side helpers pick majorness and reasons correctly."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from torch_cute_ops.kernels import compile_spec  # noqa: E402
from torch_cute_ops.kernels.common.tile_scheduler import STREAM_K_MIN_K_TILES, PersistentTileScheduler  # noqa: E402
from torch_cute_ops.runtime.gemm import SM90 as sm90_gemm  # noqa: E402
from torch_cute_ops.runtime.gemm import operand_strides  # noqa: E402
from torch_cute_ops.runtime.gemm_config import GemmConfig, choose_config  # noqa: E402

SHIPPED = sm90_gemm.shipped()


def _ptx(dump_dir):
    ptx_files = list(dump_dir.glob("*.ptx"))
    assert len(ptx_files) == 1 and list(dump_dir.glob("*.cubin"))
    return ptx_files[0].read_text()


@pytest.mark.parametrize("spec", [SHIPPED[0], next(s for s in SHIPPED if s["tile"] == (128, 128)),
                                  # the deepest ring: 64 x 64 tiles take 13 stages
                                  next(s for s in SHIPPED if s["tile"] == (64, 64) and s["cluster"] == (2, 1))],
                         ids=lambda s: s.name)
def test_shipped_ptx(spec, tmp_path):
    """WGMMA + TMA (multicast) + stmatrix, no spills; launched as a programmatic dependent: one
    griddepcontrol.wait ahead of every global access (the previous kernel may still be writing
    the operands), and one launch_dependents."""
    compile_spec(spec, dump_dir=tmp_path)
    ptx = _ptx(tmp_path)
    assert re.search(r"^\.target\s+sm_90a", ptx, re.M)
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "stmatrix", ".multicast::cluster"):
        assert instruction in ptx, instruction
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"
    if spec["act"] == "gelu_tanh":
        assert "tanh.approx" in ptx
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    wait = ptx.index("griddepcontrol.wait")
    for access in ("cp.async.bulk.tensor", "ld.global", "st.global"):
        assert access not in ptx or wait < ptx.index(access), access


def test_fp32_out_m_major_ptx(tmp_path):
    """A M-major, B K-major, fp32 output without stmatrix, single warpgroup tile."""
    spec = sm90_gemm.spec("fp16", "fp32", False, True, True, "silu", GemmConfig(64, 128))
    compile_spec(spec, dump_dir=tmp_path)
    ptx = _ptx(tmp_path)
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx


def test_192_row_tiles_ptx(tmp_path):
    """192-row tiles: three consumer warpgroups at 152 registers each (with the producer's 40,
    the register file of a 512-thread CTA), bias + gelu_tanh at 192 columns without spilling;
    wider tiles, ping-pong and blockwise scales at 192 rows are refused."""
    import cutlass

    from torch_cute_ops.kernels.sm90.gemm import Sm90Gemm

    spec = sm90_gemm.spec("bf16", "bf16", True, True, True, "gelu_tanh", GemmConfig(192, 192, 2, 1))
    compile_spec(spec, dump_dir=tmp_path)
    ptx = _ptx(tmp_path)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+152;", ptx)
    assert "wgmma.mma_async.sync.aligned.m64n192k16" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"
    bf16 = cutlass.BFloat16
    for config in (GemmConfig(192, 256), GemmConfig(192, 128, pingpong=True)):
        with pytest.raises(ValueError, match="unsupported sm90 tile"):
            Sm90Gemm(bf16, bf16, True, True, False, None, config)


def test_pingpong_ptx(tmp_path):
    """Ping-pong: two 128x128 warpgroup tiles, turn-taking named barriers between them."""
    spec = sm90_gemm.spec("bf16", "bf16", True, False, False, None, GemmConfig(128, 128, 2, 1, pingpong=True))
    compile_spec(spec, dump_dir=tmp_path)
    ptx = _ptx(tmp_path)
    assert "wgmma.mma_async" in ptx and "bar.arrive" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"


FP8_CASES = [  # (scale mode, a, b, out, bias dtype, activation, tile)
    ("tensor", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, None, None, GemmConfig(128, 256, 2, 1)),
    ("row", torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.bfloat16, "gelu_tanh",
     GemmConfig(128, 256, 2, 1)),
    ("block", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, None, None, GemmConfig(128, 128, 2, 1)),
    ("block", torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16, torch.float32, None, GemmConfig(64, 128)),
    ("block", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, None, None, GemmConfig(128, 192, 2, 1)),
    ("block", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, None, None, GemmConfig(256, 128, 1, 2)),
]


@pytest.mark.parametrize("case", FP8_CASES,
                         ids=lambda c: f"{c[0]}-{c[6].tile_m}x{c[6].tile_n}")
def test_fp8_ptx(case, tmp_path):
    """FP8 variants: e4m3/e5m2 WGMMA over 128-wide k-tiles (k32 instructions, 4 per k-tile and
    warpgroup batch), no spills; per-tensor / rowwise scales are read from global memory once, in
    the epilogue (2 values per row-pair, one per column; a 16-bit bias one word per column pair);
    blockwise ones come with each k-tile by TMA (two more loads under its stage's barrier) and are
    read from shared memory where the k-tile's batch is issued (2 rows of scale_a, then scale_b's
    block, two blocks under a 192-column tile; 4 rows and one block for a 256-row tile's two
    waves); a 192-column tile's warpgroups take turns on two named barriers; the blockwise
    consumers poll the stage barriers, with no suspend-time hint."""
    from torch_cute_ops.runtime.gemm import scaled_spec

    mode, a_dtype, b_dtype, out_dtype, bias_dtype, activation, config = case
    spec = scaled_spec(sm90_gemm, a_dtype, b_dtype, out_dtype, bias_dtype, mode, activation, config, rank=2)
    compile_spec(spec, dump_dir=tmp_path)
    ptx = _ptx(tmp_path)
    names = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32)\.f32\.(\w+)\.(\w+)", ptx))
    assert shapes == {(f"m64n{config.tile_n}k32", names[a_dtype], names[b_dtype])}, shapes
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"
    scale_loads = len(re.findall(r"ld\.global(?:\.nc)?\.b32", ptx))
    columns_per_thread = config.tile_n // 4
    expected = {"tensor": 2, "row": 2 + columns_per_thread, "block": 0}[mode]
    if bias_dtype == torch.float32:
        expected += columns_per_thread
    elif bias_dtype is not None:  # a 16-bit bias: one 32-bit word per pair of columns
        expected += columns_per_thread // 2
    assert scale_loads == expected, (scale_loads, expected)
    if mode == "block":
        tma_loads = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cta|cluster)\.global", ptx)
        assert len(tma_loads) == 4, tma_loads  # A, B, scale_a, scale_b
        # the stage's byte count: A and B's k-tiles, then the scale boxes, which start 16-byte
        # aligned (a box off that boundary faults): the tile's rows + 4, and 8 blocks of B
        # (256 rows: never moved, so aligned already, and a box spans at most 256)
        box_rows = config.tile_m if config.tile_m == 256 else config.tile_m + 4
        stage_bytes = (config.tile_m + config.tile_n) * 128 + (box_rows + 8) * 4
        expect_tx = re.findall(r"mov\.b32\s+(%r\d+), (\d+);\s+mbarrier\.arrive\.expect_tx\S*\s+\S+ \[\S+\], \1;", ptx)
        assert {int(value) for _, value in expect_tx} == {stage_bytes}, (expect_tx, stage_bytes)
        # the four places a two-fragment loop issues a batch from (the first, the loop's two,
        # the odd last one), 3 words each; the one-fragment loop's single place, 4 words
        words = sum(2 if load.startswith("ld.shared.v2") else 1
                    for load in re.findall(r"ld\.shared(?:\.v2)?\.b32", ptx))
        assert words == (5 if config.tile_m == 256 else 4 * 3 if config.tile_n <= 128 else 4), words
        hinted = re.findall(r"mbarrier\.try_wait\.parity\.shared\.b64 \S+ \[\S+\], \S+, 10000000;", ptx)
        polled = re.findall(r"mbarrier\.try_wait\.parity\.acquire\.cta\.shared::cta\.b64", ptx)
        assert polled and len(hinted) < len(re.findall(r"mbarrier\.try_wait", ptx)), (len(hinted), len(polled))
    if mode == "block" and config.tile_m == 256:
        # two waves a k-tile, 64 FFMA each, and no turns
        assert len(re.findall(r"\bfma\.rn\.f32", ptx)) >= 2 * 64
        assert not re.findall(r"\bbar\.arrive\b", ptx)
    elif mode == "block" and config.tile_n <= 128:
        # the per-k-tile promotion, one FFMA per accumulator value, at its four places
        assert len(re.findall(r"\bfma\.rn\.f32", ptx)) >= 4 * 64 * config.tile_n // 128
    elif mode == "block":  # at one place; the turns: the hand-over of the first and each k-tile's
        assert len(re.findall(r"\bfma\.rn\.f32", ptx)) >= 64 * config.tile_n // 128
        assert len(re.findall(r"\bbar\.arrive\b", ptx)) == 2 and len(re.findall(r"\bbar\.sync\b", ptx)) >= 1


def test_fp8_spec_needs_k_major_and_scales():
    from torch_cute_ops.runtime.gemm import block_scaled_config

    e4m3 = torch.float8_e4m3fn
    reason = sm90_gemm.plan((256, 128), (1, 256), (128, 64), (1, 128), e4m3, None, None, torch.bfloat16, 0,
                            scale_mode="row")
    assert reason == "sm90 gemm kernel: FP8 WGMMA needs K-major operands, a is not"
    reason = sm90_gemm.plan((256, 100), (100, 1), (100, 64), (1, 100), e4m3, None, None, torch.bfloat16, 0,
                            scale_mode="tensor")
    assert "stride 100 of dim" in reason  # K = 100 bytes: not a multiple of 16
    # blockwise scales keep k-tile fragments: tiles of 128 columns at most, or 128 x 192, never
    # ping-pong
    assert block_scaled_config(GemmConfig(128, 256, 2, 1)) == GemmConfig(128, 128, 2, 1)
    assert block_scaled_config(GemmConfig(128, 128, pingpong=True)) == GemmConfig(128, 128)
    assert block_scaled_config(GemmConfig(128, 192, 2, 1)) == GemmConfig(128, 192, 2, 1)
    assert block_scaled_config(GemmConfig(256, 128, 1, 2)) == GemmConfig(256, 128, 1, 2)
    assert block_scaled_config(GemmConfig(128, 192, 2, 1, pingpong=True)) == GemmConfig(128, 128, 2, 1)


def test_256_row_tiles_are_blockwise_only():
    """256 x 128 tiles exist for blockwise scales only: two consumer warpgroups, each issuing its
    rows of the two 128-row waves in turn, three A/B stages, the tile never moved back over M."""
    import cutlass

    from torch_cute_ops.kernels.sm90.gemm import Sm90Gemm

    bf16, e4m3 = cutlass.BFloat16, cutlass.Float8E4M3FN
    kernel = Sm90Gemm(e4m3, bf16, True, True, False, None, GemmConfig(256, 128, 1, 2), scale_mode="block")
    assert (kernel.tile_wgs, kernel.waves, kernel.ab_stages, kernel.shift_rows) == (2, 2, 3, False)
    assert kernel._scale_box_a() == 256  # a TMA box spans at most 256 rows
    for ab, config, mode in ((bf16, GemmConfig(256, 128), None), (e4m3, GemmConfig(256, 128), "row"),
                             (e4m3, GemmConfig(256, 192), "block"),
                             (e4m3, GemmConfig(256, 128, pingpong=True), "block")):
        with pytest.raises(ValueError, match="unsupported sm90 tile"):
            Sm90Gemm(ab, bf16, True, True, False, None, config, scale_mode=mode)


@pytest.mark.parametrize("mode,shape,expect_tile", [
    ("tensor", (4096, 4096, 4096), (128, 256)), ("row", (4096, 4096, 4096), (128, 256)),
    ("block", (4096, 4096, 4096), (256, 128)), ("block", (48, 4096, 1024), (64, 64)),
    ("block", (8192, 8192, 8192), (256, 128)), ("block", (1024, 14336, 4096), (128, 128)),
    ("block", (512, 4096, 4096), (128, 128)),
])
def test_fp8_launch_plan(monkeypatch, mode, shape, expect_tile):
    """The host plan of an FP8 call (no GPU: the SM count and the compiled function stubbed): the
    variant carries the scale mode, B's and the bias' dtypes; blockwise tiles become 256 x 128
    where those hold the problem about as well as the 128-row pick (8192^3: 16 waves at 97%;
    4096^3: 4 at 97%), and stay at 128 x 128 where they would not (1024 x 14336: 448 tiles of
    128 x 128 are 3.4 waves, 224 of 256 x 128 1.7); per-tensor scales travel as 1-vectors."""
    from torch_cute_ops.runtime import gemm as runtime_gemm

    monkeypatch.setattr(runtime_gemm, "sm_count", lambda index: 132)
    calls = []
    monkeypatch.setattr(runtime_gemm, "get_compiled", lambda spec: lambda *args: calls.append(args))
    m, n, k = shape
    plan = sm90_gemm.plan((m, k), (k, 1), (k, n), (1, k), torch.float8_e4m3fn, ((n,), (1,)), "relu",
                          torch.bfloat16, 0, b_dtype=torch.float8_e5m2, bias_dtype=torch.float32, scale_mode=mode)
    assert isinstance(plan, runtime_gemm.ScaledGemmLaunch), plan
    spec = plan.spec
    assert (spec["scale"], spec["ab"], spec["b"], spec["bias_dtype"], spec["act"]) == (mode, "e4m3", "e5m2",
                                                                                    "fp32", "relu")
    assert spec["tile"] == expect_tile and spec["a_major"] == spec["b_major"] == "k"
    a, b = torch.empty(m, k), torch.empty(n, k).t()
    scale = torch.ones(()) if mode == "tensor" else torch.ones(m, 1)
    plan(a, b, scale, scale, torch.empty(n), torch.empty(m, n))
    passed_scale = calls[0][2]
    assert passed_scale.shape == ((1,) if mode == "tensor" else (m, 1))
    assert calls[0][-3] == 132 // (spec["cluster"][0] * spec["cluster"][1])  # persistent clusters
    assert calls[0][-2:] == (None, None)  # no stream-K workspace


def _operand(batch, rows, cols, cols_major):
    t = torch.empty(batch, rows, cols) if cols_major else torch.empty(batch, cols, rows).transpose(1, 2)
    return t.to(torch.bfloat16)


@pytest.mark.parametrize("rows,cols,cols_major,expect_cols_major", [
    (1000, 64, True, True), (1000, 64, False, False), (1, 4095, True, True),
    (1000, 1, True, False), (1000, 1, False, False), (1, 1, True, True),
])
def test_operand_majorness(rows, cols, cols_major, expect_cols_major):
    t = _operand(1, rows, cols, cols_major)
    strides, got = operand_strides(t.shape, t.stride(), t.element_size())
    assert got == expect_cols_major
    # every stride the TMA sees is 16-byte aligned except the unit one
    unit = 2 if got else 1
    assert strides[unit] == 1
    assert all(strides[d] % 8 == 0 for d in range(3) if d != unit)


def test_unsupported_reasons():
    bf16 = torch.bfloat16
    a, b = _operand(1, 64, 64, True), _operand(1, 64, 64, True)
    assert sm90_gemm.unsupported_reason(a, b, None, None, bf16) is None
    assert "bf16 or fp16" in sm90_gemm.unsupported_reason(a.float(), b.float(), None, None, None)
    assert "out dtype" in sm90_gemm.unsupported_reason(a, b, None, None, torch.float64)
    assert "16 bytes" in sm90_gemm.unsupported_reason(_operand(1, 64, 17, True), _operand(1, 17, 64, True),
                                                      None, None, bf16)
    assert "TMA store" in sm90_gemm.unsupported_reason(a, _operand(1, 64, 17, False), None, None, bf16)
    assert "K == 0" in sm90_gemm.unsupported_reason(_operand(1, 64, 0, True), _operand(1, 0, 64, True),
                                                    None, None, bf16)


def test_scheduler_covers_every_tile_once():
    cases = [(5, 7, 2, 3, True), (4, 4, 1, 8, False), (9, 2, 3, 2, False)]
    for clusters_m, clusters_n, batches, group, band_m in cases:
        sched = PersistentTileScheduler(clusters_m, clusters_n, batches, (1, 1), group, band_m)
        seen = {tuple(int(v) for v in sched.cluster_coord(w)) for w in range(sched.num_work_units)}
        assert len(seen) == clusters_m * clusters_n * batches
        assert all(m < clusters_m and n < clusters_n and l < batches for m, n, l in seen)


def _mn(config):
    return config.tile_mn, config.cluster_mn


def test_config_heuristic():
    assert choose_config("sm_90a", 8192, 8192, 8192).tile_mn == (128, 256)
    assert choose_config("sm_90a", 8192, 8192, 8192).cluster_mn == (2, 1)
    assert _mn(choose_config("sm_90a", 48, 4096, 4096)) == ((64, 64), (1, 1))
    # a decode step's rows (16-bit, M <= 32): swapped operands, the weight on 128-row tiles
    for m, rows in ((1, 16), (16, 16), (17, 32), (32, 32)):
        decode = choose_config("sm_90a", m, 4096, 4096)
        assert (decode.swap_ab, decode.tile_mn, decode.cluster_mn) == (True, (128, rows), (1, 1)), m
    assert not choose_config("sm_90a", 33, 4096, 4096).swap_ab
    assert choose_config("sm_90a", 1, 4096, 4096, fp8=True).swap_ab  # FP8 too (blockwise: 64 x 64)
    # few rows at LLM widths: more, narrower tiles where 128 x 128 would leave SMs idle; one
    # row of 128 x 64 tiles becomes two of 64 x 64 in 2 x 1 clusters (twice the CTAs, B read once)
    assert _mn(choose_config("sm_90a", 128, 4096, 4096)) == ((64, 64), (2, 1))
    assert _mn(choose_config("sm_90a", 128, 4096, 14336)) == ((64, 64), (2, 1))
    assert _mn(choose_config("sm_90a", 256, 4096, 14336)) == ((128, 64), (2, 1))
    # ... 128 x 192 ping-pong where it makes one full wave (128 tiles; 128 x 256 makes 96, 128 x
    # 128 192) or fills the waves better than 128 x 256 (1024 x 14336: 600 tiles vs 448)
    for m, n in ((256, 12288), (512, 12288), (1024, 14336)):
        config = choose_config("sm_90a", m, n, 4096)
        assert (config.tile_mn, config.cluster_mn, config.pingpong) == ((128, 192), (2, 1), True), (m, n)
    # ... and the widest tile wherever it fills the waves as well
    assert choose_config("sm_90a", 512, 4096, 4096).tile_mn == (128, 128)
    assert choose_config("sm_90a", 512, 14336, 4096).tile_mn == (128, 256)
    assert choose_config("sm_90a", 1024, 12288, 4096).tile_mn == (128, 256)
    assert not choose_config("sm_90a", 1024, 12288, 4096).pingpong
    assert choose_config("sm_90a", 128, 4096, 4096, fp8=True).tile_mn == (128, 128)
    # one row of tiles: the width whose tiles fill about one wave (12288 / 96 = 128 tiles,
    # 14336 / 128 = 112); 16-bit only, and never 96 columns over two rows of tiles or more
    for m, n, tile in ((128, 12288, (128, 96)), (96, 11008, (128, 96)), (64, 12288, (64, 96)),
                       (48, 11008, (64, 96)), (64, 14336, (64, 128)), (33, 14336, (64, 128)),
                       (128, 14336, (128, 128)), (256, 6144, (128, 128)), (512, 4096, (128, 128))):
        assert _mn(choose_config("sm_90a", m, n, 4096)) == (tile, (1 if m <= 128 else 2, 1)), (m, n)
    # a few waves: 192-row tiles where they pad no more rows than 128-row ones and fill the
    # waves better (1152 x 4096: 132 tiles of 192 x 192, one wave; 128 x 256 makes 144) ...
    for m, n, k, tile, cluster in ((1152, 4096, 4096, (192, 192), (2, 1)), (1152, 12288, 4096, (192, 192), (2, 1)),
                                   (384, 12288, 4096, (192, 192), (2, 1)), (384, 4096, 4096, (192, 64), (1, 1)),
                                   (384, 4096, 14336, (192, 64), (1, 1)), (384, 14336, 4096, (192, 128), (1, 1))):
        assert _mn(choose_config("sm_90a", m, n, k)) == (tile, cluster), (m, n, k)
    # ... never where they pad more rows (640 = 5 x 128, 4 x 192 = 768), nor for FP8, nor over
    # many waves, nor 192 x 64 / 192 x 128 over a partial last tile row (260 x 4096)
    for m, n, k, fp8 in ((640, 12288, 4096, False), (512, 12288, 4096, False), (1152, 4096, 4096, True),
                         (260, 4096, 4096, False), (3072, 4096, 4096, False), (16896, 4096, 4096, False)):
        assert choose_config("sm_90a", m, n, k, fp8=fp8).tile_m == 128, (m, n, k, fp8)
    # 1 x 1 clusters where an odd number of tile rows would put 2 x 1 clusters' second CTAs past
    # M and add a wave (640 x 12288: 5 x 48 tiles of 128 x 256 in two waves, 6 x 48 slots in
    # three)
    assert _mn(choose_config("sm_90a", 640, 12288, 4096)) == ((128, 256), (1, 1))
    assert _mn(choose_config("sm_90a", 1152, 14336, 4096)) == ((128, 256), (1, 1))
    # one wave of 128 x 160 tiles in 1 x 2 clusters (26 columns of tiles at N = 4096, five rows)
    assert _mn(choose_config("sm_90a", 640, 4096, 4096)) == ((128, 160), (1, 2))
    assert _mn(choose_config("sm_90a", 640, 4096, 14336)) == ((128, 160), (1, 2))
    assert choose_config("sm_90a", 640, 14336, 4096).cluster_mn == (1, 1)
    assert choose_config("sm_90a", 3000, 14336, 4096, fp8=True).cluster_mn == (2, 1)  # FP8 unchanged
    assert choose_config("sm_90a", 64, 12288, 4096, fp8=True).tile_mn == (64, 64)
    assert choose_config("sm_90a", 128, 12288, 4096, fp8=True).tile_mn == (128, 128)
    # short K over many tiles: 128 x 192 ping-pong (16-bit); FP8 and K = 4096 stay cooperative
    small_k = choose_config("sm_90a", 8192, 8192, 1024)
    assert (small_k.tile_mn, small_k.cluster_mn, small_k.pingpong) == ((128, 192), (2, 1), True)
    assert not choose_config("sm_90a", 8192, 8192, 1024, fp8=True).pingpong
    assert not choose_config("sm_90a", 8192, 8192, 4096).pingpong
    # stream-K from eight full waves of 2 x 1 clusters on, when the last one is partial (16-bit)
    for shape, stream_k in (((8192, 8192, 8192), True), ((16384, 4096, 14336), True), ((4096, 12288, 4096), True),
                            ((4096, 4096, 4096), False), ((4096, 4096, 14336), False), ((1024, 12288, 4096), False),
                            ((16896, 4096, 4096), False)):  # 16896 rows: 1056 units, 16 full waves, none partial
        assert choose_config("sm_90a", *shape).stream_k == stream_k, shape
    assert not choose_config("sm_90a", 8192, 8192, 8192, fp8=True).stream_k
    assert not choose_config("sm_90a", 8192, 8192, 1024).stream_k  # ping-pong


def test_slot_use_counts_padding_and_idle_cluster_ctas():
    """slot_use = output / (waves x SMs x tile area): padded rows and columns, and the CTAs of a
    cluster wholly past M or N, take slots."""
    from torch_cute_ops.runtime.gemm_config import slot_use

    # 1152 x 4096 on 192 x 192: 6 x 22 = 132 tiles, one wave, 4224 columns computed for 4096
    assert slot_use(GemmConfig(192, 192, 2, 1), 1152, 4096, 1, 132) == pytest.approx(4096 / 4224)
    # 384 rows of 128 x 128 in 2 x 1 clusters: 4 rows of CTAs (one past M) x 32 = 128 slots, one wave
    assert slot_use(GemmConfig(128, 128, 2, 1), 384, 4096, 1, 132) == pytest.approx(96 / 132)
    # 640 x 12288 on 128 x 256: 5 x 48 = 240 tiles in two waves; 2 x 1 adds a sixth row, three waves
    assert slot_use(GemmConfig(128, 256), 640, 12288, 1, 132) == pytest.approx(240 / 264)
    assert slot_use(GemmConfig(128, 256, 2, 1), 640, 12288, 1, 132) == pytest.approx(240 / 396)
    # 1 x 2 clusters count a column of CTAs past N: 4000 / 160 = 25 columns, 26 with the pair's
    assert slot_use(GemmConfig(128, 160, 1, 2), 640, 4000, 1, 132) == pytest.approx(640 * 4000 / (132 * 128 * 160))
    assert slot_use(GemmConfig(128, 128), 0, 4096, 1, 132) == 0.0  # an empty problem


@pytest.mark.parametrize("b_k_major", [False, True], ids=["x@W", "x@W.T"])
def test_llm_shapes_run_shipped_variants(monkeypatch, b_k_major):
    """Every bf16 GEMM of the LLM widths (N, K in 4096 / 12288 / 14336), M from a decode step's 1
    to 16384, plans a prebuilt variant for row-major B and for nn.Linear's weight (a decode
    step's swapped operands included, and nn.Linear's bias there): none compiles on first use."""
    import torch_cute_ops.runtime.gemm as gemm_host

    planned = []
    monkeypatch.setattr(gemm_host, "get_compiled", planned.append)
    monkeypatch.setattr(gemm_host, "sm_count", lambda index: 132)
    bf16, shipped = torch.bfloat16, set(SHIPPED)
    for m in (1, 5, 16, 17, 32, 33, 64, 128, 256, 384, 512, 640, 1024, 1152, 4096, 16384):
        for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (12288, 4096)):
            a = torch.empty(m, k, dtype=bf16, device="meta")
            b = torch.empty(n, k, dtype=bf16, device="meta").t() if b_k_major else torch.empty(k, n, dtype=bf16,
                                                                                               device="meta")
            biases = ((None, ((n,), (1,))) if b_k_major and m <= 32 else (None,))
            for bias_layout in biases:
                launch = sm90_gemm.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), bf16, bias_layout,
                                        None, bf16, 0)
                assert not isinstance(launch, str), launch
                assert planned[-1] in shipped, (m, n, k, bias_layout, planned[-1].name)
                assert launch.swap == (m <= 32), (m, launch.spec.name)


def test_heuristic_gives_configs_the_kernel_takes():
    """Over sizes from one tile to many waves, batched or not, 16-bit and FP8 (rowwise and
    blockwise): every config the heuristic picks is one the sm90 kernel accepts."""
    import cutlass

    from torch_cute_ops.kernels.sm90.gemm import Sm90Gemm
    from torch_cute_ops.runtime.gemm import block_scaled_config

    assert choose_config("sm_90a", 0, 4096, 4096).swap_ab  # an empty problem still gets a config
    assert choose_config("sm_90a", 128, 0, 4096).tile_m == 128
    sizes = (1, 64, 65, 128, 200, 256, 512, 768, 1024, 4096, 16384)
    for m in sizes:
        for n in (64, 1000, 4096, 12288, 128256):
            for k, batch in ((64, 1), (4096, 1), (1024, 8)):
                config = choose_config("sm_90a", m, n, k, batch)
                Sm90Gemm(cutlass.BFloat16, cutlass.BFloat16, True, False, False, None, config)
                fp8 = choose_config("sm_90a", m, n, k, batch, fp8=True)
                for mode, fp8_config in (("row", fp8), ("block", block_scaled_config(fp8))):
                    Sm90Gemm(cutlass.Float8E4M3FN, cutlass.BFloat16, True, True, False, None, fp8_config,
                             scale_mode=mode)


@pytest.mark.parametrize("tokens", [4096, 16384])
@pytest.mark.parametrize("weight_layout", ["x@W.T", "x@W"])
def test_linear_training_gemms_are_prebuilt(monkeypatch, tokens, weight_layout):
    """A bf16 linear layer's three GEMMs as autograd issues them (ops/gemm.py: y = x @ B,
    dx = dy @ B^T, dB = x^T @ dy, transposed views) at LLM widths take shipped variants: a
    training process's first step compiles no GEMM."""
    import torch_cute_ops.runtime.gemm as gemm_host

    planned = []
    monkeypatch.setattr(gemm_host, "get_compiled", planned.append)
    monkeypatch.setattr(gemm_host, "sm_count", lambda index: 132)
    bf16 = torch.bfloat16

    def plan(a, b):
        launch = sm90_gemm.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), bf16, None, None, bf16, 0)
        assert not isinstance(launch, str), launch

    for n_in, n_out in ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 12288)):
        x = torch.empty(tokens, n_in, dtype=bf16, device="meta")
        dy = torch.empty(tokens, n_out, dtype=bf16, device="meta")
        w = torch.empty(n_out, n_in, dtype=bf16, device="meta")  # nn.Linear's weight
        b = w.t() if weight_layout == "x@W.T" else torch.empty(n_in, n_out, dtype=bf16, device="meta")
        plan(x, b)  # forward
        plan(dy, b.mT)  # dx
        plan(x.mT, dy)  # dB
    shipped = set(SHIPPED)
    assert len(planned) == 12 and all(spec in shipped for spec in planned), sorted(
        {spec.name for spec in planned if spec not in shipped})


@pytest.mark.parametrize("mode", ["row", "block"])
def test_fp8_llm_shapes_run_shipped_variants(mode):
    """FP8 e4m3 -> bf16 GEMMs with rowwise or blockwise scales at the LLM widths, from a decode
    step's M = 1 to 16384 (K-major operands: x @ W.T), take prebuilt variants."""
    from torch_cute_ops.runtime.gemm import block_scaled_config, scaled_spec

    e4m3, shipped = torch.float8_e4m3fn, set(SHIPPED)
    for m in (1, 16, 64, 128, 256, 512, 1024, 4096, 16384):
        for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (12288, 4096)):
            config = choose_config("sm_90a", m, n, k, fp8=True)
            config = block_scaled_config(config) if mode == "block" else config
            spec = scaled_spec(sm90_gemm, e4m3, e4m3, torch.bfloat16, None, mode, None, config, 2)
            assert spec in shipped, (m, n, k, config)


def _swapped_kernel_stand_in(calls):
    """What a swapped variant computes, in torch, from the caller-order tensors the launch passes
    (its jit host function makes the b^T, a^T, out^T views): out^T = b^T @ a^T + bias along rows."""
    def run(a, b, *rest):
        *rest, partials, flags = rest  # a data-parallel variant's workspace: two Nones
        assert partials is None and flags is None
        bias, out = (rest[0], rest[1]) if len(rest) == 4 else (None, rest[0])
        out.mT.copy_(b.mT.double() @ a.mT.double() + (0 if bias is None else bias.double()[:, None]))
        calls.append((a, b, out))
    return run


@pytest.mark.parametrize("m,n,k,batch,b_layout,bias", [
    (1, 200, 64, 1, "x@W.T", True), (7, 136, 40, 1, "x@W", False), (16, 64, 72, 3, "x@W", True),
    (33, 96, 64, 2, "x@W.T", False),
])
def test_swapped_launch_plan(monkeypatch, m, n, k, batch, b_layout, bias):
    """Swapped operands (config.swap_ab): the plan hands the kernel the caller's tensors as they
    are (no per-call views: its jit host function trades their roles) and a variant whose A
    majorness is b^T's; with torch standing in for the kernel, out = a @ b + bias (CPU, fp64)."""
    from torch_cute_ops.runtime import gemm as runtime_gemm

    monkeypatch.setattr(runtime_gemm, "sm_count", lambda index: 132)
    calls = []
    monkeypatch.setattr(runtime_gemm, "get_compiled", lambda spec: _swapped_kernel_stand_in(calls))
    two_d = batch == 1
    a = torch.randn(batch, m, k)
    b = torch.randn(batch, n, k).mT if b_layout == "x@W.T" else torch.randn(batch, k, n)
    bias_t = torch.randn(n) if bias else None
    if two_d:
        a, b = a[0], b[0]
    config = GemmConfig(64, 16, swap_ab=True)
    plan = sm90_gemm.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), torch.bfloat16,
                          None if bias_t is None else ((n,), (1,)), None, torch.bfloat16, 0, config)
    assert isinstance(plan, runtime_gemm.GemmLaunch) and plan.swap, plan
    spec = plan.spec
    assert spec["swap"] and spec["tile"] == (64, 16) and spec["rank"] == (2 if two_d else 3)
    # the kernel's A is b^T: K-major exactly when the weight is nn.Linear's (N, K); its B, a^T, is K-major
    assert spec["a_major"] == ("k" if b_layout == "x@W.T" else "m") and spec["b_major"] == "k"
    out = torch.full(a.shape[:-1] + (n,), float("nan"))
    plan(a, b, bias_t, out, 1.0)
    passed_a, passed_b, passed_out = calls[0]
    assert passed_a is a and passed_b is b and passed_out is out
    expect = a.double() @ b.double() + (0 if bias_t is None else bias_t.double())
    torch.testing.assert_close(out.double(), expect)


@pytest.mark.parametrize("mode,batch,bias", [("row", 1, True), ("row", 2, False), ("tensor", 1, False)])
def test_fp8_swapped_launch_plan(monkeypatch, mode, batch, bias):
    """FP8 on swapped operands: the variant's A is b^T (b's dtype), its B a^T; the launch passes
    the caller's tensors and scales as they are (the jit host function trades their roles: its
    row scales are b's seen as (N, 1), its column scales a's as (1, M)); with torch standing in
    for the kernel, out = (a * scale_a) @ (b * scale_b) + bias."""
    from torch_cute_ops.runtime import gemm as runtime_gemm

    calls = []

    def stand_in(a, b, sa, sb, *rest):  # the caller's tensors: the jit host function swaps them
        *rest, partials, flags = rest  # a data-parallel variant's workspace: two Nones
        assert partials is None and flags is None
        bias, out = (rest[0], rest[1]) if len(rest) == 3 else (None, rest[0])
        # rowwise: b's (1, N) scales the kernel's rows, a's (M, 1) its columns; per-tensor: 1-vectors
        scale = sa.double() * sb.double() if sa.dim() == 1 else sb.mT.double() * sa.mT.double()
        result = (b.mT.double() @ a.mT.double()) * scale
        out.mT.copy_(result + (0 if bias is None else bias.double()[:, None]))
        calls.append((a, b, sa, sb))

    monkeypatch.setattr(runtime_gemm, "sm_count", lambda index: 132)
    monkeypatch.setattr(runtime_gemm, "get_compiled", lambda spec: stand_in)
    m, n, k = 5, 48, 256
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    a = torch.randn(batch, m, k).to(e4m3)
    b = torch.randn(batch, n, k).to(e5m2).mT  # K-major (nn.Linear's weight)
    if mode == "row":
        sa, sb = torch.rand(batch, m, 1) + 0.5, torch.rand(batch, 1, n) + 0.5
    else:
        sa, sb = torch.tensor(0.75), torch.tensor(1.5)
    bias_t = torch.randn(n) if bias else None
    if batch == 1:
        a, b = a[0], b[0]
        sa, sb = (sa[0], sb[0]) if mode == "row" else (sa, sb)
    plan = sm90_gemm.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), e4m3,
                          None if bias_t is None else ((n,), (1,)), None, torch.float32, 0,
                          GemmConfig(128, 16, swap_ab=True), b_dtype=e5m2,
                          bias_dtype=None if bias_t is None else torch.float32, scale_mode=mode)
    assert isinstance(plan, runtime_gemm.ScaledGemmLaunch) and plan.swap, plan
    assert plan.spec["ab"] == "e5m2" and plan.spec["b"] == "e4m3" and plan.spec["scale"] == mode
    out = torch.full(a.shape[:-1] + (n,), float("nan"))
    plan(a, b, sa, sb, bias_t, out)
    passed_a, passed_b, passed_sa, passed_sb = calls[0]
    assert passed_a is a and passed_b is b  # no per-call views
    if mode == "row":
        assert passed_sa is sa and passed_sb is sb
    expect = (a.double() * sa.double()) @ (b.double() * sb.double()) + (0 if bias_t is None else bias_t.double())
    torch.testing.assert_close(out.double(), expect)
    # blockwise scales have no swapped variant: the plan takes the unswapped decode tile
    block = sm90_gemm.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), e4m3, None, None,
                           torch.bfloat16, 0, GemmConfig(128, 16, swap_ab=True), b_dtype=e5m2, scale_mode="block")
    assert not block.swap and block.spec["tile"] == (64, 64)


def test_swapped_config_limits():
    """Swapped operands take the narrow MMA N (16, 32) and only there; they are cooperative,
    16-bit or FP8 with per-tensor or rowwise scales, and their spec key is new while every other
    variant's stays as it was."""
    import cutlass

    from torch_cute_ops.kernels.sm90.gemm import Sm90Gemm

    bf16 = cutlass.BFloat16
    assert "swap" not in GemmConfig(128, 256, 2, 1).spec_params()
    assert GemmConfig.from_spec_params(GemmConfig(64, 16, swap_ab=True).spec_params()).swap_ab
    kernel = Sm90Gemm(bf16, bf16, True, True, True, None, GemmConfig(64, 16, swap_ab=True))
    assert kernel.direct_store and kernel.ab_stages == 22  # 10 KB a stage
    with pytest.raises(ValueError, match="unsupported sm90 tile"):
        Sm90Gemm(bf16, bf16, True, True, False, None, GemmConfig(64, 16))
    with pytest.raises(ValueError, match="cooperative"):
        Sm90Gemm(bf16, bf16, True, True, False, None, GemmConfig(64, 32, swap_ab=True, pingpong=True))
    e4m3 = cutlass.Float8E4M3FN
    Sm90Gemm(e4m3, bf16, True, True, True, None, GemmConfig(128, 16, swap_ab=True), scale_mode="row")
    with pytest.raises(ValueError, match="blockwise"):
        Sm90Gemm(e4m3, bf16, True, True, False, None, GemmConfig(128, 16, swap_ab=True), scale_mode="block")


@pytest.mark.parametrize("a_k_major,tile_n,out,act", [(False, 16, "bf16", "none"), (True, 32, "fp32", "gelu_tanh")])
def test_swapped_ptx(tmp_path, a_k_major, tile_n, out, act):
    """A swapped variant: m64nXk16 WGMMAs on the narrow side, direct stores, no local memory."""
    spec = sm90_gemm.spec("bf16", out, a_k_major, True, True, None if act == "none" else act,
                          GemmConfig(64, tile_n, swap_ab=True), 2)
    compile_spec(spec, dump_dir=tmp_path)
    ptx = _ptx(tmp_path)
    assert f"wgmma.mma_async.sync.aligned.m64n{tile_n}k16" in ptx and "cp.async.bulk.tensor" in ptx
    assert "stmatrix" not in ptx and "st.global" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"


@pytest.mark.parametrize("mode,tile_n", [("row", 16), ("tensor", 32)])
def test_fp8_swapped_ptx(tmp_path, mode, tile_n):
    """FP8 on swapped operands (a decode step's tiles): m64nXk32 e4m3 WGMMAs, direct stores, the
    rowwise scales read from global memory in the epilogue, no local memory."""
    from torch_cute_ops.runtime.gemm import scaled_spec

    e4m3 = torch.float8_e4m3fn
    spec = scaled_spec(sm90_gemm, e4m3, e4m3, torch.bfloat16, torch.bfloat16, mode, "silu",
                       GemmConfig(128, tile_n, swap_ab=True), 2)
    compile_spec(spec, dump_dir=tmp_path)
    ptx = _ptx(tmp_path)
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k32\.f32\.e4m3\.e4m3", ptx)
    assert "stmatrix" not in ptx and "st.global" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"


# ---- stream-K --------------------------------------------------------------------------

def _stream_k_works(units, k_tiles, clusters):
    """Every cluster's work items under StreamKSplit, evaluated on ints (the kernel evaluates the
    same arithmetic on Int32 values)."""
    from torch_cute_ops.kernels.common.tile_scheduler import StreamKSplit

    split = StreamKSplit(units, k_tiles, clusters)
    return split, {c: [split.work(c, j) for j in range(split.num_works(c))] for c in range(clusters)}


@pytest.mark.parametrize("units,k_tiles,clusters", [
    (1024, 128, 66), (256, 64, 66), (512, 64, 132), (96, 64, 132), (32, 64, 132), (64, 1, 132), (7, 3, 132),
    (133, 16, 132), (264, 64, 132), (132, 64, 132), (1, 200, 132), (67, 2, 66), (500, 5, 132),
])
def test_stream_k_split_covers_every_k_tile_once(units, k_tiles, clusters):
    """Each unit's k-tiles are computed exactly once; one work item per unit finishes it (holds
    its last k-tile), and the clusters before it that hold the unit's other k-tiles each store one
    partial segment, their first stream-K item (so no finisher waits on a waiting cluster); a
    cluster stores at most one partial; every cluster walks the same number of k-tiles, give or
    take one, apart from the data-parallel ones it would have idled through."""
    split, works = _stream_k_works(units, k_tiles, clusters)
    covered, finishers, partials = {}, {}, {}
    for cluster, items in works.items():
        for j, (unit, k_begin, k_end, first) in enumerate(items):
            assert 0 <= unit < units and 0 <= k_begin < k_end <= k_tiles
            for k in range(k_begin, k_end):
                assert (unit, k) not in covered
                covered[unit, k] = cluster
            if k_end == k_tiles:
                assert unit not in finishers
                finishers[unit] = (cluster, first, k_begin)
            else:
                assert cluster not in partials and j == split.dp_waves, "one partial, the first stream-K item"
                partials[cluster] = unit
    assert len(covered) == units * k_tiles and sorted(finishers) == list(range(units))
    for unit, (cluster, first, k_begin) in finishers.items():
        contributors = [c for c, u in partials.items() if u == unit]
        assert contributors == list(range(first, cluster)), (unit, cluster, first, contributors)
        assert (k_begin == 0) == (first == cluster)
    walked = [sum(k_end - k_begin for _, k_begin, k_end, _ in items) for items in works.values()]
    assert all(w >= split.dp_waves * k_tiles for w in walked)
    sk_walked = [w - split.dp_waves * k_tiles for w in walked[:split.sk_clusters]]
    if sk_walked:  # a stream-K range is long enough to pay for its partial tile
        assert max(sk_walked) - min(sk_walked) <= 1
        assert min(sk_walked) >= min(STREAM_K_MIN_K_TILES, split.sk_k_tiles)


def test_stream_k_split_keeps_full_waves_data_parallel():
    """Whole waves stay data-parallel: no stream-K when the units fill every wave; otherwise the
    last full wave joins the partial one (between one and two waves of units are split)."""
    from torch_cute_ops.kernels.common.tile_scheduler import StreamKSplit

    assert StreamKSplit(264, 64, 132).sk_units == 0
    split = StreamKSplit(1024, 128, 66)  # 8192^3 on 128 x 256 tiles in 2 x 1 clusters
    assert (split.dp_waves, split.sk_units, split.sk_clusters) == (14, 100, 66)
    assert StreamKSplit(96, 64, 132).dp_waves == 0 and StreamKSplit(96, 64, 132).sk_clusters == 132


def test_stream_k_ptx(tmp_path):
    """A stream-K variant: the same main loop, partial sums stored and flags raised with release
    semantics, finishers spinning with acquire loads, no local memory; a data-parallel variant
    has none of it."""
    ptx = {}
    for name, stream_k in (("dp", False), ("sk", True)):
        spec = sm90_gemm.spec("bf16", "bf16", True, False, True, "gelu_tanh",
                              GemmConfig(128, 256, 2, 1, stream_k=stream_k), 2)
        compile_spec(spec, dump_dir=tmp_path / name)
        ptx[name] = _ptx(tmp_path / name)
    wgmma = r"wgmma\.mma_async\.sync\.aligned\.m64n256k16"
    assert len(re.findall(wgmma, ptx["sk"])) == len(re.findall(wgmma, ptx["dp"])) > 0
    assert "ld.acquire.gpu.global.b32" in ptx["sk"] and "st.release.gpu.global.b32" in ptx["sk"]
    assert "fence.acq_rel.gpu" in ptx["sk"] and "ld.global.cg.b32" in ptx["sk"] and "st.global.cg.b32" in ptx["sk"]
    assert "ld.local" not in ptx["sk"] and "st.local" not in ptx["sk"], "register spills"
    assert "ld.acquire" not in ptx["dp"] and "st.release" not in ptx["dp"]


def test_stream_k_launch_takes_a_workspace(monkeypatch):
    """A stream-K plan sizes one partial tile and one flag per CTA of its grid; others take none."""
    from torch_cute_ops.runtime import gemm as host

    monkeypatch.setattr(host, "get_compiled", lambda spec: spec)
    monkeypatch.setattr(host, "sm_count", lambda index: 132)
    for config, expect in [(GemmConfig(128, 256, 2, 1, stream_k=True), (132 * 128 * 256, 132)),
                           (GemmConfig(128, 16, swap_ab=True, stream_k=True), (132 * 128 * 16, 132)),
                           (GemmConfig(128, 256, 2, 1), None)]:
        plan = host.SM90.plan((4096, 4096), (4096, 1), (4096, 4096), (4096, 1), torch.bfloat16, None, None,
                              torch.bfloat16, 0, config)
        assert plan.workspace_size == expect and plan.spec.get("stream_k", False) == config.stream_k


@pytest.mark.parametrize("stream_k", [False, True], ids=["data-parallel", "stream-K"])
def test_exported_variants_take_the_launch_arguments(monkeypatch, tmp_path, stream_k):
    """What a new process loads from the disk cache (or a prebuilt library) is the exported
    function, which takes every parameter of the jit host function, the workspace's included:
    the launch passes them all (on CPU tensors the call gets as far as the device check)."""
    from torch_cute_ops.runtime import cache
    from torch_cute_ops.runtime import gemm as host

    monkeypatch.setenv("TORCH_CUTE_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(host, "sm_count", lambda index: 132)
    monkeypatch.setattr(host, "scratch", lambda device, numel, dtype, owner: torch.empty(numel, dtype=dtype))
    monkeypatch.setattr(host, "zeroed_int32", lambda device, count, owner: torch.zeros(count, dtype=torch.int32))
    config = GemmConfig(64, 64, stream_k=stream_k)
    a, b, out = (torch.randn(64, 64, dtype=torch.bfloat16) for _ in range(3))
    spec = sm90_gemm.spec("bf16", "bf16", True, False, False, None, config, 2)
    cache.get_compiled(spec)
    cache.clear_memory_cache()  # what a new process sees: the exported function on disk
    launch = sm90_gemm.plan((64, 64), (64, 1), (64, 64), (64, 1), torch.bfloat16, None, None, torch.bfloat16, 0,
                            config)
    assert launch.spec == spec
    with pytest.raises(ValueError, match="Mismatched Tensor on argument #0"):  # not a parameter count
        launch(a, b, None, out, 1.0)
