"""torch-cute-ops: CuTe DSL kernels for PyTorch as torch.library custom ops."""

__version__ = "0.1.0"
