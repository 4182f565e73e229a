"""Persistent tile schedulers with grouped rasterization, for any CuTe kernel: the GEMMs'
(data-parallel, and stream-K over the last waves) and attention's.

The output of a batched GEMM is cut into ``tile_m x tile_n`` tiles, the tiles into
clusters of ``cluster_m x cluster_n`` tiles, and the clusters of all batches into a
1-D list of *work units*. A persistent launch starts ``min(units, max_clusters)``
clusters; the cluster with index ``c`` (``block_idx.z``) handles units ``c``,
``c + G``, ``c + 2G``... where ``G = grid_dim.z``. No atomics and no workspace.
:class:`StreamKTileScheduler` keeps that order for all but the last waves, whose k-tiles it
spreads over every cluster (partial sums through a workspace, :func:`stream_k_fixup`).

Grouped ("banded") rasterization keeps the tiles that run at the same time close
together, so that their A rows and B columns are still in L2 when the neighbours
read them: the cluster grid of one batch is cut into bands of ``group_size``
cluster rows (along M when ``band_along_m``, else along N); inside a band the
units walk across the band first, then along it. With ``group_size == 1`` the
order is plain row-major over (M, N); bands never cross a batch.

Host side (inside a ``@cute.jit`` host function)::

    sched = PersistentTileScheduler.create((m, n, l), (tile_m, tile_n), cluster_mn, group_size, band_along_m)
    grid = sched.grid_shape(max_clusters)   # (cluster_m, cluster_n, persistent clusters)

Device side (inside the ``@cute.kernel``; rebuild it from the same problem shape,
which costs a few integer ops once per CTA)::

    work_idx = sched.first_work_idx()
    while work_idx < sched.num_work_units:
        tile_m_idx, tile_n_idx, batch_idx = sched.tile_coord(work_idx)
        ...
        work_idx += sched.work_stride()

Only ``cute`` integer arithmetic is used, so Hopper and Blackwell kernels share it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass import const_expr
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

from .bulk import wait_for_value
from .dsl_state import DslState


def _ceil_div(a, b: int):
    return (a + (b - 1)) // b


class PersistentTileScheduler:
    """Maps a linear work-unit index to this CTA's (tile_m_idx, tile_n_idx, batch_idx)."""

    def __init__(self, clusters_m, clusters_n, num_batches, cluster_shape_mn, group_size, band_along_m):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.clusters_m = clusters_m
        self.clusters_n = clusters_n
        self.num_batches = num_batches
        self.cluster_shape_mn = tuple(cluster_shape_mn)
        self.group_size = group_size
        self.band_along_m = band_along_m
        self.num_work_units = clusters_m * clusters_n * num_batches

    @staticmethod
    def create(problem_shape_mnl, tile_shape_mn, cluster_shape_mn, group_size: int = 8,
               band_along_m: bool = True) -> "PersistentTileScheduler":
        """``problem_shape_mnl``: (M, N, L) as Int32 values (or ints); tile/cluster shapes static."""
        m, n, num_batches = problem_shape_mnl
        tiles_m = _ceil_div(Int32(m), tile_shape_mn[0])
        tiles_n = _ceil_div(Int32(n), tile_shape_mn[1])
        return PersistentTileScheduler(
            _ceil_div(tiles_m, cluster_shape_mn[0]),
            _ceil_div(tiles_n, cluster_shape_mn[1]),
            Int32(num_batches),
            cluster_shape_mn,
            group_size,
            band_along_m,
        )

    # a DSL value: loops may carry it (its three counts are the runtime part)
    def __extract_mlir_values__(self):
        return [v for x in (self.clusters_m, self.clusters_n, self.num_batches) for v in extract_mlir_values(x)]

    def __new_from_mlir_values__(self, values):
        counts = [new_from_mlir_values(x, [v])
                  for x, v in zip((self.clusters_m, self.clusters_n, self.num_batches), values)]
        return PersistentTileScheduler(*counts, self.cluster_shape_mn, self.group_size, self.band_along_m)

    # ---- host side -------------------------------------------------------------------
    def grid_shape(self, max_clusters):
        """Launch grid: x, y span one cluster; z is the number of persistent clusters."""
        persistent = cutlass.min(self.num_work_units, Int32(max_clusters))
        return (*self.cluster_shape_mn, cutlass.max(persistent, Int32(1)))

    # ---- device side -----------------------------------------------------------------
    def first_work_idx(self) -> Int32:
        return Int32(cute.arch.block_idx()[2])

    def work_stride(self) -> Int32:
        return Int32(cute.arch.grid_dim()[2])

    def cluster_coord(self, work_idx: Int32):
        """(cluster_m_idx, cluster_n_idx, batch_idx) of a work unit, in banded order."""
        per_batch = self.clusters_m * self.clusters_n
        batch_idx = work_idx // per_batch
        unit = work_idx - batch_idx * per_batch
        if cutlass.const_expr(self.band_along_m):
            banded, across = self.clusters_m, self.clusters_n
        else:
            banded, across = self.clusters_n, self.clusters_m
        units_per_band = across * self.group_size
        band = unit // units_per_band
        band_start = band * self.group_size
        # the last band may be narrower than group_size
        band_width = cutlass.min(banded - band_start, Int32(self.group_size))
        in_band = unit - band * units_per_band
        along = in_band // band_width
        banded_idx = band_start + (in_band - along * band_width)
        if cutlass.const_expr(self.band_along_m):
            return banded_idx, along, batch_idx
        return along, banded_idx, batch_idx

    def tile_coord(self, work_idx: Int32):
        """This CTA's tile of the work unit: its cluster's origin plus its rank in the cluster."""
        cluster_m_idx, cluster_n_idx, batch_idx = self.cluster_coord(work_idx)
        if cutlass.const_expr(self.cluster_shape_mn == (1, 1)):
            return cluster_m_idx, cluster_n_idx, batch_idx
        # grid x, y are exactly one cluster wide, so block_idx x, y is the rank in the cluster
        block = cute.arch.block_idx()
        tile_m_idx = cluster_m_idx * self.cluster_shape_mn[0] + Int32(block[0])
        tile_n_idx = cluster_n_idx * self.cluster_shape_mn[1] + Int32(block[1])
        return tile_m_idx, tile_n_idx, batch_idx


