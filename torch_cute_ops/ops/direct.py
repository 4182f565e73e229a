"""When a public function may call an op's implementation without the dispatcher.

A ``torch.ops.cute`` call passes through the dispatcher and the Python autograd wrapper that
``register_autograd`` installs, about 9 us per call on an idle host CPU before the op's own
work. That wrapper has nothing to do when no input needs a gradient, nothing traces, and no
mode or tensor subclass would intercept the call; the public functions then call the
implementation directly, with the same validation, kernels and fallbacks.
"""

from __future__ import annotations

import torch

_C = torch._C


def dispatcher_free(*tensors) -> bool:
    """True when calling the implementation is indistinguishable from calling the op."""
    if (torch.compiler.is_compiling() or _C._is_torch_function_mode_enabled() or _C._len_torch_dispatch_stack()
            or _C._are_functorch_transforms_active() or _C._get_tracing_state() is not None):
        return False
    grad = _C.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True
