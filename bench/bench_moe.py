"""Mixture-of-experts grouped GEMM speed on the GPU: ``tco.grouped_mm`` vs ``torch._grouped_mm``,
one dense cuBLAS ``torch.mm`` of the same total rows, and QuACK's varlen-M GEMM when importable.

    python bench/bench_moe.py [--rounds 3] [--quick] [--tile-m 64] [--out DIR]
    python bench/bench_moe.py --model [--rounds 3]

``--model``: a Qwen3-MoE config (4 layers, hidden 2048, 64 experts top-8, expert width 768, random
weights, attention "sdpa" for all), one eager training step (forward, loss, backward) on B4 S4096
synthetic tokens, with transformers' own experts (a loop over the experts that received tokens),
with ``use_cute_experts`` (routed grouped GEMMs on our kernels), and with the same routing on
``torch._grouped_mm`` (+ silu * up): tokens/s and ratios.

Shapes (bf16): DeepSeek-V3's routed experts (hidden 7168, expert width 2048, 256 experts, top-8)
and Qwen3-30B-A3B's (hidden 2048, width 768, 128 experts, top-8) at 4096 and 16384 tokens: the
gate/up projection (x @ W_gu^T, N = 2 x width, K = hidden) and the down projection (N = hidden,
K = width), forward, and the backward's dA (dY @ W, rows grouped) and dB (x^T @ dY, K grouped);
the gate/up projection also with SwiGLU fused (``activation="swiglu"``) against
torch._grouped_mm followed by silu(gate) * up; the forward in FP8 e4m3 with rowwise scales
(``tco.scaled_grouped_mm`` beside ``torch._scaled_grouped_mm``).
Routing: a fixed random router with realistic imbalance: expert popularity drawn from
Dirichlet(0.3) (seed 0), each token picking top-8 distinct experts weighted by it.

Timing: triton.testing.do_bench medians, providers interleaved over ``--rounds`` rounds
(bench/interleave.py), every call through the public API, weights as nn.Linear keeps them
((G, N, K), passed transposed). Prints TFLOP/s (2 * rows * N * K per GEMM) and ratios to
torch._grouped_mm and to the dense GEMM; ``--out DIR`` writes DIR/moe.json. ``--tile-m 64`` runs
the grouped kernels on 64-row tiles (less row padding of small groups: 1.24x the routed rows
instead of 1.54x at DeepSeek-V3's 4096 tokens, on one consumer warpgroup per tile).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.interleave import time_interleaved  # noqa: E402

import torch_cute_ops as tco  # noqa: E402

MODELS = {"deepseek_v3": (7168, 2048, 256), "qwen3_30b_a3b": (2048, 768, 128)}  # hidden, width, experts
TOP_K = 8
TOKENS = (4096, 16384)


def route(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """int32 cumulative rows per expert of ``tokens`` tokens routed top-8 by a fixed random router:
    popularity ~ Dirichlet(0.3), each token's experts drawn without replacement by it."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.distributions.Dirichlet(torch.full((experts,), 0.3)).sample()  # the global seed (0)
    choice = torch.multinomial(popularity.expand(tokens, experts), TOP_K, replacement=False, generator=gen)
    counts = torch.bincount(choice.flatten(), minlength=experts)
    return counts.cumsum(0).to(torch.int32).cuda()


def quack_varlen():
    """QuACK's varlen-M GEMM, or None where QuACK or that entry point is missing."""
    try:
        from quack.gemm_interface import gemm as quack_gemm
    except Exception:
        return None

    def run(x, w_t, offs):
        cu_seqlens = torch.cat([offs.new_zeros(1), offs])
        return quack_gemm(x, w_t, cu_seqlens_m=cu_seqlens)
    return run


