"""Property-based fuzzing of dense attention: flash_attn_func (with its backward),
``torch.ops.cute.flash_attn_fwd`` / ``flash_attn_bwd`` directly, and scaled_dot_product_attention
(fuzz_support says what every call must do)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fuzz_support import (DEVICES, FLOAT_DTYPES, INVALID_SCALES, INVALID_WINDOWS, Case, assert_close_norm,
                          assert_matches, attention64, attention_grad_atol, attention_options, attention_tolerance,
                          differentiable, expect, fuzz_property, generator, grad_tolerance, head_dims, index_tensor,
                          layouts, lse_tolerance, make, masked_softmax64, max_score, op_bound, scale_of, seeds, seqlens,
                          strict_mode)
from hypothesis import strategies as st

import torch_cute_ops as tco
from torch_cute_ops.ops import fallback

NOT_FLOAT = (torch.int32, torch.bool, torch.complex64)
DENSE_MUTATIONS = ["q rank", "kv batch", "k head_dim", "v head_dim", "v seqlen", "heads", "head_dim 0",
                   "head_dim big", "dtype", "k dtype", "k device", "key range one", "key range dtype",
                   "key range shape"]


def key_range(draw, batch: int, s_k: int, device):
    """Valid key_start/key_end (0 <= start <= end <= S_k), maybe strided views; invalid values are
    tests/test_fuzz_cached_checks.py's."""
    ends = [draw(st.integers(0, s_k)) for _ in range(batch)]
    starts = [draw(st.integers(0, end)) for end in ends]
    return index_tensor(starts, device, draw(st.booleans())), index_tensor(ends, device, draw(st.booleans()))


def attn_mask(draw, gen, shape, dtype, device):
    """PyTorch's mask, broadcastable to ``shape`` (B, H, S_q, S_k): bool or additive in ``dtype``."""
    dims = [n if draw(st.booleans()) else 1 for n in shape][4 - draw(st.integers(0, 4)):]
    if draw(st.booleans()):
        return (torch.rand(dims, generator=gen) < 0.7).to(device)
    return make(dims, dtype, device, gen)


