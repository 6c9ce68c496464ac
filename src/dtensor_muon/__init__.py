"""dtensor_muon: exact owner-rank distributed matrix optimizers (Muon, MOP, NorMuon, SOAP) for PyTorch FSDP2/DTensor."""

from .lr_scaling import batch_scaled_lr
from .newton_schulz import NAMED_COEFFICIENTS, newton_schulz, polar_factor
from .optim.mop import MOP
from .optim.muon import Muon
from .optim.normuon import NorMuon
from .optim.soap import KLSOAP, REKLS, SOAP
from .param_groups import grouped_qkv_splits, muon_param_groups
from .process_exit import exit_without_finalization
from .views import MatrixSplit

__all__ = [
    "KLSOAP",
    "MOP",
    "NAMED_COEFFICIENTS",
    "REKLS",
    "SOAP",
    "MatrixSplit",
    "Muon",
    "NorMuon",
    "batch_scaled_lr",
    "exit_without_finalization",
    "grouped_qkv_splits",
    "muon_param_groups",
    "newton_schulz",
    "polar_factor",
]
