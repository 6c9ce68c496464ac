"""Which settings train a user's own small model: every optimizer against torch's AdamW at its defaults.

    python bench/recommended.py [--steps 40] [--seeds 0 1 2] [--models mlp lm] [--only NAME ...]
    python bench/recommended.py --quick        # 1 seed, 10 steps, one lr per setting: a smoke run

Two models, trained on one CPU process (``torch.set_num_threads(1)``), each setting at a few half-decade
learning rates, every run with the same batches (the seed sets the initialization only):

- ``mlp``: a classifier, four ``Linear`` layers (32→128→128→128→10, GELU), on 10 classes a fixed random
  teacher MLP assigns to Gaussian inputs; batches of 128. The three hidden matrices go to the matrix rule, the
  last ``Linear`` (``head``, routed by its name) and the biases to AdamW.
- ``lm``: a 4-layer transformer language model (the quickstart's ``TinyLM``: dim 36, 3 heads, SwiGLU-free
  GELU MLP of 77, RMSNorm, vocabulary 53) on sequences that follow a fixed permutation of the vocabulary
  from a random first token; batches of 16×32 tokens. Embedding, head and norms go to AdamW.

Every optimizer is built as a user would: ``Opt(model.named_parameters(), **setting)``, the Newton–Schulz
dtypes left at their defaults. The final loss of a run is the mean training loss over its last 5 steps;
``auc`` is the mean loss over all steps. Writes ``bench/results/recommended.json`` and prints a table: per
model and setting, the final loss at each lr (mean over seeds, and the seeds' spread) next to AdamW's.
"""

from __future__ import annotations

import inspect
import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dtensor_muon

TAIL = 5

# ---------------------------------------------------------------------------------------------------------------
# The models and their data: functions of (step) only, so every run of a model sees the same batches.

MLP_IN, MLP_WIDTH, MLP_CLASSES, MLP_BATCH = 32, 128, 10, 128


class MLP(nn.Module):
    """The classifier: three hidden Linear layers with GELUs (the matrix rule) and a head (AdamW, by its name)."""

    def __init__(self) -> None:
        super().__init__()
        widths = (MLP_IN, MLP_WIDTH, MLP_WIDTH, MLP_WIDTH)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(MLP_WIDTH, MLP_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def _teacher() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(12345)
        return nn.Sequential(nn.Linear(MLP_IN, 64), nn.Tanh(), nn.Linear(64, MLP_CLASSES))


_TEACHER = _teacher()


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    x = torch.randn(MLP_BATCH, MLP_IN, generator=g)
    with torch.no_grad():
        y = _TEACHER(x).argmax(dim=1)
    return x, y


def mlp_loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = mlp_batch(step)
    return F.cross_entropy(model(x), y)


VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 53, 36, 3, 77, 4, 32, 16
PERM = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.wo(y)
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h))


def lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    for t in range(1, SEQ + 1):
        x[:, t] = PERM[x[:, t - 1]]
    return x[:, :-1], x[:, 1:]


def lm_loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = lm_batch(step)
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, int], torch.Tensor]]] = {
    "mlp": (MLP, mlp_loss),
    "lm": (TinyLM, lm_loss),
}


def train(model_name: str, build: Callable[[nn.Module], torch.optim.Optimizer], steps: int, seed: int) -> list[float]:
    """The training losses of ``steps`` steps of ``model_name`` from seed ``seed``'s initialization."""
    make, loss_fn = MODELS[model_name]
    torch.manual_seed(seed)
    model = make()
    opt = build(model)
    losses = []
    for step in range(steps):
        loss = loss_fn(model, step)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            losses.extend([math.inf] * (steps - step - 1))
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return losses


def final(losses: list[float]) -> float:
    """A run's final loss: the mean over its last :data:`TAIL` steps."""
    return sum(losses[-TAIL:]) / TAIL


# ---------------------------------------------------------------------------------------------------------------
# The settings swept: name → (optimizer, keywords besides lr, learning rates; None: the constructor's default).

