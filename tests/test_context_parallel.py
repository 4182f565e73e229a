"""Context parallelism on the CPU: two gloo ranks split one sequence (each a head and a tail
chunk), attend with torch_cute_ops.distributed.context_parallel_attention, and must match the
unsplit flash_attn_func forward and backward."""

import pytest
import torch
import torch.distributed as dist

from test_dtensor import _finish, _init, _spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def _worker(rank: int, world: int, store: str) -> None:
    _init(rank, world, store)
    import torch_cute_ops as tco
    from torch_cute_ops.distributed import context_parallel_attention, shard_sequence, unshard_sequence

    for causal in (True, False):
        torch.manual_seed(0)  # every rank draws the same full tensors
        q, k, v = (torch.randn(2, 24, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
        k2, v2 = k[:, :, :2].detach().requires_grad_(), v[:, :, :2].detach().requires_grad_()  # GQA
        dout = torch.randn(2, 24, 4, 16, dtype=torch.float64)
        full = tco.flash_attn_func(q, k2, v2, causal=causal)
        grads = torch.autograd.grad(full, (q, k2, v2), dout)
        local = [shard_sequence(t.detach(), None).requires_grad_() for t in (q, k2, v2)]
        out = context_parallel_attention(*local, causal=causal)
        torch.testing.assert_close(unshard_sequence(out.detach()), full.detach())
        local_grads = torch.autograd.grad(out, local, shard_sequence(dout))
        for got, want in zip(local_grads, grads):
            torch.testing.assert_close(got, shard_sequence(want))
    _finish()


def test_context_parallel_attention_matches_the_unsplit_op():
    _spawn(_worker)
