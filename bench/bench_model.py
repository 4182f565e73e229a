"""End to end: training-step throughput of a transformers Llama with attn_implementation "sdpa"
vs "cute", eager and compiled, on full and on padded batches.

    python bench/bench_model.py [--layers 4 --hidden 2048 --heads 16 --kv-heads 4 --batch 2
                                 --seqlen 4096 --steps 10] [--out DIR]

One step is forward + backward + AdamW on random token ids (bf16 weights, random init). Modes:
``full`` (every sequence S tokens) and ``padded`` (lengths uniform in [S/4, S], right-padded,
an attention mask passed); tokens/s counts real tokens only. Each configuration is warmed up
(compiles included) and then timed over ``--steps`` steps; configurations run interleaved over
``--rounds`` rounds and keep their median. Prints a table, writes DIR/model.json and DIR/model.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_model(args, implementation: str):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 256 * 256,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seqlen, attn_implementation=implementation)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def make_batch(args, mode: str, step: int):
    gen = torch.Generator(device="cuda").manual_seed(step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda", generator=gen)
    if mode == "full":
        return ids, None, ids.numel()
    lengths = torch.randint(args.seqlen // 4, args.seqlen + 1, (args.batch,), device="cuda", generator=gen)
    mask = (torch.arange(args.seqlen, device="cuda")[None, :] < lengths[:, None]).long()
    return ids, mask, int(mask.sum())


def run(args, implementation: str, mode: str, compiled: bool):
    """A closure that times ``args.steps`` training steps and returns tokens/s."""
    import torch_cute_ops.integrations.transformers  # noqa: F401  (registers "cute")

    model = make_model(args, implementation)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compiled else model
    batches = [make_batch(args, mode, step) for step in range(args.steps)]

    def step(ids, mask):
        labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
        loss = forward(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for ids, mask, _ in batches[:2]:  # warm-up: compiles, autotuning, allocator
        step(ids, mask)
    torch.cuda.synchronize()

    def timed() -> float:
        start = time.perf_counter()
        for ids, mask, _ in batches:
            step(ids, mask)
        torch.cuda.synchronize()
        return sum(n for _, _, n in batches) / (time.perf_counter() - start)

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="full,padded")
    parser.add_argument("--compile", default="eager,compiled")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch_cute_ops as tco

    configs = [(impl, mode, kind) for mode in args.modes.split(",") for kind in args.compile.split(",")
               for impl in ("sdpa", "cute")]
    runners = {c: run(args, c[0], c[1], c[2] == "compiled") for c in configs}
    samples = {c: [] for c in configs}
    for _ in range(args.rounds):
        for c, timed in runners.items():
            samples[c].append(timed())
    fallbacks = {f"{op}: {why}": n for (op, why), n in tco.fallback_counts().items()}
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "args": vars(args) | {"out": str(args.out)}, "rows": [], "fallbacks": fallbacks}
    print(f"{results['device']}: Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, "
          f"B{args.batch} S{args.seqlen}; tokens/s (real tokens), median of {args.rounds} rounds of {args.steps} steps")
    print(f"{'mode':<8} {'':<9} {'sdpa':>10} {'cute':>10} {'cute/sdpa':>10}")
    for mode in args.modes.split(","):
        for kind in args.compile.split(","):
            sdpa = statistics.median(samples[("sdpa", mode, kind)])
            cute = statistics.median(samples[("cute", mode, kind)])
            results["rows"].append({"mode": mode, "kind": kind, "sdpa": sdpa, "cute": cute, "ratio": cute / sdpa})
            print(f"{mode:<8} {kind:<9} {sdpa:10.0f} {cute:10.0f} {cute / sdpa:9.2f}x")
    print("fallbacks:", results["fallbacks"] or "none")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["sdpa"] for r in rows], 0.4, label='attn_implementation="sdpa"')
    ax.bar([x + 0.2 for x in xs], [r["cute"] for r in rows], 0.4, label='attn_implementation="cute"')
    ax.set_xticks(list(xs), [f"{r['mode']}\n{r['kind']}" for r in rows])
    ax.set_ylabel("training tokens/s")
    ax.set_title(f"{results['device']}: Llama {args.layers}L h{args.hidden} B{args.batch} S{args.seqlen}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "model.png", dpi=120)


if __name__ == "__main__":
    main()
