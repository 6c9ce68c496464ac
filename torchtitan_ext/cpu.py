"""Run torchtitan 0.2.2's unchanged trainer on CPU processes that talk through gloo.

torchtitan 0.2.2 picks its device once, at import, and falls back to CUDA when no accelerator is
found. :func:`use_cpu_gloo` points it at the CPU instead, by rebinding the module-level names that
hold the device, before the trainer is built:

- ``device_type``/``device_module`` in ``tools.utils``, ``distributed.utils``,
  ``distributed.parallel_dims`` and ``components.metrics`` become ``"cpu"``/``torch.cpu``
  (``init_process_group`` then picks gloo, the CPU's default backend);
- the CUDA memory monitor becomes :class:`CpuMemoryMonitor` (peak resident set size);
- ``set_pg_timeouts`` (run after step 1; its barrier passes CUDA device ids) is skipped, so the
  process groups keep their start-up timeout;
- ``torch.histc``, which MoE routers call on integer expert indices (CUDA counts integers, the CPU
  kernel does not), counts integer CPU tensors through a float32 copy (exact below 2**24);
- expert parallelism's token permutation (``generate_permute_indices``, a Triton kernel) takes
  torchtitan's own CPU implementation (its ``use_cpu=True`` path) for CPU tensors.

gloo also lacks the AVG and PREMUL_SUM reductions that FSDP2 uses for gradients:
:func:`use_sum_reduction` makes FSDP2 reduce with SUM and divide afterwards (called by the train
specs of this package after parallelization, when the backend is gloo).
"""

import contextlib
import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

_GIB = 1 << 30


class CpuMemoryMonitor:
    """Stands in for torchtitan's DeviceMemoryMonitor on CPU: peak RSS of this process as "memory"."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_index = 0
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / _GIB

    def get_peak_stats(self):
        """DeviceMemStats with the peak RSS since the last reset as both active and reserved bytes."""
        from torchtitan.components.metrics import DeviceMemStats

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        peak_gib, peak_pct = peak / _GIB, 100 * peak / self.device_capacity
        return DeviceMemStats(peak_gib, peak_pct, peak_gib, peak_pct, 0, 0)

    def reset_peak_stats(self) -> None:
        """Reset the kernel's peak-RSS mark (Linux ``clear_refs`` 5); a no-op where that is unavailable."""
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def _build_cpu_memory_monitor() -> CpuMemoryMonitor:
    return CpuMemoryMonitor()


def _keep_start_up_timeouts(*args, **kwargs) -> None:
    """Replaces ``set_pg_timeouts`` on CPU (its barrier takes CUDA device ids)."""


_float_histc = torch.histc


def histc_any_dtype(input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``torch.histc`` that also counts integer CPU tensors (result in the input's dtype, as on CUDA)."""
    if input.device.type == "cpu" and not input.is_floating_point():
        return _float_histc(input.float(), *args, **kwargs).to(input.dtype)
    return _float_histc(input, *args, **kwargs)


def _permute_indices_on_cpu(original):
    """``generate_permute_indices`` that passes ``use_cpu=True`` for CPU tensors."""

    def generate_permute_indices(tokens_per_expert_group: torch.Tensor, *args, **kwargs):
        if tokens_per_expert_group.device.type == "cpu":
            kwargs["use_cpu"] = True
        return original(tokens_per_expert_group, *args, **kwargs)

    generate_permute_indices.wraps_cpu = True
    return generate_permute_indices


def use_cpu_gloo() -> None:
    """Point torchtitan's device globals at the CPU (see the module docstring). Idempotent."""
    from torchtitan.components import metrics
    from torchtitan.distributed import parallel_dims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.moe import utils as moe_utils
    from torchtitan.tools import utils

    for module in (utils, dist_utils, metrics):
        module.device_type, module.device_module = "cpu", torch.cpu
    parallel_dims.device_type = "cpu"
    metrics.build_device_memory_monitor = _build_cpu_memory_monitor
    dist_utils.set_pg_timeouts = _keep_start_up_timeouts
    torch.histc = histc_any_dtype
    if not getattr(moe_utils.generate_permute_indices, "wraps_cpu", False):
        moe_utils.generate_permute_indices = _permute_indices_on_cpu(moe_utils.generate_permute_indices)


def use_sum_reduction(model: nn.Module) -> None:
    """On gloo, make every FSDP2 module of ``model`` reduce gradients with SUM (then divide)."""
    if not (dist.is_initialized() and dist.get_backend() == "gloo"):
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
