"""Real models, unchanged, routed through the kernels by the SDPA override: a small Llama from a
`transformers` config with random weights gives PyTorch SDPA's loss and gradients (on the kernels
in eager mode; compiled, transformers passes a materialized mask, which the kernels serve too), and
a small GQA decoder trains compiled on the kernels along PyTorch's loss curve. Each test checks
by kernel name which attention kernels actually ran."""

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


def cute_kernels_run(fn) -> set[str]:
    """The attention kernels of this package that ``fn`` launched (by CUDA kernel name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return {family for family in ("flash_fwd", "flash_bwd") if any(family in n for n in names)}


def test_llama_eager_runs_on_the_kernels_with_pytorchs_loss_and_gradients():
    model = tiny_llama()
    ids = batch(0)
    ref_loss, ref_norm = loss_and_grad_norm(model, ids)
    tco.ops.fallback.reset()
    with tco.sdpa_override():
        result = []
        ran = cute_kernels_run(lambda: result.append(loss_and_grad_norm(model, ids)))
    (loss, norm), = result
    assert ran == {"flash_fwd", "flash_bwd"}, f"the model's attention did not reach the kernels: {ran}"
    assert not tco.fallback_counts()
    assert abs(loss - ref_loss) < 0.02 * abs(ref_loss)
    assert abs(norm - ref_norm) < 0.05 * ref_norm


def test_llama_compiled_runs_its_materialized_mask_on_the_kernels():
    """Under torch.compile, transformers hands SDPA an explicit causal mask (it cannot prove at
    trace time that the mask may be skipped): the kernels serve it through its block summary,
    with no fallback and PyTorch's loss and gradient norm."""
    model = tiny_llama()
    ids = batch(0)
    torch._dynamo.reset()
    ref_loss, ref_norm = loss_and_grad_norm(torch.compile(model), ids)
    torch._dynamo.reset()
    tco.ops.fallback.reset()
    with tco.sdpa_override():
        loss, norm = loss_and_grad_norm(torch.compile(model), ids)
    assert not tco.fallback_counts(), tco.fallback_counts()
    assert abs(loss - ref_loss) < 0.02 * abs(ref_loss)
    assert abs(norm - ref_norm) < 0.05 * ref_norm


class CausalLM(torch.nn.Module):
    """A small pre-norm decoder whose attention is F.scaled_dot_product_attention(is_causal=True)
    with grouped kv heads: what the override routes to the kernels, compiled or not."""

    def __init__(self, vocab=1024, dim=512, heads=8, kv_heads=2, layers=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            norm1=torch.nn.RMSNorm(dim), qkv=torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim),
            proj=torch.nn.Linear(dim, dim), norm2=torch.nn.RMSNorm(dim),
            mlp=torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim)),
        )) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        b, s, _ = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, s, -1, self.head_dim).transpose(1, 2).split(
                [self.heads, self.kv_heads, self.kv_heads], dim=1)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + blk["proj"](y.transpose(1, 2).reshape(b, s, -1))
            x = x + blk["mlp"](blk["norm2"](x))
        logits = self.head(x)[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(model, steps, override):
    """Fit two fixed batches (random tokens carry nothing else to learn), compiled, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_fn = torch.compile(model)
    losses = []
    with tco.sdpa_override() if override else contextlib.nullcontext():
        for step in range(steps):
            loss = step_fn(batch(step % 2))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses


def test_compiled_training_runs_on_the_kernels_and_tracks_pytorch_sdpa():
    torch.manual_seed(0)
    base = CausalLM().to("cuda", torch.bfloat16)
    runs = {}
    for name, override in (("ref", False), ("ref_again", False), ("ours", True)):
        torch._dynamo.reset()
        tco.ops.fallback.reset()
        ran = cute_kernels_run(lambda: runs.__setitem__(name, train(copy.deepcopy(base), 50, override)))
        assert ran == ({"flash_fwd", "flash_bwd"} if override else set()), f"{name}: kernels {ran}"
        assert not tco.fallback_counts()
    ref, ours = runs["ref"], runs["ours"]
    assert ref[-1] < ref[0] - 1.0 and ours[-1] < ours[0] - 1.0, f"did not train: {ours[::10]}"
    # bf16 training amplifies rounding: allow 3% + 0.05, or twice PyTorch's own run-to-run spread
    spread = max(abs(a - b) for a, b in zip(runs["ref_again"], ref))
    worst = max(abs(a - b) - 0.03 * b for a, b in zip(ours, ref))
    assert worst < max(0.05, 2 * spread), f"loss curves diverge: {ours[::10]} vs {ref[::10]}"
