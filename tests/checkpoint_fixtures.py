"""The saved checkpoints and pickles of ``test_checkpoint_compat.py``, and the script that wrote them.

``python tests/checkpoint_fixtures.py`` wrote ``tests/data/checkpoint_compat/`` with the library as it was while
its modules stood flat under ``src/dtensor_muon/`` (``MatrixSplit`` in ``dtensor_muon/views.py``), so the pickles
name ``dtensor_muon.views.MatrixSplit``. They are the proof that checkpoints written then still load: do not
write them again with a later version (they would name the modules of that version and prove nothing).

For each optimizer (Muon and SOAP, each with a param group cut by a ``MatrixSplit``; Muon also with a
``matrix_splits`` pattern), two steps from a seeded model, then:

- ``<name>_dcp/``: a torch.distributed.checkpoint of ``{"model", "optim"}`` (``get_model_state_dict``,
  ``get_optimizer_state_dict``; Muon's flattened as torchtitan saves it);
- ``<name>_state_dict.pt``: ``torch.save({"model": model.state_dict(), "optim": opt.state_dict()})``;
- ``<name>_optimizer.pkl``: ``pickle.dumps(opt)``, the whole optimizer;
- ``<name>_next.pt``: the third step's gradients and the parameters after it, plain tensors by name.

``matrix_split.pkl`` and ``matrix_split_protocol2.pkl``: pickled ``MatrixSplit`` s (pickle's default protocol and
protocol 2) beside their fields. ``arithmetic.pt``: a few torch operations of the kinds the steps run (float32
and bfloat16 products, eigh, QR) on fixed inputs: where a machine's results differ from these, its CPU rounds
differently from the one that wrote the fixtures, and the next steps can only be compared within a tolerance.

Everything runs on one thread (torch's CPU products may round differently with another thread count).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from dtensor_muon import SOAP, MatrixSplit, Muon

DATA = Path(__file__).parent / "data" / "checkpoint_compat"
OPTIMIZERS = ("muon", "soap")
SAVED_AFTER = 2
"""Steps taken before the checkpoints were written; the saved next step is step ``SAVED_AFTER + 1``."""

SPLITS = [
    MatrixSplit(0, sizes=(8, 4, 4)),
    MatrixSplit(1, block=4),
    MatrixSplit(0, sizes=(4, 2, 2), groups=2),
]
"""The pickled splits; their fields are pickled beside them as plain tuples."""


def fields(split: MatrixSplit) -> tuple:
    return (split.dim, split.sizes, split.block, split.groups)


class Tiny(nn.Module):
    """A fused QKV matrix (16×8: q, k, v of 8, 4 and 4 rows), an 8×8 matrix and a norm (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 16, bias=False)
        self.w = nn.Parameter(0.1 * torch.randn(8, 8))
        self.norm = nn.Parameter(torch.ones(8))


def build(name: str) -> tuple[Tiny, torch.optim.Optimizer]:
    """The seeded model and its optimizer: the qkv matrix in a group of its own with a ``matrix_split`` (three
    projections for Muon, a grouped split for SOAP); for Muon, ``w`` cut into two 8×4 blocks by a ``matrix_splits``
    pattern."""
    torch.manual_seed(0)
    model = Tiny()
    named = dict(model.named_parameters())
    qkv_split = SPLITS[0] if name == "muon" else SPLITS[2]
    groups = [
        {"params": [("qkv.weight", named.pop("qkv.weight"))], "matrix_split": qkv_split},
        {"params": list(named.items())},
    ]
    if name == "muon":
        return model, Muon(groups, lr=0.02, matrix_splits={"w": SPLITS[1]})
    return model, SOAP(groups, lr=0.01)


def gradients(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s gradients by parameter name (seeded; the same on every machine)."""
    generator = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}


def set_gradients(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
    for n, p in params.items():
        p.grad = grads[n].clone()


def arithmetic() -> dict[str, torch.Tensor]:
    """Results of the CPU operations the steps rely on, on fixed inputs (see the module docstring): a
    Newton–Schulz iteration's products in bfloat16 (2-D and batched, at the shapes of the matrices here) and
    SOAP's float32 products, eigh and QR."""
    generator = torch.Generator().manual_seed(7)
    out = {}
    for shape in ((8, 8), (4, 8), (3, 4, 8)):
        x = torch.randn(shape, generator=generator).bfloat16()
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=1e-7)
        gram = x @ x.mT
        if x.ndim == 2:
            poly = torch.addmm(gram, gram, gram, beta=-4.775, alpha=2.0315)
            out[f"newton_schulz_{shape}"] = torch.addmm(x, poly, x, beta=3.4445)
        else:
            poly = torch.baddbmm(gram, gram, gram, beta=-4.775, alpha=2.0315)
            out[f"newton_schulz_{shape}"] = torch.baddbmm(x, poly, x, beta=3.4445)
    g = torch.randn(16, 8, generator=generator)
    left, right = g @ g.T, g.T @ g
    out["matmul_float32"] = left @ g @ right
    out["eigh"] = torch.linalg.eigh(left)[1]
    out["qr"] = torch.linalg.qr(right @ torch.linalg.qr(right)[0])[0]
    return out


def write() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    torch.set_num_threads(1)
    DATA.mkdir(parents=True, exist_ok=True)
    for protocol, file in ((pickle.DEFAULT_PROTOCOL, "matrix_split.pkl"), (2, "matrix_split_protocol2.pkl")):
        blob = {"splits": SPLITS, "fields": [fields(s) for s in SPLITS]}
        (DATA / file).write_bytes(pickle.dumps(blob, protocol=protocol))
    torch.save(arithmetic(), DATA / "arithmetic.pt")
    for name in OPTIMIZERS:
        model, opt = build(name)
        params = dict(model.named_parameters())
        for step in range(1, SAVED_AFTER + 1):
            set_gradients(params, gradients(model, step))
            opt.step()
            opt.zero_grad()
        options = StateDictOptions(flatten_optimizer_state_dict=name == "muon")
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=options)}
        dcp.save(state, checkpoint_id=str(DATA / f"{name}_dcp"))
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, DATA / f"{name}_state_dict.pt")
        (DATA / f"{name}_optimizer.pkl").write_bytes(pickle.dumps(opt))
        grads = gradients(model, SAVED_AFTER + 1)
        set_gradients(params, grads)
        opt.step()
        after = {n: p.detach().clone() for n, p in params.items()}
        torch.save({"grads": grads, "params": after}, DATA / f"{name}_next.pt")


if __name__ == "__main__":
    write()