def torch_swiglu(x, w_t, offs):
    """The unfused gate/up projection: torch._grouped_mm, then silu(gate) * up."""
    pre = torch._grouped_mm(x, w_t, offs=offs)
    gate, up = pre.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rowwise_fp8(t: torch.Tensor):
    """e4m3 values and fp32 scales, one per row (amax / 448); a 3-D tensor group by group, so
    that the temporaries stay one group's size (DeepSeek-V3's experts are 15 GB in bf16)."""
    if t.dim() == 3:
        values, scales = zip(*(rowwise_fp8(group) for group in t))
        return torch.stack(values), torch.stack(scales)
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / 448.0
    return (t / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def fp8_providers(x, w, offs):
    """The forward in FP8 e4m3 with rowwise scales (x per row, w per group and output column):
    tco.scaled_grouped_mm beside torch._scaled_grouped_mm."""
    x8, scale_x = rowwise_fp8(x)
    w8, scale_w = rowwise_fp8(w)  # (G, N, K): a scale per (group, column of the output)
    w8_t = w8.transpose(-2, -1)
    calls = {"fp8 cute": lambda: tco.scaled_grouped_mm(x8, w8_t, scale_x, scale_w, offs)}
    try:
        torch._scaled_grouped_mm(x8, w8_t, scale_x, scale_w, offs=offs, out_dtype=torch.bfloat16)
        calls["fp8 torch"] = lambda: torch._scaled_grouped_mm(x8, w8_t, scale_x, scale_w, offs=offs,
                                                              out_dtype=torch.bfloat16)
    except Exception as err:
        print(f"torch._scaled_grouped_mm skipped: {type(err).__name__}: {str(err)[:100]}")
    return calls


def providers(x, w, offs, dy, quack, gated: bool):
    """name -> call, per measured GEMM of one projection (w: (G, N, K) as nn.Linear keeps it);
    ``gated``: the gate/up projection, also timed with SwiGLU ([gate | up] columns)."""
    w_t = w.transpose(-2, -1)
    rows = x.shape[0]
    dense_b = w[0].t()  # one expert's (K, N): the same FLOPs as one dense GEMM of all rows
    calls = {
        "fwd cute": lambda: tco.grouped_mm(x, w_t, offs),
        "fwd torch": lambda: torch._grouped_mm(x, w_t, offs=offs),
        "fwd dense": lambda: torch.mm(x, dense_b),
        "dA cute": lambda: tco.grouped_mm(dy, w, offs),
        "dA torch": lambda: torch._grouped_mm(dy, w, offs=offs),
        "dB cute": lambda: tco.grouped_mm(x.t(), dy, offs),
        "dB torch": lambda: torch._grouped_mm(x.t(), dy, offs=offs),
    }
    calls.update(fp8_providers(x, w, offs))
    if gated:
        calls["swiglu cute"] = lambda: tco.grouped_mm(x, w_t, offs, activation="swiglu")
        calls["swiglu torch"] = lambda: torch_swiglu(x, w_t, offs)
    if quack is not None:
        try:
            quack(x, w_t, offs)
            calls["fwd quack"] = lambda: quack(x, w_t, offs)
        except Exception as err:
            print(f"QuACK skipped at {rows} x {tuple(w.shape)}: {type(err).__name__}: {str(err)[:100]}")
    return calls


def bench_projection(name, rows_offs, n, k, experts, rounds, quack):
    offs = rows_offs
    rows = int(offs[-1])
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    times = time_interleaved(providers(x, w, offs, dy, quack, name.endswith("gate_up")), rounds)
    flops = 2 * rows * n * k
    result = {"shape": name, "rows": rows, "n": n, "k": k, "ms": times,
              "tflops": {key: flops / ms / 1e9 for key, ms in times.items()}}
    t = result["tflops"]
    line = f"{name:<34} rows {rows:>6}  " + "  ".join(f"{key} {value:6.0f}" for key, value in t.items())
    ratios = [f"fwd x{t['fwd cute'] / t['fwd torch']:.2f} torch, {t['fwd cute'] / t['fwd dense']:.0%} dense",
              f"dA x{t['dA cute'] / t['dA torch']:.2f}", f"dB x{t['dB cute'] / t['dB torch']:.2f}"]
    if "fp8 torch" in t:
        ratios.append(f"fp8 x{t['fp8 cute'] / t['fp8 torch']:.2f} torch")
    if "swiglu cute" in t:
        ratios.append(f"swiglu x{t['swiglu cute'] / t['swiglu torch']:.2f} (torch + silu * up)")
    if "fwd quack" in t:
        ratios.append(f"fwd x{t['fwd cute'] / t['fwd quack']:.2f} quack")
    print(line + "\n" + " " * 36 + "; ".join(ratios), flush=True)
    del x, w, dy
    torch.cuda.empty_cache()
    return result


def torch_routed_mm(a, b, offs=None, activation=None, gate_up_layout="concat", alpha=1.702, limit=7.0):
    """``tco.grouped_mm``'s call as the MoE integration makes it, on ``torch._grouped_mm``."""
    from torch_cute_ops.integrations.moe import gated_activation

    out = torch._grouped_mm(a, b, offs=offs)
    return out if activation is None else gated_activation(out, activation, gate_up_layout, alpha, limit)


def bench_model(rounds: int) -> dict:
    import copy
    import time

    import transformers

    from torch_cute_ops.integrations import moe

    cfg = transformers.Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                                      num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                                      num_experts=64, num_experts_per_tok=8, intermediate_size=6144,
                                      vocab_size=32000, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).train()
    cute = copy.deepcopy(base)
    moe.use_cute_experts(cute)
    ids = torch.randint(0, cfg.vocab_size, (4, 4096), device="cuda")

    def step(model):
        def run():
            model(input_ids=ids, labels=ids).loss.backward()
        return run

    def on_torch():
        saved, moe.functional.grouped_mm = moe.functional.grouped_mm, torch_routed_mm
        try:
            step(cute)()
        finally:
            moe.functional.grouped_mm = saved

    calls = {"transformers experts": step(base), "cute experts": step(cute), "torch._grouped_mm experts": on_torch}
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / 3)
    tokens = ids.numel()
    result = {name: tokens / sorted(t)[len(t) // 2] for name, t in times.items()}
    for name, tps in result.items():
        print(f"  {name:<28} {tps:9.0f} tokens/s (training step, eager, median of {rounds} rounds of 3 steps)")
    print(f"  cute vs transformers x{result['cute experts'] / result['transformers experts']:.2f}, "
          f"vs torch._grouped_mm x{result['cute experts'] / result['torch._grouped_mm experts']:.2f}", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4096 tokens only")
    parser.add_argument("--tile-m", type=int, choices=(64, 128), default=128,
                        help="row tile of the grouped kernels (the heuristic's is 128)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", action="store_true", help="the Qwen3-MoE training step instead")
    args = parser.parse_args()
    if args.model:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; Qwen3-MoE 4 layers, hidden 2048, "
              "64 experts top-8, width 768, B4 S4096")
        bench_model(args.rounds)
        print("fallbacks:", tco.fallback_counts() or "none")
        return
    if args.tile_m != 128:
        from torch_cute_ops.runtime import grouped_gemm
        from torch_cute_ops.runtime.gemm_config import GemmConfig

        grouped_gemm.grouped_config = lambda form, n: GemmConfig(args.tile_m, 256 if n >= 1024 else 128)
    torch.manual_seed(0)
    quack = quack_varlen()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TFLOP/s (2 * rows * N * K); "
          f"routing: Dirichlet(0.3) popularity, top-{TOP_K}, seed 0; QuACK {'on' if quack else 'not importable'}")
    results = []
    for model, (hidden, width, experts) in MODELS.items():
        for tokens in TOKENS[:1] if args.quick else TOKENS:
            torch.manual_seed(0)
            offs = route(tokens, experts)
            for proj, n, k in (("gate_up", 2 * width, hidden), ("down", hidden, width)):
                results.append(bench_projection(f"{model} {tokens} tok {proj}", offs, n, k, experts, args.rounds,
                                                quack))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe.json").write_text(json.dumps(results, indent=1))
    print("fallbacks:", tco.fallback_counts() or "none")


if __name__ == "__main__":
    main()
