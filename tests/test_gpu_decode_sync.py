"""Eager decoding never waits for the GPU: after warm-up, decode-step attention calls and the
transformers integration's decode steps run under ``torch.cuda.set_sync_debug_mode("error")``
(any host synchronization raises), against caches that grow by a key a step, with padded
batches, and with bad index values caught on the device instead of read back."""

import contextlib

import pytest
import torch

import torch_cute_ops as tco

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _reference(q, k, v, start, end):
    """float64 attention of one query token per entry over keys [start, end), GQA."""
    group = q.shape[2] // k.shape[2]
    outs = []
    for b in range(q.shape[0]):
        keys = k[b, start[b]:end[b]].double().repeat_interleave(group, 1)
        values = v[b, start[b]:end[b]].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[b].double(), keys) / q.shape[-1] ** 0.5
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.stack(outs)


def test_decode_calls_against_a_growing_cache_never_sync():
    torch.manual_seed(0)
    batch, heads, kv_heads, dim = 3, 32, 8, 128
    storage = torch.randn(batch, kv_heads, 700, dim, device="cuda", dtype=torch.bfloat16)  # (B, H, S, D)
    q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16)
    start = torch.tensor([0, 5, 40], dtype=torch.int32, device="cuda")
    for keys in (600, 601):  # warm-up: compile, plan, the lasting buffers
        cache = storage[:, :, :keys].transpose(1, 2)
        tco.flash_attn_func(q, cache, cache, causal=True)
        tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=keys, causal=True)
        tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=start + keys - 40, cache_leftpad=start)
    outs = []
    with no_sync():
        for keys in range(602, 640):  # the cache grows by one key a call
            cache = storage[:, :, :keys].transpose(1, 2)
            end = start + keys - 40  # fresh index tensors each step: checked on the device
            outs.append((keys, tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=end, cache_leftpad=start),
                         end))
            tco.flash_attn_func(q, cache, cache, causal=True)
            tco.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=keys, causal=True)
    for keys, out, end in outs[::9]:
        cache = storage[:, :, :keys].transpose(1, 2)
        ref = _reference(q, cache, cache, start.tolist(), end.tolist())
        assert torch.isfinite(out).all()
        assert (out.double() - ref).norm() / ref.norm() < 1e-2


def test_a_length_past_the_cache_stops_the_stream_before_the_kernel_reads():
    """A device-side assertion: checked in a subprocess, since it ends the CUDA context."""
    import subprocess
    import sys
    code = ("import torch, torch_cute_ops as tco\n"
            "q = torch.randn(2, 1, 8, 128, device='cuda', dtype=torch.bfloat16)\n"
            "c = torch.randn(2, 64, 2, 128, device='cuda', dtype=torch.bfloat16)\n"
            "out = tco.flash_attn_with_kvcache(q, c, c, cache_seqlens=torch.tensor([3, 65], dtype=torch.int32,"
            " device='cuda'))\n"
            "torch.cuda.synchronize()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "assert" in (done.stderr + done.stdout).lower()


transformers = pytest.importorskip("transformers")
from torch_cute_ops.integrations import transformers as cute_hf  # noqa: E402


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


@pytest.mark.parametrize("padded", [False, True], ids=["full", "left-padded"])
def test_transformers_decode_steps_never_sync(padded):
    """The prompt's mask is read back once; then decode steps of a DynamicCache (keys growing by
    one) run attention and the mask function without a host sync, with sdpa's tokens."""
    model = _model()
    batch, prompt = 4, 37
    ids = torch.randint(0, 1024, (batch, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
        mask[3, :20] = 0
    tokens = {}
    for implementation in ("sdpa", "cute"):
        model.config._attn_implementation = implementation
        cache = transformers.DynamicCache()
        step_mask = mask
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=step_mask, past_key_values=cache, use_cache=True)
            chosen = [out.logits[:, -1].argmax(-1, keepdim=True)]
            for step in range(12):
                step_mask = torch.cat([step_mask, step_mask.new_ones(batch, 1)], dim=1)
                position = torch.tensor([prompt + step], device="cuda")
                guard = no_sync() if implementation == "cute" and step >= 2 else contextlib.nullcontext()
                with guard:
                    out = model(input_ids=chosen[-1], attention_mask=step_mask, past_key_values=cache,
                                cache_position=position, use_cache=True)
                    chosen.append(out.logits[:, -1].argmax(-1, keepdim=True))
        tokens[implementation] = torch.cat(chosen, 1)
    same = (tokens["cute"] == tokens["sdpa"]).int().cumprod(1).sum(1)
    assert same.min().item() >= 4  # bf16 greedy decoding may part late on near-ties


def test_generate_with_a_padded_batch_keeps_the_integration_sync_free():
    """Inside generate(), the integration's functions (attention and mask) never sync after the
    prompt's one read-back; generate's own stopping checks are transformers' business."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    calls = {"mask": 0}

    def guarded_attention(*args, **kwargs):
        with no_sync():
            return cute_hf.cute_attention_forward(*args, **kwargs)

    def guarded_mask(*args, **kwargs):
        calls["mask"] += 1
        guard = no_sync() if calls["mask"] > 1 else contextlib.nullcontext()  # the prompt: one read-back
        with guard:
            return cute_hf.cute_mask(*args, **kwargs)

    model = _model()
    ids = torch.randint(0, 1024, (3, 29), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    AttentionInterface.register("cute_guarded", guarded_attention)
    AttentionMaskInterface.register("cute_guarded", guarded_mask)
    model.config._attn_implementation = "cute_guarded"
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    finally:
        model.config._attn_implementation = "cute"
    assert out.shape == (3, 39)
    assert calls["mask"] >= 10
