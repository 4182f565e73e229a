"""Mixture-of-experts layers on the grouped GEMM: ``use_cute_experts(model)``.

    from torch_cute_ops.integrations.moe import use_cute_experts
    use_cute_experts(model)   # Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss blocks, in place

transformers runs a sparse block's experts one at a time (a Python loop over the experts that
received tokens, a host sync to find them) or, for gpt-oss at inference, every expert on every
token. Here a block runs as a routed pair of grouped GEMMs, whatever the number of experts:

1. the router as the model defines it (softmax, top-k, the model's renormalization);
2. the (token, expert) pairs sorted by expert (a stable sort on the device), each expert's row
   count scattered into a histogram and summed into the int32 group ends ``offs``: no host sync;
3. ``grouped_mm(x[sorted tokens], gate_up, offs, activation=...)``: the gate and up projections
   with the gated activation fused in its epilogue, then ``grouped_mm(h, down, offs)``;
4. each row scaled by its routing weight and added back to its token (``index_add_``).

Every step is differentiable, so training and ``generate()`` take the same path, eagerly and under
``torch.compile`` (the sort and the histogram are traceable; no size depends on values).

The per-expert ``nn.Linear`` weights of Qwen3-MoE / Mixtral blocks are stacked once into two
parameters, ``gate_up_weight`` (E, 2I, H) ``[gate | up]`` and ``down_weight`` (E, H, I), which
replace the block's ``experts`` list (the state dict changes accordingly: convert after loading a
checkpoint). gpt-oss already stores its experts stacked (interleaved gate/up columns, biases, the
clamped SwiGLU): its parameters are used as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional


def route(x: torch.Tensor, expert_idx: torch.Tensor, num_experts: int):
    """Sort the (token, expert) pairs of ``expert_idx`` (tokens, top_k) by expert.

    Returns (token of each sorted row, the sorted rows' flat pair index, int32 group ends)."""
    flat = expert_idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return order // expert_idx.shape[-1], order, offs


def routed_experts(x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, *, activation: str = "swiglu", gate_up_layout: str = "concat",
                   gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                   alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{expert_idx[t, k]}(x[t])`` for (tokens, H) ``x``.

    ``gate_up`` (E, H, 2I) and ``down`` (E, I, H) as ``grouped_mm``'s 3-D operand (a transposed
    view of stacked (E, 2I, H) / (E, H, I) weights is fine); optional per-expert biases (E, 2I)
    and (E, H); ``activation`` "swiglu" (silu(gate) * up) or "swiglu_oai" (gpt-oss's clamped
    form with ``alpha`` and ``limit``)."""
    tokens, sorted_pairs, offs = route(x, expert_idx, gate_up.shape[0])
    rows = x.index_select(0, tokens)
    if gate_up_bias is None:
        h = functional.grouped_mm(rows, gate_up, offs=offs, activation=activation, gate_up_layout=gate_up_layout,
                                  alpha=alpha, limit=limit)
    else:  # a per-expert bias before the activation: the plain product, then the bias and activation
        expert_of_row = expert_idx.reshape(-1).index_select(0, sorted_pairs)
        pre = functional.grouped_mm(rows, gate_up, offs=offs) + gate_up_bias.index_select(0, expert_of_row)
        h = gated_activation(pre, activation, gate_up_layout, alpha, limit)
    y = functional.grouped_mm(h, down, offs=offs)
    if down_bias is not None:
        y = y + down_bias.index_select(0, expert_idx.reshape(-1).index_select(0, sorted_pairs))
    y = y * weights.reshape(-1).index_select(0, sorted_pairs).unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def gated_activation(pre: torch.Tensor, activation: str, layout: str, alpha: float, limit: float) -> torch.Tensor:
    """The gated activation of (rows, 2I) gate/up columns, in plain PyTorch (the reference)."""
    if layout == "concat":
        gate, up = pre.chunk(2, dim=-1)
    else:
        gate, up = pre[..., ::2], pre[..., 1::2]
    if activation == "swiglu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class StackedExperts(nn.Module):
    """A Qwen3-MoE / Mixtral expert list as two stacked parameters (see the module docstring)."""

    def __init__(self, experts: nn.ModuleList, names: tuple[str, str, str]):
        super().__init__()
        gate, up, down = names
        with torch.no_grad():
            self.gate_up_weight = nn.Parameter(torch.stack(
                [torch.cat([getattr(e, gate).weight, getattr(e, up).weight]) for e in experts]))
            self.down_weight = nn.Parameter(torch.stack([getattr(e, down).weight for e in experts]))

    def forward(self, x, expert_idx, weights):
        return routed_experts(x, expert_idx, weights, self.gate_up_weight.transpose(-2, -1),
                              self.down_weight.transpose(-2, -1))


# block class name -> (the expert list's projection names, whether it renormalizes the top-k weights)
_LIST_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": (("gate_proj", "up_proj", "down_proj"), "norm_topk_prob"),
    "Qwen2MoeSparseMoeBlock": (("gate_proj", "up_proj", "down_proj"), "norm_topk_prob"),
    "MixtralSparseMoeBlock": (("w1", "w3", "w2"), True),
}


def _list_block_forward(block):
    def forward(hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        router_logits = block.gate(x)
        probs = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, expert_idx = torch.topk(probs, block.top_k, dim=-1)
        if block._cute_renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = block.experts(x, expert_idx, weights.to(x.dtype))
        if hasattr(block, "shared_expert"):  # Qwen2-MoE's always-on expert
            out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        return out.reshape(shape), router_logits
    return forward


def _gpt_oss_experts_forward(experts):
    def forward(hidden_states, router_indices=None, routing_weights=None):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, experts.hidden_size)
        weights = routing_weights.gather(1, router_indices)  # the router's dense (tokens, E) scores
        out = routed_experts(x, router_indices, weights, experts.gate_up_proj, experts.down_proj,
                             activation="swiglu_oai", gate_up_layout="interleaved",
                             gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias,
                             alpha=experts.alpha, limit=experts.limit)
        return out.view(shape)
    return forward


def use_cute_experts(model: nn.Module) -> int:
    """Run every supported sparse-MoE block of ``model`` on the grouped GEMM, in place.

    Returns how many blocks were converted (0: the model has none this knows). Qwen3-MoE,
    Qwen2-MoE and Mixtral blocks get :class:`StackedExperts`; gpt-oss experts keep their
    parameters. Convert after loading weights and before ``torch.compile``."""
    converted = 0
    for module in list(model.modules()):
        kind = type(module).__name__
        if kind in _LIST_BLOCKS and isinstance(getattr(module, "experts", None), nn.ModuleList):
            names, renormalize = _LIST_BLOCKS[kind]
            module._cute_renormalize = renormalize if isinstance(renormalize, bool) else getattr(module, renormalize)
            module.experts = StackedExperts(module.experts, names)
            module.forward = _list_block_forward(module)
            converted += 1
        elif kind == "GptOssExperts":
            module.forward = _gpt_oss_experts_forward(module)
            converted += 1
    return converted
