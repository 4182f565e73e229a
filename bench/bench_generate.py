"""End to end: greedy ``generate()`` throughput of a transformers Llama with attn_implementation
"cute" vs "sdpa", prefill and decode against the KV cache, per batch size.

    python bench/bench_generate.py [--layers 16 --hidden 2048 --heads 32 --kv-heads 8 --head-dim 128
                                    --batch 1,8 --prompt 512 --new-tokens 128] [--cache static]
                                   [--rounds 3] [--profile] [--out DIR]
    python bench/bench_generate.py --tiny   # smoke test: a tiny model, fp32 on the CPU

One model with random weights (seeded), loaded twice: ``attn_implementation="sdpa"`` and "cute"
(registered by ``torch_cute_ops.integrations.transformers``), bf16 on CUDA. The prompts are
random token ids with an all-ones attention mask; no token ends a sequence early, so each row
gets exactly N new tokens. One sample is one ``model.generate(ids, max_new_tokens=N,
do_sample=False)`` timed between ``torch.cuda.synchronize`` calls: the prompt's prefill plus
N - 1 decode steps, host work included, as a user sees it; tokens/s = N x batch / that time.
Each (batch, implementation) is warmed up by one generate; the implementations alternate within
each of ``--rounds`` rounds and keep their median. The cache is transformers' dynamic cache, or
with ``--cache static`` its StaticCache (eager: transformers would compile the decoding step for
a static cache, which ``--compile`` lets it do). Also reported: how many leading generated tokens
of "cute" and "sdpa" agree (the minimum over rows; greedy bf16 decoding may part on a near-tie
late), the prompt's last logits of both (relative difference, the top-2 gap that decides a greedy
pick) and tco's fallbacks over the timed generates (``tco.fallback_counts()``). ``--profile``
adds one profiled generate per implementation: ms per token, GPU busy time per token, the host's
launch calls (a replayed CUDA graph is one ``cudaGraphLaunch``) and the operators with the most
host time.
Prints a table, writes DIR/generate.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMPLEMENTATIONS = ("sdpa", "cute")
TINY = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 512, "batch": "1,2",
        "prompt": 16, "new_tokens": 8, "rounds": 2, "device": "cpu", "dtype": "float32"}


def make_models(args) -> dict:
    """The same random-weight Llama under each attention implementation, in eval mode."""
    import transformers

    import torch_cute_ops.integrations.transformers  # noqa: F401  (registers "cute")

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        intermediate_size=max(64, int(args.hidden * 8 / 3) // 256 * 256), num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.prompt + args.new_tokens, bos_token_id=None, eos_token_id=None)
    models = {}
    torch.manual_seed(0)
    with torch.device(args.device):
        for name in IMPLEMENTATIONS:
            # a config each: the model reads its attention implementation from it at every call
            models[name] = transformers.AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=name, dtype=getattr(torch, args.dtype)).eval()
    first, *others = models.values()
    for model in others:
        model.load_state_dict(first.state_dict())
    assert [m.config._attn_implementation for m in models.values()] == list(IMPLEMENTATIONS)
    return models


def generate(model, ids: torch.Tensor, args) -> torch.Tensor:
    """Greedy decoding of ``args.new_tokens`` tokens after ``ids``; returns the new ones (B, N)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                         do_sample=False, cache_implementation="static" if args.cache == "static" else None,
                         disable_compile=not args.compile)
    assert out.shape == (ids.shape[0], ids.shape[1] + args.new_tokens), out.shape
    return out[:, ids.shape[1]:]


@torch.no_grad()
def prefill_logits_agreement(models: dict, ids: torch.Tensor) -> dict:
    """The prompt's last-position logits of "cute" against "sdpa": relative difference, how often
    the greedy pick agrees, and the median gap between sdpa's two best logits (random weights
    give near-ties, which bf16 noise flips: token agreement alone says little)."""
    logits = {name: model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
              for name, model in models.items()}
    ours, ref = logits["cute"], logits["sdpa"]
    top2 = ref.topk(2, dim=-1).values
    return {"rel_diff": ((ours - ref).norm() / ref.norm()).item(),
            "argmax_agree": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "top2_gap": (top2[:, 0] - top2[:, 1]).median().item(),
            "max_abs_diff": (ours - ref).abs().max().item()}


# launches a step makes, by the host calls' names (CUDA graphs replayed, kernels and copies)
LAUNCH_CALLS = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize")


