"""dtensor_muon: exact owner-rank distributed Muon for PyTorch FSDP2/DTensor."""

from .newton_schulz import NAMED_COEFFICIENTS, newton_schulz, polar_factor
from .optimizer import Muon
from .param_groups import muon_param_groups

__all__ = ["NAMED_COEFFICIENTS", "Muon", "muon_param_groups", "newton_schulz", "polar_factor"]
