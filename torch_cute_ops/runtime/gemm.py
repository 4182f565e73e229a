"""Host side of the GEMM kernels (sm90, sm100): variants, coverage and the per-layout launch plan.

The op layer asks :meth:`GemmHost.plan` once per operand layout (shapes, strides, dtypes,
flags) for a :class:`GemmLaunch` or the reason no kernel covers it; a call then costs an
alignment check of the data pointers and one TVM-FFI call. Everything here is plain torch:
the CuTe DSL is imported only if a variant must be compiled.

Kernel convention: the compiled function takes torch-order tensors a (L, M, K), b (L, K, N),
[bias (N,)], out (L, M, N), then ``alpha`` and the persistent grid size, then a stream-K
variant's workspace (partial sums, flags; two Nones for the other variants), and reads the
stream from the TVM-FFI env stream (the current torch stream).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .cache import get_compiled
from .gemm_config import GemmConfig, choose_config, num_tiles, slot_use, wave_fill
from .scratch import scratch, zeroed_int32
from .spec import KernelSpec
from .tma import TMA_ALIGN_BYTES, tma_inner_layout, tma_inner_ready, tma_reason

ACTIVATIONS = ("relu", "gelu_tanh", "silu")  # the epilogues the kernels compile (kernels/common/activation.py)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
               torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
INPUT_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gemm_spec(family: str, arch: str, ab: str, out: str, a_k_major: bool, b_k_major: bool, has_bias: bool,
              activation: str | None, config: GemmConfig, rank: int = 3) -> KernelSpec:
    """a is ([L,] M, K): K-major or M-major; b is ([L,] K, N): K-major or N-major; ``rank`` 2
    takes single 2-D operands, 3 batched ones."""
    return KernelSpec.make(family, arch, ab=ab, out=out, a_major="k" if a_k_major else "m",
                           b_major="k" if b_k_major else "n", bias=has_bias, act=activation or "none",
                           rank=rank, **config.spec_params())


# ------------------------------------------------------------------------ operand layouts

def _aligned(extent: int, element_size: int) -> int:
    per_16b = TMA_ALIGN_BYTES // element_size
    return max(-(-extent // per_16b) * per_16b, per_16b)


def operand_strides(shape, stride, element_size) -> tuple[tuple[int, int, int], bool]:
    """TMA-friendly strides for an (L, R, C) operand, and whether C is the contiguous dim.

    For a (L, M, K), C-contiguous means K-major; for b (L, K, N) it means N-major. A size-1
    dim carries no stride information, so the majorness comes from a dim of size > 1 with
    stride 1, and size-1 dims get aligned strides (a free as_strided view; the values are
    never used for addressing) so the TMA accepts them.
    """
    batch, rows, cols = shape
    s_batch, s_rows, s_cols = stride
    if cols > 1 and s_cols == 1:
        cols_major = True
    elif rows > 1 and s_rows == 1:
        cols_major = False
    else:  # no size>1 dim with stride 1: a size-1 dim can play the contiguous one
        cols_major = cols == 1 or rows != 1
    if cols_major:
        s_cols = 1 if cols == 1 else s_cols
        s_rows = _aligned(cols, element_size) if rows == 1 else s_rows
    else:
        s_rows = 1
        s_cols = _aligned(rows, element_size) if cols == 1 else s_cols
    if batch == 1:
        s_batch = _aligned(rows * cols, element_size)
    return (s_batch, s_rows, s_cols), cols_major


def _as_3d(shape, stride):
    return (tuple(shape), tuple(stride)) if len(shape) == 3 else ((1, *shape), (0, *stride))


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))


def _view(shape, stride, kernel_shape, kernel_stride):
    """None when a tensor as received is what the kernel takes, else the (shape, strides) of
    the free as_strided view it gets (size-1 dims with strides the TMA would refuse)."""
    if tuple(stride) == tuple(kernel_stride):
        return None
    return (tuple(kernel_shape), tuple(kernel_stride))


def out_strides(shape3, element_size) -> tuple[int, int, int]:
    """A fresh row-major out (L, M, N), with aligned strides on size-1 dims."""
    batch, rows, cols = shape3
    return (_aligned(rows * cols, element_size) if batch == 1 else rows * cols,
            _aligned(cols, element_size) if rows == 1 else cols, 1)


# ----------------------------------------------------------------------------- coverage

def layout_reason(kernel: str, a_dtype, a_shape, a_stride, b_shape, b_stride, bias_layout, activation,
                  out_dtype, scale_mode: str | None = None) -> str | None:
    """Why a TMA GEMM kernel cannot take these (L, M, K) / (L, K, N) layouts, or None.
    The op layer has validated shapes and dtypes; pointers are checked per call."""
    if scale_mode is None and a_dtype not in INPUT_DTYPES:
        return f"{kernel}: inputs must be bf16 or fp16, got {a_dtype}"
    if scale_mode is not None and a_dtype not in FP8_DTYPES:
        return f"{kernel}: scaled inputs must be float8_e4m3fn or float8_e5m2, got {a_dtype}"
    if out_dtype not in OUT_DTYPES:
        return f"{kernel}: out dtype must be bf16, fp16 or fp32, got {out_dtype}"
    if activation is not None and activation not in ACTIVATIONS:
        return f"{kernel}: activation {activation!r} is not one of {ACTIVATIONS}"
    batch, m, k = a_shape
    n = b_shape[2]
    if k == 0:
        return f"{kernel}: K == 0 (the TMA needs non-empty operands)"
    for name, shape, stride in (("a", a_shape, a_stride), ("b", b_shape, b_stride)):
        strides, cols_major = operand_strides(shape, stride, a_dtype.itemsize)
        if scale_mode is not None and cols_major != (name == "a"):
            return f"{kernel}: FP8 WGMMA needs K-major operands, {name} is not"
        meta = torch.empty_strided(shape, strides, dtype=a_dtype, device="meta")
        reason = tma_reason(name, meta, (2 if cols_major else 1,))
        if reason:
            return reason
    out_bytes = out_dtype.itemsize
    if m > 1 and (n * out_bytes) % TMA_ALIGN_BYTES or batch > 1 and (m * n * out_bytes) % TMA_ALIGN_BYTES:
        return f"out: rows of N={n} {out_dtype} elements are not a multiple of 16 bytes (TMA store)"
    if bias_layout is not None:
        bias_shape, bias_stride = bias_layout
        if bias_stride[0] != 1 and bias_shape[0] > 1:
            return "bias: must be a contiguous (N,) vector"
    if max(batch, m, n, k) >= 2**31:
        return f"{kernel}: sizes must fit in int32"
    return None


def pointer_reason(a, b, bias) -> str | None:
    """The one per-call check: the TMA needs 16-byte aligned base addresses."""
    for name, t in (("a", a), ("b", b), ("bias", bias)):
        if t is not None and t.data_ptr() % TMA_ALIGN_BYTES:
            return f"{name}: data pointer is not {TMA_ALIGN_BYTES}-byte aligned (storage offset {t.storage_offset()})"
    return None


# ------------------------------------------------------------------------------- launch

class GemmLaunch:
    """One operand layout's launch: the compiled variant and the views it takes.

    A view is ``None`` when the tensor already is what the kernel takes (the usual case), else
    the ``(shape, strides)`` of a free ``as_strided`` view (size-1 dims with strides the TMA
    would refuse). ``swap``: the variant computes out^T = b^T @ a^T from the same tensors (its
    jit host function trades their roles).
    """

    __slots__ = ("fn", "grid", "a_view", "b_view", "out_view", "spec", "swap", "workspace_size")

    def __init__(self, fn, grid: int, a_view, b_view, out_view, spec: KernelSpec, swap: bool = False):
        self.fn, self.grid, self.spec, self.swap = fn, grid, spec, swap
        self.a_view, self.b_view, self.out_view = a_view, b_view, out_view
        self.workspace_size = stream_k_workspace_size(spec, grid)

    def workspace(self, out) -> tuple:
        """The trailing (partial sums, flags) arguments: a stream-K variant's workspace on
        ``out``'s device, Nones for the others (every variant's exported function takes both; the
        jit host function ignores them unless it is stream-K)."""
        if self.workspace_size is None:
            return _NO_WORKSPACE
        partials, flags = self.workspace_size
        device = out.device
        return scratch(device, partials, torch.float32, "gemm stream-K"), zeroed_int32(device, flags, "gemm stream-K")

    def views(self, a, b, out):
        """The tensors as the kernel takes them (free views)."""
        if self.a_view is not None:
            a = a.as_strided(*self.a_view)
        if self.b_view is not None:
            b = b.as_strided(*self.b_view)
        if self.out_view is not None:
            out = out.as_strided(*self.out_view)
        return a, b, out

    def __call__(self, a, b, bias, out, alpha: float) -> None:
        a, b, out = self.views(a, b, out)
        if bias is None:
            self.fn(a, b, out, alpha, self.grid, *self.workspace(out))
        else:
            self.fn(a, b, bias, out, alpha, self.grid, *self.workspace(out))


def tma_block_scales(scale_a: torch.Tensor, scale_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise scales as the Hopper kernel's TMA loads them with each k-tile: scale_a ([L,] M,
    K / 128) M-contiguous (torch._scaled_mm's layout for 1 x 128 scales), scale_b ([L,] K / 128,
    N / 128) contiguous along N, the other strides and the address 16-byte aligned (what
    ``fp8.quantize_blockwise`` returns); others are copied into that layout."""
    return tuple(s if tma_inner_ready(s, inner) else tma_inner_layout(s, inner)
                 for s, inner in ((scale_a, -2), (scale_b, -1)))


