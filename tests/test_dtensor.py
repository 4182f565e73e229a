"""DTensor sharding rules of the cute ops (torch_cute_ops.distributed), on the CPU: two gloo
ranks spawned locally, the reference path doing the math. Each sharded call must give the
unsharded op's result, with the expected output placements and no collective inside the op
(DTensor found a rule that takes the inputs as placed), forward and backward."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def _spawn(worker) -> None:
    """Two ranks meeting through a fresh file store (no TCP port to race for)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, f"file://{os.path.join(tmp, 'store')}"), nprocs=2, join=True)


def _init(rank: int, world: int, store: str) -> None:
    # one intra-op thread per rank: two ranks on a 2-core runner otherwise oversubscribe it, and
    # the OpenMP pool beside gloo's threads is the likeliest source of a rare heap corruption seen
    # once in a rank ("malloc(): unaligned tcache chunk detected")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)


def _finish() -> None:
    """A worker whose checks passed leaves without the interpreter's teardown: gloo's threads
    sometimes abort it at exit ("terminate called without an active exception") after all the
    work is done. A failed check raises before this and is reported by mp.spawn."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _check(name, sharded_call, full_call, expected, inputs=(), full_inputs=()):
    """Run ``sharded_call`` under CommDebugMode: no collective, ``expected`` placements, the
    unsharded values; with ``inputs``, gradients of sum(out * w) match too."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        out = sharded_call()
    outs = out if isinstance(out, tuple) else (out,)
    assert comm.get_total_counts() == 0, f"{name}: collectives inside the op: {comm.get_comm_counts()}"
    for o, placement in zip(outs, expected):
        assert tuple(o.placements) == (placement,), f"{name}: placements {o.placements}, expected {placement}"
    full = full_call()
    fulls = full if isinstance(full, tuple) else (full,)
    for o, f in zip(outs, fulls):
        torch.testing.assert_close(o.full_tensor(), f, msg=lambda m: f"{name}: {m}")
    if inputs:
        weight = torch.randn(fulls[0].shape, dtype=fulls[0].dtype)
        grads = torch.autograd.grad((outs[0].full_tensor() * weight).sum(), inputs)
        ref = torch.autograd.grad((fulls[0] * weight).sum(), full_inputs)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g.full_tensor(), r, msg=lambda m: f"{name} (grad): {m}")


