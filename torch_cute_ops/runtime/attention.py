"""Host side of the Hopper attention kernels: tile configs, variants, coverage, launch plans.

Plain torch (the CuTe DSL is imported only if a variant must be compiled). The op layer asks
for a plan once per input layout; a call then checks data pointers, allocates the outputs
and makes one TVM-FFI call.

Compiled functions (torch-order tensors; the stream is the TVM-FFI env stream):

* forward: ``fn(q, k, v, out, lse, tile_counter, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, softmax_scale, window_left, window_right, softcap, max_ctas)``, q/k/v/out
  (B, S, H, D), lse (B, H, S_q) fp32, a 4-byte tile counter for the dynamic schedule;
* backward: ``fn(dout, q, k, v, out, lse, dq, dk, dv, delta, lse_log2, dq_accum, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap)``
  with fp32 workspaces padded to whole query blocks. Soft-capping is a compiled flag with the
  cap a runtime value.

Packed (varlen) variants take the packed tensors with a unit batch, (1, total, H, D) and lse
(1, H, total), and read each sequence's rows from ``cu_seqlens`` (int32, B + 1). Padded variants
take dense tensors and, in the cu_seqlens slots, the first and one-past-last real key of each
entry (int32, B). Dense variants are handed a placeholder there and never read it.

The visible band of keys is one of three compiled kinds (:func:`kernel_band`): dense, causal
(bottom-right), or local, a (left, right) window whose bounds are runtime arguments, so one
variant serves every window and PyTorch's top-left causal alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from .cache import get_compiled
from .attention_mask import bwd_mask_summary, dq_turns, fwd_mask_summary, kernel_mask, mask_summary, walks_in_step
from .attention_mask import mask_kind  # noqa: F401 (the op layer asks the host for it)
from .lasting import lasting
from .scratch import zeroed_int32
from .spec import KernelSpec
from .tma import TMA_ALIGN_BYTES, tma_reason
from .unfilled import written_in_full

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
FWD_FAMILY, BWD_FAMILY = "flash_fwd_sm90", "flash_bwd_sm90"


# ---------------------------------------------------------------------------- forward tiles

@dataclass(frozen=True)
class FwdConfig:
    tile_n: int
    num_wg: int  # consumer warpgroups; tile_m = 64 * num_wg
    num_stages: int
    pingpong: bool  # round-robin the tensor cores between consumer WGs
    separate_o: bool  # O has its own smem; else it reuses Q's (no room at D >= 192)
    # tiles handed out by an atomic counter (see AttentionTileScheduler), else static
    dynamic_schedule: bool = False
    l2_kv_mib: int = 16  # the K/V of the heads worked on together is kept under this
    # the online softmax keeps a row's max until it grows by more than this (log2 units;
    # 0: every block), so O is rescaled only in the blocks where a max moved that far
    rescale_threshold: float = 8.0

    @property
    def tile_m(self) -> int:
        return 64 * self.num_wg


# Causal D64 attention over at most this many keys runs 128-row query tiles (H100, one run:
# +7% at 512 keys, +8% at 1024, -5% at 2048 against 192-row tiles).
SHORT_CAUSAL_KEYS = 1024


@functools.lru_cache(maxsize=None)
def config_for(head_dim: int, causal: bool, short: bool = False, ragged: bool = False) -> FwdConfig:
    """Tile shapes that fit 227 KB of smem and the register budget (FA3's choices), for
    ``short`` (at most SHORT_CAUSAL_KEYS keys) or longer sequences; ``ragged`` (packed or padded
    batch entries) tiles differ in length whether causal or not."""
    if head_dim <= 64 and not (causal and short):
        tiles = FwdConfig(tile_n=128, num_wg=3, num_stages=2, pingpong=True, separate_o=True)
    elif head_dim <= 128:
        tiles = FwdConfig(tile_n=128, num_wg=2, num_stages=2, pingpong=True, separate_o=True)
    elif head_dim <= 192:
        tiles = FwdConfig(tile_n=112, num_wg=2, num_stages=2, pingpong=False, separate_o=False)
    else:
        tiles = FwdConfig(tile_n=80, num_wg=2, num_stages=2, pingpong=False, separate_o=False)
    # Causal tiles differ in length: whichever CTA frees up takes the next longest, and
    # since that order spreads one head's tiles over time, more heads' K/V stay in L2.
    # Equal tiles run head after head: the CTAs in flight stream the same K/V blocks
    # (H100, D128 S >= 4k, two runs: 4 MiB +2-5% over 16 MiB non-causal, -2-4% causal).
    uneven = causal or ragged
    return dataclasses.replace(tiles, dynamic_schedule=uneven, l2_kv_mib=16 if uneven else 4)


def kernel_band(causal: bool, window_left, window_right, seqlen_q: int, seqlen_k: int):
    """(causal, local, left, right) for the kernels from the op's band (None: unbounded).

    A causal right edge with no left one is the causal variant; any other bounded band is a
    local variant whose open side gets a bound past every key (``S_q + S_k``), and whose
    bounds are clamped there so that no index arithmetic overflows.
    """
    if causal:
        window_right = 0 if window_right is None else min(window_right, 0)
    if window_left is None and window_right is None:
        return False, False, 0, 0
    if window_left is None and window_right == 0:
        return True, False, 0, 0
    far = seqlen_q + seqlen_k
    left = far if window_left is None else max(min(window_left, far), -far)
    right = far if window_right is None else max(min(window_right, far), -far)
    return False, True, left, right


@functools.lru_cache(maxsize=None)  # a pure function of a few flags: plans rebuilt per new size reuse it
def fwd_spec(dtype: str, head_dim: int, causal: bool, config: FwdConfig | None = None,
             arch: str = "sm_90a", local: bool = False, softcap: bool = False,
             rows: str = "dense", attn_mask: str = "none", split_kv: bool = False,
             rows_per_query: int = 1, bounded_scores: bool = False, sink: bool = False,
             page_rows: int = 0) -> KernelSpec:
    """``rows_per_query`` > 1: each query token is that many consecutive rows (pack-GQA with
    several tokens), which the causal band counts as one. ``bounded_scores``: capped scores
    whose softmax needs no running max (:func:`softcap_kind`). ``sink``: attention sinks joined
    at the softmax finalize (split variants: at the combine). ``page_rows``: a paged cache's
    page size when smaller than a key tile (:func:`kvcache_page_rows`)."""
    config = config or config_for(head_dim, causal, ragged=rows != "dense" or attn_mask != "none")
    # the config is in the key: a new config recompiles
    extra = {"rows_per_query": rows_per_query} if rows_per_query > 1 else {}
    if bounded_scores:
        extra["bounded_scores"] = True
    if sink:  # a flag of its own: the variants without keep their names
        extra["sink"] = True
    if page_rows:
        extra["page_rows"] = page_rows
    return KernelSpec.make(FWD_FAMILY, arch, dtype=dtype, head_dim=head_dim, causal=causal, local=local,
                           softcap=softcap, rows=rows, attn_mask=attn_mask, split_kv=split_kv,
                           config=dataclasses.astuple(config), **extra)


# Soft-capped scores lie in (-softcap, softcap). Up to this cap one fixed max keeps their
# exponentials within [2^-120, 2^64] (kernels.common.softmax.OnlineSoftmax): fp32 sums and
# bf16 P hold them without a running max, and the forward skips the max altogether
# (bench/NOTES.md, 2026-11-23, "Softcap without a running max"). fp16 P tops out at 2^16.
BOUNDED_SOFTCAP_MAX = 92.0 * math.log(2.0)  # 63.8: softcap * log2(e) <= 92


def softcap_kind(softcap: float, dtype: torch.dtype) -> str:
    """"none", "bounded" (the forward's softmax without a running max) or "capped"."""
    if not softcap:
        return "none"
    return "bounded" if dtype == torch.bfloat16 and softcap <= BOUNDED_SOFTCAP_MAX else "capped"


# --------------------------------------------------------------------------- backward tiles

# head_dim -> (tile_m, tile_n, num_stages). The two MMA warpgroups keep dK and dV for
# the whole key block in registers (tile_n * head_dim * 2 / 256 fp32 per thread), and smem
# holds K, V, num_stages x (Q, dO, dS, and P when it is not kept in registers) and the
# fp32 dQ tile (<= 227 KB). At head dim 64 the query tiles have 128 rows, as FlashAttention's
# Hopper backward has them (half the K/V-side work per query), with P^T in registers and two dS
# stages; dV's WGMMA then waits for dS (kernels/sm90/flash_bwd.py: the registers are full).
BWD_TILES = {
    64: (128, 128, 2),
    96: (64, 128, 2),
    128: (64, 128, 2),
    192: (64, 64, 2),
    256: (64, 64, 1),
}
STAT_PAD = 128  # lse and delta rows are padded to whole query blocks for their TMA loads


def bwd_keys_in_rows(tile_n: int) -> bool:
    """Whether the backward computes S (and dP) transposed, keys along WGMMA's M: with two 64-key
    halves per key block (kernels/sm90/flash_bwd.py says why). A bool mask's bits are then
    packed by key rows (``attention_mask.bwd_mask_summary``)."""
    return tile_n == 128



@functools.lru_cache(maxsize=None)
def bwd_spec(dtype: str, head_dim: int, causal: bool, arch: str = "sm_90a", local: bool = False,
             softcap: bool = False, rows: str = "dense", attn_mask: str = "none",
             deterministic: bool = False, sink: bool = False) -> KernelSpec:
    """``deterministic``: dQ added in a fixed key-block order (bitwise reproducible dQ).
    ``sink``: the preprocess also forms the attention sinks' gradient."""
    tile_m, tile_n, num_stages = BWD_TILES[head_dim]
    extra = {"deterministic": True} if deterministic else {}
    if sink:
        extra["sink"] = True
    return KernelSpec.make(BWD_FAMILY, arch, dtype=dtype, head_dim=head_dim, causal=causal, local=local,
                           softcap=softcap, rows=rows, attn_mask=attn_mask, tile=(tile_m, tile_n),
                           stages=num_stages, **extra)


def shipped(arch: str) -> list[KernelSpec]:
    """The variants the package ships (prebuilt by ``aot``): those a model's first steps plan.

    Forward: bf16 at the common head dims, causal padded and packed batches and bool and
    additive attn_masks at D64 and D128, split-KV decode, one-token decode from transformers'
    caches (and their prefill) and from paged caches at D64 and D128, and Gemma 2's (D256,
    softcap) from transformers' caches. Backward: bf16 and fp16 at D64 and D128, bf16 causal
    padded and packed, and masked. Others compile on first use."""
    if arch != "sm_90a":
        return []
    fwd = [fwd_spec("bf16", h, c) for h in (64, 128, 256) for c in (False, True)]
    fwd.append(fwd_spec("bf16", 64, True, config_for(64, True, short=True)))
    fwd += [fwd_spec("bf16", h, False, local=True) for h in (64, 128, 256)]  # sliding windows
    # Gemma 2's layers (cap 50: bounded scores)
    fwd += [fwd_spec("bf16", 256, c, local=not c, softcap=True, bounded_scores=True) for c in (False, True)]
    # padded (transformers) and packed (varlen) batches as models train them
    fwd += [fwd_spec("bf16", h, True, rows=rows) for h in (64, 128) for rows in ("padded", "packed")]
    # the SDPA drop-in under a bool or additive attn_mask
    masked = [(h, kind) for h in (64, 128) for kind in ("bool", "add")]
    fwd += [fwd_spec("bf16", h, False, config_for(h, False, ragged=True), attn_mask=kind) for h, kind in masked]
    fwd.append(fwd_spec("bf16", 128, False, split_kv=True))  # long-cache decode without a cache
    # one-token decode (pack-GQA) on one warpgroup (short caches) or two, whole or split, from
    # transformers' caches (ranged rows, with the prompt against a static cache) and from paged
    # ones (page tables); D128 and D64 (the small GQA models: Llama 3.2 1B, Qwen 2.5 0.5B)
    for head_dim in (64, 128):
        fwd.append(fwd_spec("bf16", head_dim, True, rows="ranged"))
        decode = config_for(head_dim, False, ragged=True)
        fwd += [fwd_spec("bf16", head_dim, False, config, rows=rows, split_kv=split)
                for rows in ("ranged", "kvcache") for config in (decode, _one_warpgroup_decode(decode, head_dim, 2))
                for split in (False, True)]
    # Gemma 2 served from transformers' caches (D256, softcap 50: bounded scores): the prompt, and
    # one-token decode over global and sliding-window layers, whole or split
    gemma = {"softcap": True, "bounded_scores": True}
    decode = config_for(256, False, ragged=True)
    fwd.append(fwd_spec("bf16", 256, True, rows="ranged", **gemma))
    fwd += [fwd_spec("bf16", 256, False, decode, rows="ranged", local=local, split_kv=split, **gemma)
            for local in (False, True) for split in (False, True)]
    fwd.append(fwd_spec("bf16", 256, False, _one_warpgroup_decode(decode, 256, 2), rows="ranged", split_kv=True,
                        **gemma))
    bwd = [bwd_spec(d, h, c) for d in ("bf16", "fp16") for h in (64, 128) for c in (False, True)]
    bwd += [bwd_spec("bf16", h, False, local=True) for h in (64, 128)]
    bwd += [bwd_spec("bf16", h, True, rows=rows) for h in (64, 128) for rows in ("padded", "packed")]
    bwd += [bwd_spec("bf16", h, False, attn_mask=kind) for h, kind in masked]
    return fwd + bwd


# -------------------------------------------------------------------------------- coverage

def qkv_coverage_reason(kernel: str, q, k, v) -> str | None:
    """Why a TMA attention kernel cannot take q, k, v (B, S, H, D), or None (the op layer has
    validated shapes: one dtype, equal head dims, whole GQA groups)."""
    if q.dtype not in DTYPE_NAMES:
        return f"{kernel} supports bf16/fp16 q, k, v, got {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"{kernel} supports equal q/k/v head dims in {HEAD_DIMS}, got {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]}"
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"{kernel} needs one dtype and num_heads_q a multiple of num_heads_kv"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = tma_reason(name, t, (3,), check_pointer=False)
        if reason:
            return reason
    if max(q.shape[1], k.shape[1]) >= 2**31 or q.shape[0] * q.shape[2] >= 2**31:
        return f"{kernel} indexes sizes with 32-bit integers"
    return None


def pointer_reason(*named) -> str | None:
    """The one per-call check: the TMA needs 16-byte aligned base addresses."""
    for name, t in named:
        if t.data_ptr() % TMA_ALIGN_BYTES:
            return f"{name}: data pointer is not {TMA_ALIGN_BYTES}-byte aligned (storage offset {t.storage_offset()})"
    return None


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# ------------------------------------------------------------------- split-KV and placeholders

@lasting
def _split_placeholders(device_index: int, head_dim: int) -> tuple:
    """What an unsplit forward gets for the split-KV partials it never reads."""
    device = torch.device("cuda", device_index)
    return (torch.zeros((1, 1, 1, head_dim), dtype=torch.float32, device=device),
            torch.zeros((1, 1, 1), dtype=torch.float32, device=device), 1)


# split-KV: the fewest key blocks a split of a full wave streams (below that, the partial O write
# and the combine are no longer small beside its K/V reads)
MIN_BLOCKS_PER_SPLIT = 4
# the combine's warp holds one split's lse per lane (kernels.common.split_kv.SplitKvCombine)
MAX_SPLITS = 32


def num_splits_for(tiles: int, key_blocks: int, sms: int) -> int:
    """Split-KV (flash-decoding): how many CTAs share one tile's keys, when the tiles fill at most
    a quarter of the GPU (H100, B8 x 4k decode, 64 tiles: 2 splits 4% slower than none, 3 splits
    14%); at most MAX_SPLITS.

    A long key range fills one wave with splits of >= MIN_BLOCKS_PER_SPLIT blocks. A short one
    takes about half a wave of splits, down to one block each: a step of a few blocks is latency,
    and more CTAs overlap it (H100, clean graph replays: B1 x 1k 14.5 -> 11.9 us with 8 splits of
    one block instead of 2 of four; a full wave of two-block splits, B4 x 1k, 15.5 -> 16.6)."""
    if 4 * tiles > sms or key_blocks < 2:
        return 1
    full_wave = min(sms // tiles, MAX_SPLITS)
    if key_blocks >= MIN_BLOCKS_PER_SPLIT * full_wave:
        return full_wave
    return max(1, min(key_blocks, sms // 2 // tiles))


def sink_rows(sink: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The sinks (H_q,) fp32, contiguous, as a forward kernel reads them: lse's shape as the kernel
    takes it, zero strides but the heads'. One-token pack-GQA takes lse as (B, H_kv, group), query
    head ``h * group + j`` at (h, j) (:func:`packed_gqa_views`)."""
    group = sink.shape[0] // lse.shape[1]
    return sink.as_strided(lse.shape, (0, group, 1) if group > 1 else (0, 1, 0))


def no_key_lse(lse: torch.Tensor, sink) -> None:
    """The lse of rows that see no key: -inf, or with sinks their sink (their output stays 0)."""
    if sink is None:
        lse.fill_(float("-inf"))
    else:
        lse.copy_(sink_rows(sink, lse))


@lasting
def _mask_placeholders(device_index: int) -> tuple:
    """What an unmasked variant gets for the (mask, bits, blocks, ranges) it never reads."""
    device = torch.device("cuda", device_index)
    return (torch.zeros((1, 1, 1, 1), dtype=torch.uint8, device=device),
            _bits_placeholder(device_index),
            torch.zeros((1, 1, 1, 1), dtype=torch.int8, device=device),
            torch.zeros((1, 1, 1, 2), dtype=torch.int32, device=device))


@lasting
def _bits_placeholder(device_index: int) -> torch.Tensor:
    """The bits a bool or unmasked variant never reads: one 16-byte row (kernels.common.mask_args)."""
    return torch.zeros((1, 1, 1, 4), dtype=torch.int32, device=torch.device("cuda", device_index))


def _mask_args(attn_mask, bits, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device_index: int) -> tuple:
    """(mask, bits) as a masked variant reads them: a bool mask's bits in the mask's place, an
    additive mask's values and its zeros' bits."""
    bits = bits.expand(batch, heads, *bits.shape[2:])
    if attn_mask.dtype == torch.bool:
        return bits, _bits_placeholder(device_index)
    return kernel_mask(attn_mask, batch, heads, seqlen_q, seqlen_k), bits


def _tile_counter(device: torch.device) -> torch.Tensor:
    """The dynamic schedule's tile counter of the current stream (scratch.zeroed_int32): zeroed
    again by every launch's last claim (``AttentionTileScheduler.claim_tile``)."""
    return zeroed_int32(device, 1, "attention")


@lasting
def _unused_counter(device_index: int) -> torch.Tensor:
    """What a kernel gets for an int32 tensor it never reads: a static schedule's tile counter,
    a dense variant's cu_seqlens."""
    return torch.empty(1, dtype=torch.int32, device=torch.device("cuda", device_index))


# ---------------------------------------------------------------------------------- launch

def packed_gqa_views(q, group: int, out=None, lse=None):
    """Decode (one query token) with grouped kv heads: the ``group`` query heads of each kv head
    as ``group`` query rows of one kv head, through free strided views of q (B, 1, H_q, D), out
    (contiguous, like q) and lse (B, H_q, 1), so a tile holds ``group`` rows instead of one and
    each K/V block serves the whole group. Valid when every row shares the band: dense, or
    causal (one query sees every key)."""
    b, _, h_q, d = q.shape
    h_kv = h_q // group
    s_b, _, s_h, s_d = q.stride()
    q_rows = q.as_strided((b, group, h_kv, d), (s_b, s_h, group * s_h, s_d))
    out_rows = None if out is None else out.as_strided((b, group, h_kv, d), (h_q * d, d, group * d, 1))
    lse_rows = None if lse is None else lse.as_strided((b, h_kv, group), (h_q, group, 1))
    return q_rows, out_rows, lse_rows


# decode tiles whose (token, head) rows fit 64 and whose CTA walks at most this many key blocks
# run one consumer warpgroup, with up to DECODE_MAX_STAGES K/V stages in the shared memory the
# second warpgroup's Q and O leave. Measured on an H100 (GQA 32/8, D128, graph replays): -1.4 to
# -1.9 us at B1 x 512/1k, but +5 to +7 us at B8 x 4k and B64 x 2k (16 blocks per CTA), where two
# warpgroups in ping-pong keep more loads in flight than one warpgroup with three stages.
DECODE_ONE_WARPGROUP_MAX_BLOCKS = 8
DECODE_MAX_STAGES = 3
_SMEM_BYTES = 227 * 1024


def _one_warpgroup_decode(config: FwdConfig, head_dim: int, elem_bytes: int) -> FwdConfig:
    """``config`` with one consumer warpgroup (64 rows: a decode tile's 4-64 (token, head) rows;
    a second one would run its GEMMs on empty rows in turn with the first, doubling each key
    block's compute, which at 4k-key decode is as long as the block's memory time) and as many
    K/V stages as fit (more bytes in flight per CTA)."""
    slab = 64 * head_dim * elem_bytes  # Q, and O when it has its own
    fixed = slab * (2 if config.separate_o else 1) + 1024  # + barriers and alignment
    per_stage = 2 * config.tile_n * head_dim * elem_bytes
    stages = max(config.num_stages, min(DECODE_MAX_STAGES, (_SMEM_BYTES - fixed) // per_stage))
    return dataclasses.replace(config, num_wg=1, pingpong=False, num_stages=stages)


# pack-GQA serves decode with up to this many query tokens (speculative decoding), in the row
# layouts whose queries are all real (kernels.common.seqlen); split-KV serves the same layouts
PACK_GQA_MAX_QUERIES = 16
DECODE_ROWS = ("dense", "ranged", "kvcache")


class FlashFwdLaunch:
    """The forward of one input layout: writes out (B, S_q, H_q, D) and lse (B, H_q, S_q).
    ``group`` > 0: the layout is decode with GQA, whose (token, head) pairs are the rows of
    one kv head (:func:`packed_gqa_views`)."""

    __slots__ = ("fn", "dynamic", "device_index", "grid", "no_keys", "group", "tiles", "splits")

    def __init__(self, spec: KernelSpec | None, dynamic: bool, device_index: int, grid: int, group: int = 0,
                 tiles: tuple[int, int] = (0, 0), splits: int = 1):
        self.fn = None if spec is None else get_compiled(spec)
        self.no_keys = spec is None
        self.dynamic, self.device_index, self.grid, self.group = dynamic, device_index, grid, group
        self.tiles = tiles  # (tile_m, tile_n): the granularity of an attn_mask's block summary
        self.splits = splits  # split-KV: CTAs per tile's key range (1: no split)

    def _gqa_rows(self, q, out, lse):
        """q, out and lse as the kernel takes them: one query token's heads as the rows of a kv
        head (strided views); with several tokens the kernel forms the (token, head) rows itself
        (kernels.common.seqlen.gqa_rows)."""
        if not self.group or q.shape[1] > 1:
            return q, out, lse
        return packed_gqa_views(q, self.group, out, lse)

    def _attends_to_nothing(self, out, lse, sink=None) -> bool:
        """No keys at all (the plan has no kernel): every row is 0 with lse -inf (or its sink)."""
        if self.no_keys:
            out.zero_()
            no_key_lse(lse, sink)
        return self.no_keys

    def _split_args(self, q) -> tuple:
        """The split-KV partials (fresh fp32 buffers shaped like q, splits x batch) or placeholders."""
        if self.splits == 1:
            return _split_placeholders(self.device_index, q.shape[-1])
        b, s, h, d = q.shape
        return (torch.empty((self.splits * b, s, h, d), dtype=torch.float32, device=q.device),
                torch.empty((self.splits * b, h, s), dtype=torch.float32, device=q.device), self.splits)

    def _sink_arg(self, sink, lse, q) -> torch.Tensor:
        """What the kernel gets for the sinks: :func:`sink_rows`, or (a variant without sinks) the
        unread split-KV lse placeholder, an fp32 tensor of the same rank."""
        if sink is None:
            return _split_placeholders(self.device_index, q.shape[-1])[1]
        return sink_rows(sink, lse)

    def masked(self, q, k, v, attn_mask, out, lse, softmax_scale: float, sink=None) -> None:
        """PyTorch's attn_mask (bool or additive, broadcastable to (B, H_q, S_q, S_k)); the plan's
        variant is masked. Key blocks the mask leaves empty are never loaded."""
        if self._attends_to_nothing(out, lse, sink):
            return
        (b, s_q, h, _), s_k = q.shape, k.shape[1]
        blocks, ranges, bits = mask_summary(attn_mask, ("fwd", s_q, s_k, self.tiles), lambda: fwd_mask_summary(
            attn_mask, s_q, s_k, self.tiles))
        counter = _tile_counter(q.device)
        unused = _unused_counter(self.device_index)
        m_blocks, n_blocks = blocks.shape[-2:]
        self.fn(q, k, v, out, lse, counter, unused, unused, 0, 0,
                *_mask_args(attn_mask, bits, b, h, s_q, s_k, self.device_index),
                blocks.expand(b, h, m_blocks, n_blocks), ranges.expand(b, h, m_blocks, 2), softmax_scale, 0, 0,
                0.0, self.grid, *self._split_args(q), self._sink_arg(sink, lse, q))

    def __call__(self, q, k, v, out, lse, softmax_scale: float, window_left: int = 0, window_right: int = 0,
                 softcap: float = 0.0, sink=None) -> None:
        """``sink`` (every launch): the attention sinks, (H_q,) fp32 contiguous, for a sink variant."""
        if self._attends_to_nothing(out, lse, sink):
            return
        q, out, lse = self._gqa_rows(q, out, lse)
        unused = _unused_counter(self.device_index)
        counter = _tile_counter(q.device) if self.dynamic else unused
        self.fn(q, k, v, out, lse, counter, unused, unused, 0, 0, *_mask_placeholders(self.device_index),
                softmax_scale, window_left, window_right,
                softcap, self.grid, *self._split_args(q), self._sink_arg(sink, lse, q))

    def padded(self, q, k, v, key_start, key_end, out, lse, softmax_scale: float, window_left: int = 0,
               window_right: int = 0, softcap: float = 0.0, sink=None) -> None:
        """A padded batch: entry b's real keys are [key_start[b], key_end[b]) (int32, B); the plan's
        variant is padded. Rows that are not real get output 0 and lse -inf (or their sink)."""
        out.zero_()
        no_key_lse(lse, sink)
        if self.no_keys:
            return
        counter = _tile_counter(q.device)
        self.fn(q, k, v, out, lse, counter, key_start, key_end, 0, 0, *_mask_placeholders(self.device_index),
                softmax_scale, window_left, window_right,
                softcap, self.grid, *self._split_args(q), self._sink_arg(sink, lse, q))

    def kvcache(self, q, k_cache, v_cache, key_lengths, page_table, page_size: int, out, lse, softmax_scale: float,
                window_left: int = 0, window_right: int = 0, softcap: float = 0.0, sink=None) -> None:
        """Attention of q (B, S_q, H_q, D) over a KV cache of pages (num_pages, page_size, H_kv, D):
        entry b's keys are its first key_lengths[b] through page_table[b] (int32 (B, pages));
        the plan's variant is kvcache. A contiguous cache is one page per entry."""
        if self._attends_to_nothing(out, lse, sink):  # an empty cache
            return
        q, out, lse = self._gqa_rows(q, out, lse)
        counter = _tile_counter(q.device)
        rows = k_cache.shape[0] * k_cache.shape[1]
        k_rows = k_cache.reshape(1, rows, *k_cache.shape[2:])
        v_rows = v_cache.reshape(1, rows, *v_cache.shape[2:])
        self.fn(q, k_rows, v_rows, out, lse, counter, page_table.reshape(-1), key_lengths, page_table.shape[1],
                page_size, *_mask_placeholders(self.device_index), softmax_scale, window_left, window_right,
                softcap, self.grid, *self._split_args(q), self._sink_arg(sink, lse, q))

    def packed_paged(self, q, k_cache, v_cache, cu_seqlens_q, key_info, max_seqlen_q: int, out, lse,
                     softmax_scale: float, window_left: int = 0, window_right: int = 0, softcap: float = 0.0) -> None:
        """Packed queries q, out (total_q, H_q, D), lse (H_q, total_q) against a KV cache of pages
        (num_pages, page_size, H_kv, D); ``key_info`` is seqused_k, seqused_q, the page table
        flattened and each sequence's first query block of this plan's tiles, concatenated (int32,
        kernels.common.seqlen "packed_paged"); the plan's variant is packed_paged. Its sinks are
        merged after the launch by the op (ops/sinks.py)."""
        if self._attends_to_nothing(out, lse):
            return
        counter = _tile_counter(q.device)
        rows = k_cache.shape[0] * k_cache.shape[1]
        k_rows = k_cache.reshape(1, rows, *k_cache.shape[2:])
        v_rows = v_cache.reshape(1, rows, *v_cache.shape[2:])
        self.fn(q[None], k_rows, v_rows, out[None], lse[None], counter, cu_seqlens_q, key_info, max_seqlen_q,
                k_cache.shape[1], *_mask_placeholders(self.device_index), softmax_scale, window_left, window_right,
                softcap, self.grid, *self._split_args(q[None]), self._sink_arg(None, lse[None], q[None]))

    def ranged(self, q, k, v, key_start, key_end, out, lse, softmax_scale: float, window_left: int = 0,
               window_right: int = 0, softcap: float = 0.0, sink=None) -> None:
        """q (B, S_q, H_q, D), all real, against entry b's keys [key_start[b], key_end[b]) of k, v
        (B, S_k, H_kv, D) (int32, B), aligned bottom-right to key_end; the plan's variant is ranged."""
        if self._attends_to_nothing(out, lse, sink):
            return
        q, out, lse = self._gqa_rows(q, out, lse)
        counter = _tile_counter(q.device)
        self.fn(q, k, v, out, lse, counter, key_start, key_end, 0, 0, *_mask_placeholders(self.device_index),
                softmax_scale, window_left, window_right, softcap, self.grid, *self._split_args(q),
                self._sink_arg(sink, lse, q))

    def packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, out, lse,
               softmax_scale: float, window_left: int = 0, window_right: int = 0, softcap: float = 0.0,
               sink=None) -> None:
        """Varlen: q, k, v, out (total, H, D), lse (H, total_q); the plan's variant is packed."""
        if self._attends_to_nothing(out, lse[None], sink):
            return
        counter = _tile_counter(q.device)
        self.fn(q[None], k[None], v[None], out[None], lse[None], counter, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, *_mask_placeholders(self.device_index), softmax_scale, window_left,
                window_right, softcap, self.grid, *self._split_args(q), self._sink_arg(sink, lse[None], q))


# pages smaller than a key tile: each block is loaded as one TMA box per page (a whole number of
# the 8-row swizzle atoms, so that each box lands on an atom boundary of the tile)
SMALL_PAGES = (16, 32)


def kvcache_config(head_dim: int, page_size: int | None) -> FwdConfig | str:
    """The tiles of a KV-cache variant: key blocks must not straddle pages, so the key tile
    divides the page size (64 when the default does not), or a small page (SMALL_PAGES) divides
    the key tile, whose block is then a box per page; or the reason none fits."""
    config = config_for(head_dim, False, ragged=True)
    if page_size is None or page_size % config.tile_n == 0:
        return config
    if page_size % 64 == 0:
        return dataclasses.replace(config, tile_n=64)
    if page_size in SMALL_PAGES:
        return dataclasses.replace(config, tile_n=config.tile_n // page_size * page_size)
    return f"page_size {page_size}: the kernels need 16, 32 or a multiple of 64"


def kvcache_page_rows(page_size: int | None) -> int:
    """The kernel's ``page_rows`` for a paged cache's page size (None: one page per entry): the
    page size when smaller than every key tile, else 0 (one box per key block)."""
    return page_size if page_size in SMALL_PAGES else 0


def plan_fwd(q, k, v, causal: bool, config: FwdConfig | None = None,
             max_ctas: int | None = None, local: bool = False, softcap: float = 0.0,
             rows: str = "dense", attn_mask: str = "none", keys_per_entry: int | None = None,
             sink: bool = False, page_rows: int = 0) -> FlashFwdLaunch | str | None:
    """The forward launch for this layout and band kind (:func:`kernel_band`), the reason no
    kernel covers it, or None when there is nothing to compute. ``config`` and ``max_ctas``
    override the tiles and the persistent grid (experiments). ``rows``: "dense", "packed"
    (varlen q, k, v (total, H, D), called through :meth:`FlashFwdLaunch.packed`) or "padded"
    (called through :meth:`FlashFwdLaunch.padded`). ``attn_mask``: "none", "bool" or "add"
    (called through :meth:`FlashFwdLaunch.masked`). ``keys_per_entry``: a kvcache entry's
    capacity (its keys are not k's extent); ``page_rows``: its small pages
    (:func:`kvcache_page_rows`). ``softcap``: the cap (0: none), which picks the variant
    (:func:`softcap_kind`). Tiles too few to fill the GPU split their keys
    (:func:`num_splits_for`). ``sink``: a variant with attention sinks (launched with ``sink=``)."""
    packed = rows in ("packed", "packed_paged")  # packed_paged: k, v the (pages * page_size, H, D) rows
    if packed:
        q, k, v = q[None], k[None], v[None]
    reason = qkv_coverage_reason("flash_fwd_sm90", q, k, v)
    if reason:
        return reason
    if q.numel() == 0:
        return None
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    grid = max_ctas or num_sms(device_index)
    if k.shape[1] == 0:
        return FlashFwdLaunch(None, False, device_index, grid)
    # decode with grouped kv heads: the group's (token, head) pairs as the rows of one kv head's
    # tiles; one token sees every key (no band), several see the causal band per token
    dense = rows == "dense"
    unmasked = attn_mask == "none"
    # a serving step (packed_paged) packs the groups of every sequence, decode rows and prefill
    # chunks alike: each K/V block is read once per kv head, not once per query head
    group = (q.shape[2] // k.shape[2] if (q.shape[1] <= PACK_GQA_MAX_QUERIES and rows in DECODE_ROWS
                                          or rows == "packed_paged")
             and unmasked and not local and k.shape[2] < q.shape[2] else 0)
    rows_per_query = group if group and (q.shape[1] > 1 or rows == "packed_paged") else 1
    causal = causal and (not group or rows_per_query > 1)
    head_dim = q.shape[-1]
    config = config or config_for(head_dim, causal, not packed and k.shape[1] <= SHORT_CAUSAL_KEYS,
                                  not (dense and unmasked))
    if attn_mask != "none" and config.tile_n % 32:  # bits (a bool mask, an additive one's zeros): whole words
        config = dataclasses.replace(config, tile_n=config.tile_n // 32 * 32)
    splits = 1
    if rows in DECODE_ROWS and unmasked:
        tile_rows, tile_heads = (group * q.shape[1], k.shape[2]) if group else (q.shape[1], q.shape[2])
        tiles = -(-tile_rows // config.tile_m) * tile_heads * q.shape[0]
        key_blocks = -(-(keys_per_entry or k.shape[1]) // config.tile_n)
        splits = num_splits_for(tiles, key_blocks, grid)
        if group and group * q.shape[1] <= 64 and key_blocks <= DECODE_ONE_WARPGROUP_MAX_BLOCKS * splits:
            config = _one_warpgroup_decode(config, head_dim, q.element_size())
    elif rows == "packed_paged" and group:
        # 64-row tiles: a decode row fills only its group's rows of a tile, and a second warpgroup
        # would run its GEMMs on empty rows (the decode rows dominate a serving step's keys)
        config = _one_warpgroup_decode(config, head_dim, q.element_size())
    capped = softcap_kind(softcap, q.dtype)
    spec = fwd_spec(DTYPE_NAMES[q.dtype], head_dim, causal, config, local=local, softcap=capped != "none",
                    rows=rows, attn_mask=attn_mask, split_kv=splits > 1, rows_per_query=rows_per_query,
                    bounded_scores=capped == "bounded", sink=sink, page_rows=page_rows)
    return FlashFwdLaunch(spec, config.dynamic_schedule, device_index, grid, group, (config.tile_m, config.tile_n),
                          splits)


def _bwd_workspaces(batch: int, heads: int, stat_rows: int, accum_rows: int, head_dim: int, tile_m: int,
                    device) -> tuple:
    """The backward's fp32 workspaces: delta and lse * log2(e) (batch, heads, stat_rows), padded to
    whole query blocks, and the dQ accumulator (batch, heads, query blocks of tile_m rows covering
    accum_rows, warpgroup, its tile in accumulator order: see kernels/sm90/flash_bwd.py), which the
    kernel's preprocess zeroes. Every value of them that the kernel reads, it writes first
    (runtime.unfilled)."""
    return written_in_full(_new_bwd_workspaces, batch, heads, stat_rows, accum_rows, head_dim, tile_m, device)


def _new_bwd_workspaces(batch, heads, stat_rows, accum_rows, head_dim, tile_m, device) -> tuple:
    delta = torch.empty((batch, heads, stat_rows), dtype=torch.float32, device=device)
    lse_log2 = torch.empty((batch, heads, stat_rows), dtype=torch.float32, device=device)
    blocks = -(-accum_rows // tile_m)
    dq_accum = torch.empty((batch, heads, blocks, 2, tile_m * head_dim // 2), dtype=torch.float32,
                           device=device)
    return delta, lse_log2, dq_accum


class FlashBwdLaunch:
    """The backward of one input layout: writes dq, dk, dv (preallocated, contiguous)."""

    __slots__ = ("fn", "device_index", "deterministic", "unused", "unused_order", "tile_m", "tile_n", "num_sms")

    def __init__(self, spec: KernelSpec, device_index: int):
        self.fn = get_compiled(spec)
        self.device_index = device_index
        self.deterministic = spec.get("deterministic", False)
        self.tile_m, self.tile_n = spec["tile"]  # the dQ accumulator's blocks are the query tiles
        self.num_sms = 0  # looked up at the first deterministic launch
        self.unused = _unused_counter(device_index)  # the int32 tensors a variant never reads
        # the default variants' placeholder for the add counts: the compiled signature is 4-D
        self.unused_order = self.unused.view(1, 1, 1, 1)

    def _dq_order(self, dq_accum: torch.Tensor, seqlen_k: int, turns: torch.Tensor | None = None,
                  in_step: bool = True) -> tuple:
        """Deterministic variants: one zeroed int32 per dQ accumulator tile, the count of key
        blocks added to it so far (the next one waits for its turn), with a mask each key
        block's turn per query block (:func:`dq_turns`), and how many heads' launches take turns
        (about the CTAs resident at once over a head's key blocks; read by the variants whose key
        blocks walk in step, kernels.sm90.flash_bwd_dq, and 1 where a mask staggers the walks:
        ``in_step``); else placeholders (the compiled signature is 4-D either way)."""
        if not self.deterministic:
            return self.unused_order, self.unused_order, 1
        order = torch.zeros(dq_accum.shape[:4], dtype=torch.int32, device=dq_accum.device)
        if not self.num_sms:
            self.num_sms = num_sms(self.device_index)
        interleave = -(-self.num_sms // -(-seqlen_k // self.tile_n)) if in_step else 1
        return order, self.unused_order if turns is None else turns, interleave

    def _sink_args(self, sink, dsink) -> tuple:
        """(sinks, their gradient), fp32 (H_q,) contiguous, the gradient added to; or placeholders."""
        if sink is None:
            unused = self.unused.view(torch.float32)  # never read: the int32 placeholder's bytes
            return unused, unused
        return sink, dsink

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float, window_left: int = 0,
                 window_right: int = 0, softcap: float = 0.0, sink=None, dsink=None) -> None:
        """``sink``, ``dsink`` (every launch): a sink variant's sinks and the gradient it adds to."""
        batch, seqlen_q, heads, head_dim = q.shape
        delta, lse_log2, dq_accum = _bwd_workspaces(batch, heads, -(-seqlen_q // STAT_PAD) * STAT_PAD, seqlen_q,
                                                    head_dim, self.tile_m, q.device)
        self.fn(dout, q, k, v, out, lse, dq, dk, dv, delta, lse_log2, dq_accum, *self._dq_order(dq_accum, k.shape[1]),
                self.unused, self.unused, 0, 0,
                *_mask_placeholders(self.device_index),
                softmax_scale, window_left, window_right, softcap, *self._sink_args(sink, dsink))

    def masked(self, dout, q, k, v, out, lse, attn_mask, dq, dk, dv, softmax_scale: float, sink=None,
               dsink=None) -> None:
        """PyTorch's attn_mask (see :meth:`FlashFwdLaunch.masked`): key blocks skip the query blocks
        the mask leaves empty for their whole GQA group."""
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        tiles = BWD_TILES[head_dim][:2]
        blocks, ranges, bits = mask_summary(
            attn_mask, ("bwd", seqlen_q, seqlen_k, tiles, kv_heads),
            lambda: bwd_mask_summary(attn_mask, seqlen_q, seqlen_k, tiles, kv_heads, bwd_keys_in_rows(tiles[1])))
        delta, lse_log2, dq_accum = _bwd_workspaces(batch, heads, -(-seqlen_q // STAT_PAD) * STAT_PAD, seqlen_q,
                                                    head_dim, self.tile_m, q.device)
        m_blocks, n_blocks = blocks.shape[-2:]
        turns, in_step = None, True
        if self.deterministic:
            # compact (batch, kv heads, key blocks, query blocks): few registers to index it
            turns, in_step = mask_summary(
                attn_mask, ("bwd turns", batch, seqlen_q, seqlen_k, tiles, kv_heads),
                lambda: (dq_turns(ranges, m_blocks).expand(batch, kv_heads, n_blocks, m_blocks).contiguous(),
                         walks_in_step(ranges)))
        self.fn(dout, q, k, v, out, lse, dq, dk, dv, delta, lse_log2, dq_accum,
                *self._dq_order(dq_accum, seqlen_k, turns, bool(in_step)), self.unused, self.unused, 0, 0,
                *_mask_args(attn_mask, bits, batch, heads, seqlen_q, seqlen_k, self.device_index),
                blocks.expand(batch, heads, m_blocks, n_blocks), ranges.expand(batch, kv_heads, n_blocks, 2),
                softmax_scale, 0, 0, 0.0, *self._sink_args(sink, dsink))

    def padded(self, dout, q, k, v, out, lse, key_start, key_end, dq, dk, dv, softmax_scale: float,
               window_left: int = 0, window_right: int = 0, softcap: float = 0.0, sink=None, dsink=None) -> None:
        """A padded batch (see :meth:`FlashFwdLaunch.padded`): rows that are not real get zero
        gradients. Each entry's statistics start at its first real query, in its own slot."""
        batch, seqlen_q, heads, head_dim = q.shape
        delta, lse_log2, dq_accum = _bwd_workspaces(batch, heads, -(-seqlen_q // STAT_PAD) * STAT_PAD, seqlen_q,
                                                    head_dim, self.tile_m, q.device)
        for grad in (dq, dk, dv):
            grad.zero_()
        self.fn(dout, q, k, v, out, lse, dq, dk, dv, delta, lse_log2, dq_accum, *self._dq_order(dq_accum, k.shape[1]),
                key_start, key_end, 0, 0,
                *_mask_placeholders(self.device_index),
                softmax_scale, window_left, window_right, softcap, *self._sink_args(sink, dsink))

    def packed(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
               dq, dk, dv, softmax_scale: float, window_left: int = 0, window_right: int = 0,
               softcap: float = 0.0, sink=None, dsink=None) -> None:
        """Varlen: (total, H, D) tensors, lse (H, total_q). The fp32 workspaces hold each
        sequence's rows from a multiple of STAT_PAD on (see kernels.common.seqlen)."""
        total_q, heads, head_dim = q.shape
        batch = cu_seqlens_q.shape[0] - 1
        padded = -(-(total_q + batch * STAT_PAD) // STAT_PAD) * STAT_PAD
        delta, lse_log2, dq_accum = _bwd_workspaces(1, heads, padded, padded, head_dim, self.tile_m, q.device)
        self.fn(dout[None], q[None], k[None], v[None], out[None], lse[None], dq[None], dk[None], dv[None],
                delta, lse_log2, dq_accum, *self._dq_order(dq_accum, max_seqlen_k), cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k,
                *_mask_placeholders(self.device_index),
                softmax_scale, window_left, window_right, softcap, *self._sink_args(sink, dsink))


def plan_bwd(q, k, v, causal: bool, local: bool = False, softcap: bool = False,
             rows: str = "dense", attn_mask: str = "none", deterministic: bool = False,
             sink: bool = False) -> FlashBwdLaunch | str:
    """The backward launch for this layout of q, k, v, or the reason no kernel covers it
    (dout and out, loaded like q, are checked by the op layer). ``rows`` as in :func:`plan_fwd`;
    ``sink``: a variant that also adds the attention sinks' gradient (launched with ``sink=`` and
    ``dsink=``)."""
    if rows == "packed":
        q, k, v = q[None], k[None], v[None]
    if q.numel() == 0 or k.shape[1] == 0:  # no rows, heads or keys: no grid to launch
        return "flash_bwd_sm90 needs non-empty batch, heads and sequences"
    reason = qkv_coverage_reason("flash_bwd_sm90", q, k, v)
    if reason:
        return reason
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    spec = bwd_spec(DTYPE_NAMES[q.dtype], q.shape[-1], causal, local=local, softcap=softcap, rows=rows,
                    attn_mask=attn_mask, deterministic=deterministic, sink=sink)
    return FlashBwdLaunch(spec, device_index)


def fwd_unsupported_reason(q, k, v, causal: bool) -> str | None:
    plan = plan_fwd(q, k, v, causal)
    return plan if isinstance(plan, str) else pointer_reason(("q", q), ("k", k), ("v", v))


def bwd_unsupported_reason(q, k, v, causal: bool) -> str | None:
    plan = plan_bwd(q, k, v, causal)
    return plan if isinstance(plan, str) else pointer_reason(("q", q), ("k", k), ("v", v))


def launch_fwd(q, k, v, out, lse, softmax_scale: float, causal: bool, config: FwdConfig | None = None,
               max_ctas: int | None = None, window_left=None, window_right=None, softcap: float = 0.0) -> None:
    """Uncached forward launch (tests, benchmarks); the window as the op takes it."""
    causal, local, left, right = kernel_band(causal, window_left, window_right, q.shape[1], k.shape[1])
    plan = plan_fwd(q, k, v, causal, config, max_ctas, local, float(softcap))
    if isinstance(plan, str):
        raise ValueError(plan)
    if plan is not None:
        plan(q, k, v, out, lse, float(softmax_scale), left, right, float(softcap))


def launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float, causal: bool, window_left=None,
               window_right=None, softcap: float = 0.0) -> None:
    """Uncached backward launch (tests, benchmarks); the window as the op takes it."""
    causal, local, left, right = kernel_band(causal, window_left, window_right, q.shape[1], k.shape[1])
    plan = plan_bwd(q, k, v, causal, local, softcap != 0.0)
    if isinstance(plan, str):
        raise ValueError(plan)
    plan(dout, q, k, v, out, lse, dq, dk, dv, float(softmax_scale), left, right, float(softcap))