class ScaledGemmLaunch(GemmLaunch):
    """An FP8 variant's launch: the scales ride along (one-element ones as a 1-vector, blockwise
    ones in the layout the kernel's TMA reads, ``tma_block_scales``)."""

    __slots__ = ("scalar_scales", "tma_scales")

    def __init__(self, fn, grid: int, a_view, b_view, out_view, spec: KernelSpec, swap: bool = False):
        super().__init__(fn, grid, a_view, b_view, out_view, spec, swap)
        self.scalar_scales = spec["scale"] == "tensor"
        self.tma_scales = spec["scale"] == "block" and spec.arch == "sm_90a"

    def __call__(self, a, b, scale_a, scale_b, bias, out) -> None:
        a, b, out = self.views(a, b, out)
        if self.scalar_scales:
            scale_a, scale_b = scale_a.reshape(1), scale_b.reshape(1)
        elif self.tma_scales:
            scale_a, scale_b = tma_block_scales(scale_a, scale_b)
        if bias is None:
            self.fn(a, b, scale_a, scale_b, out, self.grid, *self.workspace(out))
        else:
            self.fn(a, b, scale_a, scale_b, bias, out, self.grid, *self.workspace(out))


class GemmHost:
    """The GEMM kernels of one arch, as the op layer sees them."""

    def __init__(self, arch: str, family: str, kernel_name: str):
        self.arch, self.family, self.kernel_name = arch, family, kernel_name

    def spec(self, *args, **kwargs) -> KernelSpec:
        return gemm_spec(self.family, self.arch, *args, **kwargs)

    def plan(self, a_shape, a_stride, b_shape, b_stride, dtype, bias_layout, activation, out_dtype,
             device_index: int, config: GemmConfig | None = None, *, b_dtype=None, bias_dtype=None,
             scale_mode: str | None = None) -> GemmLaunch | str:
        """The launch of one layout (2-D or 3-D operands, as the op received them), or the
        reason no kernel covers it. Resolves (maybe compiles) the variant: call it outside
        tracing, once per layout. With ``scale_mode`` ("tensor", "row", "block") the operands
        are FP8 (a's dtype ``dtype``, b's ``b_dtype``) and the launch a :class:`ScaledGemmLaunch`."""
        a3, b3 = _as_3d(a_shape, a_stride), _as_3d(b_shape, b_stride)
        if scale_mode is not None and scale_mode not in FP8_SCALE_MODES.get(self.arch, ()):
            return f"{self.kernel_name}: no FP8 variant with {scale_mode} scales"
        reason = layout_reason(self.kernel_name, dtype, *a3, *b3, bias_layout, activation, out_dtype, scale_mode)
        if reason:
            return reason
        (batch, m, k), n = a3[0], b3[0][2]
        rank = len(a_shape)  # 2-D operands take the rank-2 variant: no 3-D views per call
        sms = sm_count(device_index)
        config = config or choose_config(self.arch, m, n, k, batch, sms, fp8=scale_mode is not None)
        if scale_mode == "block":
            config = block_scaled_config(config, m, n, batch, sms)
        b_dtype, bias_dtype = b_dtype or dtype, bias_dtype if bias_layout is not None else None
        a_strides, a_k_major = operand_strides(*a3, dtype.itemsize)
        b_strides, b_n_major = operand_strides(*b3, dtype.itemsize)
        out_shape = (batch, m, n)
        o_strides = out_strides(out_shape, out_dtype.itemsize)
        launch_type = GemmLaunch if scale_mode is None else ScaledGemmLaunch
        if config.swap_ab:
            # out^T = b^T @ a^T: the kernel's A is b^T (K-major when b is), its B a^T (K-major when
            # a is), its out out^T (M-major); its jit host function makes those views of the tensors
            # the launch passes as for any variant. FP8 operands swap their dtypes (and scales) too.
            if scale_mode is None:
                spec = self.spec(DTYPE_NAMES[dtype], DTYPE_NAMES[out_dtype], not b_n_major, a_k_major,
                                 bias_layout is not None, activation, config, rank)
            else:
                spec = scaled_spec(self, b_dtype, dtype, out_dtype, bias_dtype, scale_mode, activation, config, rank)
        elif scale_mode is None:
            spec = self.spec(DTYPE_NAMES[dtype], DTYPE_NAMES[out_dtype], a_k_major, not b_n_major,
                             bias_layout is not None, activation, config, rank)
        else:
            spec = scaled_spec(self, dtype, b_dtype, out_dtype, bias_dtype, scale_mode, activation, config, rank)
        if bias_layout is not None and n % 2 and not config.swap_ab:
            # only single-row outputs: the bias read column by column
            spec = KernelSpec.make(spec.family, spec.arch, **dict(spec.params), odd_n=True)
        out_received = tuple(a_shape[:-1]) + (n,)
        views = (_view(a_shape, a_stride, a3[0][3 - rank:], a_strides[3 - rank:]),
                 _view(b_shape, b_stride, b3[0][3 - rank:], b_strides[3 - rank:]),
                 _view(out_received, _contiguous_strides(out_received), out_shape[3 - rank:], o_strides[3 - rank:]))
        return launch_type(get_compiled(spec), sms // (config.cluster_m * config.cluster_n), *views, spec,
                           swap=config.swap_ab)

    def launch(self, a, b, bias, activation, out, alpha: float = 1.0, config: GemmConfig | None = None) -> None:
        """out = act(alpha * a @ b + bias) on the current stream, uncached (tests, benchmarks):
        a (L, M, K) or (M, K), b and out to match; ``config`` overrides the heuristic."""
        if out.numel() == 0:
            return
        bias_layout = None if bias is None else (tuple(bias.shape), bias.stride())
        device_index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        plan = self.plan(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype, bias_layout, activation,
                         out.dtype, device_index, config)
        if isinstance(plan, str):
            raise ValueError(plan)
        if not out.is_contiguous():
            raise ValueError("out: must be a contiguous (row-major) tensor")
        plan(a, b, bias, out, float(alpha))

    def unsupported_reason(self, a, b, bias, activation, out_dtype) -> str | None:
        """Why no kernel takes these tensors (any 2-D/3-D layout, pointers included), or None."""
        a3, b3 = _as_3d(a.shape, a.stride()), _as_3d(b.shape, b.stride())
        bias_layout = None if bias is None else (tuple(bias.shape), bias.stride())
        return (layout_reason(self.kernel_name, a.dtype, *a3, *b3, bias_layout, activation, out_dtype or a.dtype)
                or pointer_reason(a, b, bias))

    def shipped(self) -> list[KernelSpec]:
        return _SHIPPED[self.arch](self)


