"""Hopper (sm_90a) persistent GEMM: out = act(alpha * A @ B + bias), fp32 accumulation, with
16-bit operands or FP8 ones under per-tensor, rowwise or blockwise scales.

Kernel convention: A is (M, K, L), B is (N, K, L), C is (M, N, L); each of A and B
is K-major or M/N-major (decided at compile time from which stride is the static
1), C is N-major. The compiled function takes the torch tensors the op layer hands
over, a (L, M, K), b (L, K, N) and out (L, M, N), and permutes their layouts in the
jit host function (no torch-side views or copies).

One CTA = one producer warpgroup + two consumer warpgroups (one for 64-row tiles):

* producer (warp 0 of warpgroup 0, 40 registers): walks the same persistent tile
  schedule as the consumers and streams ``tile_m x 64`` A and ``tile_n x 64`` B
  k-tiles into a ring of swizzled smem stages with TMA, signalling a
  ``PipelineTmaAsync`` mbarrier per stage. In a 2x1 cluster each CTA loads half of
  the shared B tile and multicasts it to both CTAs.
* consumers (232 registers each): WGMMA over the stages with one wgmma batch in
  flight, releasing each stage as soon as the batch that read it retired.
  Cooperative (default): the two warpgroups split a 128-row tile into 64-row halves.
  Ping-pong (``GemmConfig.pingpong``): each warpgroup owns whole tiles and the two
  take turns, so one's epilogue runs under the other's main loop.
* epilogue (consumers): bias (per column, fp32) and the activation in registers,
  then for 16-bit outputs ``stmatrix`` into a small smem ring of ``64k x 32``
  subtiles and TMA stores from there (M/N tails clipped by the TMA unit); fp32
  outputs are stored from registers with M/N predicates. Meanwhile the producer
  already prefetches the next tile's k-tiles.
* launch: a programmatic dependent launch. Barrier init and descriptor prefetch overlap
  the previous kernel's tail; every thread waits for that grid before touching global
  memory, then lets the next kernel launch (a model's back-to-back GEMMs).

FP8 (``scale_mode`` set; e4m3 / e5m2, both operands K-major as FP8 WGMMA requires): k-tiles
are 128 wide (128 bytes, one swizzle atom, as for 16-bit types). "tensor" and "row" scales
multiply the fp32 accumulator in the epilogue; "block" scales (1 x 128 blocks of A, 128 x 128
of B) are applied per k-tile in the main loop (``gemm_block_scaled.py``).

Swapped operands (``GemmConfig.swap_ab``, a decode step's rows on the MMA's narrow N) compute
out^T = b^T @ a^T, the jit host function trading the roles of the caller's tensors (layouts
only): the bias runs along the kernel's rows, the out is M-major and stored from registers.
Rowwise scales swap with their operands (the kernel's ``scale_a`` is the caller's ``scale_b``
seen as a column), so the epilogue is the same.

Grouped variants (``grouped``: a Mixture-of-Experts layer's expert GEMMs in one launch, rows or K
grouped by a device-side group table; ``gated``: SwiGLU fused for gate/up projections) are this
kernel with the extension of ``gemm_grouped.py``, which explains them.

The tile schedule is :class:`~..common.tile_scheduler.PersistentTileScheduler`
(banded rasterization for L2 reuse), or for stream-K variants (``GemmConfig.stream_k``, many
waves with a partial last one) :class:`~..common.tile_scheduler.StreamKTileScheduler`: the
producer and the consumers walk the same segments (a unit's k-range), and a segment that does
not finish its tile hands its partial sums to the one that does instead of running the
epilogue. The tile/cluster come from :func:`torch_cute_ops.runtime.gemm_config.choose_config`.
"""


import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ...runtime.gemm_config import GemmConfig
from ...runtime.spec import KernelSpec
from ...runtime.tma import TMA_ALIGN_BYTES
from ..common.activation import GATED_ACTIVATIONS, apply_activation
from ..common.gemm_operands import (fake_block_scales, fake_operand, fake_scales, scales_to_kernel_order,
                                    swapped_scales, to_kernel_order, to_swapped_kernel_order)
from ..common.tile_scheduler import PersistentTileScheduler, StreamKTileScheduler, stream_k_fixup
from .gemm_block_scaled import SCALE_BLOCK, BlockScaledMainloop
from .gemm_epilogue import GemmEpilogue
from .gemm_grouped import (GROUPED_MODES, concat_as_interleaved, group_tile, grouped_kernel_order, num_groups,
                           row_tiles_bound, total_row_tiles, zero_k_tail)


# spec dtype string -> DSL type
_DSL_TYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32,
              "e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}

TILE_K_BYTES = 128  # one smem row of a k-tile: the 128B swizzle atom (64 16-bit or 128 FP8 values)
SCALE_MODES = (None, "tensor", "row", "block")
_SMEM_CAPACITY = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
_SMEM_RESERVED_BYTES = 1024  # mbarriers and alignment slack
# Small tiles take as many stages as smem holds (64 x 64: 13, swapped 64 x 16: 22): with few
# rows the kernel streams the weight, and the bytes in flight per SM set its rate.
_MAX_AB_STAGES = 24


