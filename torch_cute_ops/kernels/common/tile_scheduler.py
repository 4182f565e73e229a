"""A static persistent tile scheduler with grouped rasterization, for any CuTe kernel.

The output of a batched GEMM is cut into ``tile_m x tile_n`` tiles, the tiles into
clusters of ``cluster_m x cluster_n`` tiles, and the clusters of all batches into a
1-D list of *work units*. A persistent launch starts ``min(units, max_clusters)``
clusters; the cluster with index ``c`` (``block_idx.z``) handles units ``c``,
``c + G``, ``c + 2G``... where ``G = grid_dim.z``. No atomics and no workspace.

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
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


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