_NO_WORKSPACE = (None, None)


def stream_k_workspace_size(spec: KernelSpec, grid: int) -> tuple[int, int] | None:
    """(fp32 partial sums, int32 flags) a stream-K variant launched on ``grid`` clusters takes:
    one slot of a tile's values and one flag per CTA (kernels/common/tile_scheduler.py); None for
    the other variants."""
    if not spec.get("stream_k", False):
        return None
    (tile_m, tile_n), (cluster_m, cluster_n) = spec["tile"], spec["cluster"]
    ctas = grid * cluster_m * cluster_n
    return ctas * tile_m * tile_n, ctas


def scaled_spec(host: GemmHost, a_dtype, b_dtype, out_dtype, bias_dtype, scale_mode: str, activation,
                config: GemmConfig, rank: int = 3) -> KernelSpec:
    """An FP8 variant (K-major a and b): the 16-bit spec's parameters plus b's dtype, the scale
    mode and, with a bias, its dtype."""
    extra = {"b": DTYPE_NAMES[b_dtype], "scale": scale_mode}
    if bias_dtype is not None:
        extra["bias_dtype"] = DTYPE_NAMES[bias_dtype]
    return KernelSpec.make(host.family, host.arch, ab=DTYPE_NAMES[a_dtype], out=DTYPE_NAMES[out_dtype], a_major="k",
                           b_major="k", bias=bias_dtype is not None, act=activation or "none", rank=rank,
                           **config.spec_params(), **extra)