@st.composite
def dense_cases(draw, device, public: bool):
    gen = generator(draw(seeds()))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    b, s_q, s_k = draw(st.integers(0, 2)), draw(seqlens(device)), draw(seqlens(device))
    h_kv, group, d = draw(st.integers(1, 2)), draw(st.integers(0, 3)), draw(head_dims(device))
    q_shape, k_shape, v_shape = [b, s_q, h_kv * group, d], [b, s_k, h_kv, d], [b, s_k, h_kv, d]
    q_dtype = k_dtype = dtype
    k_device = device
    options = draw(attention_options(public))
    ranges = key_range(draw, b, s_k, device) if draw(st.booleans()) else (None, None)
    mask = None
    if not public and draw(st.booleans()):
        mask = attn_mask(draw, gen, (b, h_kv * group, s_q, s_k), dtype, device)
    mutations = DENSE_MUTATIONS + (["window", "softmax_scale"] if public else ["attn_mask shape", "attn_mask dtype"])
    mutation = draw(st.sampled_from(mutations)) if draw(st.booleans()) else None
    error, extra = None, {}
    if mutation == "q rank":
        q_shape, error = [b * s_q, h_kv * group, d], ("q",)
    elif mutation == "kv batch":
        k_shape[0] = v_shape[0] = b + 1
        error = ("k",)
    elif mutation in ("k head_dim", "v head_dim"):
        (k_shape if mutation[0] == "k" else v_shape)[3] = d + 1
        error = (mutation[0],)
    elif mutation == "v seqlen":
        v_shape[1], error = s_k + 1, ("v",)
    elif mutation == "heads":
        k_shape[2] = v_shape[2] = draw(st.sampled_from([0, 2]))
        q_shape[2] = 2 * group + 1
        error = ("k",)
    elif mutation in ("head_dim 0", "head_dim big"):
        q_shape[3] = k_shape[3] = v_shape[3] = 0 if mutation == "head_dim 0" else 264
        error = ("q",)
    elif mutation == "dtype":
        q_dtype = k_dtype = draw(st.sampled_from(NOT_FLOAT))
        error = ("q",)
    elif mutation == "k dtype":
        k_dtype, error = draw(st.sampled_from([t for t in FLOAT_DTYPES if t != dtype])), ("k",)
    elif mutation == "k device":
        k_device, error = "meta", ("k",)
    elif mutation == "key range one":
        ranges, error = (key_range(draw, b, s_k, device)[0], None), ("key_start", "key_end")
    elif mutation == "key range dtype":
        start, end = key_range(draw, b, s_k, device)
        ranges, error = (start.long(), end), ("key_start", "key_end")
    elif mutation == "key range shape":
        ranges, error = key_range(draw, b + 1, s_k, device), ("key_start", "key_end")
    elif mutation == "window":
        extra["window_size"], error = draw(st.sampled_from(INVALID_WINDOWS)), ("window_size",)
    elif mutation == "softmax_scale":
        options["softmax_scale"], _ = draw(st.sampled_from(INVALID_SCALES))
        error = ("softmax_scale",)
    elif mutation == "attn_mask shape":
        mask, error = torch.ones(s_q + 2, s_k, dtype=torch.bool, device=device), ("attn_mask",)
    elif mutation == "attn_mask dtype":
        mask_dtype = draw(st.sampled_from([torch.int32, *[t for t in FLOAT_DTYPES if t != dtype]]))
        mask, error = torch.zeros(s_q, s_k, dtype=mask_dtype, device=device), ("attn_mask",)
    q = make(q_shape, q_dtype, device, gen, draw(layouts(len(q_shape))))
    k = make(k_shape, k_dtype, k_device, gen, draw(layouts(4)))
    v = make(v_shape, k_dtype, k_device, gen, draw(layouts(4)))
    tensors = dict(q=q, k=k, v=v, key_start=ranges[0], key_end=ranges[1], attn_mask=mask)
    note = f"{mutation or 'valid'} {dtype} q{q_shape} k{k_shape} {options}"
    return Case({**tensors, **options, **extra}, error, note)


def dense_reference(kw, public: bool, leaves=None):
    q, k, v = leaves or (kw["q"], kw["k"], kw["v"])
    bound = op_bound if public else (lambda x: x)
    return attention64(q, k, v, scale_of(kw, q.shape[-1]), kw["causal"], bound(kw["left"]), bound(kw["right"]),
                       kw["softcap"], kw["key_start"], kw["key_end"], kw["attn_mask"])


def check_attention(name, kw, out, lse, ref_out, ref_lse, device):
    q, k, v, softcap = kw["q"], kw["k"], kw["v"], kw["softcap"]
    smax = max_score(q, k, scale_of(kw, q.shape[-1]), softcap)
    assert out.dtype == q.dtype and out.shape == q.shape, f"{name}: out {out.dtype} {tuple(out.shape)}"
    assert_matches(f"{name} out", out, ref_out, *attention_tolerance(q.dtype, device, v, smax, softcap))
    if lse is not None:
        assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32), f"{name}: lse dtype"
        assert_matches(f"{name} lse", lse, ref_lse, *lse_tolerance(q.dtype, device, ref_lse, smax, softcap))


def check_grads(name, kw, grads, dout, public: bool, device):
    leaves = [t.detach().to("cpu", torch.float64).requires_grad_(True) for t in (kw["q"], kw["k"], kw["v"])]
    ref, _ = dense_reference(kw, public, leaves)
    ref.backward(dout.to("cpu", torch.float64))
    atol = attention_grad_atol(kw["q"], kw["k"], kw["v"], dout, scale_of(kw, kw["q"].shape[-1]))
    for label, ours, theirs in zip("qkv", grads, leaves):
        assert_close_norm(f"{name} d{label}", ours, theirs.grad, grad_tolerance(kw["q"].dtype, device, kw["softcap"]),
                          atol)


