"""The float64 per-group loop the grouped_mm tests (CPU and GPU) compare with, written apart from
the package's reference."""

import torch


def loop64(a, b, offs):
    """The four forms, one float64 matmul per group; rows/columns past offs[-1] zero."""
    a, b = a.double(), b.double()
    if offs is None:
        return a @ b
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g]
    elif a.dim() == 2:
        out = torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    else:
        out = a.new_zeros(a.shape[1], b.shape[1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[:, s:e] = a[g] @ b[:, s:e]
    return out