# Blockwise 128 x 192 (one k-tile fragment per warpgroup) against 128 x 128 (two) where both fill
# their waves: +1 to +10% at 8192^3 and 16384 x 8192 / 12288 / 14336 x 4096 (H100, bench_fp8.py,
# several runs; bench/NOTES.md, 2026-11-26, "Blockwise 128 x 192; ordered adds over rotated walks"),
# level at 1024 / 16384 x 4096 x 4096 and 1024 x 12288.
# Elsewhere the tile count's wave fill decides.
BLOCK_192_EFFICIENCY = 1.03


# Blockwise 256 x 128 (each warpgroup's rows in two waves) against 128 x 128 where both fill their
# waves, through the pipeline's polled waits: +5% at 4096 / 1024 x 4096 x 14336, and +2 to +5% over
# 128 x 192 at 8192^3, 16384 x 8192 x 4096 and 4096 x 14336 x 4096 (H100, bench/NOTES.md,
# 2026-11-26, "DeepGEMM measured here; blockwise 256 x 128"). Its 1 x 2 cluster (A multicast to
# the pair) was the faster one at four of those five shapes.
BLOCK_256_EFFICIENCY = 1.06


def block_scaled_config(config: GemmConfig, m: int | None = None, n: int | None = None, batch: int = 1,
                        sms: int = 132) -> GemmConfig:
    """Blockwise scales keep a k-tile fragment beside the accumulator (kernels/sm90/
    gemm_block_scaled.py): cooperative tiles of 64 or 128 columns (two fragments), 128 x 192
    (one), or 256 x 128 (one, a wave of rows at a time). A 128 x 256 pick (the heuristic's for
    wide problems) becomes 128 x 192 where that fills the waves about as well as 128 x 128 (given
    the problem's ``m``, ``n``), else 128 x 128; then 256 x 128 in a 1 x 2 cluster where it holds
    the problem about as well as that pick. They have no swapped variant: a decode step's rows
    take 64 x 64 tiles instead."""
    if config.swap_ab:
        return GemmConfig(64, 64)
    if not config.pingpong and (128 % config.tile_n == 0 or config.tile_mn in ((128, 192), (256, 128))):
        return config
    narrow = dataclasses.replace(config, tile_n=128, pingpong=False)
    if config.tile_mn != (128, 256) or m is None:
        return narrow
    wide_fill = wave_fill(num_tiles(m, n, batch, 128, 192), sms)
    narrow_fill = wave_fill(num_tiles(m, n, batch, 128, 128), sms)
    picked = dataclasses.replace(config, tile_n=192) if BLOCK_192_EFFICIENCY * wide_fill > narrow_fill else narrow
    efficiency = BLOCK_192_EFFICIENCY if picked.tile_n == 192 else 1.0
    tall = dataclasses.replace(config, tile_m=256, tile_n=128, cluster_m=1, cluster_n=2 if n > 128 else 1)
    # (each tiling's share of the tile slots that holds the problem, its clusters left aside)
    if (BLOCK_256_EFFICIENCY * slot_use(GemmConfig(256, 128), m, n, batch, sms)
            > efficiency * slot_use(GemmConfig(*picked.tile_mn), m, n, batch, sms)):
        return tall
    return picked


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm90_shipped(host: GemmHost) -> list[KernelSpec]:
    """bf16 row-major A and B at the three big tiles, the fused bias + gelu_tanh MLP epilogue,
    nn.Linear's layout and its backward's (dW = x^T @ dy: M-major A), stream-K twins of those
    for many-wave problems, the fp16 twin; 2-D
    operands (the eager common case), one batched; the tiles the heuristic gives few-row
    problems (M up to 1152 at LLM widths), with row-major and with nn.Linear's B, and a decode
    step's swapped ones; FP8 e4m3 -> bf16 with rowwise and with blockwise scales at the tiles
    LLM widths take from M = 1."""
    big, medium = GemmConfig(128, 256, 2, 1), GemmConfig(128, 128, 2, 1)
    big_stream_k = GemmConfig(128, 256, 2, 1, stream_k=True)  # many waves, the last one partial
    # 128 x 192 ping-pong: large M and N at K <= 1024, and the widths where it fills the waves
    wide_pingpong = GemmConfig(128, 192, 2, 1, pingpong=True)
    one_row_of_tiles, m64 = GemmConfig(128, 128), GemmConfig(64, 64)  # M <= 128, M <= 64
    few_rows = (medium, one_row_of_tiles, GemmConfig(64, 64, 2, 1), GemmConfig(128, 64, 2, 1), wide_pingpong,
                m64, GemmConfig(64, 128), GemmConfig(128, 96), GemmConfig(64, 96))
    # a few waves (M = 384 .. 1152 at LLM widths): 192-row tiles, and 1 x 1 clusters where a 2 x 1
    # cluster's second CTA would lie past M and add a wave
    few_waves = (GemmConfig(192, 192, 2, 1), GemmConfig(192, 192), GemmConfig(192, 128), GemmConfig(192, 64),
                 GemmConfig(128, 256), GemmConfig(128, 192, pingpong=True), GemmConfig(128, 160, 1, 2))
    # a decode step (M <= 32): swapped operands, so the kernel's A is the weight: M-major for
    # x @ W, K-major for nn.Linear's x @ W.T (whose bias rides along too); its B is x, K-major
    decode = (GemmConfig(128, 16, swap_ab=True), GemmConfig(128, 32, swap_ab=True))
    decode_variants = [host.spec("bf16", "bf16", weight_k_major, True, bias, None, config, 2) for config in decode
                       for weight_k_major, bias in ((False, False), (True, False), (True, True))]
    fp8_small = (medium, one_row_of_tiles, m64)  # FP8's tiles below 128 x 256
    fp8_block_wide = GemmConfig(128, 192, 2, 1)  # blockwise scales' pick for 128 x 256 (block_scaled_config)
    e4m3 = torch.float8_e4m3fn
    return [
        *(host.spec("bf16", "bf16", True, False, False, None, big, rank) for rank in (2, 3)),
        # x @ W.T [+ b]: nn.Linear's weight is K-major B
        *(host.spec("bf16", "bf16", True, True, has_bias, None, big, 2) for has_bias in (False, True)),
        host.spec("bf16", "bf16", False, False, False, None, big, 2),  # a weight's gradient, x^T @ dy
        # the same four layouts where the tiles make many waves (a training step's 16k tokens)
        *(host.spec("bf16", "bf16", a_k_major, b_k_major, has_bias, None, big_stream_k, 2)
          for a_k_major, b_k_major, has_bias in ((True, False, False), (True, True, False), (True, True, True),
                                                 (False, False, False))),
        *(host.spec("bf16", "bf16", True, b_k_major, False, None, config, 2)
          for config in (*few_rows, *few_waves) for b_k_major in (False, True)),
        *decode_variants,
        host.spec("bf16", "bf16", True, False, True, "gelu_tanh", big, 2),
        host.spec("fp16", "fp16", True, False, False, None, big, 2),
        # FP8 x @ W.T at the tiles the heuristic gives it from a decode step's M up
        *(scaled_spec(host, e4m3, e4m3, torch.bfloat16, None, "row", None, config, 2)
          for config in (big, *fp8_small, *decode)),
        *(scaled_spec(host, e4m3, e4m3, torch.bfloat16, None, "block", None, config, 2)
          for config in (fp8_block_wide, *fp8_small)),
    ]


