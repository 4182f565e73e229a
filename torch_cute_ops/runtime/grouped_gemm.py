"""Host side of the grouped GEMM (sm90): variants, coverage, the group table and the launch.

The op layer asks :meth:`GroupedGemmHost.plan` once per operand layout for a launch or the reason
no kernel covers it. A launch makes the kernel's group table on the device from ``offs`` (or a
masked layout's counts) with a few tiny torch ops, so no value ever reaches the host; the grid
comes from shapes alone (kernels/sm90/gemm_grouped.py explains the table and the schedule).

Kernel convention (``Sm90Gemm.run_grouped``): torch-order a (M, K); b (G, K, N) for the rows mode,
(K, N) for the K mode; the table (int32, contiguous); out (M, N) or (G, M, N); the persistent
grid size.
"""

from __future__ import annotations

import torch

from .cache import get_compiled
from .gemm import SM90 as DENSE_SM90
from .gemm import (DTYPE_NAMES, GemmLaunch, _view, gemm_spec, layout_reason, operand_strides, out_strides,
                   scaled_spec, sm_count)
from .gemm_config import GemmConfig
from .spec import KernelSpec
from .tma import TMA_ALIGN_BYTES

TILE_K_16BIT = 64  # the kernel's k-tile of 16-bit operands (128 bytes)


def grouped_config(form: str, n: int) -> GemmConfig:
    """Cooperative 1 x 1 tiles (a cluster's CTAs may lie in different groups): 128 x 256 where
    N holds a few of them (an expert's gate/up or down projection), else 128 x 128."""
    return GemmConfig(128, 256 if n >= 1024 else 128)


def grouped_spec(arch: str, ab: torch.dtype, out: torch.dtype, a_k_major: bool, b_k_major: bool, mode: str,
                 config: GemmConfig, gated: tuple | None = None, scale_mode: str | None = None) -> KernelSpec:
    """``gated``: (activation, alpha, limit, gate/up layout) of a fused gate/up epilogue;
    ``scale_mode`` "row": FP8 operands (K-major) with rowwise scales."""
    if scale_mode is None:
        base = gemm_spec("gemm_sm90", arch, DTYPE_NAMES[ab], DTYPE_NAMES[out], a_k_major, b_k_major, False, None,
                         config, 2)
    else:
        base = scaled_spec(DENSE_SM90, ab, ab, out, None, scale_mode, None, config, 2)
    extra = {}
    if gated is not None:
        activation, alpha, limit, layout = gated
        extra = {"gated": activation, "gate_alpha": float(alpha), "gate_limit": float(limit), "gate_up": layout}
    return KernelSpec.make(base.family, base.arch, **dict(base.params), grouped=mode, **extra)


def rows_table(offs: torch.Tensor, rows: int, tile_m: int) -> torch.Tensor:
    """(3, G + 1) int32: group starts, ends and cumulative row-tile counts; column G covers the
    rows past offs[-1] (stored as zeros)."""
    starts = torch.cat([offs.new_zeros(1), offs])
    ends = torch.cat([offs, offs.new_full((1,), rows)])
    return _with_tile_counts(starts, ends, tile_m)


def masked_table(counts: torch.Tensor, capacity: int, tile_m: int) -> torch.Tensor:
    """The masked layout's table: group g's rows start at g * capacity; the pseudo group past the
    last is empty (rows past a count stay unwritten)."""
    groups = counts.shape[0]
    starts = torch.arange(0, (groups + 1) * capacity, capacity, dtype=torch.int32, device=counts.device)
    ends = starts + torch.cat([counts, counts.new_zeros(1)])
    return _with_tile_counts(starts, ends, tile_m)


def _with_tile_counts(starts, ends, tile_m):
    tiles = torch.div(ends - starts + (tile_m - 1), tile_m, rounding_mode="floor")
    return torch.stack([starts, ends, torch.cumsum(tiles, 0, dtype=torch.int32)])


def k_table(offs: torch.Tensor) -> torch.Tensor:
    """(2, G) int32: each group's k range."""
    return torch.stack([torch.cat([offs.new_zeros(1), offs[:-1]]), offs])