# ---------------------------------------------------------------------------
# GEMM: data-parallel waves, then stream-K over the rest
# ---------------------------------------------------------------------------

# A stream-K cluster walks at least this many k-tiles (fewer clusters take part otherwise):
# below it the partial tile it stores and its finisher loads cost more than the k-tiles save.
STREAM_K_MIN_K_TILES = 4


def _at_least_one(x):
    """1 where ``x`` > 0, else 0 (branch-free, for ints and Int32 alike)."""
    return cutlass.min(cutlass.max(x, 0), 1)


class StreamKSplit:
    """How a stream-K launch divides its work units (clusters of tiles, ``k_tiles`` k-tiles each)
    over ``clusters`` persistent clusters. Plain arithmetic on ints or DSL Int32 values: the host
    plans and tests with ints, the kernel recomputes the same numbers on the device.

    All but the last full wave run data-parallel (a whole unit per cluster, ``dp_waves`` of
    them); the units left (the last full wave and the partial one: between one and two waves)
    are cut into their k-tiles, and those are dealt out as contiguous ranges, one per cluster
    of the first ``sk_clusters``: ``q`` k-tiles each, one more for the first ``r``. A unit
    whose k-tiles span several clusters' ranges is finished (epilogue) by the cluster that
    holds its last k-tile, after adding the partial sums the others stored.
    """

    def __init__(self, units, k_tiles, clusters):
        self.units, self.k_tiles, self.clusters = units, k_tiles, clusters
        full_waves = units // clusters
        self.dp_waves = full_waves - _at_least_one(units - full_waves * clusters) * _at_least_one(full_waves)
        self.dp_units = self.dp_waves * clusters
        self.sk_units = units - self.dp_units
        self.sk_k_tiles = self.sk_units * k_tiles
        self.sk_clusters = (cutlass.min(cutlass.max(self.sk_k_tiles // STREAM_K_MIN_K_TILES, 1), clusters)
                            * _at_least_one(self.sk_units))
        self.q = self.sk_k_tiles // cutlass.max(self.sk_clusters, 1)
        self.r = self.sk_k_tiles - self.q * self.sk_clusters

    def range_of(self, cluster):
        """[start, end) of a stream-K cluster's k-tiles, counted over the stream-K units."""
        start = cluster * self.q + cutlass.min(cluster, self.r)
        return start, start + self.q + _at_least_one(self.r - cluster)

    def cluster_of(self, k_tile):
        """The stream-K cluster whose range holds ``k_tile``."""
        long_ones = self.r * (self.q + 1)  # k-tiles of the first r clusters, one longer each
        in_long = _at_least_one(long_ones - k_tile)
        return (in_long * (k_tile // (self.q + 1))
                + (1 - in_long) * (self.r + cutlass.max(k_tile - long_ones, 0) // cutlass.max(self.q, 1)))

    def num_works(self, cluster):
        """Work items of a cluster: its data-parallel units, then its stream-K segments (one per
        unit its range touches)."""
        start, end = self.range_of(cluster)
        segments = (end - 1) // self.k_tiles - start // self.k_tiles + 1
        return self.dp_waves + _at_least_one(self.sk_clusters - cluster) * segments

    def work(self, cluster, j):
        """Work item ``j`` of a cluster: (unit, k_begin, k_end, first_cluster). Stream-K segments
        run from the range's last unit back to its first, so the segment a cluster leaves to a
        finisher (the head of the unit its range ends in) is the first it computes, and no
        finisher waits on a cluster that is itself waiting. ``first_cluster`` is the cluster
        whose range holds the unit's first k-tile: when it is not ``cluster`` and ``k_end ==
        k_tiles``, clusters ``first_cluster .. cluster - 1`` stored partial sums to add."""
        is_sk = _at_least_one(j - self.dp_waves + 1)
        start, end = self.range_of(cluster)
        sk_unit = (end - 1) // self.k_tiles - (j - self.dp_waves) * is_sk
        unit_start = sk_unit * self.k_tiles
        k_begin = (cutlass.max(start, unit_start) - unit_start) * is_sk
        k_end = (cutlass.min(end, unit_start + self.k_tiles) - unit_start) * is_sk + (1 - is_sk) * self.k_tiles
        unit = is_sk * (self.dp_units + sk_unit) + (1 - is_sk) * (cluster + j * self.clusters)
        first_cluster = is_sk * self.cluster_of(unit_start) + (1 - is_sk) * cluster
        return unit, k_begin, k_end, first_cluster


class StreamKWork:
    """One work item of a stream-K schedule, as a CTA sees it."""

    def __init__(self, tile_m_idx, tile_n_idx, batch_idx, k_begin, k_end, first_cluster, cluster):
        self.tile_m_idx, self.tile_n_idx, self.batch_idx = tile_m_idx, tile_n_idx, batch_idx
        self.k_begin, self.k_end = k_begin, k_end
        self.first_cluster, self.cluster = first_cluster, cluster


class StreamKTileScheduler(PersistentTileScheduler):
    """:class:`PersistentTileScheduler`'s tiles and rasterization, with the last waves' units
    split along K (:class:`StreamKSplit`): where the units do not fill the clusters' last wave,
    every cluster still ends at about the same time. A work index ``j`` counts this cluster's
    work items from 0 (both CTAs of a cluster walk the same k-ranges, so B multicast holds).

    The partial sums of the segments a unit's finisher does not compute go through a workspace:
    each CTA owns one slot (it stores at most one partial tile per launch: the head of the unit
    its range ends in) and one flag, set when the slot is written and cleared by the finisher
    once it read it, so the flags are zero again when the launch ends.
    """

    def __init__(self, clusters_m, clusters_n, num_batches, cluster_shape_mn, group_size, band_along_m, k_tiles):
        super().__init__(clusters_m, clusters_n, num_batches, cluster_shape_mn, group_size, band_along_m)
        self.k_tiles = k_tiles

    @staticmethod
    def create(problem_shape_mnl, tile_shape_mn, cluster_shape_mn, group_size: int = 8,
               band_along_m: bool = True, k_tiles=None) -> "StreamKTileScheduler":
        base = PersistentTileScheduler.create(problem_shape_mnl, tile_shape_mn, cluster_shape_mn, group_size,
                                              band_along_m)
        return StreamKTileScheduler(base.clusters_m, base.clusters_n, base.num_batches, cluster_shape_mn,
                                    group_size, band_along_m, Int32(k_tiles))

    def __extract_mlir_values__(self):
        return super().__extract_mlir_values__() + extract_mlir_values(self.k_tiles)

    def __new_from_mlir_values__(self, values):
        base = super().__new_from_mlir_values__(values[:3])
        return StreamKTileScheduler(base.clusters_m, base.clusters_n, base.num_batches, self.cluster_shape_mn,
                                    self.group_size, self.band_along_m, new_from_mlir_values(self.k_tiles, [values[3]]))

    def split(self) -> StreamKSplit:
        return StreamKSplit(self.num_work_units, self.k_tiles, Int32(cute.arch.grid_dim()[2]))

    def num_works(self) -> Int32:
        return self.split().num_works(Int32(cute.arch.block_idx()[2]))

    def work(self, j: Int32) -> StreamKWork:
        cluster = Int32(cute.arch.block_idx()[2])
        unit, k_begin, k_end, first_cluster = self.split().work(cluster, j)
        return StreamKWork(*self.tile_coord(unit), k_begin, k_end, first_cluster, cluster)


@cute.jit
def stream_k_fixup(acc: cute.Tensor, work: StreamKWork, k_tiles: Int32, cluster_shape_mn, workspace, barrier,
                   tidx: Int32, num_threads: int):
    """A :class:`StreamKTileScheduler` segment's partial sums after its main loop (``acc``: the
    fp32 accumulator of the ``num_threads`` threads that share the tile, ``tidx`` among them,
    ``barrier`` theirs; ``k_tiles`` and ``cluster_shape_mn`` the scheduler's); returns whether
    this CTA finishes the tile (runs its epilogue).

    A segment that does not reach the tile's last k-tile stores ``acc`` into this CTA's slot of
    ``workspace`` = (partial sums, flags): value ``i`` of thread ``t`` at ``i * num_threads +
    t``, so each store instruction of a warp writes 128 contiguous bytes; then it raises the
    slot's flag. The finisher adds the slots of the clusters before it in cluster order (a fixed
    order: the same inputs give the same bits), lowering each flag once it saw it raised.
    Finishers only wait for segments their writers compute first (StreamKSplit.work), so no
    wait is ever on a waiting CTA.
    """
    mPartials, mFlags = workspace
    slot_values = cute.size(acc) * num_threads
    cluster_size = cluster_shape_mn[0] * cluster_shape_mn[1]
    rank = Int32(cute.arch.block_idx_in_cluster())
    finishes = work.k_end == k_tiles
    if finishes:
        for contributor in cutlass.range(work.first_cluster, work.cluster, unroll=1):
            slot = contributor * cluster_size + rank
            if tidx == 0:
                flag = mFlags.iterator + slot
                wait_for_value(flag, Int32(1))
                cute.arch.store(flag, Int32(0))
            barrier.arrive_and_wait()
            partials = mPartials.iterator + (slot * slot_values + tidx)
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + cute.arch.load(partials + i * num_threads, Float32, cop="cg")
    else:
        slot = work.cluster * cluster_size + rank
        partials = mPartials.iterator + (slot * slot_values + tidx)
        for i in cutlass.range_constexpr(cute.size(acc)):
            cute.arch.store(partials + i * num_threads, acc[i], cop="cg")
        # every thread's stores, then one release of the flag that covers them all
        cute.arch.fence_acq_rel_gpu()
        barrier.arrive_and_wait()
        if tidx == 0:
            cute.arch.store(mFlags.iterator + slot, Int32(1), sem="release", scope="gpu")
    return finishes


# ---------------------------------------------------------------------------
# attention: (query block, head, batch) tiles, static or dynamic
# ---------------------------------------------------------------------------


class AttentionTileScheduler(DslState):
    """Persistent schedule of (m_block, head, batch) tiles, static or dynamic.

    Tiles are numbered in sections of ``heads_per_section`` (batch, head) pairs;
    inside a section the query block is the slow index and the head the fast one,
    so the CTAs in flight share the K/V of a few heads (L2 reuse). With
    ``longest_first`` (causal) query blocks run from the last (most keys) to the
    first, so short tiles fill the tail of the schedule.

    * static: CTA ``c`` of ``G`` takes one tile per wave of ``G`` tiles, in snake
      order (:meth:`tile_of`); the work index advances by one.
    * dynamic: the work index is the tile itself. A CTA starts at its block index
      and then takes ``G + atomic_add(counter, 1)``: tiles are handed out in order
      to whichever CTA frees up first (longest-processing-time first for causal),
      and the kernel still prefetches the next tile under the current one.
    """

    dynamic_fields = ("num_m_blocks", "num_heads", "num_bh", "heads_per_section", "num_tiles")

    def __init__(
        self,
        num_m_blocks: Int32,
        num_heads: Int32,
        num_batch: Int32,
        heads_per_section: Int32,
        longest_first: bool,
        dynamic: bool = False,
    ):
        self.num_m_blocks = num_m_blocks
        self.num_heads = num_heads
        self.num_bh = num_heads * num_batch
        self.heads_per_section = heads_per_section
        self.longest_first = longest_first
        self.dynamic = dynamic
        self.num_tiles = num_m_blocks * self.num_bh

    @staticmethod
    def heads_per_section_for(seqlen_k: Int32, kv_bytes_per_key: int, num_bh: Int32,
                              budget_bytes: int) -> Int32:
        """How many (batch, head) pairs' K/V fit ``budget_bytes`` (at least 1), so that the
        query blocks of one head reuse its K/V from L2 (H100/H200: 50 MB)."""
        per_head = cutlass.max(seqlen_k, 1) * kv_bytes_per_key
        return cutlass.max(cutlass.min(budget_bytes // per_head, num_bh), 1)

    # Static: work w of CTA c is tile w * G + c on even waves and w * G + (G - 1 - c) on
    # odd ones (snake order), so that a CTA that got one of the longest tiles of a wave
    # gets one of the shortest of the next.
    def first_tile(self) -> Int32:
        if const_expr(self.dynamic):
            return Int32(cute.arch.block_idx()[0])
        return Int32(0)

    def next_tile(self, work: Int32) -> Int32:
        """Static schedules only; a dynamic one asks :meth:`claim_tile`."""
        return work + 1

    @cute.jit
    def claim_tile(self, counter: cute.Tensor) -> Int32:
        """Dynamic schedules: the next unclaimed tile (call from one whole warp).

        Every CTA that starts on a tile claims once per tile it runs, the last claim returning
        the end, so a launch makes exactly ``num_tiles`` claims: the one that returns
        ``num_tiles - 1`` is the last of the launch, and it zeroes the counter for the next
        launch on the stream (the host keeps one counter per stream instead of a fresh
        zeroed one per call)."""
        claimed = Int32(0)
        if cute.arch.lane_idx() == 0:
            claimed = cute.arch.atomic_add(counter.iterator, Int32(1))
            if claimed == self.num_tiles - 1:
                counter[0] = Int32(0)
        return Int32(cute.arch.grid_dim()[0]) + cute.arch.shuffle_sync(claimed, 0)

    def tile_of(self, work: Int32) -> Int32:
        if const_expr(self.dynamic):
            return work
        ctas = Int32(cute.arch.grid_dim()[0])
        cta = Int32(cute.arch.block_idx()[0])
        odd = work % 2
        return work * ctas + cta + odd * (ctas - 1 - 2 * cta)

    def is_valid(self, work: Int32):
        return self.tile_of(work) < self.num_tiles

    def coords(self, work: Int32) -> tuple:
        """(m_block, head, batch) of this CTA's work item."""
        tile = self.tile_of(work)
        section_tiles = self.heads_per_section * self.num_m_blocks
        section = tile // section_tiles
        within = tile - section * section_tiles
        first_bh = section * self.heads_per_section
        heads_here = cutlass.min(self.heads_per_section, self.num_bh - first_bh)
        m_idx = within // heads_here
        bh = first_bh + within - m_idx * heads_here
        m_block = m_idx
        if const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_idx
        batch = bh // self.num_heads
        head = bh - batch * self.num_heads
        return m_block, head, batch


class TileSource(DslState):
    """Where the producer warp and the consumer warpgroups of a kernel get their next tile.

    A static schedule computes it in every role. A dynamic one has the producer warp
    claim it right after issuing the current tile's loads and pass it on through a
    two-slot smem pipeline, so the consumers walk the same tiles one step behind.
    """

    dynamic_fields = ("scheduler", "pipe", "slots", "counter")

    def __init__(self, scheduler: AttentionTileScheduler, pipe, slots: cute.Tensor, counter: cute.Tensor):
        self.scheduler = scheduler
        self.pipe = pipe  # PipelineAsync(2 stages): producer warp -> consumer threads
        self.slots = slots  # (2,) Int32 in smem
        self.counter = counter

    @cute.jit
    def produce_next(self, tile: Int32, state) -> tuple:
        """The producer warp's next tile (published to the consumers when dynamic) and the
        advanced slot state; the caller reassigns both (a loop carries only what it assigns)."""
        next_tile = tile
        if const_expr(self.scheduler.dynamic):
            next_tile = self.scheduler.claim_tile(self.counter)
            self.pipe.producer_acquire(state)
            if cute.arch.lane_idx() == 0:
                self.slots[state.index] = next_tile
            self.pipe.producer_commit(state)
            state.advance()
        else:
            next_tile = self.scheduler.next_tile(tile)
        return next_tile, state

    @cute.jit
    def consume_next(self, tile: Int32, state) -> tuple:
        """A consumer thread's next tile (the one the producer warp published) and the
        advanced slot state."""
        next_tile = tile
        if const_expr(self.scheduler.dynamic):
            self.pipe.consumer_wait(state)
            next_tile = self.slots[state.index]
            self.pipe.consumer_release(state)
            state.advance()
        else:
            next_tile = self.scheduler.next_tile(tile)
        return next_tile, state