def _sm100_shipped(host: GemmHost) -> list[KernelSpec]:
    """1-CTA and 2-CTA (+ 4x1 multicast) tiles, plain and fused epilogues, row-major B (x @ W)
    and K-major B (x @ W.T, an nn.Linear weight), one fp16 -> fp32; batched and one 2-D; FP8
    e4m3 -> bf16 with rowwise scales."""
    one_cta, two_cta, two_cta_mcast = GemmConfig(128, 256), GemmConfig(256, 256, 2, 1), GemmConfig(256, 256, 4, 1)
    return [
        scaled_spec(host, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, None, "row", None, two_cta, 2),
    ] + [
        host.spec("bf16", "bf16", True, False, False, None, one_cta),
        host.spec("bf16", "bf16", True, True, True, "gelu_tanh", one_cta),
        host.spec("bf16", "bf16", True, False, False, None, two_cta),
        host.spec("bf16", "bf16", True, True, True, "relu", two_cta),
        host.spec("fp16", "fp32", False, False, True, "silu", two_cta_mcast),
        host.spec("bf16", "bf16", True, True, True, None, one_cta, 2),
    ]


_SHIPPED = {"sm_90a": _sm90_shipped, "sm_100a": _sm100_shipped}
# the FP8 scale modes each arch's kernel has (blockwise promotion per k-tile: Hopper only)
FP8_SCALE_MODES = {"sm_90a": ("tensor", "row", "block"), "sm_100a": ("tensor", "row")}

SM90 = GemmHost("sm_90a", "gemm_sm90", "sm90 gemm kernel")
SM100 = GemmHost("sm_100a", "gemm_sm100", "sm100 gemm kernel")