SETTINGS: dict[str, tuple[str, dict[str, Any], tuple[float, ...]]] = {
    "AdamW": ("AdamW", {}, (1e-3, 3e-3, 1e-2)),
    "Muon original": ("Muon", {}, (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)),
    "Muon match_rms_adamw": ("Muon", {"adjust_lr_fn": "match_rms_adamw"}, (1e-3, 3e-3, 1e-2, 3e-2)),
    "NorMuon original": ("NorMuon", {}, (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)),
    "NorMuon match_rms_adamw": ("NorMuon", {"adjust_lr_fn": "match_rms_adamw"}, (1e-3, 3e-3, 1e-2, 3e-2)),
    "MOP nuclear": ("MOP", {"scale": "nuclear"}, (1e-4, 3e-4, 1e-3, 3e-3)),
    "MOP shape original": ("MOP", {"scale": "shape"}, (3e-3, 1e-2, 3e-2, 1e-1)),
    "MOP shape match_rms_adamw": ("MOP", {"scale": "shape", "adjust_lr_fn": "match_rms_adamw"}, (1e-3, 3e-3, 1e-2)),
    "MOP shape original nesterov": ("MOP", {"scale": "shape", "nesterov": True}, (1e-2, 3e-2)),
    "SOAP": ("SOAP", {}, (1e-3, 3e-3, 1e-2)),
    "KLSOAP": ("KLSOAP", {}, (1e-3, 3e-3, 1e-2)),
    "REKLS": ("REKLS", {}, (1e-3, 3e-3, 1e-2)),
    # does one lr suit both rules? the matrices' lr against AdamW's, apart
    "Muon original adamw_lr=3e-3": ("Muon", {"adamw_lr": 3e-3}, (1e-2, 2e-2, 3e-2)),
    "Muon original adamw_lr=1e-2": ("Muon", {"adamw_lr": 1e-2}, (1e-2, 2e-2, 3e-2)),
    "Muon match_rms_adamw adamw_lr=3e-3": (
        "Muon",
        {"adjust_lr_fn": "match_rms_adamw", "adamw_lr": 3e-3},
        (3e-3, 1e-2, 3e-2),
    ),
    "Muon match_rms_adamw adamw_lr=3e-2": (
        "Muon",
        {"adjust_lr_fn": "match_rms_adamw", "adamw_lr": 3e-2},
        (3e-3, 1e-2, 3e-2),
    ),
    # what an unconfigured user gets: Opt(model.named_parameters()), no lr (lr None here)
    **{f"{name} (defaults)": (name, {}, (None,)) for name in ("Muon", "NorMuon", "MOP", "SOAP", "KLSOAP", "REKLS")},
}


def builder(optimizer: str, keywords: dict[str, Any]) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """``model → optimizer``: torch's AdamW on ``model.parameters()``, or ``dtensor_muon.<optimizer>`` on
    ``model.named_parameters()``, with ``keywords``."""
    if optimizer == "AdamW":
        return lambda model: torch.optim.AdamW(model.parameters(), **keywords)
    cls = getattr(dtensor_muon, optimizer)
    keywords = {k: v for k, v in keywords.items() if v is not None}  # lr None: the constructor's default
    return lambda model: cls(model.named_parameters(), **keywords)


def default_lr(optimizer: str) -> float:
    """The lr ``dtensor_muon.<optimizer>`` takes when none is given."""
    for cls in getattr(dtensor_muon, optimizer).__mro__:  # KLSOAP and REKLS take SOAP's
        parameters = inspect.signature(cls.__init__).parameters
        if "lr" in parameters:
            return parameters["lr"].default
    raise LookupError(optimizer)


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import benchmark_parser, markdown_table, write_result

    parser = benchmark_parser(__doc__, "recommended")
    parser.add_argument("--steps", type=int, default=None, help="default 40 (quick: 10)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--only", nargs="+", default=None, help="setting names (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.steps = args.steps or (10 if args.quick else 40)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    torch.set_num_threads(args.threads)
    rows = []
    for model_name in args.models:
        for name, (optimizer, keywords, lrs) in SETTINGS.items():
            if args.only and name not in args.only:
                continue
            for lr in lrs[:1] if args.quick else lrs:
                start = time.perf_counter()
                curves = [
                    train(model_name, builder(optimizer, {**keywords, "lr": lr}), args.steps, s) for s in args.seeds
                ]
                finals = [final(c) for c in curves]
                row = {
                    "model": model_name,
                    "setting": name,
                    "lr": lr if lr is not None else default_lr(optimizer),
                    "final": statistics.fmean(finals),
                    "spread": max(finals) - min(finals),
                    "auc": statistics.fmean(sum(c) / len(c) for c in curves),
                    "step10_below_step0": all(c[10] < c[0] for c in curves) if args.steps > 10 else None,
                    "finals": finals,
                    "curves": curves,
                    "seconds": time.perf_counter() - start,
                }
                rows.append(row)
                print(f"{model_name:4s} {name:34s} lr {row['lr']:7.0e}  final {row['final']:.4f} ± {row['spread']:.4f}"
                      f"  auc {row['auc']:.4f}  ({row['seconds']:.1f} s)", flush=True)  # fmt: skip
    columns = [
        ("model", "model", "{}"), ("setting", "setting", "{}"), ("lr", "lr", "{:.0e}"),
        ("final", "final loss (mean)", "{:.4f}"), ("spread", "seeds' spread", "{:.4f}"), ("auc", "mean loss", "{:.4f}"),
    ]  # fmt: skip
    print(markdown_table(rows, columns))
    write_result(args, rows)


if __name__ == "__main__":
    main()
