"""dtensor_muon: exact owner-rank distributed matrix optimizers (Muon, MOP, NorMuon, SOAP) for PyTorch FSDP2/DTensor."""

import sys

from .distributed.process_exit import exit_without_finalization
from .linalg.newton_schulz import NAMED_COEFFICIENTS, newton_schulz, polar_factor
from .optim.lr_scaling import LR_PER_ADAMW_LR, MUON_LR_PER_ADAMW_LR, batch_scaled_lr, lr_from_adamw, muon_lr_from_adamw
from .optim.mop import MOP
from .optim.muon import Muon
from .optim.normuon import NorMuon
from .optim.param_groups import grouped_qkv_splits, muon_param_groups
from .optim.soap import KLSOAP, REKLS, SOAP
from .plan import views
from .plan.views import MatrixSplit
from .rules.qk_clip import AttentionHeads

# Pickles name a class by its module: optimizer pickles, torch.save'd state dicts and torch.distributed.checkpoint
# checkpoints written while MatrixSplit lived in dtensor_muon/views.py (param groups' "matrix_split", a front
# end's matrix_splits) name dtensor_muon.views. That module path stays importable, for this reason only; it is
# the one module of the old layout whose classes end up in saved state.
sys.modules.setdefault(f"{__name__}.views", views)
del sys, views

__all__ = [
    "KLSOAP",
    "LR_PER_ADAMW_LR",
    "MOP",
    "MUON_LR_PER_ADAMW_LR",
    "NAMED_COEFFICIENTS",
    "REKLS",
    "SOAP",
    "AttentionHeads",
    "MatrixSplit",
    "Muon",
    "NorMuon",
    "batch_scaled_lr",
    "exit_without_finalization",
    "grouped_qkv_splits",
    "lr_from_adamw",
    "muon_lr_from_adamw",
    "muon_param_groups",
    "newton_schulz",
    "polar_factor",
]