@pytest.mark.parametrize("device", DEVICES)
@fuzz_property(60)
def test_flash_attn_func(device, data):
    case = data.draw(dense_cases(device, public=True))
    kw = case.kwargs
    grad = data.draw(st.booleans()) and differentiable(kw["q"], kw["k"], kw["v"])
    if grad:  # invalid calls too: through the dispatcher and autograd, not the direct path
        kw.update({name: kw[name].detach().requires_grad_(True) for name in "qkv"})
    window = kw.get("window_size", (kw["left"], kw["right"]))
    deterministic = data.draw(st.booleans())
    result = expect(lambda: tco.flash_attn_func(kw["q"], kw["k"], kw["v"], kw["softmax_scale"], kw["causal"], window,
                                                kw["softcap"], True, key_start=kw["key_start"],
                                                key_end=kw["key_end"], deterministic=deterministic),
                    case.error, case.note)
    if case.error:
        return
    out, lse = result
    ref_out, ref_lse = dense_reference(kw, public=True)
    check_attention(f"flash_attn_func {case.note}", kw, out, lse, ref_out, ref_lse, device)
    if grad:
        dout = torch.randn(out.shape, generator=generator(3), dtype=torch.float64).to(out)
        out.backward(dout)
        check_grads(f"flash_attn_func {case.note}", kw, [kw[n].grad for n in "qkv"], dout, True, device)


BWD_MUTATIONS = ["lse shape", "lse dtype", "dout shape", "out dtype"]


@pytest.mark.parametrize("device", DEVICES)
@fuzz_property(60)
def test_cute_flash_attn_fwd_bwd(device, data):
    """The ops called directly: any window bounds, PyTorch's attn_mask; then the backward op on
    the forward's out and lse (or a mutated one of them)."""
    case = data.draw(dense_cases(device, public=False))
    kw = case.kwargs
    args = (kw["q"], kw["k"], kw["v"], kw["softmax_scale"], kw["causal"], kw["left"], kw["right"], kw["softcap"],
            kw["key_start"], kw["key_end"], kw["attn_mask"])
    result = expect(lambda: torch.ops.cute.flash_attn_fwd(*args), case.error, case.note)
    if case.error:
        return
    out, lse = result
    ref_out, ref_lse = dense_reference(kw, public=False)
    check_attention(f"cute.flash_attn_fwd {case.note}", kw, out, lse, ref_out, ref_lse, device)
    dout = torch.randn(out.shape, generator=generator(4), dtype=torch.float64).to(out)
    mutation = data.draw(st.sampled_from(BWD_MUTATIONS)) if data.draw(st.booleans()) else None
    error = None
    if mutation == "lse shape":
        lse, error = torch.cat([lse, lse[..., :1]], dim=-1) if lse.shape[-1] else lse[..., None], ("lse",)
    elif mutation == "lse dtype":
        lse, error = lse.half(), ("lse",)
    elif mutation == "dout shape":
        dout, error = torch.cat([dout, dout[:, :1]], dim=1) if dout.shape[1] else dout[..., None], ("dout",)
    elif mutation == "out dtype":
        out, error = out.to(torch.float16 if out.dtype != torch.float16 else torch.float32), ("out",)
    grads = expect(lambda: torch.ops.cute.flash_attn_bwd(dout, *args[:3], out, lse, *args[3:],
                                                         deterministic=data.draw(st.booleans())),
                   error, f"{mutation or 'valid'} backward of {case.note}")
    if error is None:
        check_grads(f"cute.flash_attn_bwd {case.note}", kw, grads, dout, False, device)


# ------------------------------------------------------------------------------------------- SDPA