def _worker(rank: int, world: int, store: str) -> None:
    _init(rank, world, store)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

        import torch_cute_ops as tco
        import torch_cute_ops.distributed  # noqa: F401  (registers the rules)

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)  # the same full tensors on every rank
        dt = lambda t, p, grad=False: distribute_tensor(t, mesh, [p]).requires_grad_(grad)  # noqa: E731

        # gemm: rows, column-parallel (with bias and activation), row-parallel (partial), batch
        a, b, bias = torch.randn(8, 6, dtype=torch.float64), torch.randn(6, 10, dtype=torch.float64), \
            torch.randn(10, dtype=torch.float64)
        fa, fb = a.clone().requires_grad_(), b.clone().requires_grad_()
        da, db = dt(a, Shard(0), True), dt(b, Replicate(), True)
        _check("gemm rows", lambda: tco.gemm(da, db), lambda: tco.gemm(fa, fb), [Shard(0)], (da, db), (fa, fb))
        columns = (dt(a, Replicate()), dt(b, Shard(1)), dt(bias, Shard(0)))
        _check("gemm columns", lambda: tco.gemm(*columns, "gelu_tanh"), lambda: tco.gemm(a, b, bias, "gelu_tanh"),
               [Shard(1)])
        contraction = (dt(a, Shard(1)), dt(b, Shard(0)))
        _check("gemm contraction", lambda: tco.gemm(*contraction), lambda: tco.gemm(a, b), [Partial()])
        la, lb = torch.randn(4, 8, 6, dtype=torch.float64), torch.randn(4, 6, 10, dtype=torch.float64)
        batched = (dt(la, Shard(0)), dt(lb, Shard(0)))
        _check("gemm batch", lambda: tco.gemm(*batched), lambda: tco.gemm(la, lb), [Shard(0)])

        # scaled_gemm (FP8): rows with their rowwise scales, columns, contraction; shards made
        # locally (DTensor.from_local: FP8 is not sent over gloo)
        from torch.distributed.tensor import DTensor

        from torch_cute_ops import fp8

        (qa, sa), (qb, sb) = fp8.quantize_rowwise(torch.randn(8, 128)), fp8.quantize_rowwise(
            torch.randn(128, 10), operand="b")
        local = lambda t, p, dim=0: DTensor.from_local(  # noqa: E731
            t.chunk(world, dim)[rank] if isinstance(p, Shard) else t, mesh, [p], run_check=False)
        full = tco.scaled_mm(qa, qb, sa, sb, out_dtype=torch.float32)
        rows = (local(qa, Shard(0)), local(qb, Replicate()), local(sa, Shard(0)), local(sb, Replicate()))
        _check("scaled_gemm rows", lambda: tco.scaled_mm(*rows, out_dtype=torch.float32), lambda: full, [Shard(0)])
        cols = (local(qa, Replicate()), local(qb, Shard(1), 1), local(sa, Replicate()), local(sb, Shard(1), 1))
        _check("scaled_gemm columns", lambda: tco.scaled_mm(*cols, out_dtype=torch.float32), lambda: full,
               [Shard(1)])
        contraction = (local(qa, Shard(1), 1), local(qb, Shard(0)), local(sa, Replicate()), local(sb, Replicate()))
        _check("scaled_gemm contraction", lambda: tco.scaled_mm(*contraction, out_dtype=torch.float32),
               lambda: full, [Partial()])

        # attention (B, S, H, D), GQA 4/2: batch and heads, forward and backward
        q = torch.randn(2, 9, 4, 8, dtype=torch.float64)
        k, v = torch.randn(2, 11, 2, 8, dtype=torch.float64), torch.randn(2, 11, 2, 8, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        for name, dim, lse_dim in (("batch", 0, 0), ("heads", 2, 1)):
            sharded = [dt(t, Shard(dim), True) for t in (q, k, v)]
            _check(f"attention {name}",
                   lambda: tco.flash_attn_func(*sharded, causal=True, window_size=(3, 0), return_lse=True),
                   lambda: tco.flash_attn_func(*full, causal=True, window_size=(3, 0), return_lse=True),
                   [Shard(dim), Shard(lse_dim)], tuple(sharded), tuple(full))
        # a padded batch's key ranges follow the batch
        start, end = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([11, 9], dtype=torch.int32)
        by_batch = [dt(t, Shard(0)) for t in (q, k, v, start, end)]
        _check("attention key ranges",
               lambda: tco.flash_attn_func(*by_batch[:3], key_start=by_batch[3], key_end=by_batch[4]),
               lambda: tco.flash_attn_func(q, k, v, key_start=start, key_end=end), [Shard(0)])
        # SDPA's attn_mask: per batch entry (sharded with the batch), broadcast over heads
        mask = torch.rand(2, 1, 9, 11) > 0.3
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        for name, dim, mask_placement in (("batch", 0, Shard(0)), ("heads", 1, Replicate())):
            sharded = [dt(t, Shard(dim), True) for t in (qt, kt, vt)]
            fulls = [t.clone().requires_grad_() for t in (qt, kt, vt)]
            dmask = dt(mask, mask_placement)
            _check(f"sdpa mask {name}",
                   lambda: tco.scaled_dot_product_attention(*sharded, attn_mask=dmask, enable_gqa=True),
                   lambda: tco.scaled_dot_product_attention(*fulls, attn_mask=mask, enable_gqa=True),
                   [Shard(dim)], tuple(sharded), tuple(fulls))

        # varlen: heads
        cu = torch.tensor([0, 4, 4, 13], dtype=torch.int32)
        pq, pk, pv = (torch.randn(13, h, 8, dtype=torch.float64) for h in (4, 2, 2))
        full = [t.clone().requires_grad_() for t in (pq, pk, pv)]
        sharded = [dt(t, Shard(1), True) for t in (pq, pk, pv)]
        dcu = dt(cu, Replicate())
        _check("varlen heads",
               lambda: tco.flash_attn_varlen_func(*sharded, dcu, dcu, 9, 9, causal=True, return_lse=True),
               lambda: tco.flash_attn_varlen_func(*full, cu, cu, 9, 9, causal=True, return_lse=True),
               [Shard(1), Shard(0)], tuple(sharded), tuple(full))

        # kv cache (a decode step): heads-sharded caches (tensor parallel), then batch-sharded
        # ones, appended in place on each rank's shard without a collective
        kq = torch.randn(2, 3, 4, 8, dtype=torch.float64)
        caches = [torch.randn(2, 16, 2, 8, dtype=torch.float64) for _ in range(2)]
        new_kv = [torch.randn(2, 3, 2, 8, dtype=torch.float64) for _ in range(2)]
        seqlens = torch.tensor([5, 11], dtype=torch.int32)

        def decode(q, k_cache, v_cache, k, v, cache_seqlens):
            return torch.ops.cute.flash_attn_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, None, None,
                                                     8 ** -0.5, True)

        for name, dim, lse_dim in (("heads", 2, 1), ("batch", 0, 0)):
            full_caches = [c.clone() for c in caches]
            sharded_caches = [dt(c, Shard(dim)) for c in caches]
            sharded = [dt(kq, Shard(dim)), *sharded_caches, *(dt(t, Shard(dim)) for t in new_kv),
                       dt(seqlens, Shard(0) if dim == 0 else Replicate())]
            _check(f"kvcache {name}", lambda: decode(*sharded), lambda: decode(kq, *full_caches, *new_kv, seqlens),
                   [Shard(dim), Shard(lse_dim)])
            for sharded_cache, full_cache in zip(sharded_caches, full_caches):
                assert not torch.equal(full_cache, caches[0]) and not torch.equal(full_cache, caches[1])
                torch.testing.assert_close(sharded_cache.full_tensor(), full_cache,
                                           msg=lambda m: f"kvcache {name} (cache after the append): {m}")
        # a cache placed another way is refused, not moved (the append would land in a copy)
        misplaced = [dt(c, Shard(1)) for c in caches]
        before = [c.to_local().clone() for c in misplaced]
        with pytest.raises(Exception, match=r"k_cache, v_cache: flash_attn_kvcache appends into its caches in place"):
            decode(dt(kq, Replicate()), *misplaced, *(dt(t, Replicate()) for t in new_kv), dt(seqlens, Replicate()))
        for cache, local in zip(misplaced, before):
            assert torch.equal(cache.to_local(), local)
    except BaseException:
        dist.destroy_process_group()
        raise
    _finish()


