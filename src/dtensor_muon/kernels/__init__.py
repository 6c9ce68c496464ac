"""Matrix-product backends for Newton–Schulz: plain torch matmuls and (on CUDA) Triton SYRK kernels."""

from .dispatch import Backend, select_backend, triton_eligible, use_backend
from .torch_matmuls import TORCH_MATMULS, TorchMatmuls

__all__ = [
    "TORCH_MATMULS",
    "Backend",
    "TorchMatmuls",
    "select_backend",
    "triton_eligible",
    "use_backend",
]
