"""Learning-rate study on a GPU: which lr each optimizer wants on a MoE and a dense transformer, and how far
each gets, against AdamW, measured on held-out text.

    python -m torchtitan_ext.data                 # once: the offline corpus and tokenizer under data/stdlib
    python bench/lr_study.py tokens               # once: tokenize it into data/stdlib/tokens.pt (train / held-out)
    python bench/lr_study.py run --phases sweep seeds extras [--workers 6] [--deadline-s 560]
    python bench/lr_study.py report               # tables, bench/results/lr_study.json, docs/figures/lr_study_*.png
    python bench/lr_study.py run --quick          # CPU smoke run: tiny models, 6 steps, one lr

Two models, trained in one process each (no torch.distributed: the optimizers' results equal every world
size's, bit for bit, so one process stands for any layout), bf16 autocast on float32 weights:

- ``moe``: Qwen3-style MoE blocks, 4 layers of dim 1024, GQA attention (16 heads of 64, 4 KV heads, RoPE),
  32 experts of SwiGLU width 384 (the 0.375 width-to-dim ratio of Qwen3-30B-A3B's 768×2048 experts), top-4
  softmax routing with renormalized weights, a Switch-style balance loss (coefficient 0.01), no shared
  expert. Each expert sees about k/E = 1/8 of the batch's tokens.
- ``dense``: Llama3-style blocks, 4 layers of dim 1024, the same attention, SwiGLU width 2816.

Vocabulary 2048 (the corpus tokenizer), sequences of 512 tokens, batches of 16 (8,192 tokens), 500 steps
(4.1 M tokens: windows drawn at random from a 3.5 M-token training stream, about 1.2 passes), linear warm-up over 50 steps then cosine to 0.1× the peak,
gradient clipping at 1.0. Every run of a model sees the same batches (the seed sets only the
initialization). The held-out set is every 20th document of the corpus, never trained on; the validation
loss is the mean over 8 fixed held-out batches, taken every 25 steps.

Optimizers, each as a user would build it on ``model.named_parameters()`` (embeddings, head and norms on
AdamW at the same lr; weight decay 0.1; AdamW's β = (0.9, 0.95), ε = 1e-8 everywhere):

- ``AdamW``: ``torch.optim.AdamW(fused=True)`` on everything;
- ``Muon``, ``NorMuon``: ``adjust_lr_fn="match_rms_adamw"`` (update RMS 0.2·lr: an AdamW lr carries over);
- ``SOAP``, ``KLSOAP``: ``match_update_rms=0.2`` (the same), eigenbases refreshed every 10 steps;
- variants: ``Muon-router-adamw`` (the router matrices on AdamW), ``Muon-bf16`` / ``Muon-int8``
  (``momentum_dtype``); ``SOAP-cholqr`` / ``KLSOAP-cholqr`` (``basis="cholqr"``: each unit of expert matrices
  refreshed in one batched pass, where the default ``"qr"`` refreshes one matrix at a time).

Phases: ``sweep`` (seed 0, every optimizer at lr 3e-4, 1e-3, 3e-3, 1e-2: half-decades), ``seeds`` (seeds 1 and 2
at each optimizer's best sweep lr), ``extras`` (on the MoE at Muon's best lr: the router on AdamW and the
momentum formats, 3 seeds; the global batch doubled with the same lr and with ``batch_scaled_lr``'s lr·√2, 1
seed); ``list:moe/Muon/0.001/0,dense/AdamW/0.0003/1/32,...`` names runs one by one (model, optimizer, lr, seed,
and optionally the batch). Each run writes ``<results>/<name>.json`` as it ends, and a run whose file exists is
not run again, so a phase can continue in a later call. ``--deadline-s`` stops the runs still going at that
time; with ``--state-dir`` each saves its state there, and a later call with the same ``--state-dir`` continues
it from the step it reached (a run longer than one call's time limit then spans several calls on the same
machine). ``report`` reads the files: per model and optimizer the best lr, the final validation loss over the
seeds (mean and spread), and the steps to reach AdamW's final validation loss (the fraction of AdamW's compute),
and draws the curves.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

R = TypeVar("R")
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "stdlib"
TOKENS = DATA / "tokens.pt"
RESULTS = ROOT / "bench" / "results" / "lr_study"
SUMMARY = ROOT / "bench" / "results" / "lr_study.json"
FIGURES = ROOT / "docs" / "figures"

HELD_OUT_EVERY = 20
SWEEP_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
SEEDS = (0, 1, 2)
OPTIMIZERS = ("AdamW", "Muon", "NorMuon", "SOAP", "KLSOAP")
VARIANTS = ("Muon-router-adamw", "Muon-bf16", "Muon-int8")
SOAP_VARIANTS = ("SOAP-cholqr", "KLSOAP-cholqr")
"""The SOAP family with ``basis="cholqr"`` (a unit of expert matrices refreshed at once): runs of a ``list:`` phase."""
UPDATE_RMS = 0.2


# ---------------------------------------------------------------------------------------------------------------
# Data


def tokenize(out: Path = TOKENS) -> None:
    """Tokenize the corpus (``python -m torchtitan_ext.data``'s) into one stream of training documents and one
    of held-out documents (every :data:`HELD_OUT_EVERY`-th), each document followed by the end token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DATA / "tokenizer" / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|end_of_text|>")
    streams: dict[str, list[int]] = {"train": [], "val": []}
    with open(DATA / "corpus" / "stdlib.jsonl") as f:
        for i, line in enumerate(f):
            ids = tokenizer.encode(json.loads(line)["text"]).ids + [eos]
            streams["val" if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"].extend(ids)
    payload = {k: torch.tensor(v, dtype=torch.int16) for k, v in streams.items()}
    payload["vocab"] = tokenizer.get_vocab_size()
    torch.save(payload, out)
    print(f"{out}: {len(streams['train']):,} training and {len(streams['val']):,} held-out tokens")


def batch(stream: torch.Tensor, index: int, size: int, seq: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of a stream: ``size`` windows of ``seq + 1`` tokens at starts drawn from a generator
    seeded by (index, salt) alone, so every run sees the same batches."""
    g = torch.Generator().manual_seed(1_000_003 * salt + index)
    starts = torch.randint(0, stream.numel() - seq - 1, (size, 1), generator=g).to(stream.device)
    windows = stream[starts + torch.arange(seq + 1, device=stream.device)].long()
    return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 1024
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    ffn: int = 2816  # dense SwiGLU width
    experts: int = 0  # 0: dense
    expert_ffn: int = 384
    top_k: int = 4
    capacity_factor: float = 2.0
    balance_coefficient: float = 0.01
    vocab: int = 2048
    seq: int = 512


MODELS = {
    "moe": ModelConfig(experts=32),
    "dense": ModelConfig(),
}
QUICK_MODELS = {
    "moe": ModelConfig(dim=64, layers=2, heads=4, kv_heads=2, experts=8, expert_ffn=32, top_k=2, seq=32),
    "dense": ModelConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn=160, seq=32),
}


def rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [batch, heads, seq, head_dim] (halves rotated)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """SwiGLU experts as ``[E, m, n]`` stacks (w1, w3: [E, width, dim]; w2: [E, dim, width])."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(c.experts, c.expert_ffn, c.dim))
        self.w3 = nn.Parameter(torch.empty(c.experts, c.expert_ffn, c.dim))
        self.w2 = nn.Parameter(torch.empty(c.experts, c.dim, c.expert_ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [E, capacity, dim]
        w1, w3, w2 = (w.to(x.dtype) for w in (self.w1, self.w3, self.w2))
        hidden = F.silu(torch.bmm(x, w1.transpose(1, 2))) * torch.bmm(x, w3.transpose(1, 2))
        return torch.bmm(hidden, w2.transpose(1, 2))


class MoE(nn.Module):
    """Top-k softmax routing (weights renormalized over the k chosen), tokens sent to their experts in slots of
    capacity ⌈factor·T·k/E⌉ (a token past its expert's capacity is dropped from that expert), and the balance
    loss E·Σᵢ fᵢ·Pᵢ (fᵢ: the share of routed slots, Pᵢ: the mean router probability of expert i).

    No step waits for the device: a dropped choice is sent to one spare slot past the experts' and reads a zero
    row back, instead of being removed by a boolean mask (which copies its count to the host). Positions are
    integers, so the layer computes what the masked form did."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        self.experts = Experts(c)
        self.balance = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, shape = self.c, x.shape
        x = x.reshape(-1, c.dim)
        tokens = x.shape[0]
        logits = self.router(x)
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)  # bf16 logits in fp32
        weights, chosen = probs.topk(c.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        # [experts, choices]: the running count along the inner dimension (a scan along the outer one, with
        # a column per expert, took half of a step's device time)
        onehot = torch.zeros(c.experts, flat.numel(), dtype=torch.int32, device=x.device)
        onehot.scatter_(0, flat[None], 1)
        position = (onehot.cumsum(1) - 1).gather(0, flat[None]).squeeze(0)
        capacity = math.ceil(c.capacity_factor * tokens * c.top_k / c.experts)
        spare = c.experts * capacity
        slot = torch.where(position < capacity, flat * capacity + position, spare)
        source = torch.arange(tokens, device=x.device).repeat_interleave(c.top_k)
        slots = x.new_zeros(spare + 1, c.dim).index_copy(0, slot, x[source])
        out = self.experts(slots[:spare].view(c.experts, capacity, c.dim)).reshape(-1, c.dim)
        out = torch.cat((out, out.new_zeros(1, c.dim)))[slot] * weights.reshape(-1, 1).to(out.dtype)
        share = onehot.sum(1).to(probs.dtype) / flat.numel()
        self.balance = c.experts * (share * probs.mean(0)).sum()
        return x.new_zeros(tokens, c.dim).index_add(0, source, out.to(x.dtype)).view(shape)


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.moe = MoE(c) if c.experts else None
        self.feed_forward = None if c.experts else FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.moe is not None else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def init_weights(self) -> None:
        """N(0, 0.02) for every matrix; the residual outputs (wo, w2) by 1/√(2·layers); norms at 1."""
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                residual = {"wo", "w2"} & set(name.split("."))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.c.layers) if residual else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def balance_loss(self) -> torch.Tensor:
        return sum(layer.moe.balance for layer in self.layers if layer.moe is not None)


# ---------------------------------------------------------------------------------------------------------------
# Runs


@dataclass(frozen=True)
class Run:
    """One training run: a model of :data:`MODELS`, an optimizer (:data:`OPTIMIZERS`, :data:`VARIANTS` or
    :data:`SOAP_VARIANTS`), its lr, the seed of the initialization, the batch in sequences, the steps, and the phase
    that asked for it."""

    model: str
    optimizer: str
    lr: float
    seed: int
    batch: int = 16
    steps: int = 500
    phase: str = "sweep"

    @property
    def name(self) -> str:
        return f"{self.model}_{self.optimizer}_lr{self.lr:g}_seed{self.seed}_batch{self.batch}_steps{self.steps}"


def build_optimizer(run: Run, model: Transformer, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of a run, as a user builds it (module docstring)."""
    import dtensor_muon

    common = dict(lr=run.lr, weight_decay=0.1)
    cpu = {} if device.type == "cuda" else dict(ns_dtype=torch.float32)
    if run.optimizer == "AdamW":
        return torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda", **common)
    family, _, variant = run.optimizer.partition("-")
    if family in ("SOAP", "KLSOAP"):
        basis = {"basis": variant} if variant else {}
        front = getattr(dtensor_muon, family)
        return front(
            model.named_parameters(), match_update_rms=UPDATE_RMS, precondition_frequency=10, **basis, **common
        )
    front = getattr(dtensor_muon, family)
    options = dict(adjust_lr_fn="match_rms_adamw", **common, **cpu)
    if variant in ("bf16", "int8"):
        options["momentum_dtype"] = {"bf16": "bfloat16", "int8": "int8"}[variant]
    if variant == "router-adamw":
        routers = [n for n, _ in model.named_parameters() if ".router." in n]
        return front(dtensor_muon.muon_param_groups(model, adamw_names=routers), **options)
    return front(model.named_parameters(), **options)


def schedule(steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to 0.1."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(
    run: Run,
    quick: bool = False,
    deadline: float = math.inf,
    config: ModelConfig | None = None,
    after_step: Callable[[torch.optim.Optimizer], None] | None = None,
    progress_every: int = 0,
    state_dir: Path | None = None,
    until_step: int | None = None,
    tokens: Path = TOKENS,
) -> dict | None:
    """Train one run; its record (curves, final losses, time), or None when it stopped first: at the deadline, or
    at step ``until_step`` (the step reached, its rate and the last held-out loss then go to stderr).

    ``config`` replaces the model's (:data:`MODELS`, :data:`QUICK_MODELS` with ``quick``); ``after_step`` is
    called with the optimizer after each step (other benches use it to probe the optimizer's state);
    ``progress_every`` > 0 prints the step and its rate to stderr every that many steps. With ``state_dir``, a
    run that stops saves its model, optimizer, schedule and curves to ``<state_dir>/<name>.pt``, and a run that
    finds that file continues from it: the finished record equals an uninterrupted run's (every batch is a
    function of its step, and nothing else draws random numbers). ``tokens``: the file :func:`tokenize` writes."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(2)
    data = torch.load(tokens)
    c = replace(config or (QUICK_MODELS if quick else MODELS)[run.model], vocab=int(data["vocab"]))
    train_stream, val_stream = data["train"].to(device), data["val"].to(device)
    torch.manual_seed(run.seed)
    model = Transformer(c)
    model.init_weights()
    model.to(device)
    opt = build_optimizer(run, model, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(run.steps, warmup=max(1, run.steps // 10)))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    eval_every = max(1, run.steps // 20)
    val_batches = [batch(val_stream, i, 16, c.seq, salt=2) for i in range(2 if quick else 8)]

    def validate() -> float:
        model.eval()
        with torch.no_grad(), autocast:
            losses = [F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) for x, y in val_batches]
        model.train()
        return float(torch.stack(losses).mean())

    state_file = None if state_dir is None else Path(state_dir) / f"{run.name}.pt"
    first, earlier_s, train_curve = 0, 0.0, []
    if state_file is not None and state_file.exists():
        saved = torch.load(state_file, map_location=device, weights_only=False)  # written by this function
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        first, earlier_s, val_curve = saved["step"], saved["seconds"], saved["val"]
        train_curve = [torch.tensor(v, device=device) for v in saved["train"]]
        print(f"{run.name}: continues from step {first}", file=sys.stderr, flush=True)
    else:
        val_curve = [(0, validate())]
    start = time.perf_counter()
    for step in range(first, run.steps):
        if time.time() > deadline or step == until_step:
            rate = (time.perf_counter() - start) / max(1, step - first)
            saved_to = ""
            if state_file is not None:
                state_file.parent.mkdir(parents=True, exist_ok=True)
                state = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "step": step,
                    "seconds": earlier_s + time.perf_counter() - start,
                    "val": val_curve,
                    "train": [float(v) for v in train_curve],
                }
                torch.save(state, state_file)
                saved_to = f"; saved to {state_file}"
            print(
                f"{run.name}: stopped at step {step} of {run.steps} ({rate:.2f} s a step), "
                f"held-out loss {val_curve[-1][1]:.4f} at step {val_curve[-1][0]}{saved_to}",
                file=sys.stderr,
                flush=True,
            )
            return None
        x, y = batch(train_stream, step, run.batch, c.seq, salt=1)
        with autocast:
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        total = loss + c.balance_coefficient * model.balance_loss() if c.experts else loss
        total.backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        if after_step is not None:
            after_step(opt)
        sched.step()
        opt.zero_grad(set_to_none=True)
        train_curve.append(loss.detach())
        if (step + 1) % eval_every == 0 or step + 1 == run.steps:
            val_curve.append((step + 1, validate()))
        if progress_every and (step + 1) % progress_every == 0:
            rate = (time.perf_counter() - start) / (step + 1 - first)
            print(f"{run.name}: step {step + 1} of {run.steps}, {rate:.2f} s a step", file=sys.stderr, flush=True)
    seconds = earlier_s + time.perf_counter() - start
    if state_file is not None:
        state_file.unlink(missing_ok=True)
    train_losses = [float(v) for v in torch.stack(train_curve).cpu()]
    return {
        **asdict(run),
        "name": run.name,
        "config": asdict(c),
        "train": train_losses,
        "val": val_curve,
        "final_val": val_curve[-1][1],
        "final_train": statistics.fmean(train_losses[-20:]),
        "seconds": seconds,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def in_processes(fn: Callable[..., R], jobs: list[tuple], workers: int) -> list[R]:
    """``fn(*job)`` for every job, in ``workers`` spawned processes (each its own CUDA context), in job order."""
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return [f.result() for f in [pool.submit(fn, *job) for job in jobs]]


def _worker(
    run: Run, quick: bool, deadline: float, min_run_s: float, results: str, state_dir: str | None
) -> tuple[str, float | None, float]:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    t0 = time.time()
    if deadline - t0 < min_run_s:  # it would not end in time: leave it to a later call
        return run.name, None, 0.0
    try:
        record = train(run, quick, deadline, progress_every=100, state_dir=Path(state_dir) if state_dir else None)
    except Exception as error:  # a failed run is reported, and the others go on
        print(f"{run.name}: failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return run.name, None, time.time() - t0
    if record is None:
        return run.name, None, time.time() - t0
    path = Path(results) / f"{run.name}.json"
    path.write_text(json.dumps(record))
    return run.name, record["final_val"], time.time() - t0


# ---------------------------------------------------------------------------------------------------------------
# Phases


def load(results: Path) -> list[dict]:
    """Every run record written under ``results``."""
    return [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]


def best_lrs(records: list[dict], steps: int) -> dict[tuple[str, str], float]:
    """Per (model, optimizer): the sweep lr with the lowest seed-0 final validation loss at the study batch."""
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for r in records:
        if r["seed"] != 0 or r["batch"] != 16 or r["steps"] != steps or not math.isfinite(r["final_val"]):
            continue
        key = (r["model"], r["optimizer"])
        if key not in best or r["final_val"] < best[key][1]:
            best[key] = (r["lr"], r["final_val"])
    return {k: v[0] for k, v in best.items()}


def phase_runs(phase: str, models: list[str], records: list[dict], steps: int, lrs: tuple[float, ...]) -> list[Run]:
    """The runs of a phase (module docstring), given the records so far (``seeds`` and ``extras`` use the sweep's
    best lrs)."""
    if phase.startswith("list:"):  # explicit runs: list:model/optimizer/lr/seed[/batch],...
        runs = []
        for item in phase.removeprefix("list:").split(","):
            model, optimizer, lr, seed, *rest = item.split("/")
            runs.append(Run(model, optimizer, float(lr), int(seed), int(rest[0]) if rest else 16, steps, "list"))
        return runs
    if phase == "sweep":
        # the middle of the grid first, so a cut phase still brackets each optimizer's best
        order = sorted(lrs, key=lambda lr: abs(math.log10(lr) - math.log10(2e-3)))
        return [Run(m, o, lr, 0, steps=steps) for lr in order for m in models for o in OPTIMIZERS]
    best = best_lrs(records, steps)
    if phase == "seeds":
        return [
            Run(m, o, best[(m, o)], s, steps=steps, phase="seeds")
            for s in SEEDS[1:]
            for m in models
            for o in OPTIMIZERS
            if (m, o) in best
        ]
    if phase == "extras":
        runs = []
        for m in models:
            if (m, "Muon") not in best:
                continue
            lr = best[(m, "Muon")]
            variants = VARIANTS if m == "moe" else VARIANTS[1:]
            runs += [Run(m, v, lr, s, steps=steps, phase="extras") for s in SEEDS for v in variants]
            if m == "moe":
                from dtensor_muon import batch_scaled_lr

                scaled = batch_scaled_lr(lr, 32, 16)
                runs += [
                    Run(m, o, x, 0, batch=32, steps=steps, phase="extras") for o in ("Muon",) for x in (lr, scaled)
                ]
        return runs
    raise ValueError(f"phase: expected sweep, seeds, extras or list:..., got {phase!r}")


def run_phases(args: argparse.Namespace) -> None:
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.deadline_s
    context = get_context("spawn")
    for phase in args.phases:
        done = {p.stem for p in results.glob("*.json")}
        runs = phase_runs(phase, args.models, load(results), args.steps, tuple(args.lrs))
        runs = [r for r in runs if r.name not in done]
        if args.optimizers:
            runs = [r for r in runs if r.optimizer in args.optimizers]
        print(f"phase {phase}: {len(runs)} runs to do", flush=True)
        with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
            futures = [
                pool.submit(_worker, r, args.quick, deadline, args.min_run_s, str(results), args.state_dir)
                for r in runs
            ]
            for future in as_completed(futures):
                name, final, seconds = future.result()
                status = f"{final:.4f}" if final is not None else "not finished"
                print(f"  {name}: final val {status} ({seconds:.0f} s)", flush=True)
        if time.time() > deadline:
            print("deadline reached", flush=True)
            return


# ---------------------------------------------------------------------------------------------------------------
# Report


def steps_to_reach(val: list[list[float]], target: float) -> float | None:
    """The first step at which a validation curve reaches ``target`` (linear between evaluations)."""
    for (s0, v0), (s1, v1) in itertools.pairwise(val):
        if v1 <= target:
            return s1 if v0 == v1 else s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
    return None


def mean_curve(records: list[dict]) -> list[list[float]]:
    steps = [s for s, _ in records[0]["val"]]
    return [[s, statistics.fmean(r["val"][i][1] for r in records)] for i, s in enumerate(steps)]


def report(args: argparse.Namespace) -> None:
    records = load(Path(args.results))
    steps = args.steps
    best = best_lrs(records, steps)
    rows, sweep, curves = [], [], {}
    for model, optimizer in sorted(best):
        sweep.append(
            {
                "model": model,
                "optimizer": optimizer,
                **{
                    f"lr {r['lr']:g}": round(r["final_val"], 4)
                    for r in sorted(records, key=lambda r: r["lr"])
                    if (r["model"], r["optimizer"], r["seed"], r["batch"], r["steps"])
                    == (model, optimizer, 0, 16, steps)
                },
            }
        )
    for model in sorted({m for m, _ in best}):
        groups = {}
        for optimizer in (*OPTIMIZERS, *VARIANTS, *SOAP_VARIANTS):
            lr = best.get((model, optimizer), best.get((model, "Muon")) if optimizer in VARIANTS else None)
            chosen = [
                r
                for r in records
                if (r["model"], r["optimizer"], r["batch"], r["steps"]) == (model, optimizer, 16, steps)
                and r["lr"] == lr
            ]
            if chosen:
                groups[optimizer] = (lr, chosen)
        adamw = groups.get("AdamW")
        target = statistics.fmean(r["final_val"] for r in adamw[1]) if adamw else None
        muon_by_seed = {r["seed"]: r["final_val"] for r in groups.get("Muon", (None, []))[1]}
        for optimizer, (lr, chosen) in groups.items():
            finals = [r["final_val"] for r in chosen]
            paired = [r["final_val"] - muon_by_seed[r["seed"]] for r in chosen if r["seed"] in muon_by_seed]
            curve = mean_curve(chosen)
            reach = steps_to_reach(curve, target) if target is not None else None
            curves[f"{model}/{optimizer}"] = curve
            rows.append(
                {
                    "model": model,
                    "optimizer": optimizer,
                    "lr": lr,
                    "seeds": len(chosen),
                    "final val": round(statistics.fmean(finals), 4),
                    "spread": round(max(finals) - min(finals), 4),
                    "vs AdamW": round(statistics.fmean(finals) - target, 4) if target is not None else None,
                    "steps to AdamW's final": None if reach is None else round(reach),
                    "fraction of AdamW's steps": None if reach is None else round(reach / steps, 2),
                    "vs Muon, same seeds": round(statistics.fmean(paired), 4)
                    if optimizer in VARIANTS and paired
                    else None,
                    "s per run": round(statistics.fmean(r["seconds"] for r in chosen), 1),
                }
            )
    batch_rows = [
        {
            "model": r["model"],
            "optimizer": r["optimizer"],
            "batch": r["batch"],
            "lr": r["lr"],
            "final val": round(r["final_val"], 4),
        }
        for r in records
        if r["batch"] != 16
    ]
    from common import markdown_table

    for title, table in (
        ("sweep (seed 0, final validation loss)", sweep),
        ("at the best lr", rows),
        ("batch", batch_rows),
    ):
        if table:
            keys = list(dict.fromkeys(k for row in table for k in row))
            print(f"\n### {title}\n\n{markdown_table(table, [(k, k, '{}') for k in keys])}")
    summary = {"steps": steps, "sweep": sweep, "best": rows, "batch": batch_rows, "curves": curves}
    if records:
        devices = Counter(record["device"] for record in records)
        summary["machine"] = {"runs per device": dict(devices), "torch": sorted({r["torch"] for r in records})}
    Path(args.summary).write_text(json.dumps(summary, indent=1))
    draw(curves, Path(args.figures))


def draw(curves: dict[str, list[list[float]]], folder: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figures", file=sys.stderr)
        return
    folder.mkdir(parents=True, exist_ok=True)
    for model in sorted({k.split("/")[0] for k in curves}):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, curve in curves.items():
            if key.startswith(model + "/"):
                s, v = zip(*curve[1:])
                ax.plot(s, v, label=key.split("/")[1])
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (mean over seeds)")
        ax.set_title(f"{model}: each optimizer at its best lr")
        ax.legend()
        ax.grid(alpha=0.3)
        low = min(v for k, c in curves.items() if k.startswith(model + "/") for _, v in c)
        ax.set_ylim(low - 0.1, low + 2.0)
        fig.tight_layout()
        fig.savefig(folder / f"lr_study_{model}.png", dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tokens")
    run_parser = sub.add_parser("run")
    run_parser.add_argument("--phases", nargs="+", default=["sweep", "seeds", "extras"])
    run_parser.add_argument("--models", nargs="+", default=list(MODELS))
    run_parser.add_argument("--optimizers", nargs="*", default=[])
    run_parser.add_argument("--workers", type=int, default=6)
    run_parser.add_argument(
        "--deadline-s", type=float, default=math.inf, help="stop the runs still going after this many s"
    )
    run_parser.add_argument("--min-run-s", type=float, default=0.0, help="start no run with less time left")
    run_parser.add_argument("--lrs", nargs="+", type=float, default=list(SWEEP_LRS), help="the sweep's lrs")
    run_parser.add_argument(
        "--state-dir",
        default=None,
        help="runs stopped by the deadline save their state here; later calls continue them",
    )
    run_parser.add_argument(
        "--quick", action="store_true", help="tiny models, 6 steps, the sweep at 1e-2 only: a smoke run"
    )
    report_parser = sub.add_parser("report")
    report_parser.add_argument("--summary", default=str(SUMMARY))
    report_parser.add_argument("--figures", default=str(FIGURES))
    for p in (run_parser, report_parser):
        p.add_argument("--results", default=str(RESULTS))
        p.add_argument("--steps", type=int, default=500)
    args = parser.parse_args(argv)
    if args.command == "tokens":
        tokenize()
    elif args.command == "run":
        if args.quick:
            args.steps, args.lrs = 6, [1e-2]
        run_phases(args)
    else:
        report(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
