"""Blackwell (sm_100a) GEMM with a fused bias + activation epilogue.

``out[l] = act(alpha * a[l] @ b[l] + bias)``, accumulated in fp32 in tensor memory (TMEM).

FP8 (``scale_mode`` set; e4m3 / e5m2 operands, tcgen05's kind::f8f6f4 MMA over 128-byte k-tiles):
per-tensor scales fold into alpha, rowwise ones (scale_a (M, 1), scale_b (1, N)) multiply each
accumulator value in the epilogue by its row's and column's scale. Blockwise scales (a promotion
per k-tile) have no variant here.

Warp roles inside one CTA (192 threads, persistent over output tiles):

* warps 0-3, epilogue: TMEM -> registers (tcgen05.ld), alpha, bias and activation in fp32,
  registers -> smem -> global memory with TMA stores, one sub-tile at a time;
* warp 4, MMA: one thread issues tcgen05.mma for the whole CTA (or CTA pair);
* warp 5, producer: TMA loads of A/B k-tiles into a multi-stage smem ring.

Two accumulator buffers in TMEM let the MMA warp run tile i+1 while the epilogue
drains tile i. With ``tile_m == 256`` a CTA pair of the cluster runs one 256-row MMA
(cta_group::2): each CTA loads half of A's rows and half of B's columns and the
leader CTA's MMA thread issues the instruction for both. Clusters wider than the pair
multicast the shared operand tile to every CTA that needs it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from ...runtime.gemm_config import GemmConfig
from ...runtime.spec import KernelSpec
from ...runtime.tma import TMA_ALIGN_BYTES
from ..common.activation import apply_activation
from ..common.gemm_operands import fake_operand, fake_scales, scales_to_kernel_order, to_kernel_order
from ..common.tile_scheduler import PersistentTileScheduler


_DSL_TYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32,
              "e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}
SCALE_MODES = (None, "tensor", "row")  # blockwise: Hopper only

# Warp roles; the epilogue warps must be warps 0-3 so that warp i reads TMEM lanes 32i..32i+31.
EPILOGUE_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
LOAD_WARP = 5
THREADS_PER_CTA = 32 * 6

# Named barriers (id 0 is __syncthreads)
_EPILOGUE_BARRIER_ID = 1
_TMEM_PTR_BARRIER_ID = 2

SMEM_CAPACITY = cutlass.memory.get_smem_capacity_in_bytes("sm_100")
SMEM_RESERVED = 3072  # mbarriers, the TMEM address slot, the bias tile and alignment padding
TMEM_COLUMNS = 512
ACC_STAGES = 2  # accumulator buffers in TMEM: MMA of the next tile overlaps this tile's epilogue
MMA_K_BLOCKS = 4  # tcgen05.mma instructions (k=16 for 16-bit inputs, 32 for FP8) per k-tile: 128 bytes of K


def is_two_cta(config: GemmConfig) -> bool:
    """On sm_100 ``config.tile_m`` is the MMA tile: 256 rows are one 2-CTA MMA of a CTA pair."""
    return config.tile_m == 256


def config_supported(config: GemmConfig) -> bool:
    """Tiles of 128/256 MMA rows by 64/128/256 columns; a 2-CTA MMA needs whole CTA pairs."""
    return (config.tile_m in (128, 256) and config.tile_n in (64, 128, 256) and not config.pingpong
            and (not is_two_cta(config) or config.cluster_m % 2 == 0)
            and config.cluster_m * config.cluster_n <= 16)


def _regroup_mma_modes(tensor: cute.Tensor) -> cute.Tensor:
    """((ATOM_M, ATOM_N), MMA_M, MMA_N, ...) -> ((ATOM_M, MMA_M), (ATOM_N, MMA_N), ...).

    The epilogue tiles the accumulator by (rows, cols); the MMA partitions keep the atom
    modes apart from the repeat modes, so fold each atom mode with its repeat mode.
    """
    layout = tensor.layout
    shape, stride = layout.shape, layout.stride
    new_layout = cute.make_layout(
        ((shape[0][0], shape[1]), (shape[0][1], shape[2]), *shape[3:]),
        stride=((stride[0][0], stride[1]), (stride[0][1], stride[2]), *stride[3:]),
    )
    return cute.make_tensor(tensor.iterator, new_layout)


class GemmSm100:
    """One compiled variant: dtypes, majorness (read from the tensors), epilogue, tile config."""

    def __init__(self, ab_dtype, out_dtype, has_bias: bool, activation, config: GemmConfig, b_dtype=None,
                 scale_mode=None):
        if not config_supported(config):
            raise ValueError(f"unsupported sm100 GEMM config {config}")
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES} on sm_100a, got {scale_mode!r}")
        if (ab_dtype.width == 8) != (scale_mode is not None):
            raise ValueError("FP8 operands take scales (and scales FP8 operands)")
        self.ab_dtype = ab_dtype  # A's dtype (B's too unless b_dtype says otherwise)
        self.b_dtype = b_dtype or ab_dtype
        self.scale_mode = scale_mode
        self.out_dtype = out_dtype
        self.has_bias = has_bias  # 16-bit variants: the input dtype; FP8 ones: the spec's bias dtype
        self.activation = activation
        self.acc_dtype = cutlass.Float32
        self.config = config
        self.two_cta = is_two_cta(config)
        self.cta_group = tcgen05.CtaGroup.TWO if self.two_cta else tcgen05.CtaGroup.ONE
        self.cluster_shape_mnk = (config.cluster_m, config.cluster_n, 1)
        self.mma_tiler_mn = (config.tile_m, config.tile_n)

    # ------------------------------------------------------------------ host side
    def _plan(self, a_major, b_major, out_layout):
        """Compile-time layouts, stage counts and TMEM size for this variant."""
        self.tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.b_dtype, a_major, b_major, self.acc_dtype, self.cta_group, self.mma_tiler_mn
        )
        mma_inst_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        self.mma_tiler = (*self.mma_tiler_mn, mma_inst_k * MMA_K_BLOCKS)
        ctas_per_mma = cute.size(self.tiled_mma.thr_id.shape)
        self.cta_tile_mnk = (self.mma_tiler[0] // ctas_per_mma, *self.mma_tiler[1:])
        # (V, M, N, K): V is the CTA's place inside its MMA pair
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout(self.cluster_shape_mnk), (self.tiled_mma.thr_id.shape,)
        )
        self.mcast_ctas_a = cute.size(self.cluster_layout_vmnk.shape[2])
        self.mcast_ctas_b = cute.size(self.cluster_layout_vmnk.shape[1])
        self.ctas_per_mma = ctas_per_mma

        self.out_layout = out_layout
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
            self.cta_tile_mnk, self.two_cta, out_layout, self.out_dtype
        )
        a_one = sm100_utils.make_smem_layout_a(self.tiled_mma, self.mma_tiler, self.ab_dtype, 1)
        b_one = sm100_utils.make_smem_layout_b(self.tiled_mma, self.mma_tiler, self.b_dtype, 1)
        epi_one = sm100_utils.make_smem_layout_epi(self.out_dtype, out_layout, self.epi_tile, 1)
        ab_stage_bytes = cute.size_in_bytes(self.ab_dtype, a_one) + cute.size_in_bytes(
            self.b_dtype, b_one
        )
        epi_stage_bytes = cute.size_in_bytes(self.out_dtype, epi_one)
        self.epi_stages = 2
        self.ab_stages = (
            SMEM_CAPACITY - SMEM_RESERVED - self.epi_stages * epi_stage_bytes
        ) // ab_stage_bytes
        # leftover smem deepens the store ring: more stores in flight before a wait
        self.epi_stages += (
            SMEM_CAPACITY
            - SMEM_RESERVED
            - self.ab_stages * ab_stage_bytes
            - self.epi_stages * epi_stage_bytes
        ) // epi_stage_bytes
        self.a_smem_staged = sm100_utils.make_smem_layout_a(
            self.tiled_mma, self.mma_tiler, self.ab_dtype, self.ab_stages
        )
        self.b_smem_staged = sm100_utils.make_smem_layout_b(
            self.tiled_mma, self.mma_tiler, self.b_dtype, self.ab_stages
        )
        self.epi_smem_staged = sm100_utils.make_smem_layout_epi(
            self.out_dtype, out_layout, self.epi_tile, self.epi_stages
        )
        # A/B bytes landing per stage on the leader CTA's barrier (both CTAs of a pair)
        self.tma_bytes_per_stage = ab_stage_bytes * ctas_per_mma
        self.tmem_cols = cutlass.memory.get_num_tmem_alloc_cols(
            self._acc_buffers(self.tiled_mma), arch="sm_100"
        )
        assert self.tmem_cols <= TMEM_COLUMNS

    def _acc_buffers(self, tiled_mma):
        """A TMEM tensor (MMA, MMA_M, MMA_N, ACC_STAGE) without an address yet."""
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        return tiled_mma.make_fragment_C(cute.append(acc_shape, ACC_STAGES))

    # Every GEMM variant's function ends with a stream-K workspace (partial sums, flags), the
    # launch's common convention (runtime/gemm.py); this arch has no stream-K: always None.
    @cute.jit
    def run(self, mA_torch: cute.Tensor, mB_torch: cute.Tensor, mOut_torch: cute.Tensor,
            alpha: cutlass.Float32, max_clusters: cutlass.Int32, stream, mPartials=None, mFlags=None):
        self._launch(mA_torch, mB_torch, None, mOut_torch, alpha, max_clusters, stream)

    @cute.jit
    def run_with_bias(self, mA_torch: cute.Tensor, mB_torch: cute.Tensor, mBias: cute.Tensor,
                      mOut_torch: cute.Tensor, alpha: cutlass.Float32, max_clusters: cutlass.Int32, stream,
                      mPartials=None, mFlags=None):
        self._launch(mA_torch, mB_torch, mBias, mOut_torch, alpha, max_clusters, stream)

    @cute.jit
    def run_scaled(self, mA_torch: cute.Tensor, mB_torch: cute.Tensor, mScaleA: cute.Tensor,
                   mScaleB: cute.Tensor, mOut_torch: cute.Tensor, max_clusters: cutlass.Int32, stream,
                   mPartials=None, mFlags=None):
        self._launch(mA_torch, mB_torch, None, mOut_torch, Float32(1.0), max_clusters, stream, mScaleA, mScaleB)

    @cute.jit
    def run_scaled_with_bias(self, mA_torch: cute.Tensor, mB_torch: cute.Tensor, mScaleA: cute.Tensor,
                             mScaleB: cute.Tensor, mBias: cute.Tensor, mOut_torch: cute.Tensor,
                             max_clusters: cutlass.Int32, stream, mPartials=None, mFlags=None):
        self._launch(mA_torch, mB_torch, mBias, mOut_torch, Float32(1.0), max_clusters, stream, mScaleA, mScaleB)

    def _launch(self, mA_torch, mB_torch, mBias, mOut_torch, alpha, max_clusters, stream, mScaleA=None,
                mScaleB=None):
        mA, mB, mOut = to_kernel_order(mA_torch, mB_torch, mOut_torch)
        if cutlass.const_expr(self.scale_mode == "row"):
            mScaleA, mScaleB = scales_to_kernel_order(mScaleA), scales_to_kernel_order(mScaleB)
        self._plan(
            LayoutEnum.from_tensor(mA).mma_major_mode(),
            LayoutEnum.from_tensor(mB).mma_major_mode(),
            LayoutEnum.from_tensor(mOut),
        )
        tiled_mma = self.tiled_mma

        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(
            sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mnk[:2], tiled_mma.thr_id),
            mA,
            cute.slice_(self.a_smem_staged, (None, None, None, 0)),
            self.mma_tiler,
            tiled_mma,
            self.cluster_layout_vmnk.shape,
        )
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mnk[:2], tiled_mma.thr_id),
            mB,
            cute.slice_(self.b_smem_staged, (None, None, None, 0)),
            self.mma_tiler,
            tiled_mma,
            self.cluster_layout_vmnk.shape,
        )
        tma_out, tma_mOut = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            mOut,
            cute.select(self.epi_smem_staged, mode=[0, 1]),
            self.epi_tile,
        )

        # Persistent grid: (cluster_m, cluster_n, clusters that fit on the device)
        grid = self._scheduler(mOut).grid_shape(max_clusters)

        self.kernel(
            tiled_mma,
            tma_a,
            tma_mA,
            tma_b,
            tma_mB,
            tma_out,
            tma_mOut,
            mOut,
            mBias,
            mScaleA,
            mScaleB,
            alpha,
            self.cluster_layout_vmnk,
            self.a_smem_staged,
            self.b_smem_staged,
            self.epi_smem_staged,
            self.epi_tile,
        ).launch(
            grid=grid,
            block=[THREADS_PER_CTA, 1, 1],
            cluster=self.cluster_shape_mnk,
            min_blocks_per_mp=1,  # one persistent CTA per SM: no register cap for occupancy
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_out: cute.CopyAtom,
        mOut_tma: cute.Tensor,
        mOut: cute.Tensor,
        mBias: cute.Tensor | None,
        mScaleA: cute.Tensor | None,  # FP8: per-tensor (1,) or rowwise (M, 1, L), in kernel order
        mScaleB: cute.Tensor | None,  # (1,) or (1, N, L)
        alpha: cutlass.Float32,
        cluster_layout_vmnk: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_out)

        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank)
        # the CTA's half of the MMA pair (always 0 without 2-CTA MMA)
        mma_half = cute.arch.block_idx()[0] % cute.size(tiled_mma.thr_id.shape)
        is_leader_cta = mma_half == 0

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, ACC_STAGES * 2]
            tmem_dealloc_mbar: cutlass.Int64
            tmem_addr: cutlass.Int32

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        ab_pipe, acc_pipe, tmem = self._pipelines(storage, tiled_mma, cluster_layout_vmnk)
        # barrier inits must be visible cluster-wide before any peer arrives on them
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)

        # 128B-swizzled operand stages start on a swizzle-pattern (1024 B) boundary
        sA = smem.allocate_tensor(
            element_type=self.ab_dtype,
            layout=a_smem_staged.outer,
            byte_alignment=1024,
            swizzle=a_smem_staged.inner,
        )
        sB = smem.allocate_tensor(
            element_type=self.b_dtype,
            layout=b_smem_staged.outer,
            byte_alignment=1024,
            swizzle=b_smem_staged.inner,
        )
        sOut = smem.allocate_tensor(
            element_type=self.out_dtype,
            layout=epi_smem_staged.outer,
            byte_alignment=128,
            swizzle=epi_smem_staged.inner,
        )
        sBias = None
        if cutlass.const_expr(mBias is not None):  # the bias slice of the current tile
            sBias = smem.allocate_tensor(
                element_type=mBias.element_type, layout=cute.make_layout(self.cta_tile_mnk[1]), byte_alignment=16
            )

        # Global tiles: (bM, bK, RestM, RestK, RestL), (bN, bK, RestN, RestK, RestL), ...
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        gOut = cute.local_tile(
            mOut_tma, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None)
        )
        thr_mma = tiled_mma.get_slice(mma_half)
        tCgA = thr_mma.partition_A(gA)  # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgB = thr_mma.partition_B(gB)  # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
        tCgOut = thr_mma.partition_C(gOut)  # (MMA, MMA_M, MMA_N, RestM, RestN, RestL)
        tCcOut = None
        if cutlass.const_expr(self.scale_mode == "row"):
            # (row, col, batch) of every output value, partitioned exactly as the output is
            cOut = cute.local_tile(cute.make_identity_tensor(mOut.shape), cute.slice_(self.mma_tiler, (None, None, 0)),
                                   (None, None, None))
            tCcOut = thr_mma.partition_C(cOut)

        # TMA views; A is multicast along the cluster's N mode, B along its M mode
        tAsA, tAgA = cpasync.tma_partition(
            tma_a,
            cta_coord_vmnk[2],
            cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape),
            cute.group_modes(sA, 0, 3),
            cute.group_modes(tCgA, 0, 3),
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b,
            cta_coord_vmnk[1],
            cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape),
            cute.group_modes(sB, 0, 3),
            cute.group_modes(tCgB, 0, 3),
        )
        tCrA = tiled_mma.make_fragment_A(sA)  # smem descriptors (MMA, MMA_M, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(sB)

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        scheduler = self._scheduler(mOut)
        k_tiles = cute.size(gA, mode=[3])
        acc_layout = self._acc_buffers(tiled_mma).layout

        if warp_idx == LOAD_WARP:
            self.load_ab(
                scheduler, ab_pipe, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB,
                cluster_layout_vmnk, cta_coord_vmnk, k_tiles,
            )
        if warp_idx == MMA_WARP:
            tmem.wait_for_alloc()
            tCtAcc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), acc_layout)
            self.issue_mma(
                scheduler, ab_pipe, acc_pipe, tiled_mma, tCrA, tCrB, tCtAcc, is_leader_cta, k_tiles
            )
        if warp_idx < MMA_WARP:
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc = cute.make_tensor(tmem_ptr, acc_layout)
            self.epilogue(
                scheduler, acc_pipe, tCtAcc, tCgOut, sOut, tma_out, mOut, mBias, sBias, alpha,
                epi_tile, warp_idx, mScaleA, mScaleB, tCcOut,
            )
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)

    def _pipelines(self, storage, tiled_mma: cute.TiledMma, cluster_layout_vmnk: cute.Layout):
        """The A/B ring, the accumulator buffers' pipeline and the TMEM allocator over ``storage``'s
        barriers (their inits made visible by the caller's pipeline_init_arrive)."""
        # A/B ring: TMA (producer thread, leader CTA's barrier) -> tcgen05.mma (consumer)
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.mcast_ctas_a + self.mcast_ctas_b - 1
            ),
            tx_count=self.tma_bytes_per_stage,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        # accumulator buffers: tcgen05.commit (producer) -> epilogue warps of both CTAs of a pair
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(),
            num_stages=ACC_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread,
                len(EPILOGUE_WARPS) * cute.size(tiled_mma.thr_id.shape),
            ),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=_TMEM_PTR_BARRIER_ID,
                num_threads=32 * (len(EPILOGUE_WARPS) + 1),
            ),
            allocator_warp_id=EPILOGUE_WARPS[0],
            is_two_cta=self.two_cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
        )
        return ab_pipe, acc_pipe, tmem

    def _scheduler(self, mOut: cute.Tensor) -> PersistentTileScheduler:
        """The shared persistent scheduler over CTA tiles; built alike on host and device."""
        return PersistentTileScheduler.create(
            mOut.shape,
            self.cta_tile_mnk[:2],
            self.cluster_shape_mnk[:2],
            self.config.group_size,
            self.config.band_along_m,
        )

    def _mma_tile_coord(self, scheduler: PersistentTileScheduler, work_idx):
        """(m, n, l) of the MMA tile: the two CTAs of a pair share one 256-row MMA tile."""
        m, n, l = scheduler.tile_coord(work_idx)
        return (m // self.ctas_per_mma, n, l)

    @cute.jit
    def load_ab(self, scheduler, ab_pipe, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB,
                cluster_layout_vmnk, cta_coord_vmnk, k_tiles):
        mask_a = None
        mask_b = None
        if cutlass.const_expr(self.mcast_ctas_a > 1 or self.mcast_ctas_b > 1 or self.two_cta):
            mask_a = cpasync.create_tma_multicast_mask(
                cluster_layout_vmnk, cta_coord_vmnk, mcast_mode=2
            )
            mask_b = cpasync.create_tma_multicast_mask(
                cluster_layout_vmnk, cta_coord_vmnk, mcast_mode=1
            )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        work_idx, num_work_units = scheduler.first_work_idx(), scheduler.num_work_units
        while work_idx < num_work_units:
            m, n, l = self._mma_tile_coord(scheduler, work_idx)
            tAgA_k = tAgA[(None, m, None, l)]  # ((atom_v, rest_v), RestK)
            tBgB_k = tBgB[(None, n, None, l)]
            for k in cutlass.range(k_tiles, unroll=1):
                ab_pipe.producer_acquire(state)
                barrier = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, tAgA_k[(None, k)], tAsA[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=mask_a)
                cute.copy(tma_b, tBgB_k[(None, k)], tBsB[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=mask_b)
                state.advance()
            work_idx += scheduler.work_stride()
        ab_pipe.producer_tail(state)  # no CTA exits while its smem can still be written

    @cute.jit
    def issue_mma(self, scheduler, ab_pipe, acc_pipe, tiled_mma, tCrA, tCrB, tCtAcc, is_leader_cta, k_tiles):
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ACC_STAGES)
        work_idx, num_work_units = scheduler.first_work_idx(), scheduler.num_work_units
        while work_idx < num_work_units:
            if is_leader_cta:  # the pair's MMA is issued from the leader CTA only
                tCtAcc_buf = tCtAcc[(None, None, None, acc_state.index)]
                acc_pipe.producer_acquire(acc_state)  # epilogue done with this buffer
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for k in cutlass.range(k_tiles, unroll=1):
                    ab_pipe.consumer_wait(ab_state)
                    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                        stage_kb = (None, None, kb, ab_state.index)
                        cute.gemm(tiled_mma, tCtAcc_buf, tCrA[stage_kb], tCrB[stage_kb], tCtAcc_buf)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    ab_pipe.consumer_release(ab_state)  # tcgen05.commit frees the stage
                    ab_state.advance()
                acc_pipe.producer_commit(acc_state)  # tcgen05.commit: accumulator ready
            acc_state.advance()
            work_idx += scheduler.work_stride()
        acc_pipe.producer_tail(acc_state)

    @cute.jit
    def epilogue(self, scheduler, acc_pipe, tCtAcc, tCgOut, sOut, tma_out, mOut, mBias, sBias, alpha,
                 epi_tile, warp_idx, mScaleA=None, mScaleB=None, tCcOut=None):
        tidx = cute.arch.thread_idx()[0]
        if cutlass.const_expr(self.scale_mode == "tensor"):
            alpha = alpha * mScaleA[0] * mScaleB[0]
        # TMEM -> registers: warp w reads lanes 32w..32w+31 (the tile's rows)
        tAcc = _regroup_mma_modes(tCtAcc)  # (TILE_M, TILE_N, ACC_STAGE)
        tAcc_epi = cute.flat_divide(tAcc, epi_tile)  # (EPI_M, EPI_N, n_m, n_n, ACC_STAGE)
        t2r_atom = sm100_utils.get_tmem_load_op(
            self.cta_tile_mnk, self.out_layout, self.out_dtype, self.acc_dtype, epi_tile, self.two_cta
        )
        tiled_t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = tiled_t2r.get_slice(tidx)
        tTR_tAcc = thr_t2r.partition_S(tAcc_epi)  # (T2R, T2R_M, T2R_N, n_m, n_n, ACC_STAGE)
        gOut_epi = cute.flat_divide(_regroup_mma_modes(tCgOut), epi_tile)
        tTR_gOut = thr_t2r.partition_D(gOut_epi)  # (T2R, T2R_M, T2R_N, n_m, n_n, RestM, RestN, RestL)
        tTR_rAcc = cute.make_rmem_tensor(tTR_gOut[(None, None, None, 0, 0, 0, 0, 0)].shape, self.acc_dtype)
        tTR_rOut = cute.make_rmem_tensor(tTR_rAcc.shape, self.out_dtype)
        # registers -> smem
        r2s_atom = sm100_utils.get_smem_store_op(self.out_layout, self.out_dtype, self.acc_dtype, tiled_t2r)
        tiled_r2s = cute.make_tiled_copy_D(r2s_atom, tiled_t2r)
        tRS_sOut = tiled_r2s.get_slice(tidx).partition_D(sOut)  # (R2S, R2S_M, R2S_N, EPI_STAGE)
        tRS_rOut = tiled_r2s.retile(tTR_rOut)
        # smem -> global (one thread issues the bulk tensor store)
        bSG_sOut, bSG_gOut = cpasync.tma_partition(
            tma_out, 0, cute.make_layout(1), cute.group_modes(sOut, 0, 2), cute.group_modes(gOut_epi, 0, 2)
        )
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(EPILOGUE_WARPS)),
        )
        epi_barrier = pipeline.NamedBarrier(
            barrier_id=_EPILOGUE_BARRIER_ID, num_threads=32 * len(EPILOGUE_WARPS)
        )
        if cutlass.const_expr(self.scale_mode == "row"):
            # coordinates of this thread's values: (T2R, T2R_M, T2R_N, n_m, n_n, RestM, RestN, RestL)
            tTR_cOut = thr_t2r.partition_D(cute.flat_divide(_regroup_mma_modes(tCcOut), epi_tile))
        if cutlass.const_expr(mBias is not None):
            # the bias tile seen as a (rows, cols) tile with row stride 0, split like the accumulator
            sBias_mn = cute.make_tensor(sBias.iterator, cute.make_layout(self.cta_tile_mnk[:2], stride=(0, 1)))
            tTR_sBias = cute.group_modes(thr_t2r.partition_D(cute.flat_divide(sBias_mn, epi_tile)), 3, 5)

        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ACC_STAGES)
        subtiles = cute.size(tTR_tAcc, mode=[3]) * cute.size(tTR_tAcc, mode=[4])
        store_count = cutlass.Int32(0)
        work_idx, num_work_units = scheduler.first_work_idx(), scheduler.num_work_units
        while work_idx < num_work_units:
            m, n, l = self._mma_tile_coord(scheduler, work_idx)
            tTR_tAcc_tile = cute.group_modes(tTR_tAcc[(None, None, None, None, None, acc_state.index)], 3, 5)
            bSG_gOut_tile = cute.group_modes(bSG_gOut[(None, None, None, m, n, l)], 1, 3)
            if cutlass.const_expr(mBias is not None):
                # every reader of the previous tile's bias has passed that tile's last barrier
                self._stage_bias(mBias, sBias, n, tidx)
                epi_barrier.arrive_and_wait()
            acc_pipe.consumer_wait(acc_state)
            for sub in cutlass.range_constexpr(subtiles):
                cute.copy(tiled_t2r, tTR_tAcc_tile[(None, None, None, sub)], tTR_rAcc)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before reading registers
                if cutlass.const_expr(sub == subtiles - 1):
                    # this warp's TMEM reads are done: hand the buffer back to the MMA warp
                    with cute.arch.elect_one():
                        acc_pipe.consumer_release(acc_state)
                    acc_state.advance()
                if cutlass.const_expr(self.scale_mode == "row"):
                    coords = cute.group_modes(tTR_cOut[(None, None, None, None, None, m, n, l)], 3, 5)
                    self._apply_row_scales(tTR_rAcc, coords[(None, None, None, sub)], mScaleA, mScaleB, mOut.shape)
                if cutlass.const_expr(mBias is not None):  # broadcast smem reads, in fp32
                    bias = tTR_sBias[(None, None, None, sub)].load().to(self.acc_dtype)
                    tTR_rAcc.store(tTR_rAcc.load() * alpha + bias)
                else:
                    tTR_rAcc.store(tTR_rAcc.load() * alpha)
                apply_activation(tTR_rAcc, self.activation)
                tTR_rOut.store(tTR_rAcc.load().to(self.out_dtype))
                buf = store_count % self.epi_stages
                cute.copy(tiled_r2s, tRS_rOut, tRS_sOut[(None, None, None, buf)])
                # st.shared results must be visible to the async (TMA) proxy
                cute.arch.fence_proxy("async.shared", space="cta")
                epi_barrier.arrive_and_wait()
                if warp_idx == EPILOGUE_WARPS[0]:
                    cute.copy(tma_out, bSG_sOut[(None, buf)], bSG_gOut_tile[(None, sub)])
                    store_pipe.producer_commit()
                    store_pipe.producer_acquire()  # the next buffer's old store has read smem
                epi_barrier.arrive_and_wait()
                store_count += 1
            work_idx += scheduler.work_stride()
        if warp_idx == EPILOGUE_WARPS[0]:
            store_pipe.producer_tail()
        epi_barrier.arrive_and_wait()

    @cute.jit
    def _apply_row_scales(self, acc, coords, mScaleA, mScaleB, mn_shape):
        """acc *= scale_a[row] * scale_b[col] per value (rowwise FP8 scales). Rows and columns
        past M and N read the last one's scale: those values are never stored (the TMA clips)."""
        last_row, last_col = mn_shape[0] - 1, mn_shape[1] - 1
        for i in cutlass.range_constexpr(cute.size(acc)):
            row, col, batch = coords[i]
            acc[i] = acc[i] * (mScaleA[cutlass.min(row, last_row), 0, batch]
                               * mScaleB[0, cutlass.min(col, last_col), batch])

    @cute.jit
    def _stage_bias(self, mBias, sBias, n_tile, tidx):
        """bias[n_tile * tile_n:][:tile_n] -> smem, by the epilogue threads."""
        tile_n = self.cta_tile_mnk[1]
        n_last = mBias.shape[0] - 1
        for j in cutlass.range_constexpr(cute.ceil_div(tile_n, 32 * len(EPILOGUE_WARPS))):
            col = tidx + j * 32 * len(EPILOGUE_WARPS)
            if col < tile_n:
                # columns past N are clipped by the TMA store; clamp only to stay in bounds
                sBias[col] = mBias[cutlass.min(n_tile * tile_n + col, n_last)]


