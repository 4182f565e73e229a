"""attn_implementation="cute" on the GPU: small transformers models with random weights run
every attention layer on the kernels, eager and under torch.compile(fullgraph=True), with
attn_implementation="sdpa"'s loss and gradient norms; padded batches (either side) run on the
kernels too; generate() decodes (batched with left padding too); masks with holes run on the
kernels' attn_mask path. Kernels are identified by CUDA kernel name."""

import pytest
import torch

import torch_cute_ops as tco

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

from torch_cute_ops.integrations import transformers as cute_hf  # noqa: E402,F401

SMALL = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1024)


def build(kind: str, implementation: str):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    elif kind == "qwen2":  # layer 0 full attention, layer 1 a 100-token sliding window
        config = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=100, max_window_layers=1)
        model = transformers.Qwen2ForCausalLM(config)
    else:  # Gemma 2: alternating sliding / global layers, logit soft-capping
        config = transformers.Gemma2Config(**SMALL, head_dim=64, sliding_window=100, query_pre_attn_scalar=64)
        model = transformers.Gemma2ForCausalLM(config)
    model.config._attn_implementation = implementation
    return model.to("cuda", torch.bfloat16)


def ids_batch(seed=0, bsz=2, seqlen=300):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 1024, (bsz, seqlen), device="cuda", generator=gen)


def loss_and_grad_norm(forward, model, ids, mask=None):
    model.zero_grad(set_to_none=True)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    loss = forward(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    norm = torch.sqrt(sum(p.grad.float().square().sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()


def kernels_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return {family for family in ("flash_fwd", "flash_bwd") if any(family in n for n in names)}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_every_attention_layer_runs_on_the_kernels(kind, compiled):
    ids = ids_batch()
    reference = build(kind, "sdpa")
    ref_loss, ref_norm = loss_and_grad_norm(reference, reference, ids)
    model = build(kind, "cute")
    forward = torch.compile(model, fullgraph=True) if compiled else model
    torch._dynamo.reset()
    tco.ops.fallback.reset()
    loss_and_grad_norm(forward, model, ids)  # warm-up (compiles)
    result = []
    ran = kernels_run(lambda: result.append(loss_and_grad_norm(forward, model, ids)))
    (loss, norm), = result
    assert ran == {"flash_fwd", "flash_bwd"}, f"attention did not run on the kernels: {ran}"
    assert not tco.fallback_counts(), tco.fallback_counts()
    assert abs(loss - ref_loss) < 0.02 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) < 0.05 * ref_norm, (norm, ref_norm)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_runs_on_the_kernels(side, compiled):
    ids = ids_batch(1)
    mask = torch.ones_like(ids)
    if side == "right":
        mask[1, 200:] = 0
    else:
        mask[1, :100] = 0
    reference = build("llama", "sdpa")
    ref_loss, ref_norm = loss_and_grad_norm(reference, reference, ids, mask)
    model = build("llama", "cute")
    forward = torch.compile(model, fullgraph=True) if compiled else model
    torch._dynamo.reset()
    tco.ops.fallback.reset()
    loss_and_grad_norm(forward, model, ids, mask)  # warm-up (compiles)
    result = []
    ran = kernels_run(lambda: result.append(loss_and_grad_norm(forward, model, ids, mask)))
    (loss, norm), = result
    assert ran == {"flash_fwd", "flash_bwd"}, f"attention did not run on the kernels: {ran}"
    assert not tco.fallback_counts(), tco.fallback_counts()
    assert abs(loss - ref_loss) < 0.02 * abs(ref_loss) and abs(norm - ref_norm) < 0.05 * ref_norm, \
        (loss, ref_loss, norm, ref_norm)


def test_mask_with_holes_runs_on_the_kernels_attn_mask_path():
    """Two runs of real tokens (packed documents): transformers' materialized mask reaches the
    kernels' attn_mask path, forward and backward, with sdpa's loss and gradient norm."""
    ids = ids_batch(1)
    mask = torch.ones_like(ids)
    mask[1, 100:150] = 0
    reference = build("llama", "sdpa")
    ref_loss, ref_norm = loss_and_grad_norm(reference, reference, ids, mask)
    model = build("llama", "cute")
    tco.ops.fallback.reset()
    result = []
    ran = kernels_run(lambda: result.append(loss_and_grad_norm(model, model, ids, mask)))
    (loss, norm), = result
    assert abs(loss - ref_loss) < 0.02 * abs(ref_loss) and abs(norm - ref_norm) < 0.05 * ref_norm
    assert ran == {"flash_fwd", "flash_bwd"} and not tco.fallback_counts(), (ran, tco.fallback_counts())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_generate_prefills_and_decodes_on_the_kernels(kind):
    model = build(kind, "cute").eval()
    reference = build(kind, "sdpa").eval()
    ids = ids_batch(2, bsz=1, seqlen=50)
    tco.ops.fallback.reset()
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=20, do_sample=False)
        ref = reference.generate(ids, max_new_tokens=20, do_sample=False)
    assert ours.shape == ref.shape == (1, 70)
    # bf16 greedy decoding may flip a near-tie late; the prefix must agree
    assert torch.equal(ours[:, :60], ref[:, :60])
    assert not tco.fallback_counts()


def test_batched_generate_with_left_padding_runs_on_the_kernels():
    model = build("llama", "cute").eval()
    reference = build("llama", "sdpa").eval()
    ids = ids_batch(3, bsz=2, seqlen=40)
    mask = torch.ones_like(ids)
    mask[0, :15] = 0  # left padding, as generation pads
    tco.ops.fallback.reset()
    with torch.no_grad():
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        ref = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours[:, :46], ref[:, :46])
    assert not tco.fallback_counts()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_static_cache_generate_with_left_padding_runs_on_the_kernels(kind):
    """A preallocated cache (unwritten slots) and a left-padded batch: prefill and decode attend to
    each row's written, real keys on the kernels (no materialized mask), as sdpa does."""
    model = build(kind, "cute").eval()
    reference = build(kind, "sdpa").eval()
    ids = ids_batch(4, bsz=2, seqlen=40)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    tco.ops.fallback.reset()
    with torch.no_grad():
        ran = kernels_run(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                                 cache_implementation="static"))
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              cache_implementation="static")
        ref = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                 cache_implementation="static")
    assert torch.equal(ours[:, :46], ref[:, :46])
    assert ran == {"flash_fwd"} and not tco.fallback_counts(), (ran, tco.fallback_counts())
