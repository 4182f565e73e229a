"""transformers' sparse-MoE blocks on the grouped GEMM (``use_cute_experts``): the converted block
gives the original's output and gradients (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral,
gpt-oss with its clamped SwiGLU and biases), in float32 on the CPU reference path."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch_cute_ops.integrations.moe import route, use_cute_experts  # noqa: E402


def _config(kind):
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                                           norm_topk_prob=True)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, moe_intermediate_size=48, shared_expert_intermediate_size=32,
                                           num_experts=8, num_experts_per_tok=2)
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=6, num_experts_per_tok=2)
    return transformers.GptOssConfig(**common, num_local_experts=8, num_experts_per_tok=2, head_dim=16)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def test_converted_blocks_match_the_original(kind):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind)).float().train()
    if kind == "gpt_oss":  # its expert parameters start uninitialized
        for name, p in model.named_parameters():
            if "experts" in name:
                torch.nn.init.normal_(p, std=0.05)
    block = [m for m in model.modules() if type(m).__name__ in ("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock",
                                                               "MixtralSparseMoeBlock", "GptOssMLP")][0]
    x = torch.randn(3, 11, 64, requires_grad=True)
    want = block(x)
    want_out = want[0] if isinstance(want, tuple) else want
    dy = torch.randn_like(want_out)
    want_dx, = torch.autograd.grad(want_out, x, dy)
    assert use_cute_experts(model) == 1
    got = block(x)
    got_out = got[0] if isinstance(got, tuple) else got
    got_dx, = torch.autograd.grad(got_out, x, dy)
    torch.testing.assert_close(got_out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-4, atol=1e-5)
    if isinstance(want, tuple):
        torch.testing.assert_close(got[1], want[1])


def test_route_sorts_pairs_by_expert_and_counts_every_group():
    expert_idx = torch.tensor([[2, 0], [2, 1], [0, 2], [4, 2]])
    tokens, pairs, offs = route(torch.empty(4, 8), expert_idx, 6)
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 3, 7, 7, 8, 8]
    assert expert_idx.reshape(-1)[pairs].tolist() == [0, 0, 1, 2, 2, 2, 2, 4]
    assert tokens.tolist() == [0, 2, 1, 0, 1, 2, 3, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_converted_blocks_run_on_the_grouped_kernels_without_a_sync(kind):
    """bf16 on the GPU: the converted block matches the original in bf16 (the same routing: a
    float32 original may pick other experts for near ties), takes no fallback, and its forward
    never synchronizes with the host."""
    import torch_cute_ops as tco

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind)).float().train()
    for name, p in model.named_parameters():
        if "experts" in name:
            torch.nn.init.normal_(p, std=0.05)
    block = [m for m in model.modules() if type(m).__name__ in ("Qwen3MoeSparseMoeBlock", "GptOssMLP")][0].cuda()
    block.bfloat16()
    xb = torch.randn(4, 131, 64, device="cuda", dtype=torch.bfloat16)
    want = block(xb)
    want_out = (want[0] if isinstance(want, tuple) else want).float()
    assert use_cute_experts(block) == 1
    xb.requires_grad_()
    tco.ops.fallback.reset()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = block(xb)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got_out = got[0] if isinstance(got, tuple) else got
    got_out.float().square().sum().backward()
    assert tco.fallback_counts() == {}
    assert torch.isfinite(xb.grad).all()
    err = (got_out.float() - want_out).norm() / want_out.norm()
    assert err < 2e-2, err
