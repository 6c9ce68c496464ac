"""Matrix-product backends for Newton–Schulz: plain torch matmuls and (on CUDA) Triton SYRK kernels."""

from .dispatch import (
    NS_ALGORITHMS,
    Backend,
    forced_backend,
    resolve_ns_algorithm,
    select_backend,
    triton_eligible,
    use_backend,
    use_gram,
)
from .shapes import gram_work
from .torch_matmuls import TORCH_MATMULS, TorchMatmuls

__all__ = [
    "NS_ALGORITHMS",
    "TORCH_MATMULS",
    "Backend",
    "TorchMatmuls",
    "forced_backend",
    "gram_work",
    "resolve_ns_algorithm",
    "select_backend",
    "triton_eligible",
    "use_backend",
    "use_gram",
]
