"""Compile-only checks of the attention sinks in the kernels (no GPU needed).

The sink variants are the plain kernels with one compiled flag: the forward reads each row's sink
(two rows per thread) and adds it at the softmax finalize, the split-KV combine reads it per row,
and the backward's preprocess reduces its CTA's share of the sinks' gradient with one fp32
``red.add`` (the main kernel is unchanged). The plain variants must not change.
"""

import os
import re

import pytest

pytest.importorskip("cutlass")

from torch_cute_ops.runtime import attention as flash_host  # noqa: E402


@pytest.fixture(autouse=True)
def _arch(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))


def _entries(ptx: str) -> dict[str, str]:
    """Each ``.entry`` of a PTX file by its name."""
    starts = [m.start() for m in re.finditer(r"^\.(visible )?\.entry ", ptx, re.M)] + [len(ptx)]
    return {re.search(r"\.entry\s+(\S+?)\(", ptx[a:b]).group(1): ptx[a:b] for a, b in zip(starts, starts[1:])}


def _global_loads(ptx: str) -> int:
    return len(re.findall(r"^\s*ld\.global[.\w]*\s", ptx, re.M))


_DECODE = flash_host.config_for(64, False, ragged=True)

# (name, plain spec arguments): dense causal, packed causal, one-token decode from a paged cache
FORWARD = [
    ("dense", dict(dtype="bf16", head_dim=64, causal=True)),
    ("packed", dict(dtype="bf16", head_dim=128, causal=True, rows="packed")),
    ("decode", dict(dtype="bf16", head_dim=64, causal=False, config=_DECODE, rows="kvcache")),
]


@pytest.mark.parametrize("name,params", FORWARD, ids=[name for name, _ in FORWARD])
def test_the_forward_reads_the_sink_once_per_row_and_stays_in_registers(variant_ptx, name, params):
    plain = variant_ptx(flash_host.fwd_spec(**params)).read_text()
    sinked = variant_ptx(flash_host.fwd_spec(**params, sink=True)).read_text()
    assert ".local" not in sinked
    # the consumer's two rows of a tile: one 4-byte load each, beside the plain kernel's loads
    assert _global_loads(sinked) - _global_loads(plain) == 2
    # the finalize: exp2 of the old max's and of the sink's offsets to the new max, per row
    assert sinked.count("ex2.approx") > plain.count("ex2.approx")
    assert sinked.count("lg2.approx") == plain.count("lg2.approx")


def test_the_split_combine_merges_the_sink(variant_ptx):
    params = dict(dtype="bf16", head_dim=64, causal=False, config=_DECODE, rows="kvcache", split_kv=True)
    plain = _entries(variant_ptx(flash_host.fwd_spec(**params)).read_text())
    sinked = _entries(variant_ptx(flash_host.fwd_spec(**params, sink=True)).read_text())
    (plain_combine,) = [body for entry, body in plain.items() if "Combine" in entry]
    (sinked_combine,) = [body for entry, body in sinked.items() if "Combine" in entry]
    assert _global_loads(sinked_combine) == _global_loads(plain_combine) + 1
    # the splits themselves store their own lse: no sink read in the main kernel
    (plain_main,) = [body for entry, body in plain.items() if "Combine" not in entry]
    (sinked_main,) = [body for entry, body in sinked.items() if "Combine" not in entry]
    assert _global_loads(sinked_main) == _global_loads(plain_main)


@pytest.mark.parametrize("rows", ["dense", "packed"])
def test_the_backward_preprocess_reduces_the_sinks_gradient(variant_ptx, rows):
    plain = _entries(variant_ptx(flash_host.bwd_spec("bf16", 64, True, rows=rows)).read_text())
    sinked = _entries(variant_ptx(flash_host.bwd_spec("bf16", 64, True, rows=rows, sink=True)).read_text())
    pre = next(body for entry, body in sinked.items() if "preprocess" in entry)
    plain_pre = next(body for entry, body in plain.items() if "preprocess" in entry)
    assert len(re.findall(r"red[.\w]*\.global\.add\.f32", pre)) == 1  # one per CTA (thread 0)
    assert not re.search(r"red[.\w]*\.global\.add\.f32", plain_pre)
    assert "bar.sync" in pre and ".local" not in pre
    # the main kernel and the postprocess are the plain ones
    for part in ("_main_kernel", "postprocess"):
        body = next(body for entry, body in sinked.items() if part in entry)
        plain_body = next(body for entry, body in plain.items() if part in entry)
        assert body.count("\n") == plain_body.count("\n"), part


def test_sink_flag_in_the_cache_key_not_sizes():
    plain, sinked = flash_host.fwd_spec("bf16", 64, True), flash_host.fwd_spec("bf16", 64, True, sink=True)
    assert plain != sinked and plain.digest != sinked.digest and "sink=1" in sinked.name
    assert "sink" not in plain.name  # the variants without sinks keep their names and prebuilt files
    assert flash_host.bwd_spec("bf16", 64, True, sink=True) != flash_host.bwd_spec("bf16", 64, True)
