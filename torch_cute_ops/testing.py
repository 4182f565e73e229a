"""Small models for the tests and benchmarks that need one; not part of the op API.

:class:`RecipeDecoder` is the distributed recipe model of docs/integrations.md: pre-norm blocks, GQA attention
through :func:`torch_cute_ops.scaled_dot_product_attention`, a GELU MLP, every projection a
:class:`CuteLinear` without bias (tensor-parallel styles accept ``nn.Linear`` subclasses);
:func:`tensor_parallel_plan` shards it column-/row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PROJECTIONS = ("q", "k", "v", "o", "up", "down")


class CuteLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`torch_cute_ops.linear`."""

    def forward(self, x):
        from . import linear

        return linear(x, self.weight, self.bias)


class DecoderBlock(nn.Module):
    """Pre-norm attention (GQA, causal) and GELU MLP; ``fully_shard`` takes it as a unit."""

    def __init__(self, dim: int, heads: int, kv_heads: int, mlp_ratio: int = 2):
        super().__init__()
        self.head_dim = dim // heads
        kv_dim = kv_heads * self.head_dim
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.o = CuteLinear(dim, dim, bias=False), CuteLinear(dim, dim, bias=False)
        self.k, self.v = CuteLinear(dim, kv_dim, bias=False), CuteLinear(dim, kv_dim, bias=False)
        self.up = CuteLinear(dim, mlp_ratio * dim, bias=False)
        self.down = CuteLinear(mlp_ratio * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from . import scaled_dot_product_attention

        b, s, _ = x.shape
        h = self.norm1(x)
        # -1 heads: under tensor parallelism each rank holds its share of the heads
        q, k, v = (proj(h).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class RecipeDecoder(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                 mlp_ratio: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderBlock(dim, heads, kv_heads, mlp_ratio) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy in fp32."""
        logits = self(ids)[:, :-1].float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def tensor_parallel_plan(num_layers: int) -> dict:
    """Column-parallel q/k/v and MLP-in, row-parallel out and MLP-out: attention runs on each rank's
    heads (whole GQA groups when both head counts divide by the TP size)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {f"layers.{i}.{name}": ColwiseParallel() if name in ("q", "k", "v", "up") else RowwiseParallel()
            for i in range(num_layers) for name in PROJECTIONS}
