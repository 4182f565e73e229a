"""Compile-only checks of the serving variants (no GPU needed): packed queries against a paged
cache, and pages smaller than a key tile loaded as one TMA box per page into the same tile."""

import os
import re

import pytest

from torch_cute_ops.runtime import attention as flash_host

pytest.importorskip("cutlass")


def _ptx(variant_ptx, page_size, head_dim=128, rows="packed_paged"):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    spec = flash_host.fwd_spec("bf16", head_dim, True, flash_host.kvcache_config(head_dim, page_size), rows=rows,
                               page_rows=flash_host.kvcache_page_rows(page_size))
    return variant_ptx(spec).read_text()


def _tma_loads(ptx):
    return len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx))


def test_small_pages_are_boxes_per_page(variant_ptx):
    """Per key block, 128 / page_size boxes (each looked up in the page table, no division), the
    same consumer (its WGMMAs unchanged), no local memory."""
    by_page = {page: _ptx(variant_ptx, page) for page in (16, 32, 64)}
    loads = {page: _tma_loads(ptx) for page, ptx in by_page.items()}
    # every K/V load site issues one box (page 64: tile_n 64) or 4 / 8 boxes (tile_n 128)
    kv_sites = (loads[32] - loads[64]) // 3
    assert kv_sites > 0 and loads[16] == loads[64] + 7 * kv_sites, loads
    for page, ptx in by_page.items():
        assert "ld.local" not in ptx and "st.local" not in ptx, page
        assert len(re.findall(r"div\.s32", ptx)) <= len(re.findall(r"div\.s32", by_page[64])), page
    wgmma = {page: sorted(re.findall(r"wgmma\.mma_async\S*", ptx)) for page, ptx in by_page.items()}
    assert wgmma[16] == wgmma[32], "the consumer does not depend on the page size"


def test_packed_paged_pack_gqa_variant(variant_ptx):
    """What a GQA serving step plans: (token, head) rows gathered with cp.async, one warpgroup,
    K/V by TMA, no local memory."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    config = flash_host._one_warpgroup_decode(flash_host.kvcache_config(64, 16), 64, 2)
    spec = flash_host.fwd_spec("bf16", 64, True, config, rows="packed_paged", rows_per_query=8, page_rows=16)
    ptx = variant_ptx(spec).read_text()
    assert "wgmma.mma_async" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert "cp.async.cg.shared.global" in ptx and _tma_loads(ptx) > 0
