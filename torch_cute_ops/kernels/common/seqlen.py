"""Where one batch entry's rows live in the attention tensors: dense, packed (varlen) or padded.

Shared by the forward and the backward. Both take q-like tensors as (S, D, H, B) views (TMA
coordinate tensors or plain gmem) and per-query statistics as (S, H, B). The row layout
(``rows``) is a compile-time choice; its two int32 tensors ``info_q``/``info_k`` say:

* ``"dense"``: (B, S, H, D) inputs; entry ``b`` is index ``b`` of mode B, its S rows all real
  (the info tensors are not read);
* ``"packed"`` (FlashAttention's varlen): (1, total, H, D) inputs, ``info_q``/``info_k`` the
  cu_seqlens (B + 1,); entry ``b`` owns rows ``[cu[b], cu[b + 1])``;
* ``"padded"``: (B, S, H, D) inputs whose entry ``b`` has real keys only in
  ``[info_q[b], info_k[b])`` (a padded batch, left or right); its queries are aligned with the
  keys bottom-right (query ``i`` sits at key position ``i + S_k - S_q``), so the real query rows
  are those whose position falls in that range;
* ``"ranged"``: dense queries (B, S_q, H, D), all real, against (B, S_k, H, D) keys of which entry
  ``b`` attends to ``[info_q[b], info_k[b])``, the queries aligned bottom-right to the range's end
  (a contiguous KV cache: a left-padded entry's first real key, its length so far);
* ``"kvcache"``: dense queries (B, S_q, H, D), all real, against a KV cache of pages: k and v are
  (1, pages * page_size, H, D), ``info_q`` the page table flattened (B * pages_per_entry) and
  ``info_k`` the key lengths (B,); entry ``b``'s key ``j`` is row ``page_table[b, j // page_size]
  * page_size + j % page_size`` (a contiguous cache is one page per entry). Queries align with
  the entry's keys bottom-right. Key blocks never straddle pages (page_size % tile_n == 0, or one
  page per entry, whose blocks past the end are masked);
* ``"packed_paged"`` (a serving step: decode rows and prefill chunks in one batch): packed queries
  (1, total_q, H, D), ``info_q`` the cu_seqlens_q (B + 1,), against a KV cache of pages as in
  ``"kvcache"``; ``info_k`` is one int32 tensor holding the key lengths (seqused_k, B), the used
  query lengths (seqused_q, B), the page table flattened (B * pages_per_entry) and each entry's
  first query block in a list of all entries' blocks (B + 1, the last the total), in that order.
  Entry ``b``'s queries are rows ``[cu_q[b], cu_q[b] + seqused_q[b])``, aligned bottom-right to
  its ``seqused_k[b]`` keys; with pack-GQA (``gqa_rows``) its rows are those tokens' (token, head)
  pairs.

A kernel sees an entry as an (S, D) slab starting at its first real row (a domain offset), so
tile arithmetic is the dense one. A tile that runs past the entry's end reads rows that are not
the entry's: keys there are masked by ``seqlen_k``, and query rows there are never stored (no
TMA stores past ``seqlen_q`` in the packed and padded layouts).

The backward's fp32 per-query statistics (lse, delta) and dQ accumulator have a padded copy
per entry: it starts at ``padded_offset_q``, a multiple of ``pad`` (whole query blocks) with
room for the entry's last block, so that whole-block loads and reduce-adds start aligned and
never touch another entry's rows. Packed, with B entries, the copy has ``total_q + B * pad``
rows; padded, each entry's copy is its own batch slot, from its first real query on.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import LoadCacheMode, cpasync

from .dsl_state import DslState


ROW_LAYOUTS = ("dense", "packed", "padded", "ranged", "kvcache", "packed_paged")
# packed queries: B = 1 and the entries' rows found through cu_seqlens_q
PACKED_QUERIES = ("packed", "packed_paged")
# keys found through a page table
PAGED_KEYS = ("kvcache", "packed_paged")


def seq_major(m: cute.Tensor) -> cute.Tensor:
    """The (S, D, H, B) view of a (B, S, H, D) tensor, as these helpers take q-like tensors."""
    return cute.make_tensor(m.iterator, cute.select(m.layout, mode=[1, 3, 2, 0]))


class SeqBounds(DslState):
    """Rows of batch entry ``batch``: ``offset_q``/``seqlen_q`` of the queries, ``offset_k``/
    ``seqlen_k`` of the keys, ``padded_offset_q`` of its statistics in the backward's padded
    copies. ``seqlen_q``/``seqlen_k``: the tensors' extents (dense, padded)."""

    dynamic_fields = ("offset_q", "seqlen_q", "offset_k", "seqlen_k", "padded_offset_q", "page_base",
                      "page_size")

    def __init__(self, batch, seqlen_q, seqlen_k, info_q: cute.Tensor = None, info_k: cute.Tensor = None,
                 rows: str = "dense", pad: int = 128, pages_per_entry=0, page_size=0, rows_per_query: int = 1):
        assert rows in ROW_LAYOUTS, rows
        self.rows = rows
        self.page_table = info_q
        self.page_base, self.page_size = Int32(0), Int32(0)
        if const_expr(rows == "kvcache"):
            self.offset_q, self.offset_k, self.padded_offset_q = Int32(0), Int32(0), Int32(0)
            self.seqlen_q, self.seqlen_k = Int32(seqlen_q), info_k[batch]
            self.page_base, self.page_size = batch * pages_per_entry, Int32(page_size)
        elif const_expr(rows == "packed_paged"):
            # pack-GQA (rows_per_query > 1): query rows are (token, head) pairs (gqa_rows)
            entries = cute.size(info_q.shape[0]) - 1
            self.offset_q = info_q[batch] * rows_per_query
            self.seqlen_q = info_k[entries + batch] * rows_per_query
            self.offset_k, self.seqlen_k, self.padded_offset_q = Int32(0), info_k[batch], Int32(0)
            self.page_table = info_k
            self.page_base, self.page_size = 2 * entries + batch * pages_per_entry, Int32(page_size)
        elif const_expr(rows == "packed"):
            self.offset_q = info_q[batch]
            self.seqlen_q = info_q[batch + 1] - self.offset_q
            self.offset_k = info_k[batch]
            self.seqlen_k = info_k[batch + 1] - self.offset_k
            self.padded_offset_q = (self.offset_q + batch * pad) // pad * pad
        elif const_expr(rows in ("ranged", "padded")):  # keys [info_q[b], info_k[b])
            self.offset_k = info_q[batch]
            self.seqlen_k = info_k[batch] - self.offset_k
            # padded: statistics from the entry's first real query on, in its own slot (whole-block
            # loads start aligned: a 1-D TMA box must)
            self.padded_offset_q = Int32(0)
            if const_expr(rows == "ranged"):  # every query real, the last at the range's end
                self.offset_q, self.seqlen_q = Int32(0), Int32(seqlen_q)
            else:
                shift = seqlen_k - seqlen_q  # query i sits at key position i + shift
                self.offset_q = cutlass.max(self.offset_k - shift, 0)
                self.seqlen_q = cutlass.max(info_k[batch] - shift, self.offset_q) - self.offset_q
        else:
            self.offset_q, self.offset_k, self.padded_offset_q = Int32(0), Int32(0), Int32(0)
            self.seqlen_q, self.seqlen_k = Int32(seqlen_q), Int32(seqlen_k)

    @staticmethod
    def num_entries(dense_batch, cu_seqlens_q: cute.Tensor, rows: str):
        return cute.size(cu_seqlens_q.shape[0]) - 1 if const_expr(rows in PACKED_QUERIES) else dense_batch

    @staticmethod
    def pages_per_entry(cu_seqlens_q: cute.Tensor, info_k: cute.Tensor):
        """packed_paged: the page table's row length, from the sizes of the two info tensors."""
        entries = cute.size(cu_seqlens_q.shape[0]) - 1
        return (cute.size(info_k.shape[0]) - 3 * entries - 1) // cutlass.max(entries, 1)

    def _entry(self, batch):
        return 0 if const_expr(self.rows in PACKED_QUERIES) else batch

    def key_row(self, key):
        """kvcache, packed_paged: the cache row of this entry's key ``key`` (through its page)."""
        page = self.page_table[self.page_base + key // self.page_size]
        return page * self.page_size + key % self.page_size

    def _slab(self, m: cute.Tensor, offset, head, batch) -> cute.Tensor:
        if const_expr(self.rows == "dense"):
            return m[None, None, head, batch]
        return cute.domain_offset((offset, 0), m[None, None, head, self._entry(batch)])

    def q_rows(self, m: cute.Tensor, head, batch) -> cute.Tensor:
        """The (S_q, D) slab of a q-like (S, D, H, B) tensor (q, out, dout, dq)."""
        return self._slab(m, self.offset_q, head, batch)

    def k_rows(self, m: cute.Tensor, head, batch) -> cute.Tensor:
        """The (S_k, D) slab of a k-like (S, D, H, B) tensor (k, v, dk, dv); kvcache: the whole
        cache (blocks are found through :meth:`key_row`)."""
        if const_expr(self.rows in PAGED_KEYS):
            return m[None, None, head, 0]
        return self._slab(m, self.offset_k, head, batch)

    def padded_rows(self, m: cute.Tensor, head, batch) -> cute.Tensor:
        """The (S, D) slab of the backward's fp32 dQ accumulator (S, D, H, B)."""
        return self._slab(m, self.padded_offset_q, head, batch)

    def padded_stat(self, m: cute.Tensor, head, batch) -> cute.Tensor:
        """The (S,) slice of a padded per-query statistic (S, H, B) (lse * log2 e, delta)."""
        if const_expr(self.rows == "dense"):
            return m[None, head, batch]
        return cute.domain_offset((self.padded_offset_q,), m[None, head, self._entry(batch)])

    def q_index(self, row, batch) -> tuple:
        """(row, entry) of query ``row`` of this entry in an (S, ..., B) tensor."""
        return self.offset_q + row, self._entry(batch)

    def padded_index(self, row, batch) -> tuple:
        """(row, entry) of query ``row`` in a padded statistic or accumulator."""
        return self.padded_offset_q + row, self._entry(batch)


def gqa_rows(m: cute.Tensor, group: int, head_mode: int) -> cute.Tensor:
    """Pack-GQA with several query tokens: an (S, ..., H, ...) view of a q-like tensor (q, out,
    lse, their split partials) whose rows are the (token, head) pairs of one kv head's group,
    row ``t * group + j`` = token t of query head ``h * group + j``, and whose heads are the kv
    heads. Not one stride: the rows mode is (group, S):(stride_H, stride_S), which row indexing
    resolves (no TMA box fits it; :func:`load_rows` and :func:`store_rows` move such rows)."""
    return cute.make_tensor(m.iterator, gqa_rows_layout(m.layout, group, head_mode))


def gqa_rows_layout(layout: cute.Layout, group: int, head_mode: int) -> cute.Layout:
    """The layout of :func:`gqa_rows`."""
    shape, stride = list(layout.shape), list(layout.stride)
    rows = ((group, shape[0]), (stride[head_mode], stride[0]))
    shape[head_mode], stride[head_mode] = shape[head_mode] // group, stride[head_mode] * group
    shape[0], stride[0] = rows
    return cute.make_layout(tuple(shape), stride=tuple(stride))


def _row_walk(sX: cute.Tensor, tidx: Int32, num_threads: int):
    """How ``num_threads`` threads cover an smem tile (rows, cols) in 16-byte chunks, one row
    after another: (elements per chunk, this thread's chunk columns, its first row, the row step).
    Each thread keeps its columns and steps over rows, so a loop needs one address per copy."""
    vec = 128 // sX.element_type.width
    chunks = cute.size(sX, mode=[1]) // vec
    threads_per_row = min(chunks, num_threads)
    first_chunk = tidx % threads_per_row
    columns = [first_chunk + k * threads_per_row for k in range(chunks // threads_per_row)]
    return vec, columns, tidx // threads_per_row, num_threads // threads_per_row


@cute.jit
def load_rows(gX: cute.Tensor, sX: cute.Tensor, row_offset: Int32, num_rows: Int32, tidx: Int32,
              num_threads: cutlass.Constexpr[int]):
    """Start copies of rows ``row_offset + [0, rows of sX)`` below ``num_rows`` of gmem (rows, cols)
    into an smem tile, 16 bytes per cp.async (the caller commits and waits, or arrives on an
    mbarrier when they land). Rows at or past ``num_rows`` are not written: the reader fills
    them (:func:`zero_rows`). A loop over rows, no unrolled row table (a producer warp has few
    registers)."""
    vec, columns, first_row, row_step = _row_walk(sX, tidx, num_threads)
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(LoadCacheMode.GLOBAL), sX.element_type, num_bits_per_copy=128)
    real_rows = cutlass.min(cute.size(sX, mode=[0]), num_rows - row_offset)
    for r in cutlass.range(first_row, real_rows, row_step, unroll=1):
        for c in cutlass.range_constexpr(len(columns)):
            cute.copy(atom, cute.local_tile(gX[row_offset + r, None], (vec,), (columns[c],)),
                      cute.local_tile(sX[r, None], (vec,), (columns[c],)))


@cute.jit
def zero_rows(sX: cute.Tensor, first_row: Int32, tidx: Int32, num_threads: cutlass.Constexpr[int]):
    """Zero rows ``[max(first_row, 0), rows)`` of an smem tile (rows, cols) with 16-byte stores:
    the rows :func:`load_rows` leaves unwritten, so that a GEMM over the whole tile reads
    finite values there."""
    vec, columns, own_row, row_step = _row_walk(sX, tidx, num_threads)
    zeros = cute.make_rmem_tensor((vec,), sX.element_type)
    zeros.fill(0.0)
    for r in cutlass.range(cutlass.max(first_row, 0) + own_row, cute.size(sX, mode=[0]), row_step, unroll=1):
        for c in cutlass.range_constexpr(len(columns)):
            cute.local_tile(sX[r, None], (vec,), (columns[c],)).store(zeros.load())


@cute.jit
def store_rows(sX: cute.Tensor, gX: cute.Tensor, num_rows: Int32, tidx: Int32,
               num_threads: cutlass.Constexpr[int], row_offset: Int32 = 0):
    """Copy rows ``[0, num_rows)`` of an smem tile (rows, cols) to gmem rows ``row_offset + r``
    in 16-byte vectors.

    The store of a packed tile: a TMA store would also write the rows past ``num_rows``,
    which belong to the next sequence. ``num_threads`` threads, ``tidx`` in [0, num_threads).
    """
    rows, cols = cute.size(sX, mode=[0]), cute.size(sX, mode=[1])
    vec = 128 // sX.element_type.width
    chunks = cols // vec
    total = rows * chunks
    for i in cutlass.range_constexpr((total + num_threads - 1) // num_threads):
        idx = tidx + i * num_threads
        r = idx // chunks
        c = idx - r * chunks
        in_tile = r < num_rows
        if const_expr(total % num_threads != 0):
            in_tile = in_tile & (idx < total)
        if in_tile:
            src = cute.local_tile(sX[r, None], (vec,), (c,))
            dst = cute.local_tile(gX[row_offset + r, None], (vec,), (c,))
            dst.store(src.load())