def profile_generate(model, ids: torch.Tensor, args, name: str) -> dict:
    """One generate under torch.profiler: its wall time per new token, the host calls that launch
    work (a replayed CUDA graph is one ``cudaGraphLaunch``; kernels launched one by one show as
    kernel launches), and the operators with the most host time. Printed and returned."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(args.device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        generate(model, ids, args)
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()
    per_token_ms = (time.perf_counter() - start) * 1e3 / args.new_tokens
    events = prof.key_averages()
    launches = {e.key: e.count for e in events if any(call in e.key for call in LAUNCH_CALLS)}
    top = sorted((e for e in events if e.key.startswith("aten::") or "cute::" in e.key),
                 key=lambda e: -e.self_cpu_time_total)[:6]
    host = {e.key: round(e.self_cpu_time_total / 1e3, 2) for e in top}
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(f"  profile {name}: {per_token_ms:.2f} ms per new token (profiled), GPU busy {gpu_ms / args.new_tokens:.2f} "
          f"ms per token; launch calls {launches}; most host time (ms): {host}")
    return {"ms_per_token": per_token_ms, "gpu_ms_per_token": gpu_ms / args.new_tokens, "launch_calls": launches,
            "host_ms": host}


def leading_agreement(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Per row, how many leading tokens of a and b are equal."""
    return (a == b).int().cumprod(dim=1).sum(dim=1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--compile", action="store_true",
                        help="let transformers compile the decoding step (it does so for a static cache on CUDA)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="after the timings, profile one generate per implementation: where a step's time goes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help=f"smoke-test defaults: {TINY}")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if args.tiny:  # other defaults; options given on the command line still win
        parser.set_defaults(**TINY)
        args = parser.parse_args()
    import transformers

    import torch_cute_ops as tco

    on_cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    models = make_models(args)
    device_name = torch.cuda.get_device_name() if on_cuda else args.device
    results = {"device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
               "args": vars(args) | {"out": str(args.out)}, "rows": []}
    print(f"{device_name}: Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} "
          f"D{args.head_dim}, {args.dtype}; prompt {args.prompt}, {args.new_tokens} new tokens greedy, "
          f"{args.cache} cache{' (compiled)' if args.compile else ''}; tokens/s = new tokens x batch / "
          f"generate time, median of {args.rounds} rounds")
    print(f"{'batch':>5} {'sdpa':>10} {'cute':>10} {'cute/sdpa':>10}  {'same leading tokens':>19}  fallbacks")
    for batch in (int(b) for b in args.batch.split(",")):
        ids = torch.randint(0, args.vocab, (batch, args.prompt), device=args.device,
                            generator=torch.Generator(args.device).manual_seed(batch))
        for model in models.values():  # warm-up: kernels' first calls, allocator, cache set-up
            generate(model, ids, args)
        tco.ops.fallback.reset()
        seconds = {name: [] for name in models}
        tokens = {}
        for _ in range(args.rounds):
            for name, model in models.items():
                sync()
                start = time.perf_counter()
                tokens[name] = generate(model, ids, args)
                sync()
                seconds[name].append(time.perf_counter() - start)
        rate = {name: args.new_tokens * batch / statistics.median(s) for name, s in seconds.items()}
        agree = leading_agreement(tokens["cute"], tokens["sdpa"])
        logits = prefill_logits_agreement(models, ids)
        fallbacks = {f"{op}: {why}": n for (op, why), n in tco.fallback_counts().items()}
        results["rows"].append({"batch": batch, "tokens_per_s": rate, "ratio": rate["cute"] / rate["sdpa"],
                                "seconds": seconds, "leading_tokens_agree": agree, "prefill_logits": logits,
                                "fallbacks": fallbacks})
        if args.profile:
            results["rows"][-1]["profile"] = {name: profile_generate(model, ids, args, name)
                                              for name, model in models.items()}
        print(f"{batch:>5} {rate['sdpa']:10.1f} {rate['cute']:10.1f} {rate['cute'] / rate['sdpa']:9.2f}x  "
              f"{f'{min(agree)}/{args.new_tokens}':>19}  {fallbacks or 'none'}; prefill logits: rel. diff "
              f"{logits['rel_diff']:.1e}, max |diff| {logits['max_abs_diff']:.1e}, median top-2 gap "
              f"{logits['top2_gap']:.1e}, argmax agrees {logits['argmax_agree']:.0%}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
