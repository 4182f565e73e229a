"""A real model, unchanged, routed through the kernels: a small Llama from a `transformers` config
with random weights gives PyTorch SDPA's loss and gradients, eager and compiled, and trains along
the same loss curve."""

import contextlib
import copy

import pytest
import torch

import torch_cute_ops as tco

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def tiny_llama(seed=0):
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=1024, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def batch(step, bsz=4, seqlen=256):
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    return torch.randint(0, 1024, (bsz, seqlen), device="cuda", generator=gen)


def loss_and_grad_norm(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.sqrt(sum(p.grad.float().square().sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()


@pytest.mark.parametrize("compiled", [False, True])
def test_llama_loss_and_gradients_match_pytorch_sdpa(compiled):
    model = tiny_llama()
    run = torch.compile(model) if compiled else model
    ids = batch(0)
    ref_loss, ref_norm = loss_and_grad_norm(run, ids)
    torch._dynamo.reset()
    tco.ops.fallback.reset()
    with tco.sdpa_override():
        loss, norm = loss_and_grad_norm(torch.compile(model) if compiled else model, ids)
    assert not [k for k in tco.fallback_counts() if k[0] == "scaled_dot_product_attention"], \
        f"the model's attention did not reach the kernels: {tco.fallback_counts()}"
    assert abs(loss - ref_loss) < 0.02 * abs(ref_loss)
    assert abs(norm - ref_norm) < 0.05 * ref_norm


def train(model, steps, override):
    """Fit two fixed batches (random tokens carry nothing else to learn), compiled, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_fn = torch.compile(model)
    losses = []
    with tco.sdpa_override() if override else contextlib.nullcontext():
        for step in range(steps):
            ids = batch(step % 2)
            loss = step_fn(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses


def test_training_tracks_pytorch_sdpa_loss_curve():
    base = tiny_llama()
    torch._dynamo.reset()
    ref = train(copy.deepcopy(base), 50, override=False)
    torch._dynamo.reset()
    ours = train(copy.deepcopy(base), 50, override=True)
    assert ref[-1] < ref[0] - 1.0 and ours[-1] < ours[0] - 1.0, f"did not train: {ours[::10]}"
    worst = max(abs(a - b) - 0.03 * b for a, b in zip(ours, ref))
    assert worst < 0.05, f"loss curves diverge: {ours[::10]} vs {ref[::10]}"
