"""What the Hopper attention GPU tests share: the skip marker and the closeness check."""

import pytest
import torch

HOPPER = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm_90 (Hopper) GPU"),
]


def close(name, ours, ref, rel_bound=2e-2):
    """Relative Frobenius (and max) error of ours against a float reference; NaN never passes.
    A reference that is ~0 everywhere is measured against an RMS floor of 1e-2."""
    assert not torch.isnan(ours).any(), f"{name}: NaN (an element was not written)"
    ours, ref = ours.float(), ref.float()
    # infinities (lse of a row that sees no key) must match exactly; the rest is measured
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)) and torch.equal(ours[torch.isinf(ours)],
                                                                            ref[torch.isinf(ref)]), \
        f"{name}: infinities differ from the reference's"
    finite = torch.isfinite(ref)
    ours, ref = torch.where(finite, ours, 0.0), torch.where(finite, ref, 0.0)
    floor = 1e-2 * max(ref.numel(), 1) ** 0.5
    rel = ((ours - ref).norm() / ref.norm().clamp_min(floor)).item()
    max_err = ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-2)).item() if ref.numel() else 0.0
    assert rel < rel_bound and max_err < 5 * rel_bound, f"{name}: rel {rel:.2e} max {max_err:.2e}"