class Sm90Gemm(GemmEpilogue, BlockScaledMainloop):
    """One compiled variant: dtypes, majorness, epilogue and tile config are static.

    Two consumer schedules (``config.pingpong``):

    * cooperative: the ``tile_m // 64`` consumer warpgroups split one tile by rows and
      run main loop and epilogue together;
    * ping-pong: two consumer warpgroups each own a whole tile and take turns: the
      producer fills the smem ring with one warpgroup's k-tiles after the other's, so
      one warpgroup's epilogue overlaps the other's main loop.
    """

    def __init__(self, ab_dtype, out_dtype, a_k_major: bool, b_k_major: bool, has_bias: bool,
                 activation, config: GemmConfig, b_dtype=None, bias_dtype=None, scale_mode=None,
                 odd_n: bool = False, grouped: str | None = None, gated: tuple | None = None):
        narrow_n = (16, 32) if config.swap_ab else ()  # a decode step's few rows as the MMA's N
        # 96 columns: N = 12288 in 128 tiles, about one wave on 132 SMs (runtime.gemm_config); 160:
        # N = 4096 in 26 columns of tiles, one wave of 130 at M = 640
        # 256 rows: blockwise only, two waves of 128 rows per warpgroup pair (gemm_block_scaled.py)
        if (config.tile_m not in (64, 128, 192, 256) or config.tile_n not in (*narrow_n, 64, 96, 128, 160, 192, 256)
                or (config.tile_m == 192 and (config.pingpong or config.tile_n > 192 or scale_mode == "block"))
                or (config.tile_m == 256 and (config.pingpong or config.tile_n != 128 or scale_mode != "block"))):
            raise ValueError(f"unsupported sm90 tile {config.tile_mn}")
        if config.stream_k and config.pingpong:
            raise ValueError(f"stream-K runs cooperative tiles, got {config}")
        if config.swap_ab and (scale_mode == "block" or config.pingpong):
            raise ValueError(f"swapped operands are cooperative, without blockwise scales, got {config}")
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
        if ab_dtype.width == 8 and not (a_k_major and b_k_major and scale_mode):
            raise ValueError("FP8 operands need scales and K-major A and B (FP8 WGMMA reads K-major smem only)")
        if scale_mode == "block" and (config.pingpong or not (SCALE_BLOCK % config.tile_n == 0
                                                              or config.tile_mn == (128, 192))):
            # the per-k-tile fragment doubles the accumulator registers (gemm_block_scaled.py)
            raise ValueError(f"blockwise scales need a cooperative tile of 64 or 128 columns, or 128 x 192, or "
                             f"256 x 128, got {config}")
        if grouped not in GROUPED_MODES:
            raise ValueError(f"grouped must be one of {GROUPED_MODES}, got {grouped!r}")
        if grouped and (config.pingpong or config.stream_k or config.swap_ab or config.cluster_mn != (1, 1)
                        or scale_mode not in (None, "row") or (scale_mode and grouped != "rows") or has_bias
                        or activation or config.tile_m == 256):
            # each tile's k-tile count is its group's (no ping-pong ring skip, no stream-K split), and
            # the two CTAs of a cluster may lie in different groups (no shared B)
            raise ValueError(f"grouped GEMMs run cooperative 1 x 1 tiles without epilogue extras but rowwise "
                             f"scales (rows mode), got {config}, scales {scale_mode}")
        if gated is not None and (grouped != "rows" or gated[0] not in GATED_ACTIVATIONS
                                  or gated[3] not in ("concat", "interleaved")):
            raise ValueError(f"gated epilogues ({GATED_ACTIVATIONS}) run on rows-grouped variants, got {gated}")
        self.grouped = grouped  # None, "rows" (M grouped) or "k" (K grouped), see grouped_gemm.py
        # (activation, alpha, limit, gate/up layout) of a gate/up projection: C has half of B's
        # columns (gemm_grouped.py)
        self.gated = gated
        self.ab_dtype = ab_dtype  # A's dtype (B's too unless b_dtype says otherwise)
        self.b_dtype = b_dtype or ab_dtype
        self.bias_dtype = bias_dtype or ab_dtype
        self.odd_n = odd_n  # N may be odd (a bias read column by column)
        self.scale_mode = scale_mode
        self.out_dtype = out_dtype
        self.a_k_major = a_k_major
        self.b_k_major = b_k_major
        self.has_bias = has_bias
        self.activation = activation
        self.config = config
        self.swap_ab = config.swap_ab  # the bias runs along the kernel's M (the caller's N)
        self.stream_k = config.stream_k  # the last waves split along K (StreamKTileScheduler)
        # the last tile row (column) moves back to end at row M (column N), see _tile_start; not
        # under stream-K, whose split tiles would store the outputs both tiles compute with other
        # roundings, and for columns not with blockwise scales, read per 128-column block of B
        # (a 256-row tile stays put: its scale_a box, at most 256 rows, then starts 16-byte aligned)
        self.shift_rows = not config.stream_k and config.tile_m != 256
        self.shift_cols = not config.stream_k and scale_mode != "block"
        self.tile_shape_mnk = (config.tile_m, config.tile_n, TILE_K_BYTES * 8 // ab_dtype.width)
        self.cluster_shape_mn = config.cluster_mn
        self.pingpong = config.pingpong
        # warpgroups that share one tile (each owns 64 rows of every wave of 64 x tile_wgs rows)
        # and tile groups in flight
        self.tile_wgs = 1 if self.pingpong else 2 if config.tile_m == 256 else config.tile_m // 64
        # row waves a warpgroup issues, waits for and promotes one after the other (blockwise
        # 256-row tiles: two of 128 rows)
        self.waves = 2 if config.tile_m == 256 else 1
        self.num_tile_groups = 2 if self.pingpong else 1
        self.tile_threads = 128 * self.tile_wgs
        self.num_mma_threads = self.tile_threads * self.num_tile_groups
        self.threads_per_cta = 128 + self.num_mma_threads
        # three consumer warpgroups (192-row tiles) share the register file four ways
        self.producer_regs, self.mma_regs = 40, 232 if self.num_mma_threads <= 256 else 152
        # B is shared by the CTAs of a cluster column, A by those of a cluster row
        self.b_mcast = config.cluster_m > 1
        self.a_mcast = config.cluster_n > 1
        # fp32 results go straight from registers to global memory; 16-bit ones through
        # a ring of swizzled smem subtiles (stmatrix) and TMA stores, except for swapped
        # operands, whose out^T is M-major and a few columns wide
        self.direct_store = out_dtype.width == 32 or self.swap_ab or gated is not None
        self.epi_tile = (64 * self.tile_wgs, 32)
        # ping-pong keeps a ring per warpgroup: three subtiles each leave room for a fifth A/B
        # stage at 128 x 192 (QuACK's default tile and depth)
        # (192-row tiles: two subtiles of 12 KB, so that 192 x 192 keeps four A/B stages; 256 x 128
        # keeps four of 8 KB and three A/B stages of 48 KB: +6% at 16384 x 14336 x 4096 over two
        # and four, the other shapes within -2..+2%, bench/NOTES.md)
        self.epi_stages = 3 if config.pingpong else 2 if config.tile_m == 192 else 4
        self.ab_stages = self._ab_stages()

    def _ab_stages(self) -> int:
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        stage_bytes = (tile_m * self.ab_dtype.width + tile_n * self.b_dtype.width) * tile_k // 8
        stage_bytes += self._scale_smem_bytes()
        free = _SMEM_CAPACITY - _SMEM_RESERVED_BYTES - self._epi_smem_bytes()
        return min(free // stage_bytes, _MAX_AB_STAGES)

    def _epi_smem_bytes(self) -> int:
        if self.direct_store:
            return 0
        subtile_bytes = self.epi_tile[0] * self.epi_tile[1] * self.out_dtype.width // 8
        return subtile_bytes * self.epi_stages * self.num_tile_groups

    # ---- host side -------------------------------------------------------------------
    @cute.jit
    def run_with_bias(self, mA: cute.Tensor, mB: cute.Tensor, mBias: cute.Tensor, mC: cute.Tensor,
                      alpha: Float32, max_clusters: Int32, stream, mPartials=None, mFlags=None):
        self._launch(mA, mB, mBias, mC, alpha, max_clusters, stream, workspace=(mPartials, mFlags))

    @cute.jit
    def run(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, alpha: Float32, max_clusters: Int32,
            stream, mPartials=None, mFlags=None):
        # without bias the kernel never reads its bias argument; C stands in for it
        self._launch(mA, mB, mC, mC, alpha, max_clusters, stream, workspace=(mPartials, mFlags))

    @cute.jit
    def run_scaled(self, mA: cute.Tensor, mB: cute.Tensor, mScaleA: cute.Tensor, mScaleB: cute.Tensor,
                   mC: cute.Tensor, max_clusters: Int32, stream, mPartials=None, mFlags=None):
        self._launch(mA, mB, mC, mC, Float32(1.0), max_clusters, stream, mScaleA, mScaleB, (mPartials, mFlags))

    @cute.jit
    def run_scaled_with_bias(self, mA: cute.Tensor, mB: cute.Tensor, mScaleA: cute.Tensor,
                             mScaleB: cute.Tensor, mBias: cute.Tensor, mC: cute.Tensor, max_clusters: Int32,
                             stream, mPartials=None, mFlags=None):
        self._launch(mA, mB, mBias, mC, Float32(1.0), max_clusters, stream, mScaleA, mScaleB, (mPartials, mFlags))

    @cute.jit
    def run_grouped(self, mA: cute.Tensor, mB: cute.Tensor, mGroups: cute.Tensor, mC: cute.Tensor,
                    max_clusters: Int32, stream):
        """A grouped GEMM (``self.grouped``; the group table ``mGroups`` in grouped_gemm.py)."""
        self._launch(mA, mB, mC, mC, Float32(1.0), max_clusters, stream, mGroups=mGroups)

    @cute.jit
    def run_grouped_scaled(self, mA: cute.Tensor, mB: cute.Tensor, mScaleA: cute.Tensor, mScaleB: cute.Tensor,
                           mGroups: cute.Tensor, mC: cute.Tensor, max_clusters: Int32, stream):
        """A rows-grouped FP8 GEMM with rowwise scales: scale_a (M, 1), scale_b (G, 1, N)."""
        self._launch(mA, mB, mC, mC, Float32(1.0), max_clusters, stream, mScaleA, mScaleB, mGroups=mGroups)

    def _launch(self, mA, mB, mBias, mC, alpha, max_clusters, stream, mScaleA=None, mScaleB=None,
                workspace=(None, None), mGroups=None):
        """``workspace``: stream-K variants' (partial sums, flags), see StreamKTileScheduler;
        the host sizes them with runtime.gemm.stream_k_workspace_size. ``mGroups``: a grouped
        variant's group table."""
        mPartials, mFlags = workspace  # None unless stream-K
        if cutlass.const_expr(self.grouped is not None):
            mA, mB, mC = grouped_kernel_order(mA, mB, mC)
            if cutlass.const_expr(self.gated is not None and self.gated[3] == "concat"):
                mB = concat_as_interleaved(mB)
        elif cutlass.const_expr(self.swap_ab):
            mA, mB, mC = to_swapped_kernel_order(mA, mB, mC)
        else:
            mA, mB, mC = to_kernel_order(mA, mB, mC)
        if cutlass.const_expr(self.scale_mode is None):
            mScaleA = mScaleB = mC  # never read
        elif cutlass.const_expr(self.scale_mode != "tensor"):  # per-tensor: one value each
            mScaleA, mScaleB = (swapped_scales(mScaleA, mScaleB) if self.swap_ab
                                else (scales_to_kernel_order(mScaleA), scales_to_kernel_order(mScaleB)))
        a_layout = LayoutEnum.ROW_MAJOR if self.a_k_major else LayoutEnum.COL_MAJOR
        b_layout = LayoutEnum.ROW_MAJOR if self.b_k_major else LayoutEnum.COL_MAJOR
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.b_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            Float32, (self.tile_wgs, 1, 1), tiler_mn=(64, self.tile_shape_mnk[1]),
        )
        sA_layout = sm90_utils.make_smem_layout_a(a_layout, self.tile_shape_mnk, self.ab_dtype, self.ab_stages)
        sB_layout = sm90_utils.make_smem_layout_b(b_layout, self.tile_shape_mnk, self.b_dtype, self.ab_stages)
        # each tile group has its own ring of epi_stages subtiles
        sC_layout = sm90_utils.make_smem_layout_epi(
            self.out_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.epi_stages * self.num_tile_groups)

        tile_m, tile_n, tile_k = self.tile_shape_mnk
        cluster_m, cluster_n = self.cluster_shape_mn
        tma_atom_a, tma_tensor_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp() if self.a_mcast else cpasync.CopyBulkTensorTileG2SOp(),
            mA, cute.slice_(sA_layout, (None, None, 0)), (tile_m, tile_k), num_multicast=cluster_n,
        )
        tma_atom_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp() if self.b_mcast else cpasync.CopyBulkTensorTileG2SOp(),
            mB, cute.slice_(sB_layout, (None, None, 0)), (tile_n, tile_k), num_multicast=cluster_m,
        )
        if cutlass.const_expr(self.direct_store):
            tma_atom_c, tensor_c = None, mC
        else:
            tma_atom_c, tensor_c = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(sC_layout, (None, None, 0)), self.epi_tile,
            )

        tma_atom_sa = tma_atom_sb = None
        if cutlass.const_expr(self.scale_mode == "block"):  # the k-tiles' scales come with them
            tma_atom_sa, mScaleA, tma_atom_sb, mScaleB = self._scale_tma_atoms(mScaleA, mScaleB)

        sched = self._scheduler(mC, cute.ceil_div(mA.shape[1], self.tile_shape_mnk[2]), mGroups)
        grid = sched.grid_shape(max_clusters)
        if cutlass.const_expr(mGroups is None):
            mGroups = mC  # never read
        sC_elems = 1 if self.direct_store else cute.cosize(sC_layout)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(sB_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, sC_elems], 1024]
            if self.scale_mode == "block":  # a k-tile's scales, a slot per A/B stage
                sScaleA: cute.struct.Align[cute.struct.MemRange[Float32, self._scale_elems()[0]], 128]
                sScaleB: cute.struct.Align[cute.struct.MemRange[Float32, self._scale_elems()[1]], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_c, tensor_c, mBias, mScaleA, mScaleB,
            mPartials, mFlags, alpha, tiled_mma, sA_layout, sB_layout, sC_layout, tma_atom_sa, tma_atom_sb, mGroups, mC,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(cluster_m, cluster_n, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=True,
        )

    def _scheduler(self, mC, num_k_tiles, mGroups=None, row_tiles=None) -> PersistentTileScheduler:
        """The tile schedule over C. Grouped rows: ``row_tiles`` (the device's real count of the
        groups' row tiles) tiles of rows, or without it (the host's grid) the bound of
        :func:`grouped_gemm.row_tiles_bound`."""
        shape = mC.shape
        if cutlass.const_expr(self.gated is not None):  # tiles of B's columns, two per output column
            shape = (mC.shape[0], mC.shape[1] * 2, mC.shape[2])
        if cutlass.const_expr(self.grouped == "rows"):
            tile_m = self.tile_shape_mnk[0]
            if cutlass.const_expr(row_tiles is None):
                row_tiles = row_tiles_bound(mC.shape[0], mGroups.shape[1], tile_m)
            shape = (row_tiles * tile_m, shape[1], 1)
        args = (shape, self.tile_shape_mnk[:2], self.cluster_shape_mn, self.config.group_size,
                self.config.band_along_m)
        if cutlass.const_expr(self.stream_k):
            return StreamKTileScheduler.create(*args, k_tiles=num_k_tiles)
        return PersistentTileScheduler.create(*args)

    # ---- device side -----------------------------------------------------------------
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB_nkl: cute.Tensor, tma_atom_c, mC_mnl: cute.Tensor, mBias: cute.Tensor, mScaleA: cute.Tensor,
               mScaleB: cute.Tensor, mPartials, mFlags, alpha: Float32, tiled_mma: cute.TiledMma,
               sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, sC_layout: cute.ComposedLayout,
               tma_atom_sa, tma_atom_sb, mGroups: cute.Tensor, mC_gmem: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(not self.direct_store):
                cpasync.prefetch_descriptor(tma_atom_c)

        cluster_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord_mnk = cluster_layout_mnk.get_flat_coord(cta_rank)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
        scale_smem = self._scale_smem(storage) if cutlass.const_expr(self.scale_mode == "block") else None

        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # a stage is read (and released) by the warpgroups of one tile group
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_threads),
            tx_count=cute.size_in_bytes(self.ab_dtype, cute.slice_(sA_layout, (None, None, 0)))
            + cute.size_in_bytes(self.b_dtype, cute.slice_(sB_layout, (None, None, 0))) + self._scale_stage_bytes(),
            cta_layout_vmnk=cute.make_layout((1, *cluster_layout_mnk.shape)),
            enable_multicast_signaling=True,
            defer_sync=True,
        )
        # peers must see initialized barriers before any multicast lands in them
        pipeline.pipeline_init_arrive(cluster_layout_mnk, is_relaxed=True)

        tile_m, tile_n, tile_k = self.tile_shape_mnk
        # (tile, tile, rest_m/n, rest_k, L) views of the global tensors
        gA = cute.local_tile(mA_mkl, (tile_m, tile_k), (None, None, None))
        gB = cute.local_tile(mB_nkl, (tile_n, tile_k), (None, None, None))
        num_k_tiles = cute.size(gA, mode=[3])
        sched = self._scheduler(mC_mnl, num_k_tiles, mGroups)

        pipeline.pipeline_init_wait(cluster_layout_mnk)
        # Launched early (programmatic dependent launch): the set-up above overlapped the
        # previous kernel's tail; its outputs may be our operands, and it may still read what
        # we write, so no thread touches global memory before that grid is done. Our own
        # dependents may launch now: every CTA of this persistent grid is already resident, and
        # they wait for all of it in turn.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.grouped == "rows"):  # the group table is the previous kernels' output
            sched = self._scheduler(mC_mnl, num_k_tiles, mGroups, total_row_tiles(mGroups))

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce(ab_pipeline, sched, tma_atom_a, tma_atom_b, mA_mkl, mB_nkl, gA, gB, sA, sB,
                              cluster_layout_mnk, cluster_coord_mnk, num_k_tiles,
                              (tma_atom_sa, tma_atom_sb, mScaleA, mScaleB, scale_smem), mGroups)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consume(ab_pipeline, sched, tiled_mma, tma_atom_c, mC_mnl, mBias, mScaleA, mScaleB, alpha,
                          sA, sB, sC, num_k_tiles, tidx - 128, (mPartials, mFlags), scale_smem, (mGroups, mC_gmem))

    @cute.jit
    def _produce(self, ab_pipeline, sched, tma_atom_a, tma_atom_b, mA_mkl, mB_nkl, gA, gB, sA, sB,
                 cluster_layout_mnk, cluster_coord_mnk, num_k_tiles, scale_loads=None, mGroups=None):
        """TMA loads of every k-tile of every tile this CTA owns, ab_stages ahead of the MMAs
        (with blockwise scales, each k-tile's scales under the same barrier: ``scale_loads``)."""
        # A is split over the CTAs of a cluster row, B over those of a cluster column
        a_cta_layout = cute.make_layout(cute.slice_(cluster_layout_mnk, (0, None, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, cluster_coord_mnk[1], a_cta_layout, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2),
        )
        b_cta_layout = cute.make_layout(cute.slice_(cluster_layout_mnk, (None, 0, 0)).shape)
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, cluster_coord_mnk[0], b_cta_layout, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2),
        )
        a_mcast_mask = cute.make_layout_image_mask(cluster_layout_mnk, cluster_coord_mnk, mode=1) if self.a_mcast else 0
        b_mcast_mask = cute.make_layout_image_mask(cluster_layout_mnk, cluster_coord_mnk, mode=0) if self.b_mcast else 0

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        work_idx, num_work_units, work_stride = self._work_walk(sched)
        while work_idx < num_work_units:
            tile_m_idx, tile_n_idx, batch_idx, k_begin, k_count, _ = self._work_tile(sched, work_idx, num_k_tiles)
            if cutlass.const_expr(self.grouped is not None):
                # the group's rows (or k range) from its first row (k): nothing before it is loaded
                tile = group_tile(self, mGroups, tile_m_idx, tile_n_idx, batch_idx, mA_mkl.shape[0],
                                  cute.size(mB_nkl, mode=[0]), mB_nkl.shape[2], num_k_tiles)
                k_count = tile.k_count
                tAgA_tile = self._k_tiles_at(tma_atom_a, cluster_coord_mnk[1], a_cta_layout, sA, mA_mkl,
                                             tile.row_start, tile.k_start, 0, self.tile_shape_mnk[0])
                tBgB_tile = self._k_tiles_at(tma_atom_b, cluster_coord_mnk[0], b_cta_layout, sB, mB_nkl,
                                             tile.col_start, tile.k_start, tile.b_batch, self.tile_shape_mnk[1])
            elif cutlass.const_expr(self.shift_rows):
                tAgA_tile = self._k_tiles(tma_atom_a, cluster_coord_mnk[1], a_cta_layout, sA, mA_mkl, tile_m_idx,
                                          batch_idx, self.tile_shape_mnk[0], True)
            else:
                tAgA_tile = tAgA[(None, tile_m_idx, None, batch_idx)]
            if cutlass.const_expr(self.grouped is not None):
                pass
            elif cutlass.const_expr(self.shift_cols):
                tBgB_tile = self._k_tiles(tma_atom_b, cluster_coord_mnk[0], b_cta_layout, sB, mB_nkl, tile_n_idx,
                                          batch_idx, self.tile_shape_mnk[1], False)
            else:
                tBgB_tile = tBgB[(None, tile_n_idx, None, batch_idx)]
            if cutlass.const_expr(self.scale_mode == "block"):
                # (the tile's first row and column as the consumers see them)
                row_start = self._tile_start(tile_m_idx, mA_mkl.shape[0], self.tile_shape_mnk[0], True)
                col_start = self._tile_start(tile_n_idx, mB_nkl.shape[0], self.tile_shape_mnk[1], False)
                scale_tiles = self._scale_k_tiles(scale_loads, row_start, col_start, batch_idx)
            for k_tile in cutlass.range(k_count, unroll=1):
                k_idx = k_tile if cutlass.const_expr(not self.stream_k) else k_begin + k_tile
                ab_pipeline.producer_acquire(state)
                barrier = ab_pipeline.producer_get_barrier(state)
                cute.copy(tma_atom_a, tAgA_tile[(None, k_idx)], tAsA[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=a_mcast_mask)
                cute.copy(tma_atom_b, tBgB_tile[(None, k_idx)], tBsB[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=b_mcast_mask)
                if cutlass.const_expr(self.scale_mode == "block"):
                    self._copy_scales(scale_loads, scale_tiles, k_idx, state.index, barrier)
                ab_pipeline.producer_commit(state)
                state.advance()
            work_idx += work_stride
        ab_pipeline.producer_tail(state)

    def _work_walk(self, sched, group=None):
        """(first work index, end, stride) of a walk over the schedule: the producer's (``group``
        None) takes every unit of this cluster, a consumer tile group every num_tile_groups-th;
        under stream-K both walk this cluster's own work items."""
        if cutlass.const_expr(self.stream_k):
            return Int32(0), sched.num_works(), 1
        if cutlass.const_expr(group is None):
            return sched.first_work_idx(), sched.num_work_units, sched.work_stride()
        return (sched.first_work_idx() + sched.work_stride() * group, sched.num_work_units,
                sched.work_stride() * self.num_tile_groups)

    def _work_tile(self, sched, work_idx, num_k_tiles):
        """(tile_m_idx, tile_n_idx, batch_idx, k_begin, k_count, stream-K work or None) of a work
        index (stream-K: the segment's k-tiles, else all of them)."""
        if cutlass.const_expr(self.stream_k):
            work = sched.work(work_idx)
            return work.tile_m_idx, work.tile_n_idx, work.batch_idx, work.k_begin, work.k_end - work.k_begin, work
        return (*sched.tile_coord(work_idx), 0, num_k_tiles, None)

    def _tile_start(self, tile_idx, extent, tile, rows: bool):
        """The first row (column) of a tile of ``tile`` rows (columns) of an ``extent``-long
        dimension. A tile over the tail, or wholly past it (the second CTA of a 2 x 1 cluster over
        an odd number of tile rows), moves back to end at the extent where it holds a whole tile:
        the TMA fills elements past the end with zeros at a fraction of its load rate (H200, 192
        x 64 tiles, N = K = 4096: 54 us at M = 193, 28 us at M = 384), while the outputs the tile
        shares with the one before are computed in the same order and stored again unchanged.
        ``rows``: a row (else a column) of tiles, moved where ``shift_rows`` (``shift_cols``)."""
        start = tile_idx * tile
        if cutlass.const_expr(self.shift_rows if rows else self.shift_cols):  # (below one tile: unmoved)
            start = cutlass.min(start, cutlass.max(extent - tile, 0))
        return start

    @cute.jit
    def _k_tiles(self, tma_atom, cta_coord, cta_layout, sX, mX, tile_idx, batch_idx, tile, is_a: bool):
        """(TMA values, k-tile) gmem view of an A (B) tile from its (moved) first row (column)."""
        return self._k_tiles_at(tma_atom, cta_coord, cta_layout, sX, mX,
                                self._tile_start(tile_idx, mX.shape[0], tile, is_a), 0, batch_idx, tile)

    @cute.jit
    def _k_tiles_at(self, tma_atom, cta_coord, cta_layout, sX, mX, start, k_start, batch_idx, tile):
        """(TMA values, k-tile) gmem view of an A (B) tile whose first row (column) is ``start`` and
        first k ``k_start`` (a K-grouped tile's group start; the TMA takes any coordinate)."""
        rows = cute.domain_offset((start, k_start), mX[None, None, batch_idx])
        gX = cute.local_tile(rows, (tile, self.tile_shape_mnk[2]), (0, None))
        _, tXgX = cpasync.tma_partition(tma_atom, cta_coord, cta_layout, cute.group_modes(sX, 0, 2),
                                        cute.group_modes(gX, 0, 2))
        return tXgX

    @cute.jit
    def _consume(self, ab_pipeline, sched, tiled_mma, tma_atom_c, mC_mnl, mBias, mScaleA, mScaleB, alpha,
                 sA, sB, sC, num_k_tiles, mma_tidx, workspace, scale_smem=None, grouped_args=None):
        """WGMMA main loop, then the fused epilogue, for every tile of this tile group. A grouped
        variant's ``grouped_args``: the group table and C in global memory (for predicated stores;
        ``mC_mnl`` is the TMA's view of it)."""
        mGroups, mC_gmem = grouped_args
        group = mma_tidx // self.tile_threads
        group_tidx = mma_tidx % self.tile_threads
        # WGMMA is issued per warpgroup: slice the MMA by warpgroup (a warp-uniform value, so the
        # smem descriptors are built in uniform registers), the epilogue by thread
        wg_slice = tiled_mma.get_slice(cute.arch.make_warp_uniform((group_tidx // 128) * 128))
        if cutlass.const_expr(self.waves > 1):  # each wave's rows of A, issued on their own
            wave_rows = 64 * self.tile_wgs
            tCrA = tuple(
                tiled_mma.make_fragment_A(wg_slice.partition_A(
                    cute.local_tile(sA, (wave_rows, self.tile_shape_mnk[2]), (wave, 0, None))))
                for wave in range(self.waves))
        else:
            tCrA = tiled_mma.make_fragment_A(wg_slice.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(wg_slice.partition_B(sB))
        tile_m, tile_n, _ = self.tile_shape_mnk
        # (m, n) of each accumulator value inside the tile
        tCcC = tiled_mma.get_slice(group_tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        acc = cute.make_rmem_tensor(tCcC.shape, Float32)
        if cutlass.const_expr(self.scale_mode == "block"):
            # k-tile partial sums, promoted into acc (gemm_block_scaled.py)
            fragment_shape = tCcC.shape if self.waves == 1 else (tCcC.shape[0], 1, tCcC.shape[2])  # one wave's
            acc_k_tiles = tuple(cute.make_rmem_tensor(fragment_shape, Float32) for _ in range(self._block_fragments()))
            turns = None
            if cutlass.const_expr(self._block_fragments() == 1 and self.waves == 1):
                turns = self._start_turns(cute.arch.make_warp_uniform(group_tidx // 128))
        if cutlass.const_expr(self.scale_mode == "tensor"):
            alpha = alpha * mScaleA[0] * mScaleB[0]
        if cutlass.const_expr(not self.direct_store):
            # 16-bit out: registers -> stmatrix -> this group's smem ring -> TMA store
            tma_store = self._tma_store_setup(tiled_mma, acc, sC, group, group_tidx)

        # the producer fills the ring tile by tile in schedule order and tile groups take
        # turns: each group skips the k-tiles of the other groups' tiles
        skip = num_k_tiles * (self.num_tile_groups - 1)
        if cutlass.const_expr(self.pingpong):
            # Turn barriers: a group starts its main loop only once the other group has
            # waited on all stages of its own tile. Besides serializing the tensor-core
            # work (so an epilogue overlaps the other group's main loop), this keeps every
            # stage barrier at most one phase ahead of its waiter, which the parity waits
            # of the mbarriers need. Group 1 pre-arrives so that group 0 goes first.
            my_turn = pipeline.NamedBarrier(barrier_id=3 + group, num_threads=2 * self.tile_threads)
            other_turn = pipeline.NamedBarrier(barrier_id=4 - group, num_threads=2 * self.tile_threads)
            if group == 1:
                other_turn.arrive()
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        read_state = _advance_state(read_state, num_k_tiles * group)
        release_state = read_state.clone()
        subtiles_done = Int32(0)
        if cutlass.const_expr(self.stream_k):
            fixup_barrier = pipeline.NamedBarrier(barrier_id=1 + group, num_threads=self.tile_threads)
        work_idx, num_work_units, work_stride = self._work_walk(sched, group)
        while work_idx < num_work_units:
            tile_m_idx, tile_n_idx, batch_idx, k_begin, k_count, work = self._work_tile(sched, work_idx, num_k_tiles)
            row_start = self._tile_start(tile_m_idx, mC_mnl.shape[0], tile_m, True)
            col_start = self._tile_start(tile_n_idx, mC_mnl.shape[1], tile_n, False)
            if cutlass.const_expr(self.grouped is not None):
                tile = group_tile(self, mGroups, tile_m_idx, tile_n_idx, batch_idx, mC_mnl.shape[0],
                                  mC_mnl.shape[1] * (2 if self.gated is not None else 1),
                                  num_groups(self, mGroups, mC_mnl), num_k_tiles)
                row_start, col_start, k_count, batch_idx = tile.row_start, tile.col_start, tile.k_count, tile.c_batch
            # (scale_b per group: the group's batch of B)
            column_values = self._column_values(tCcC, mBias, mScaleB, col_start, mC_mnl.shape,
                                                tile.b_batch if self.grouped is not None else batch_idx)
            if cutlass.const_expr(self.swap_ab):  # the bias runs along the rows, scale_b (a's) along the columns
                column_values = (self._row_bias(tCcC, mBias, row_start, mC_mnl.shape), column_values[1])

            if cutlass.const_expr(self.pingpong):
                my_turn.arrive_and_wait()
            if cutlass.const_expr(self.grouped is not None):
                # an empty group (K grouped) or the rows past the last group: zeros, nothing loaded
                if k_count > 0:
                    read_state, release_state = self._mainloop(
                        ab_pipeline, tiled_mma, acc, tCrA, tCrB, read_state, release_state, k_count,
                        (sA, sB, tile.k_tail, group_tidx))
                    warpgroup.wait_group(0)
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()
                else:
                    acc.fill(0.0)
            elif cutlass.const_expr(self.scale_mode == "block"):
                read_state = self._mainloop_block_scaled(
                    ab_pipeline, tiled_mma, acc, acc_k_tiles, turns, tCrA, tCrB, read_state, k_count, scale_smem,
                    tCcC, row_start, col_start)
                release_state = read_state.clone()
            else:
                read_state, release_state = self._mainloop(ab_pipeline, tiled_mma, acc, tCrA, tCrB, read_state,
                                                           release_state, k_count)
            if cutlass.const_expr(self.pingpong):
                other_turn.arrive()
            if cutlass.const_expr(self.scale_mode != "block" and self.grouped is None):
                warpgroup.wait_group(0)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
            if cutlass.const_expr(self.num_tile_groups > 1):
                read_state = _advance_state(read_state, skip)
                release_state = _advance_state(release_state, skip)

            # ---- stream-K: a segment that does not end its tile leaves its partial sums to the
            # tile's finisher, which adds those of the segments before its own
            finishes = True
            if cutlass.const_expr(self.stream_k):
                finishes = stream_k_fixup(acc, work, num_k_tiles, self.cluster_shape_mn, workspace, fixup_barrier,
                                          group_tidx, self.tile_threads)
            if finishes:
                # ---- epilogue: alpha, bias and activation in fp32 registers, then out
                if cutlass.const_expr(self.grouped is None or self.scale_mode is not None):
                    self._scale_add_bias(acc, alpha, tCcC, column_values, mScaleA, row_start, mC_mnl.shape, batch_idx)
                    apply_activation(acc, self.activation, prescaled=True)  # _scale_add_bias scaled its input
                if cutlass.const_expr(self.grouped is not None and not self.direct_store):
                    # a tile inside its group (every tile of a group of tile_m rows or more, moved back
                    # to end at the group's end) through the TMA; a smaller group's rows predicated
                    if row_start + tile_m <= tile.row_end:
                        subtiles_done = self._store_tma(tma_store, tma_atom_c, sC, mC_mnl, tile_m_idx, tile_n_idx,
                                                        row_start, col_start, batch_idx, subtiles_done, group)
                    else:
                        self._store_direct(acc, tCcC, mC_gmem, row_start, col_start, batch_idx, tile.row_end)
                elif cutlass.const_expr(self.gated is not None):
                    self._store_gated(acc, tCcC, mC_mnl, row_start, col_start, tile.row_end)
                elif cutlass.const_expr(self.direct_store):
                    self._store_direct(acc, tCcC, mC_mnl, row_start, col_start, batch_idx,
                                       tile.row_end if self.grouped is not None else None)
                else:
                    subtiles_done = self._store_tma(tma_store, tma_atom_c, sC, mC_mnl, tile_m_idx, tile_n_idx,
                                                    row_start, col_start, batch_idx, subtiles_done, group)
            work_idx += work_stride
        if cutlass.const_expr(not self.direct_store):
            store_pipeline, is_store_warp = tma_store.store_pipeline, tma_store.is_store_warp
            if is_store_warp:
                store_pipeline.producer_tail()

    @cute.jit
    def _mainloop(self, ab_pipeline, tiled_mma, acc, tCrA, tCrB, read_state, release_state, num_k_tiles,
                  k_tail_zeroing=None):
        """acc = this tile's A @ B with one wgmma batch in flight; a stage is released once the
        batch that read it retired. k-tile 0 is peeled: it zero-initializes acc. The last
        batch is left in flight (the caller waits for it and releases its stage). K grouped
        (``k_tail_zeroing``): the last k-tile's columns past the group are zeroed first."""
        ab_pipeline.consumer_wait(read_state)
        if cutlass.const_expr(self.grouped == "k"):
            if num_k_tiles == 1:
                zero_k_tail(self, *k_tail_zeroing, read_state.index)
        self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index, zero_init=True)
        read_state.advance()
        for k_tile in cutlass.range(1, num_k_tiles, unroll=1):
            ab_pipeline.consumer_wait(read_state)
            if cutlass.const_expr(self.grouped == "k"):
                if k_tile == num_k_tiles - 1:
                    zero_k_tail(self, *k_tail_zeroing, read_state.index)
            self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index, zero_init=False)
            warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        return read_state, release_state

    @cute.jit
    def _mma_k_tile(self, tiled_mma, acc, tCrA, tCrB, stage, zero_init: cutlass.Constexpr):
        """Issue (not wait for) the wgmma batch of one k-tile of this warpgroup."""
        warpgroup.fence()
        # a fresh atom per batch: its ACCUMULATE flag is a compile-time state
        mma_atom = cute.make_mma_atom(tiled_mma.op)
        mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k_block in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            cute.gemm(mma_atom, acc, tCrA[(None, None, k_block, stage)], tCrB[(None, None, k_block, stage)], acc)
            mma_atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()


def _advance_state(state, steps):
    """``state`` advanced by a runtime number of stages (the phase flips per wrap)."""
    index = state.index + steps
    wraps = index // state.stages
    return pipeline.PipelineState(state.stages, state.count + steps, index - wraps * state.stages,
                                  state.phase ^ (wraps % 2))


# ---- compile-time variants ---------------------------------------------------------------

def build(spec: KernelSpec):
    """A 16-bit GEMM variant, or an FP8 one when the spec carries a scale mode (``scale``) and
    B's dtype (``b``, A's is ``ab``) and the bias dtype (``bias_dtype``)."""
    ab_dtype, out_dtype = _DSL_TYPES[spec["ab"]], _DSL_TYPES[spec["out"]]
    activation = None if spec["act"] == "none" else spec["act"]
    scale_mode = spec.get("scale")
    b_dtype = _DSL_TYPES[spec.get("b", spec["ab"])]
    bias_dtype = _DSL_TYPES[spec.get("bias_dtype", spec["ab"])]
    gemm = Sm90Gemm(ab_dtype, out_dtype, spec["a_major"] == "k", spec["b_major"] == "k", spec["bias"],
                    activation, GemmConfig.from_spec_params(spec), b_dtype, bias_dtype, scale_mode,
                    spec.get("odd_n", False), spec.get("grouped"),
                    (spec["gated"], spec["gate_alpha"], spec["gate_limit"], spec["gate_up"]) if spec.get("gated")
                    else None)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if gemm.grouped is not None:
        # rows: a (M, K), b (G, K, N), out (M, N); K grouped: a (M, K), b (K, N), out (G, M, N)
        b_rank, out_rank = (3, 2) if gemm.grouped == "rows" else (2, 3)
        groups = cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(), cute.sym_int32()),
                                               (cute.sym_int64(), 1), assumed_align=4)
        operands = (fake_operand(ab_dtype, gemm.a_k_major, 2), fake_operand(b_dtype, not gemm.b_k_major, b_rank))
        tail = (groups, fake_operand(out_dtype, True, out_rank), Int32(1), stream)
        if scale_mode is not None:  # rowwise: scale_a (M, 1), scale_b (G, 1, N)
            return gemm.run_grouped_scaled, (*operands, fake_scales("row", 2), fake_scales("row", 3), *tail)
        return gemm.run_grouped, (*operands, *tail)
    # the caller's torch-order tensors (a (L, M, K), b (L, K, N), out (L, M, N)); the jit function
    # permutes their layouts, so the host passes them as they are. Swapped operands: the kernel's
    # A (dtype ab, majorness a_major) is b^T, its B (dtype b, majorness b_major) a^T
    rank = spec["rank"]
    if gemm.swap_ab:
        mA = fake_operand(b_dtype, gemm.b_k_major, rank)
        mB = fake_operand(ab_dtype, not gemm.a_k_major, rank)
    else:
        mA = fake_operand(ab_dtype, gemm.a_k_major, rank)
        mB = fake_operand(b_dtype, not gemm.b_k_major, rank)
    mC = fake_operand(out_dtype, True, rank)
    # stream-K: the workspace (partial sums, flags) trails the arguments
    workspace = ()
    if gemm.stream_k:
        workspace = (cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int32(),), assumed_align=16),
                     cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=4))
    bias = ()
    if gemm.has_bias:
        bias = (cute.runtime.make_fake_compact_tensor(bias_dtype, (cute.sym_int32(),), assumed_align=TMA_ALIGN_BYTES),)
    if scale_mode is not None:
        if scale_mode == "block":  # loaded by TMA with the k-tiles (runtime.gemm.tma_block_scales)
            scales = (fake_block_scales(rank, -2), fake_block_scales(rank, -1))
        else:
            scales = (fake_scales(scale_mode, rank), fake_scales(scale_mode, rank))
        fn = gemm.run_scaled_with_bias if gemm.has_bias else gemm.run_scaled
        return fn, (mA, mB, *scales, *bias, mC, Int32(1), stream, *workspace)
    fn = gemm.run_with_bias if gemm.has_bias else gemm.run
    return fn, (mA, mB, *bias, mC, Float32(1.0), Int32(1), stream, *workspace)