# ---------------------------------------------------------------------- compile
def build(spec: KernelSpec):
    """A 16-bit variant, or an FP8 one when the spec carries a scale mode (``scale``), B's dtype
    (``b``) and the bias dtype (``bias_dtype``), as the Hopper kernel's specs do."""
    ab, out = _DSL_TYPES[spec["ab"]], _DSL_TYPES[spec["out"]]
    b_dtype = _DSL_TYPES[spec.get("b", spec["ab"])]
    bias_dtype = _DSL_TYPES[spec.get("bias_dtype", spec["ab"])]
    scale_mode = spec.get("scale")
    activation = None if spec["act"] == "none" else spec["act"]
    gemm = GemmSm100(ab, out, spec["bias"], activation, GemmConfig.from_spec_params(spec), b_dtype, scale_mode)
    rank = spec["rank"]
    mA = fake_operand(ab, spec["a_major"] == "k", rank)
    mB = fake_operand(b_dtype, spec["b_major"] == "n", rank)
    mOut = fake_operand(out, True, rank)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    bias = ()
    if spec["bias"]:
        bias = (cute.runtime.make_fake_compact_tensor(bias_dtype, (cute.sym_int32(),), assumed_align=TMA_ALIGN_BYTES),)
    if scale_mode is not None:
        scales = (fake_scales(scale_mode, rank), fake_scales(scale_mode, rank))
        fn = gemm.run_scaled_with_bias if spec["bias"] else gemm.run_scaled
        return fn, (mA, mB, *scales, *bias, mOut, Int32(1), stream)
    fn = gemm.run_with_bias if spec["bias"] else gemm.run
    return fn, (mA, mB, *bias, mOut, Float32(1.0), Int32(1), stream)