SDPA_MUTATIONS = {  # mutation -> the argument names its error may cite
    "rank": ("query", "key", "value"), "dtype": ("query",), "key dtype": ("key",), "value device": ("value",),
    "key head_dim": ("key",), "value seqlen": ("value",), "dropout": ("dropout_p",), "gqa": ("key", "value"),
    "batch": ("key", "value"), "mask dtype": ("attn_mask",), "mask shape": ("attn_mask",),
}


@st.composite
def sdpa_cases(draw, device):
    gen = generator(draw(seeds()))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    rank = draw(st.sampled_from([4, 4, 4, 3, 2]))
    b, l, s = draw(st.integers(0, 2)), draw(seqlens(device)), draw(seqlens(device))
    h_kv, group, e = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(head_dims(device))
    enable_gqa = rank >= 3 and draw(st.booleans())
    h_q = h_kv * group if enable_gqa else h_kv
    e_v = e if draw(st.integers(0, 4)) else draw(st.integers(1, 9))
    q_shape, k_shape, v_shape = [b, h_q, l, e][4 - rank:], [b, h_kv, s, e][4 - rank:], [b, h_kv, s, e_v][4 - rank:]
    is_causal = draw(st.booleans())
    mask = None
    if not is_causal and draw(st.booleans()):
        mask = sdpa_mask(draw, gen, ([b, h_q, l, s])[4 - rank:], dtype, device)
    kwargs = dict(dropout_p=0.0, is_causal=is_causal, scale=draw(st.sampled_from([None, 0.0, -0.5, 0.3, 2.0])),
                  enable_gqa=enable_gqa)
    q_dtype = k_dtype = v_dtype = dtype
    v_device = device
    mutation = draw(st.sampled_from(list(SDPA_MUTATIONS))) if draw(st.booleans()) else None
    if mutation == "rank":
        q_shape = [e]
    elif mutation == "dtype":
        q_dtype = k_dtype = v_dtype = draw(st.sampled_from([torch.int32, torch.complex64]))
    elif mutation == "key dtype":
        k_dtype = draw(st.sampled_from([t for t in FLOAT_DTYPES if t != dtype]))
    elif mutation == "value device":
        v_device = "meta"
    elif mutation == "key head_dim":
        k_shape[-1] = e + 1
    elif mutation == "value seqlen":
        v_shape[-2] = s + 1
    elif mutation == "dropout":
        kwargs["dropout_p"] = draw(st.sampled_from([-0.5, 1.5]))
    elif mutation == "gqa" and rank >= 3:
        kwargs["enable_gqa"], k_shape[-3], v_shape[-3], q_shape[-3] = True, 2, 2, 2 * group + 1
    elif mutation == "batch" and rank == 4 and b != 1:  # a batch of 1 broadcasts
        k_shape[0] = v_shape[0] = b + 2
    elif mutation == "mask dtype":
        not_allowed = [t for t in (torch.float16, torch.bfloat16, torch.float64) if t != dtype]  # nor float32
        mask = torch.zeros(l, s, dtype=draw(st.sampled_from([torch.int32, *not_allowed])), device=device)
    elif mutation == "mask shape":
        mask = torch.ones(l + 1, s + 2, dtype=torch.bool, device=device)
    elif mutation is not None:
        mutation = None  # not applicable at this rank
    kwargs["attn_mask"] = mask
    query = make(q_shape, q_dtype, device, gen, draw(layouts(len(q_shape))))
    key = make(k_shape, k_dtype, device, gen, draw(layouts(len(k_shape))))
    value = make(v_shape, v_dtype, v_device, gen, draw(layouts(len(v_shape))))
    case = Case(dict(query=query, key=key, value=value, **kwargs), SDPA_MUTATIONS.get(mutation),
                f"{mutation or 'valid'} {dtype} q{q_shape} k{k_shape} v{v_shape} gqa={enable_gqa} causal={is_causal}")
    return case, mutation


