"""Matrix-product backends for Newton–Schulz: plain torch matmuls and (on CUDA) Triton SYRK kernels."""

from .dispatch import select_backend
from .torch_matmuls import TORCH_MATMULS, TorchMatmuls

__all__ = ["select_backend", "TORCH_MATMULS", "TorchMatmuls"]
