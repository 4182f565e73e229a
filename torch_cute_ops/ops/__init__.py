"""The op layer: schemas, validation, fake functions, autograd and dispatch of ``torch.ops.cute``.

Importing this package registers every op; it never imports the CuTe DSL (kernel modules are
imported on the first CUDA call that can use them).
"""

# (registration side effects)
from . import (attention, attention_kvcache, attention_paged, attention_varlen, gemm, grouped_gemm,  # noqa: F401
               scaled_grouped_gemm)
