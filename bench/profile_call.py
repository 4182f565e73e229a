"""One public call, warmed up, inside an NVTX range named ``target``: the unit a profiler looks at.

    ncu --clock-control none --nvtx --nvtx-include target/ [sections] \\
        python bench/profile_call.py CASE [--size N] [--causal]

CASE: ``gemm`` (``tco.gemm``, bf16 N x N x N), ``gemm_bias_gelu`` (the same with a bias and gelu_tanh
fused), ``scaled_mm_tensor`` / ``scaled_mm_row`` / ``scaled_mm_block`` (``tco.scaled_mm``, e4m3, the
three scale modes), ``attn_fwd`` (``tco.flash_attn_func``) and ``attn_bwd``
(``torch.ops.cute.flash_attn_bwd`` called directly: a backward reached through autograd runs on
autograd's device thread, outside a range opened here; ``--deterministic``: the ordered dQ adds).
Attention shapes: B16 S``--size`` H16 D``--head-dim``. ``decode`` (``tco.flash_attn_with_kvcache``)
and, to set beside it, ``decode_torch`` (torch's SDPA, ``enable_gqa``): one query token of
B``--batch`` against ``--size`` cached keys, GQA 32/8. Random data; the call runs ``--warmup``
times before the marked one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = ("gemm", "gemm_bias_gelu", "scaled_mm_tensor", "scaled_mm_row", "scaled_mm_block", "attn_fwd", "attn_bwd",
         "decode", "decode_torch")


def make_call(case: str, size: int, head_dim: int, causal: bool, batch: int = 1, deterministic: bool = False):
    """The zero-argument call of ``case`` on fresh random CUDA inputs."""
    import torch_cute_ops as tco
    from torch_cute_ops import fp8

    dev, bf = "cuda", torch.bfloat16
    if case.startswith("gemm"):
        a, b = torch.randn(size, size, device=dev, dtype=bf), torch.randn(size, size, device=dev, dtype=bf)
        if case == "gemm_bias_gelu":
            bias = torch.randn(size, device=dev, dtype=bf)
            return lambda: tco.gemm(a, b, bias=bias, activation="gelu_tanh")
        return lambda: tco.gemm(a, b)
    if case.startswith("scaled_mm_"):
        quantize = {"tensor": fp8.quantize_tensorwise, "row": fp8.quantize_rowwise,
                    "block": fp8.quantize_blockwise}[case.removeprefix("scaled_mm_")]
        x = torch.randn(size, size, device=dev, dtype=bf)
        w = torch.randn(size, size, device=dev, dtype=bf)
        (qa, sa), (qb, sb) = quantize(x), quantize(w.t(), operand="b")
        return lambda: tco.scaled_mm(qa, qb, sa, sb)
    if case.startswith("decode"):
        q = torch.randn(batch, 1, 32, head_dim, device=dev, dtype=bf)
        k, v = (torch.randn(batch, size, 8, head_dim, device=dev, dtype=bf) for _ in range(2))
        if case == "decode_torch":
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            return lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        lengths = torch.full((batch,), size, dtype=torch.int32, device=dev)
        return lambda: tco.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)
    q, k, v = (torch.randn(16, size, 16, head_dim, device=dev, dtype=bf) for _ in range(3))
    if case == "attn_fwd":
        return lambda: tco.flash_attn_func(q, k, v, causal=causal)
    out, lse = tco.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn_like(out)
    return lambda: torch.ops.cute.flash_attn_bwd(dout, q, k, v, out, lse, head_dim ** -0.5, causal,
                                                 deterministic=deterministic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=CASES)
    parser.add_argument("--size", type=int, default=None,
                        help="GEMM N (default 8192), attention S (default 1024) or decode keys (default 32768)")
    parser.add_argument("--batch", type=int, default=1, help="decode batch")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--deterministic", action="store_true", help="attn_bwd: the ordered dQ adds")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    size = args.size or (1024 if args.case.startswith("attn") else 32768 if args.case.startswith("decode") else 8192)
    call = make_call(args.case, size, args.head_dim, args.causal, args.batch, args.deterministic)
    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("target")
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