def sdpa_mask(draw, gen, shape, dtype, device):
    """Broadcastable to ``shape``: bool (each row keeps key 0, so no row is fully masked) or
    additive in float32 or the query's dtype."""
    keep = draw(st.integers(2, len(shape)))
    dims = [n if draw(st.booleans()) else 1 for n in shape][len(shape) - keep:]
    if draw(st.booleans()):
        mask = torch.rand(dims, generator=gen) < 0.7
        mask[..., :1] = True
        return mask.to(device)
    return make(dims, draw(st.sampled_from([dtype, torch.float32])), device, gen)


def sdpa64(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """PyTorch's SDPA in float64: (..., L, E) inputs, batch dims broadcast, is_causal top-left."""
    q, k, v = (t.to("cpu", torch.float64) for t in (query, key, value))
    if enable_gqa and q.dim() >= 3:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.mT * scale
    visible = None
    if is_causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = attn_mask.cpu()
        else:
            scores = scores + attn_mask.to("cpu", torch.float64)
    probs, _ = masked_softmax64(scores, visible)
    return probs @ v


@pytest.mark.parametrize("device", DEVICES)
@fuzz_property(60)
def test_scaled_dot_product_attention(device, data):
    """Strict mode or not, an invalid input gets its own named error (never a FallbackError),
    and PyTorch rejects it too; a valid one matches the float64 reference (or, in strict mode,
    is refused with a FallbackError where no kernel covers it)."""
    case, mutation = data.draw(sdpa_cases(device))
    strict = data.draw(st.booleans())
    kw = case.kwargs
    grad = not strict and data.draw(st.booleans()) and differentiable(kw["query"], kw["key"], kw["value"])
    if grad:
        kw.update({name: kw[name].detach().requires_grad_(True) for name in ("query", "key", "value")})
    fallback.reset()
    try:
        with strict_mode(strict):
            out = expect(lambda: tco.scaled_dot_product_attention(**kw), case.error, case.note)
    except AssertionError as e:
        if not (strict and case.error is None and isinstance(e.__cause__, tco.FallbackError)):
            raise
        return
    if case.error:
        assert not fallback.counts(), f"an invalid input was counted as a fallback ({case.note})"
        # PyTorch's CPU kernel reads past a shorter value unchecked, its math path takes a negative
        # dropout_p, and it checks nothing of empty tensors
        tensors = (kw["query"], kw["key"], kw["value"])
        if mutation != "value seqlen" and kw["dropout_p"] >= 0 and all(t.numel() for t in tensors):
            with pytest.raises(Exception):
                F.scaled_dot_product_attention(**kw)
        return
    q, k, v = kw["query"], kw["key"], kw["value"]
    ref = sdpa64(q, k, v, kw["attn_mask"], kw["is_causal"], kw["scale"], kw["enable_gqa"])
    assert out.dtype == q.dtype, case.note
    scale = kw["scale"] if kw["scale"] is not None else (q.shape[-1] ** -0.5 if q.shape[-1] else 0.0)
    smax = max_score(q, k, scale)
    if kw["attn_mask"] is not None and kw["attn_mask"].dtype != torch.bool:
        smax += kw["attn_mask"].abs().max().item() if kw["attn_mask"].numel() else 0.0
    assert_matches(f"sdpa {case.note}", out, ref, *attention_tolerance(q.dtype, device, v, smax))
    if grad:
        dout = torch.randn(out.shape, generator=generator(6), dtype=torch.float64).to(out)
        out.backward(dout)
        leaves = [t.detach().to("cpu", torch.float64).requires_grad_(True) for t in (q, k, v)]
        sdpa64(*leaves, kw["attn_mask"], kw["is_causal"], kw["scale"], kw["enable_gqa"]).backward(dout.double().cpu())
        atol = attention_grad_atol(q, k, v, dout, scale)
        for name, ours, theirs in zip(("query", "key", "value"), (q, k, v), leaves):
            assert_close_norm(f"sdpa d{name} {case.note}", ours.grad, theirs.grad, grad_tolerance(q.dtype, device),
                              atol)
