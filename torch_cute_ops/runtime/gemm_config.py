"""GEMM tile configurations and the small heuristics that pick one per problem.

A :class:`GemmConfig` is what changes the code of a GEMM kernel besides dtypes and
majorness: the CTA tile, the cluster shape and the rasterization of the persistent
tile scheduler (:mod:`.tile_scheduler`). Pipeline depth is not part of it: each
kernel derives its stage count from the shared memory its tile leaves free.

``choose_config(arch, m, n, k, batch)`` dispatches to one heuristic per arch. The
Hopper rules live here; another arch registers its own with
:func:`register_heuristic` from its kernel module, so the table stays in one place
and this file never imports a kernel.

Hopper (sm_90a) rules, for 16-bit inputs on a 132-SM H100/H200:

* ``M <= 32``: swapped operands on ``128 x 16`` / ``128 x 32`` tiles (out^T = b^T @ a^T), the
  way cuBLAS runs a decode step: every stage carries 16 KB of the weight (16-bit; 128 x 128
  FP8 values) instead of a 64-row A tile that is mostly padding.
* ``M <= 64``: one consumer warpgroup, ``64 x 128`` tiles when they fill four fifths of a
  wave (FP8: a whole one), else (16-bit) ``64 x 96`` when those do, else ``64 x 64``; these
  shapes are bound by reading B, so the tile count that fills one wave wins.
* otherwise 128-row tiles with two consumer warpgroups (each owns 64 rows), ``tile_n``
  one of 256, 192, 128, 96 (one row of tiles only), 64: the widest unless a narrower one
  fills the last wave enough better to pay for its lower throughput per tile
  (:data:`SM90_TILE_N_EFFICIENCY`). Few-row problems at LLM widths (M = 128..512) are where
  this matters: 128 x 64 tiles put twice the CTAs of 128 x 128 on reading B, 128 x 192 makes
  128 tiles (one wave) of 256 x 12288, where 128 x 256 makes 96 and 128 x 128 makes 192, and
  128 x 96 makes 128 of 128 x 12288.
* FP8 keeps ``128 x 256`` when those fill 3/4 of a wave, else ``128 x 128``.
* K <= 1024 with at least sixteen waves of ``128 x 192`` tiles (16-bit only): those tiles
  in ping-pong, whose epilogue overlaps the other warpgroup's short main loop.
* a ``2 x 1`` cluster (B tile multicast to both CTAs of the pair, halving its L2
  reads) whenever there are at least two tile rows, unless the second CTA of the last cluster
  row (past M, over an odd number of tile rows) would add a wave (:func:`slot_use`).
* a few waves (M = 384 .. 1152 at LLM widths): ``192``-row tiles (three consumer warpgroups)
  where they pad no more rows than 128-row ones and use the SMs' tile slots better
  (:data:`SM90_TALL_TILE_EFFICIENCY`): 1152 x 4096 makes one wave of 192 x 192 tiles.
* stream-K (16-bit, cooperative tiles) from eight full waves of work on, when the last wave
  is partial (:data:`SM90_STREAM_K_MIN_WAVES`).
* bands of 8 clusters along M for L2 reuse between the tiles of one wave.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

# SMs of the usual parts; kernels take the real count of the device at launch
DEFAULT_SM_COUNT = {"sm_90a": 132, "sm_100a": 148}


@dataclass(frozen=True)
class GemmConfig:
    tile_m: int
    tile_n: int
    cluster_m: int = 1
    cluster_n: int = 1
    group_size: int = 8
    band_along_m: bool = True
    # Hopper: two consumer warpgroups each on its own tile, taking turns (see kernels/sm90)
    pingpong: bool = False
    # Hopper: the kernel computes out^T = b^T @ a^T, so that a few rows of ``a`` (a decode
    # step's tokens) sit on the MMA's narrow N side (``tile_n`` 16 or 32) and the weight's N
    # on its M side; tile_m / tile_n then tile the caller's N / M
    swap_ab: bool = False
    # Hopper: the units of the last waves are split along K over all clusters (stream-K), so a
    # tile count that leaves part of the last wave idle still keeps every SM busy to the end
    stream_k: bool = False

    @property
    def tile_mn(self) -> tuple[int, int]:
        return (self.tile_m, self.tile_n)

    @property
    def cluster_mn(self) -> tuple[int, int]:
        return (self.cluster_m, self.cluster_n)

    def spec_params(self) -> dict:
        """The KernelSpec parameters this config contributes."""
        return {
            "tile": self.tile_mn,
            "cluster": self.cluster_mn,
            "group": self.group_size,
            "band_m": self.band_along_m,
            "pingpong": self.pingpong,
            # the other variants' keys stay as they were
            **({"swap": True} if self.swap_ab else {}),
            **({"stream_k": True} if self.stream_k else {}),
        }

    @staticmethod
    def from_spec_params(params) -> "GemmConfig":
        """Inverse of :meth:`spec_params`, from a KernelSpec (or any mapping with those keys)."""
        tile, cluster = params["tile"], params["cluster"]
        return GemmConfig(tile[0], tile[1], cluster[0], cluster[1], params["group"], params["band_m"],
                          params["pingpong"], params.get("swap", False), params.get("stream_k", False))


Heuristic = Callable[[int, int, int, int, int, bool], GemmConfig]
_HEURISTICS: dict[str, Heuristic] = {}


def register_heuristic(arch: str, heuristic: Heuristic) -> None:
    """``heuristic(m, n, k, batch, sm_count, fp8) -> GemmConfig`` becomes the rule for ``arch``."""
    _HEURISTICS[arch] = heuristic


def choose_config(arch: str, m: int, n: int, k: int, batch: int = 1, sm_count: int | None = None,
                  fp8: bool = False) -> GemmConfig:
    """The config for one problem size (sizes of one GEMM; ``batch`` GEMMs of it); ``fp8``:
    the operands are FP8 (scaled GEMM)."""
    try:
        heuristic = _HEURISTICS[arch]
    except KeyError:
        raise ValueError(f"no GEMM config heuristic registered for {arch!r}") from None
    return heuristic(m, n, k, batch, sm_count or DEFAULT_SM_COUNT.get(arch, 132), fp8)


def num_tiles(m: int, n: int, batch: int, tile_m: int, tile_n: int) -> int:
    return -(-m // tile_m) * -(-n // tile_n) * batch


# Up to this K, large problems take 128 x 192 ping-pong tiles: a tile's main loop is short (16
# k-tiles at 1024), so the epilogue the other warpgroup overlaps is a large share of it.
# Measured (H100, 16-bit): +3% at 8192 x 8192 x 1024 as a bare config, +8% through tco.gemm
# (two runs each); at K = 4096 and 8192 the gain or loss stayed within run-to-run noise
# (+-3%), so those keep 128 x 256 cooperative.
SM90_PINGPONG_MAX_K = 1024


# Throughput of a 128-row cooperative tile per SM relative to 128 x 256 (16-bit, H100): the
# narrower the tile, the more A and B bytes it loads per MMA. Fitted to bench_gemm.py config
# columns at M = 128..1024 (bench/NOTES.md, 2026-11-25, "Few-row GEMMs: tile width by wave fill"):
# at equal wave fill 128 x 192 ran at
# 0.92-0.98 of 128 x 256; 128 x 64 wins only where the wider tiles leave half the SMs or more
# idle (M = 128 and 256 at N = 4096). 128 x 96 fitted to one point (2026-11-25, "96-column tiles;
# the two-wave gap"): 128 x 12288 x
# 4096, 128 tiles of 96 (fill 0.97) at 263-265 TFLOP/s against 96 of 128 (fill 0.73) at 252.
# 128 x 192 runs ping-pong (0.93 cooperative): at 256 x 12288, 512 x 12288 and 1024 x 14336 (K
# = 4096) ping-pong was 2-4% faster than cooperative at the same tile (2026-11-25, "What cuBLAS
# runs at few rows; deeper rings").
SM90_TILE_N_EFFICIENCY = {256: 1.0, 192: 0.96, 128: 0.85, 96: 0.66, 64: 0.6}


def wave_fill(tiles: int, sm_count: int) -> float:
    """The share of the SMs' tile slots that ``tiles`` occupy over the waves they take."""
    return tiles / (max(-(-tiles // sm_count), 1) * sm_count)


# Up to this many rows a 16-bit GEMM runs with swapped operands (``GemmConfig.swap_ab``) on
# 128 x 16 or 128 x 32 tiles: the weight's N on the MMA's 128 rows, the few rows of ``a`` on its
# narrow N, so the weight is read once. H100, bf16, against 64 x 64 (the rule before), same
# runs, of cuBLAS: 1 x 4096 x 4096 0.99 vs 0.82, 8 x 4096 x 14336 1.02 vs 0.88, 16 x 4096 x
# 14336 1.01 vs 0.84; 32 rows (128 x 32) 0.97-1.02 vs 0.92-0.95; at 48 and 64 rows 64 x 64
# wins (the weight would be read twice). FP8 rowwise, of torch._scaled_mm: 1.07-1.39x vs
# 1.01-1.25x at M = 1 and 16, 1.06-1.29x vs 1.07-1.20x at 32 rows. Blockwise scales have no
# swapped variant (runtime.gemm.block_scaled_config). bench/NOTES.md, 2026-11-25, "Swapped
# operands for decode rows; PDL".
SM90_SWAP_MAX_M = 32


def _sm90_heuristic(m: int, n: int, k: int, batch: int, sm_count: int, fp8: bool = False) -> GemmConfig:
    if m <= SM90_SWAP_MAX_M:
        return GemmConfig(128, 16 if m <= 16 else 32, swap_ab=True)
    if m <= 64:
        # 16-bit: one wave of 64 x 128 tiles beats two of 64 x 64 once it fills four fifths of the
        # SMs, and so does one of 64 x 96 tiles (H100, TFLOP/s: 64 x 14336 x 4096, 112 tiles of
        # 128, 140-142 vs 133-135; 64 x 12288 x 4096, 128 tiles of 96, 135 vs 129-131; 64 x 11008 x
        # 4096, 115 of 96, 126 vs 118; 64 x 4096 x 4096 keeps 64 x 64: 96-97 vs 84-87 for 64 x 128).
        # FP8 keeps 64 x 64 below a full wave of 64 x 128 (not measured there).
        tiles = num_tiles(m, n, batch, 64, 128)
        if tiles >= sm_count or (not fp8 and 5 * tiles >= 4 * sm_count):
            return GemmConfig(64, 128)
        tiles = num_tiles(m, n, batch, 64, 96)
        return GemmConfig(64, 96 if not fp8 and 4 * sm_count <= 5 * tiles <= 5 * sm_count else 64)
    cluster_m = 2 if m > 128 else 1
    if fp8:  # FP8 keeps its two tiles (blockwise scales allow at most 128 columns)
        tile_n = 256 if 4 * num_tiles(m, n, batch, 128, 256) >= 3 * sm_count else 128
        return GemmConfig(128, tile_n, cluster_m)
    if k <= SM90_PINGPONG_MAX_K and num_tiles(m, n, batch, 128, 192) >= 16 * sm_count:
        return GemmConfig(128, 192, cluster_m, pingpong=True)
    # the first of the widest on a tie; 96 columns for one row of tiles only (128 x 12288 x 4096:
    # 128 x 96 263-265 vs 128 x 128 252 TFLOP/s; with two rows and more, 2 x 1 clusters of 128 x 96
    # lost 2-37% to 128 x 128 at 256 x 6144, 384 x 4096, 512 x 3072 and 768 x 2048)
    widths = [tile_n for tile_n in SM90_TILE_N_EFFICIENCY if tile_n != 96 or m <= 128]
    tile_n = max(widths, key=lambda tile_n: SM90_TILE_N_EFFICIENCY[tile_n]
                 * wave_fill(num_tiles(m, n, batch, 128, tile_n), sm_count))
    if tile_n == 64 and m <= 128:
        # one row of 128 x 64 tiles: 64-row tiles in 2 x 1 clusters give twice the CTAs, each
        # B tile still read once, and a 13-stage ring (H100, 128 x 4096 x 4096: 189 vs 165
        # TFLOP/s; cuBLAS takes the same shape of tile there)
        return GemmConfig(64, 64, 2)
    config = GemmConfig(128, tile_n, cluster_m, pingpong=tile_n == 192)
    config = config if config.pingpong else _with_stream_k(config, m, n, batch, sm_count)
    if config.stream_k:  # many waves, the last one shared out: nothing left to gain below
        return config
    # a few waves: the 128-row pick against taller and narrower tiles, by efficiency x slot use
    single = _without_idle_cluster_rows(config, m, n, batch, sm_count)
    score = SM90_TILE_N_EFFICIENCY[tile_n] * slot_use(single, m, n, batch, sm_count)
    score *= SM90_SINGLE_CTA_EFFICIENCY if single.cluster_m < config.cluster_m else 1
    tall = _tall_tiles(m, n, batch, sm_count, score)
    if tall is not None:
        return tall
    if (num_tiles(m, n, batch, 128, 160) <= sm_count
            and SM90_ONE_WAVE_160_EFFICIENCY * slot_use(SM90_ONE_WAVE_160, m, n, batch, sm_count) > score):
        return SM90_ONE_WAVE_160
    return single


def slot_use(config: GemmConfig, m: int, n: int, batch: int, sm_count: int) -> float:
    """The share of the SMs' tile slots, over the waves a config takes, that computes output: a
    tile's rows and columns past the problem and the CTAs of a cluster wholly past M or N (they
    run the main loop with their partner) take a slot but give nothing."""
    rows = -(-m // (config.tile_m * config.cluster_m)) * config.cluster_m
    cols = -(-n // (config.tile_n * config.cluster_n)) * config.cluster_n
    slots = rows * cols * batch
    waves = max(-(-slots // sm_count), 1)  # an empty problem: no slot used
    return m * n * batch / (waves * sm_count * config.tile_m * config.tile_n)


# A 128-row tile in a 1 x 1 cluster against the same tile in 2 x 1 (B multicast to the pair),
# at equal slot use. Fitted to the config columns of bench/NOTES.md, 2026-11-26, "192-row tiles,
# few-wave heuristic, tail tiles" (H100, bf16, M = 384 .. 1152):
# 0.93-0.95 for 128 x 256 and 128 x 192 ping-pong; 0.9 keeps 2 x 1 at 2052 x 14336 x 4096 (17
# tile rows: 10 waves in 1 x 1, 11 in 2 x 1; measured 2 x 1 596 vs 1 x 1 567 TFLOP/s).
SM90_SINGLE_CTA_EFFICIENCY = 0.9


def _without_idle_cluster_rows(config: GemmConfig, m: int, n: int, batch: int, sm_count: int) -> GemmConfig:
    """1 x 1 clusters where an odd number of tile rows would leave a 2 x 1 cluster's second CTA
    past M and those CTAs cost more slot use than the multicast saves. H100, bf16, TFLOP/s, 2 x 1
    vs 1 x 1 (2026-11-26, "192-row tiles, few-wave heuristic, tail tiles"): 640 x 12288 x 4096 on
    128 x 256 tiles 481 vs 614 (3 waves vs 2), 1152
    x 14336 x 4096 583 vs 643 (5 vs 4), 640 x 14336 x 4096 on 128 x 192 ping-pong 525 vs 594;
    where the waves are as many, 2 x 1 kept its lead: 640 x 14336 on 128 x 256 551 vs 507, 640
    x 4096 ping-pong 494 vs 463."""
    if config.cluster_m == 1:
        return config
    single = replace(config, cluster_m=1)
    better = (SM90_SINGLE_CTA_EFFICIENCY * slot_use(single, m, n, batch, sm_count)
              > slot_use(config, m, n, batch, sm_count))
    return single if better else config


# 192-row tiles (three consumer warpgroups), on the scale of SM90_TILE_N_EFFICIENCY: fitted to
# bench_gemm.py config columns at M = 384, 640 and 1152 over the LLM widths (H100, bf16,
# 2026-11-26, "192-row tiles, few-wave heuristic, tail tiles"): 192 x 192 in 2 x 1 clusters ran at
# 0.98 of 128 x 256 in 2 x 1 at equal slot use; 192 x 128
# in 1 x 1 beat 128 x 192 ping-pong in 1 x 1 by 5-10% at equal slot use (384 x 14336 x 4096: 582
# vs 528); 192 x 64 at 0.66 (its measured wins: 384 x 4096 x 4096, 128 tiles, 409-411 TFLOP/s
# against 347-353 for 96 of 128 x 128 in 2 x 1; 533 vs 372 at K = 14336). 16-bit only, where
# 192-row tiles pad no more rows than 128-row ones and the problem is a few waves (up to
# SM90_TALL_TILE_MAX_WAVES of 128 x 256 tiles), the range measured.
SM90_TALL_TILE_EFFICIENCY = {192: 0.98, 128: 0.92, 64: 0.66}
SM90_TALL_TILE_MAX_WAVES = 4


def _tall_tiles(m: int, n: int, batch: int, sm_count: int, score_to_beat: float) -> GemmConfig | None:
    """The best 192-row config if it beats ``score_to_beat`` (a 128-row config's efficiency x
    slot use), else None."""
    rows = -(-m // 192)
    if (m <= 256 or rows * 192 > -(-m // 128) * 128
            or num_tiles(m, n, batch, 128, 256) > SM90_TALL_TILE_MAX_WAVES * sm_count):
        return None
    # 2 x 1 clusters for 192 x 192 over an even number of tile rows (as measured). The narrower
    # 192-row tiles only over whole tile rows: with a partial last row they ran far below their
    # full-row figures (192 x 64 at 260 x 4096 x 4096 166 TFLOP/s, 192 x 128 at 640 x 4096 x 4096
    # 347-350), measured before the kernel stopped loading past M (the TMA's slow zero fill,
    # kernels/sm90/gemm.py _tile_start); not re-fitted since
    widths = [tile_n for tile_n in SM90_TALL_TILE_EFFICIENCY if tile_n == 192 or m % 192 == 0]
    candidates = [GemmConfig(192, tile_n, 2 if tile_n == 192 and rows % 2 == 0 else 1) for tile_n in widths]
    scores = {config: SM90_TALL_TILE_EFFICIENCY[config.tile_n] * slot_use(config, m, n, batch, sm_count)
              for config in candidates}
    best = max(candidates, key=scores.get)
    return best if scores[best] > score_to_beat else None


# 128 x 160 tiles in 1 x 2 clusters (A multicast to the pair), as cuBLAS runs 640 x 4096 x K:
# 26 columns of tiles at N = 4096, 130 tiles over five tile rows, one wave. Only where they make
# one wave: H200, bf16, bare, 2026-11-26, "192-row tiles, few-wave heuristic, tail tiles": 640 x
# 4096 x 4096 611 vs 560 TFLOP/s (128 x 192
# ping-pong in 2 x 1, the pick before), 656 vs 588 at K = 14336; behind at 384 x 4096 (399 vs 475)
# and over several waves (2052 x 14336: 571 vs 584, 1536 x 4096: 540 vs 702). Efficiency on the
# scale of SM90_TILE_N_EFFICIENCY, fitted to the 640 x 4096 pair.
SM90_ONE_WAVE_160 = GemmConfig(128, 160, 1, 2)
SM90_ONE_WAVE_160_EFFICIENCY = 0.87


# From this many full waves of work units (clusters of tiles) on, a 16-bit GEMM whose last wave
# is partial runs stream-K (GemmConfig.stream_k): the last two waves' k-tiles are dealt out over
# all clusters. H100, bf16, 128 x 256 tiles in 2 x 1 clusters, bare configs side by side in two
# runs (bench/NOTES.md, 2026-11-25, "Stream-K for the last waves"): 8192^3 +5% (697-708 vs
# 649-681 TFLOP/s), M = 16384 at the LLM
# widths 0 to +3%, 4096 x 12288 / 14336 x 4096 (11-13 waves) even; at 4 waves or fewer it lost up
# to 11% (4096 x 4096 x 14336, 512 x 14336 x 4096): the clusters' k-ranges start at unrelated
# k-tiles, so the tiles of a wave no longer share their A rows and B columns through L2, and the
# stream-K phase is most of the run there. FP8 (half the time per k-tile for the same bytes) was
# even at 8192^3 and 3-10% slower at the other grid shapes: it stays data-parallel.
SM90_STREAM_K_MIN_WAVES = 8


def _with_stream_k(config: GemmConfig, m: int, n: int, batch: int, sm_count: int) -> GemmConfig:
    clusters = max(sm_count // (config.cluster_m * config.cluster_n), 1)
    units = (-(-m // (config.tile_m * config.cluster_m)) * -(-n // (config.tile_n * config.cluster_n))) * batch
    if units // clusters >= SM90_STREAM_K_MIN_WAVES and units % clusters:
        return replace(config, stream_k=True)
    return config


register_heuristic("sm_90a", _sm90_heuristic)


# ---- Blackwell (sm_100a) ---------------------------------------------------------------
# Here ``tile_m`` is the tcgen05 MMA tile: 256 rows are one 2-CTA MMA (cta_group::2) run by
# the CTA pair of a cluster, each CTA owning 128 rows and loading half of the B tile.
# Untuned (no Blackwell GPU was available): the rules only follow the tile counts.

def _sm100_heuristic(m: int, n: int, k: int, batch: int, sm_count: int, fp8: bool = False) -> GemmConfig:
    tile_n = 64 if n <= 64 else 128 if n <= 128 else 256  # no MMA columns wasted on a narrow N
    if m > 128 and 4 * num_tiles(m, n, batch, 256, tile_n) >= 3 * (sm_count // 2):
        # tall problems: a 4x1 cluster also multicasts each B tile to both pairs of a column
        return GemmConfig(256, tile_n, 4 if m >= 2048 else 2, 1)
    # 1-CTA tiles, narrowed until the CTAs fill most of the device
    while tile_n > 64 and 4 * num_tiles(m, n, batch, 128, tile_n) < 3 * sm_count:
        tile_n //= 2
    return GemmConfig(128, tile_n)


register_heuristic("sm_100a", _sm100_heuristic)
