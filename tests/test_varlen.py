"""Packed sequences (varlen) in the op layer, on the CPU: semantics against per-sequence dense
attention, gradients, fake functions and opcheck, named errors, and compilation that does not
recompile when the packing changes."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_cute_ops as tco


def _cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _inputs(lens_q, lens_k, heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n, h: torch.randn(n, h, head_dim, generator=gen, dtype=dtype)  # noqa: E731
    return rand(sum(lens_q), heads_q), rand(sum(lens_k), heads_kv), rand(sum(lens_k), heads_kv)


BANDS = [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (3, 0), 0.0), (False, (2, 2), 0.0),
         (True, (-1, -1), 5.0)]


@pytest.mark.parametrize("causal,window,softcap", BANDS)
def test_each_sequence_is_its_own_batch_entry(causal, window, softcap):
    """Sequence b of the packing gives exactly flash_attn_func on its rows: causal and windows
    aligned per sequence (bottom-right when q and k lengths differ), lengths 0 allowed."""
    lens_q, lens_k = [0, 1, 7, 33, 5], [3, 1, 9, 40, 0]
    q, k, v = _inputs(lens_q, lens_k)
    cq, ck = _cu(lens_q), _cu(lens_k)
    out, lse = tco.flash_attn_varlen_func(q, k, v, cq, ck, 40, 40, causal=causal, window_size=window,
                                          softcap=softcap, return_lse=True)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert not out.isnan().any() and not lse.isnan().any()
    for b in range(len(lens_q)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lens_q[b] == 0:
            continue
        dense_out, dense_lse = tco.flash_attn_func(q[None, rq], k[None, rk], v[None, rk], causal=causal,
                                                   window_size=window, softcap=softcap, return_lse=True)
        torch.testing.assert_close(out[rq], dense_out[0])
        torch.testing.assert_close(lse[:, rq], dense_lse[0])
    # the sequence with no keys: output 0, lse -inf
    assert (out[cq[4]:cq[5]] == 0).all() and torch.isinf(lse[:, cq[4]:cq[5]]).all()


def test_gradcheck():
    lens_q, lens_k = [0, 3, 6], [2, 5, 6]
    q, k, v = (t.requires_grad_() for t in _inputs(lens_q, lens_k, head_dim=8))
    cq, ck = _cu(lens_q), _cu(lens_k)
    fn = lambda q, k, v: tco.flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, causal=True, softcap=3.0,  # noqa: E731
                                                    window_size=(2, 0))
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_fakes_match_real_and_opcheck():
    lens = [3, 0, 9]
    q, k, v = _inputs(lens, lens, dtype=torch.float32)
    cu = _cu(lens)
    args = (cu, cu, 9, 9, 0.25, True)
    out, lse = torch.ops.cute.flash_attn_varlen_fwd(q, k, v, *args)
    grads = torch.ops.cute.flash_attn_varlen_bwd(torch.randn_like(out), q, k, v, out, lse, *args)
    with FakeTensorMode() as mode:
        fq, fk, fv, fo, fl, fcu = (mode.from_tensor(t) for t in (q, k, v, out, lse, cu))
        fout, flse = torch.ops.cute.flash_attn_varlen_fwd(fq, fk, fv, fcu, fcu, 9, 9, 0.25, True)
        fgrads = torch.ops.cute.flash_attn_varlen_bwd(fo, fq, fk, fv, fo, fl, fcu, fcu, 9, 9, 0.25, True)
    for fake, real in zip((fout, flse, *fgrads), (out, lse, *grads)):
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.cute.flash_attn_varlen_fwd.default, (q, k, v, *args, 4, 0, 2.0))
    torch.library.opcheck(torch.ops.cute.flash_attn_varlen_bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *args))


def _bad(**overrides):
    lens = [3, 5]
    q, k, v = _inputs(lens, lens)
    call = dict(q=q, k=k, v=v, cu_seqlens_q=_cu(lens), cu_seqlens_k=_cu(lens), max_seqlen_q=5, max_seqlen_k=5)
    call.update(overrides)
    return call


@pytest.mark.parametrize("overrides,match", [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 8])), "cu_seqlens_q: expected dtype torch.int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 8], dtype=torch.float32)), "cu_seqlens_k: expected dtype torch.int32"),
    (dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)), "cu_seqlens_q: must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 9, 8], dtype=torch.int32)), "non-decreasing"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32)), "cu_seqlens_k: the last entry"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 5, 8], dtype=torch.int32)), "cu_seqlens_k: expected 3 entries"),
    (dict(max_seqlen_q=4), "max_seqlen_q: 4 is shorter than the longest sequence"),
    (dict(q=torch.randn(2, 8, 4, 16, dtype=torch.float64)), "q: expected"),
    (dict(k=torch.randn(8, 3, 16, dtype=torch.float64)), "kv heads"),
])
def test_named_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        tco.flash_attn_varlen_func(**_bad(**overrides))


def test_compile_does_not_recompile_for_new_packings():
    import torch._dynamo.testing

    def attend(q, k, v, cu, max_len):
        return tco.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for seed, lens in enumerate(([7, 3, 12], [1, 1, 1, 40], [33, 0, 25, 6, 9])):
        # 8 query heads: no size equals a cu_seqlens length (duck sizing would tie them)
        q, k, v = (t.requires_grad_() for t in _inputs(lens, lens, 8, 2, dtype=torch.float32, seed=seed))
        cu = _cu(lens)
        out = compiled(q, k, v, cu, max(lens))
        torch.testing.assert_close(out, attend(q, k, v, cu, max(lens)))
        out.sum().backward()
        assert q.grad is not None and not q.grad.isnan().any()
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[-1] == frames[0], f"compiled frames after each packing: {frames}"
