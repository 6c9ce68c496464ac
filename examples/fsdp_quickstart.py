"""Quickstart: a small transformer trained with FSDP2 and dtensor_muon.Muon, checkpointed with DCP, resumed.

    torchrun --nproc_per_node 2 examples/fsdp_quickstart.py   # 2 processes: gloo on CPU, NCCL on GPUs
    python examples/fsdp_quickstart.py                        # the same; forks the 2 processes itself

    python examples/fsdp_quickstart.py --steps 30 --save-at 15 --checkpoint-dir /tmp/ckpt
    python examples/fsdp_quickstart.py --steps 30 --resume --checkpoint-dir /tmp/ckpt  # steps 15-29, same losses

What it shows:
- ``fully_shard`` per block and at the root; several matrices have an odd number of rows (77, 53), so their
  shards on 2 ranks are uneven;
- ``Muon(model.named_parameters(), ...)``: the block matrices get Muon, the embedding, the output head and
  the norms AdamW (by name and ndim);
- a warmup + cosine ``LambdaLR`` (it scales the Muon and the AdamW groups), ``clip_grad_norm_`` on the
  DTensor gradients, ``opt.metrics`` logged on rank 0;
- model + optimizer + scheduler + step saved with ``torch.distributed.checkpoint`` and loaded by ``--resume``,
  which continues with the same losses, bit for bit (give it the same ``--steps``: the schedule depends on it).
"""

import argparse
import json
import math
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dtensor_muon import Muon, exit_without_finalization

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 53, 36, 3, 77, 2, 32, 16
PERM = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))  # the rule the model has to learn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)  # 77 rows: shards of 39 and 38
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.wo(y)
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)  # "tok_embeddings" and "output": AdamW, by name
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h))


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data, a function of (step, rank) only: a random first token, then x[t] = PERM[x[t-1]]."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    for t in range(1, SEQ + 1):
        x[:, t] = PERM[x[:, t - 1]]
    return x[:, :-1].to(device), x[:, 1:].to(device)


def warmup_cosine(total: int, warmup: int = 5):
    """LR factor: linear warmup, then cosine from 1 down to 0.1 at the last step."""

    def factor(s: int) -> float:
        return (s + 1) / warmup if s < warmup else 0.55 + 0.45 * math.cos(math.pi * (s - warmup) / (total - warmup))

    return factor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-at", type=int, help="save a DCP checkpoint after this many steps")
    parser.add_argument("--checkpoint-dir", default="checkpoints/fsdp_quickstart")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint-dir, continue to --steps")
    parser.add_argument("--print-losses-json", metavar="PATH", help="rank 0 writes the per-step losses here")
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()

    cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])  # one GPU per process, else CPU
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial weights on every rank; fully_shard keeps each rank's rows
    model = TinyLM().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model.named_parameters(), lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps))

    def checkpoint_state(step: int) -> dict:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "extra": {"step": step, "scheduler": sched.state_dict()}}

    start = 0
    if args.resume:
        state = checkpoint_state(0)
        dcp.load(state, checkpoint_id=args.checkpoint_dir)  # fills the tensors in place, replaces "extra"
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["extra"]["scheduler"])
        start = state["extra"]["step"]
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {start}", flush=True)

    losses = []
    for step in range(start, args.steps):
        inputs, targets = batch(step, rank, device)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # global norm, a DTensor
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # sum over ranks (gloo has no AVG)
        losses.append(mean_loss.item() / world)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            m = opt.metrics
            print(
                f"step {step:3d}  loss {losses[-1]:.4f}  lr {lr:.4f}  grad_norm {grad_norm.full_tensor():.3f}  "
                f"muon: {m['muon/time_step_ms']:.1f} ms, {m['muon/bytes_sent'] / 1e3:.1f} kB sent, "
                f"imbalance {m['muon/plan_imbalance']:.2f}, update rms {m['muon/update_rms/muon']:.4f}",
                flush=True,
            )
        if args.save_at == step + 1:
            dcp.save(checkpoint_state(step + 1), checkpoint_id=args.checkpoint_dir)  # overwrites an older one
            if rank == 0:
                print(f"saved {args.checkpoint_dir} after step {step}", flush=True)

    if rank == 0 and args.print_losses_json:
        with open(args.print_losses_json, "w") as f:
            json.dump({"first_step": start, "losses": losses}, f)
    dist.destroy_process_group()


def forked_worker(local_rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))  # torchrun's default too: 1 thread each
    main()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        main()
        exit_without_finalization()  # gloo can abort during finalization: docs/limits.md
    else:  # plain `python`: fork 2 workers (no second import of torch) and give them torchrun's environment
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.start_processes(forked_worker, args=(2, port), nprocs=2, start_method="fork")