class GroupedGemmLaunch:
    """One operand layout's launch of a grouped variant (views as in runtime.gemm.GemmLaunch)."""

    __slots__ = ("fn", "grid", "mode", "tile_m", "a_view", "b_view", "out_view", "spec")

    def __init__(self, fn, grid: int, mode: str, tile_m: int, views, spec: KernelSpec):
        self.fn, self.grid, self.mode, self.tile_m, self.spec = fn, grid, mode, tile_m, spec
        self.a_view, self.b_view, self.out_view = views

    def __call__(self, a, b, offs, out, scales=()) -> None:
        """``offs``: cumulative group ends (rows, K modes), or a masked layout's counts; ``scales``
        an FP8 variant's (scale_a (M, 1), scale_b (G, 1, N))."""
        if self.mode == "rows":
            table = rows_table(offs, a.shape[0], self.tile_m)
        elif self.mode == "masked":
            table = masked_table(offs, a.shape[0] // offs.shape[0], self.tile_m)
        else:
            table = k_table(offs)
        a, b, out = GemmLaunch.views(self, a, b, out)  # the same free views as the dense launch's
        self.fn(a, b, *scales, table, out, self.grid)


def _units_bound(mode: str, m: int, n: int, groups: int, config: GemmConfig) -> int:
    tiles_n = -(-n // config.tile_n)
    if mode == "k":
        return -(-m // config.tile_m) * tiles_n * groups
    return (-(-m // config.tile_m) + groups + 1) * tiles_n


class GroupedGemmHost:
    def __init__(self, arch: str, kernel_name: str):
        self.arch, self.kernel_name = arch, kernel_name

    def plan(self, form: str, a_shape, a_stride, b_shape, b_stride, dtype, out_dtype, groups: int,
             device_index: int, config: GemmConfig | None = None, gated: tuple | None = None,
             scale_mode: str | None = None) -> GroupedGemmLaunch | str:
        """``form``: "rows" (a (M, K), b (G, K, N)), "masked" (the same shapes, a's G groups of
        M / G rows) or "k" (a (M, K), b (K, N), out (G, M, N)). ``gated``: rows with a fused
        (activation, alpha, limit, gate/up layout) epilogue, out (M, N / 2). ``scale_mode`` "row":
        FP8 operands with rowwise scales (rows mode)."""
        if scale_mode not in (None, "row") or (scale_mode and (form == "k" or gated)):
            return f"{self.kernel_name}: no FP8 variant with {scale_mode} scales in this form"
        mode = "k" if form == "k" else "rows"
        a3 = ((1, *a_shape), (0, *a_stride))
        b3 = (tuple(b_shape), tuple(b_stride)) if len(b_shape) == 3 else ((1, *b_shape), (0, *b_stride))
        reason = layout_reason(self.kernel_name, dtype, *a3, *b3, None, None, out_dtype, scale_mode)
        if reason:
            return reason
        m, n = a_shape[0], b_shape[-1]
        out_shape = (m, n // 2 if gated else n) if mode == "rows" else (groups, m, n)
        if gated and m > 1 and (n // 2 * out_dtype.itemsize) % TMA_ALIGN_BYTES:  # the gated out's own rows
            return f"out: rows of N={n // 2} {out_dtype} elements are not a multiple of 16 bytes (TMA store)"
        if mode == "k" and groups > 1 and (m * n * out_dtype.itemsize) % TMA_ALIGN_BYTES:
            return f"out: groups of {m} x {n} {out_dtype} elements are not a multiple of 16 bytes (TMA store)"
        if groups + 2 >= 2**31 // 2 or m + (groups + 1) * 128 >= 2**31:
            return f"{self.kernel_name}: sizes must fit in int32"
        config = config or grouped_config(form, n)
        a_strides, a_k_major = operand_strides(*a3, dtype.itemsize)
        b_strides, b_n_major = operand_strides(*b3, dtype.itemsize)
        spec = grouped_spec(self.arch, dtype, out_dtype, a_k_major, not b_n_major, mode, config, gated, scale_mode)
        b_rank = len(b_shape)
        o3 = out_strides((1, *out_shape) if mode == "rows" else out_shape, out_dtype.itemsize)
        contiguous_out = tuple(torch.empty(out_shape, device="meta").stride())
        views = (_view(a_shape, a_stride, a_shape, a_strides[1:]),
                 _view(b_shape, b_stride, b_shape, b_strides[3 - b_rank:]),
                 _view(out_shape, contiguous_out, out_shape, o3[3 - len(out_shape):]))
        sms = sm_count(device_index)
        grid = max(1, min(_units_bound(mode, m, n, groups, config), sms))
        return GroupedGemmLaunch(get_compiled(spec), grid, form if form == "masked" else mode, config.tile_m, views,
                                 spec)

    def shipped(self) -> list[KernelSpec]:
        """bf16: the forward and dA (rows, a K-major, b either way: x @ W and x @ W.T), the weight
        gradient (K grouped, a^T of a row-major x: M-major a, N-major dY), the fused gate/up
        projections of gpt-oss (swiglu_oai at its alpha and limit, interleaved) and of Qwen3 /
        Mixtral (swiglu, concatenated), nn.Linear's weight; FP8 e4m3 -> bf16 with rowwise scales."""
        config = grouped_config("rows", 4096)
        bf16 = torch.bfloat16
        return [
            *(grouped_spec(self.arch, bf16, bf16, True, b_k_major, "rows", config) for b_k_major in (False, True)),
            grouped_spec(self.arch, bf16, bf16, False, False, "k", config),
            grouped_spec(self.arch, bf16, bf16, True, True, "rows", config, ("swiglu_oai", 1.702, 7.0, "interleaved")),
            grouped_spec(self.arch, bf16, bf16, True, True, "rows", config, ("swiglu", 1.702, 7.0, "concat")),
            grouped_spec(self.arch, torch.float8_e4m3fn, bf16, True, True, "rows", config, scale_mode="row"),
        ]


SM90 = GroupedGemmHost("sm_90a", "sm90 grouped gemm kernel")
