"""The Hopper GEMM kernel against a float32 reference, on an sm_90 GPU.

Every case draws fresh random operands, poisons the output with NaN before the
launch (so an unwritten element fails) and compares with a float32 matmul of the
same rounded inputs: relative Frobenius error and max error relative to max |ref|.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs an sm_90 (Hopper) GPU",
    ),
]

# relative Frobenius error, max error / max |ref|
TOLERANCE = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 4e-3), torch.float32: (1e-4, 1e-3)}


def operand(batch, rows, cols, cols_major, dtype, batch_gap=0):
    """(batch, rows, cols) random tensor, contiguous along cols (else rows); batch_gap
    extra elements between batches make the batch stride non-compact."""
    inner = (rows, cols) if cols_major else (cols, rows)
    size = inner[0] * inner[1]
    flat = torch.randn(batch, size + batch_gap, device="cuda").to(dtype)
    t = flat[:, :size].unflatten(1, inner)
    return t if cols_major else t.transpose(1, 2)


def reference(a, b, bias, activation, out_dtype, alpha=1.0):
    from torch_cute_ops.reference.gemm import ACTIVATIONS

    ref = torch.matmul(a.float(), b.float()) * alpha
    if bias is not None:
        ref = ref + bias.float()
    if activation is not None:
        ref = ACTIVATIONS[activation](ref)
    return ref


def check(out, ref, dtype):
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    diff = (out.float() - ref).float()
    rel = (diff.norm() / ref.norm().clamp_min(1e-6)).item()
    max_rel = (diff.abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    bound_rel, bound_max = TOLERANCE[dtype]
    assert rel < bound_rel and max_rel < bound_max, f"rel {rel:.2e} max {max_rel:.2e}"


def run_case(m, n, k, *, batch=1, a_k_major=True, b_n_major=True, dtype=torch.bfloat16, out_dtype=None,
             bias=False, activation=None, batch_gap=0, config=None, alpha=1.0, two_d=False):
    """``two_d``: the operands are single 2-D (M, K) / (K, N) views, served by the rank-2 variant."""
    from torch_cute_ops.runtime.gemm import SM90 as sm90_gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    out_dtype = out_dtype or dtype
    a = operand(batch, m, k, a_k_major, dtype, batch_gap)
    b = operand(batch, k, n, b_n_major, dtype, batch_gap)
    bias_t = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    out = torch.full((batch, m, n), float("nan"), device="cuda", dtype=out_dtype)
    if two_d:
        assert batch == 1
        a, b, out = a[0], b[0], out[0]
    assert sm90_gemm.unsupported_reason(a, b, bias_t, activation, out_dtype) is None
    sm90_gemm.launch(a, b, bias_t, activation, out, alpha, config=config)
    torch.cuda.synchronize()
    check(out, reference(a, b, bias_t, activation, out_dtype, alpha), out_dtype)


# (M, N, K, a K-major, b N-major): tails in every dim, tiny and odd sizes where the
# majorness keeps the leading dims 16-byte aligned
SHAPES = [
    (1000, 1000, 1000, True, True),
    (4095, 1000, 1000, True, False),
    (17, 4096, 1000, True, True),
    (1000, 1000, 17, False, True),
    (1000, 8, 4095, False, True),
    (1, 4096, 4095, True, True),
    (1, 1000, 1000, True, False),
    (1000, 1000, 1, False, True),
    (256, 512, 40, True, True),
    (64, 64, 64, True, True),
    (4096, 4096, 4096, True, True),
]


@pytest.mark.parametrize("two_d", [False, True], ids=["3d", "2d"])
@pytest.mark.parametrize("m,n,k,a_k_major,b_n_major", SHAPES)
def test_shapes(m, n, k, a_k_major, b_n_major, two_d):
    run_case(m, n, k, a_k_major=a_k_major, b_n_major=b_n_major, two_d=two_d)


# a last tile row (column) over the M (N) tail moves back to end at row M (column N), and a
# cluster's CTA wholly past M or N with it: tiles of 64 / 128 / 192 rows, ping-pong, 1 x 2
# clusters, fp32 (direct) and 16-bit (TMA) out, x @ W and x @ W.T, M or N below one tile (no move)
TAIL_CASES = [
    (260, 4096, 200, (192, 64, 1, 1, False)),
    (193, 520, 136, (192, 192, 2, 1, False)),
    (300, 1000, 264, (128, 128, 2, 1, False)),
    (130, 776, 72, (128, 256, 1, 1, False)),
    (331, 1000, 64, (128, 192, 2, 1, True)),
    (200, 1000, 64, (128, 128, 1, 2, False)),
    (100, 256, 64, (128, 128, 2, 1, False)),
    (97, 304, 128, (64, 64, 2, 1, False)),
    (520, 96, 64, (128, 128, 1, 1, False)),
    (640, 4096, 136, (128, 160, 1, 1, False)),
]


@pytest.mark.parametrize("m,n,k,config", TAIL_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else str(v))
@pytest.mark.parametrize("out_dtype,b_k_major", [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16", "fp32"])
def test_tail_tiles(m, n, k, config, out_dtype, b_k_major):
    """Every output right (those two tiles share included), and bitwise the same on a rerun."""
    from torch_cute_ops.runtime.gemm import SM90 as sm90_gemm
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    tile_m, tile_n, cluster_m, cluster_n, pingpong = config
    config = GemmConfig(tile_m, tile_n, cluster_m, cluster_n, group_size=3, pingpong=pingpong)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if b_k_major
         else torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    outs = [torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype) for _ in range(2)]
    for out in outs:
        sm90_gemm.launch(a, b, bias, "gelu_tanh", out, config=config)
    torch.cuda.synchronize()
    check(outs[0], reference(a, b, bias, "gelu_tanh", out_dtype), out_dtype)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("m", [17, 200, 333])
def test_tail_tiles_swapped(m):
    """Swapped operands: the kernel's rows are the weight's N (here 1000 = 7 x 128 + 104), its
    columns the caller's M (17 < 32: no move)."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    run_case(m, 1000, 264, config=GemmConfig(128, 32, swap_ab=True), bias=True, two_d=True)