def test_sharding_rules_keep_inputs_in_place_and_match_the_unsharded_ops():
    _spawn(_worker)


def _twin_decoders():
    """An unsharded reference decoder and a copy to shard, float64, the same weights on every rank."""
    from torch_cute_ops.testing import RecipeDecoder

    torch.manual_seed(0)
    reference = RecipeDecoder().double()
    model = RecipeDecoder().double()
    model.load_state_dict(reference.state_dict())
    return reference, model


def _tp_worker(rank: int, world: int, store: str) -> None:
    _init(rank, world, store)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        import torch_cute_ops as tco
        import torch_cute_ops.distributed  # noqa: F401

        reference, model = _twin_decoders()
        from torch_cute_ops.testing import tensor_parallel_plan

        parallelize_module(model, init_device_mesh("cpu", (world,)), tensor_parallel_plan(2))
        ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
        tco.ops.fallback.reset()
        for step_model in (reference, model):
            logits = step_model(ids)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
            loss.backward()
            step_model.loss = loss.detach()
        torch.testing.assert_close(model.loss, reference.loss)
        for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, r.grad, msg=lambda m: f"{name}: {m}")
        assert not tco.fallback_counts(), tco.fallback_counts()
    except BaseException:
        dist.destroy_process_group()
        raise
    _finish()


def test_tensor_parallel_recipe_matches_one_process():
    """The tensor-parallel plan of docs/integrations.md over the recipe decoder: the same loss and gradients as the
    unsharded model, with every projection and attention on the cute ops."""
    _spawn(_tp_worker)


def _fsdp_worker(rank: int, world: int, store: str) -> None:
    _init(rank, world, store)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import torch_cute_ops as tco
        import torch_cute_ops.distributed  # noqa: F401

        reference, model = _twin_decoders()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1 + rank))  # per-rank data
        tco.ops.fallback.reset()
        for step_model in (reference, model):
            logits = step_model(ids)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
            mean = r.grad.clone()
            dist.all_reduce(mean)
            torch.testing.assert_close(p.grad.full_tensor(), mean / world, msg=lambda m: f"{name}: {m}")
        assert not tco.fallback_counts(), tco.fallback_counts()
    except BaseException:
        dist.destroy_process_group()
        raise
    _finish()


def test_fsdp2_recipe_averages_the_ranks_gradients():
    """fully_shard over the recipe decoder (each rank its own batch): the gradients are the mean of
    the unsharded model's per-rank gradients."""
    _spawn(_fsdp_worker)