# the heuristic's few-wave picks (M = 384 .. 1100 at wide N), with tails: 192-row tiles in 2 x 1
# and 1 x 1 clusters, and 1 x 1 clusters over odd numbers of 128-row tiles
FEW_WAVE_PICKS = [
    (1100, 4000, 264, (192, 192), (2, 1), False),
    (700, 12288, 104, (192, 192), (2, 1), False),
    (384, 4000, 136, (192, 64), (1, 1), False),
    (384, 14000, 64, (192, 128), (1, 1), False),
    (600, 12000, 200, (128, 256), (1, 1), False),
    (640, 14336, 72, (128, 192), (1, 1), True),
    (600, 4000, 136, (128, 160), (1, 2), False),
]


@pytest.mark.parametrize("m,n,k,tile,cluster,pingpong", FEW_WAVE_PICKS,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("b_n_major,bias", [(True, False), (False, True)], ids=["x@W", "x@W.T+gelu"])
def test_few_wave_picks(m, n, k, tile, cluster, pingpong, b_n_major, bias):
    from torch_cute_ops.runtime.gemm_config import choose_config

    config = choose_config("sm_90a", m, n, k, 1, torch.cuda.get_device_properties(0).multi_processor_count)
    assert (config.tile_mn, config.cluster_mn, config.pingpong) == (tile, cluster, pingpong)
    run_case(m, n, k, b_n_major=b_n_major, bias=bias, activation="gelu_tanh" if bias else None, two_d=True)


@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_majorness_batched(a_k_major, b_n_major, dtype):
    run_case(520, 776, 392, batch=3, a_k_major=a_k_major, b_n_major=b_n_major, dtype=dtype, batch_gap=24)


@pytest.mark.parametrize("activation", [None, "relu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [False, True])
def test_epilogue(activation, bias):
    run_case(777, 1048, 512, bias=bias, activation=activation)
    run_case(777, 1048, 512, bias=bias, activation=activation, two_d=True, out_dtype=torch.float32)


@pytest.mark.parametrize("alpha,bias,activation", [(0.5, True, "gelu_tanh"), (-1.25, False, None),
                                                   (0.0625, True, "silu")])
def test_alpha(alpha, bias, activation):
    """alpha scales A @ B before the bias and the activation, in both output paths."""
    run_case(777, 1048, 512, bias=bias, activation=activation, alpha=alpha)
    run_case(300, 264, 520, out_dtype=torch.float32, bias=bias, activation=activation, alpha=alpha)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_pairs_and_odd_n(dtype):
    """The bias is read as pairs of columns (one 32-bit word): a single-row output with an odd
    N (its own column-by-column variant) and an N tail inside the last pair's tile."""
    run_case(1, 1001, 1000, b_n_major=False, dtype=dtype, bias=True, activation="gelu_tanh", two_d=True)
    run_case(130, 264, 72, dtype=dtype, bias=True, activation="gelu_tanh")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_out(dtype):
    run_case(300, 264, 520, batch=2, dtype=dtype, out_dtype=torch.float32, bias=True, activation="silu")


CONFIGS = [(128, 256, 2, 1, False), (128, 128, 1, 1, False), (128, 128, 1, 2, False), (64, 128, 1, 1, False),
           (64, 64, 1, 1, False), (128, 128, 2, 1, True), (128, 192, 1, 1, True), (128, 192, 2, 1, True),
           (64, 256, 1, 2, True), (128, 64, 1, 1, False), (128, 64, 2, 1, False), (128, 192, 2, 1, False),
           (64, 64, 2, 1, False), (192, 128, 1, 1, False), (192, 192, 2, 1, False), (192, 64, 1, 2, False),
           (128, 160, 1, 1, False), (128, 160, 2, 1, False), (128, 160, 1, 2, False)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "{}x{}_c{}x{}_pp{:d}".format(*c))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_configs(config, out_dtype):
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    tile_m, tile_n, cluster_m, cluster_n, pingpong = config
    config = GemmConfig(tile_m, tile_n, cluster_m, cluster_n, group_size=3, pingpong=pingpong)
    # odd tile counts: the last cluster and the last ping-pong turn are partial
    run_case(1000, 1000, 1000, batch=3, bias=True, activation="gelu_tanh", out_dtype=out_dtype, config=config)


@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("b_n_major", [True, False], ids=["x@W", "x@W.T"])
def test_96_column_tiles(tile_m, b_n_major):
    """96-column tiles (one row of them is a wave at N = 12288): N tails of 40 and 8 columns, B
    of either majorness (N-major, a tile row is one and a half 128-byte swizzle rows), bias and
    gelu_tanh, a batch with fp32 out, and 2 x 1 clusters."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    config = GemmConfig(tile_m, 96)
    for m, n, k in ((tile_m, 12288, 512), (100, 1000, 264), (33, 1064, 200)):
        run_case(m, n, k, b_n_major=b_n_major, bias=True, activation="gelu_tanh", config=config)
    run_case(1000, 1000, 1000, batch=3, b_n_major=b_n_major, out_dtype=torch.float32, config=config)
    run_case(300, 1000, 1000, b_n_major=b_n_major, bias=True, config=GemmConfig(tile_m, 96, 2, 1))


@pytest.mark.parametrize("m,n,k,batch,b_n_major,bias,activation,out_dtype,tile_n", [
    (1, 4096, 4095, 1, True, False, None, torch.bfloat16, 16),
    (1, 1000, 1000, 1, False, True, None, torch.bfloat16, 16),
    (7, 4096, 1000, 1, False, True, "silu", torch.bfloat16, 16),
    (16, 1000, 4096, 2, True, True, "gelu_tanh", torch.float32, 16),
    (33, 4096, 1000, 3, False, False, None, torch.float16, 32),
    (64, 1000, 520, 1, True, True, "relu", torch.bfloat16, 32),
    # the heuristic's decode tiles, 128 x 16 and 128 x 32: N tails past a 128-row kernel tile
    (1, 4000, 4096, 1, False, True, None, torch.bfloat16, (128, 16)),
    (13, 1096, 2056, 2, True, False, "gelu_tanh", torch.float16, (128, 16)),
    (16, 4096, 1000, 1, True, True, "silu", torch.float32, (128, 16)),
    (29, 1096, 4096, 1, True, True, None, torch.bfloat16, (128, 32)),
    (32, 4000, 1000, 2, False, False, "relu", torch.float32, (128, 32)),
])
def test_swapped_operands(m, n, k, batch, b_n_major, bias, activation, out_dtype, tile_n):
    """out^T = b^T @ a^T (config.swap_ab): a decode step's rows on the MMA's narrow N, the
    bias along the kernel's rows, the out written M-major; tails in M, N and K."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    tile_m, tile_n = tile_n if isinstance(tile_n, tuple) else (64, tile_n)
    dtype = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
    run_case(m, n, k, batch=batch, b_n_major=b_n_major, dtype=dtype, out_dtype=out_dtype, bias=bias,
             activation=activation, config=GemmConfig(tile_m, tile_n, swap_ab=True), two_d=batch == 1)


def test_swapped_operands_transposed_rows():
    """Swapped operands with ``a`` M-major (a transposed view, 16-byte aligned rows): the kernel's
    B is then N-major."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    run_case(16, 1000, 1000, a_k_major=False, b_n_major=False, bias=True, config=GemmConfig(128, 16, swap_ab=True),
             two_d=True)


# stream-K: (M, N, K, batch, config, bias + activation, out dtype). Units over and under one wave
# of clusters, tails in M, N and K, k-ranges shorter than a tile (units < clusters), K of one
# k-tile (fewer stream-K clusters), 2 x 1 and 1 x 2 clusters, swapped operands, fp32 out.
STREAM_K_CASES = [
    (4096, 4096, 4096, 1, (128, 256, 2, 1), True, torch.bfloat16),
    (3000, 5000, 1000, 1, (128, 256, 2, 1), False, torch.bfloat16),
    (1000, 1000, 1000, 3, (128, 128, 1, 1), True, torch.float32),
    (128, 12288, 4096, 1, (128, 128, 1, 1), False, torch.bfloat16),
    (1000, 1000, 40, 1, (128, 128, 2, 1), True, torch.bfloat16),
    (1000, 1000, 1000, 1, (128, 128, 1, 2), False, torch.bfloat16),
    (64, 4096, 4096, 1, (64, 64, 1, 1), True, torch.bfloat16),
    (520, 776, 392, 2, (64, 128, 2, 1), False, torch.float32),
    (1152, 4096, 1000, 1, (192, 192, 2, 1), True, torch.bfloat16),
]


@pytest.mark.parametrize("m,n,k,batch,config,epilogue,out_dtype", STREAM_K_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
def test_stream_k(m, n, k, batch, config, epilogue, out_dtype):
    """Stream-K variants (GemmConfig.stream_k): every tile whole after the finisher added the
    partial sums, including the epilogue (bias + gelu_tanh)."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    config = GemmConfig(*config, stream_k=True)
    run_case(m, n, k, batch=batch, bias=epilogue, activation="gelu_tanh" if epilogue else None,
             out_dtype=out_dtype, config=config, two_d=batch == 1)


@pytest.mark.parametrize("m,n,k,batch,tile_n,out_dtype", [(1, 4096, 4096, 1, 16, torch.bfloat16),
                                                          (32, 4000, 1000, 2, 32, torch.float32)])
def test_stream_k_swapped(m, n, k, batch, tile_n, out_dtype):
    """A decode step's swapped tiles with their K split over the idle SMs."""
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    run_case(m, n, k, batch=batch, bias=True, out_dtype=out_dtype, two_d=batch == 1,
             config=GemmConfig(128, tile_n, swap_ab=True, stream_k=True))


def test_stream_k_is_deterministic_and_leaves_its_flags_down():
    """Launches in a row (new inputs each time) and a CUDA graph replayed on new inputs: each
    result right (a flag left raised would let a finisher add a stale slot), and the same
    inputs give the same bits (partial sums are added in a fixed order)."""
    from torch_cute_ops.runtime.gemm import SM90
    from torch_cute_ops.runtime.gemm_config import GemmConfig

    config = GemmConfig(128, 256, 2, 1, stream_k=True)
    m, n, k = 4096, 4096, 1000
    a, b = operand(1, m, k, True, torch.bfloat16)[0], operand(1, k, n, True, torch.bfloat16)[0]
    outs = []
    for _ in range(3):
        outs.append(torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16))
        SM90.launch(a, b, None, None, outs[-1], config=config)
        a2, b2 = torch.randn_like(a), torch.randn_like(b)
        other = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        SM90.launch(a2, b2, None, None, other, config=config)
        torch.cuda.synchronize()
        check(other, reference(a2, b2, None, None, torch.bfloat16), torch.bfloat16)
    check(outs[0], reference(a, b, None, None, torch.bfloat16), torch.bfloat16)
    assert all(torch.equal(outs[0], o) for o in outs[1:])

    static_a, static_b = a.clone(), b.clone()
    static_out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    SM90.launch(static_a, static_b, None, None, static_out, config=config)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        SM90.launch(static_a, static_b, None, None, static_out, config=config)
    for _ in range(2):
        static_a.copy_(torch.randn_like(a))
        static_b.copy_(torch.randn_like(b))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(static_out, reference(static_a, static_b, None, None, torch.bfloat16), torch.bfloat16)


def test_op_layer():
    """torch.ops.cute.gemm runs this kernel (strict mode forbids the fallback)."""
    import torch_cute_ops  # noqa: F401  registers the ops
    from torch_cute_ops.ops import fallback

    a = torch.randn(336, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 264, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(264, device="cuda", dtype=torch.bfloat16)
    fallback.reset()
    out = torch.ops.cute.gemm(a, b, bias, "gelu_tanh")
    assert not fallback.counts(), fallback.counts()
    check(out, reference(a, b, bias, "gelu_tanh", torch.bfloat16), torch.bfloat16)
    # transposed views (what autograd passes) reach the kernel without copies
    out_t = torch.ops.cute.gemm(b.t(), a.t())
    assert not fallback.counts(), fallback.counts()
    check(out_t, reference(b.t(), a.t(), None, None, torch.bfloat16), torch.bfloat16)
