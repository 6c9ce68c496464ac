"""The whole optimizer step on a real model's parameter shapes: dtensor_muon.Muon vs torch.optim.Muon + AdamW
vs fused AdamW, side by side in one process on one device; with the host overhead of each step and, per
world size, the busiest FSDP rank's share of dtensor_muon's work.

    PYTHONPATH=src python bench/optimizer_step.py --model llama3_8b --layers 16
    PYTHONPATH=src python bench/optimizer_step.py --model deepseek_v3_16b --layers 12
    PYTHONPATH=src python bench/optimizer_step.py --model qwen3_30b_a3b --layers 8 --world-size 8,64,256
    PYTHONPATH=src python bench/optimizer_step.py --model kimi_k2 --layers 2 --experts 48 --world-size 8,64
    PYTHONPATH=src python bench/optimizer_step.py --quick [--model qwen3_30b_a3b] [--world-size 8]  # CPU, seconds

Models (``--model``): ``llama3_8b`` (torchtitan llama3 "8B"), ``deepseek_v3_16b`` (deepseek_v3 "16B"),
``qwen3_30b_a3b`` (qwen3 "30B-A3B": 48 layers, 128 experts of 768×2048 per layer, no shared expert) and
``kimi_k2``: Kimi K2's shapes, a DeepSeek-V3 architecture (dim 7168, 61 layers, the first dense with inter_dim
18432, 384 routed experts of moe_inter_dim 2048 and 1 shared expert, 64 heads, q_lora_rank 1536,
kv_lora_rank 512, head dims 128/64/128, vocab 163840). torchtitan 0.2.2 has no Kimi flavor: its arguments are
built from ``DeepSeekV3ModelArgs`` with these values (:data:`KIMI_K2_ARGS`).

The parameter set is the torchtitan model's own (built on the meta device, first ``--layers`` layers; the
embeddings, final norm and head always), in fp32 with random fixed-seed values and gradients (one gradient
per parameter, the same at every step). Where torchtitan does not import (the GPU image) the same shapes come
from a built-in table (:data:`BUILTIN_ARGS`, :func:`builtin_shapes`; the tests check it against torchtitan).
``--experts N`` keeps the first N experts of every MoE layer (the router's gate then has N rows), so that a
slice of a large MoE model fits one device. ``--quick`` takes a small flavor of the family (``debugmodel``,
Qwen3's ``debugmodel_moe``, Kimi K2's own arguments) shrunk to width 64 (:data:`QUICK_ARGS`).
One parameter set is allocated and kept; before each optimizer its values and gradients are regenerated from
the same seeds, and each optimizer's state is freed before the next. Optimizers:

- ``dtensor_muon.Muon(model.named_parameters(), ...)``: Muon on the matrices, AdamW on embeddings, head
  and norms (its routing).
- ``torch.optim.Muon`` on the same matrices + ``torch.optim.AdamW`` (fused on CUDA) on the rest.
  torch.optim.Muon takes 2-D parameters only, so each 3-D expert weight ``[E, m, n]`` is handed to it as
  E 2-D parameters that are views of the same storage (expert e's slice, with gradient slice e): the same
  E Newton–Schulz problems, one at a time.
- ``torch.optim.AdamW`` (fused on CUDA) on every parameter.
- with ``--momentum-dtypes bfloat16 int8``: ``dtensor_muon.Muon(..., momentum_dtype=...)`` in each format;
- with ``--units-per-stack N ...``: ``dtensor_muon.Muon`` computing up to N same-size units of one shape in one
  Newton–Schulz call (``dtensor_muon.kernels.batching.stack_units``), one row per N; ``N:NAME=VALUE`` also sets
  a constant of the dispatch around its steps (``bench/dispatch_settings.py``), e.g.
  ``8:STACK_MAX_SIDE=2048`` to stack 1408-wide experts too;
- with ``--skip-references``: ``dtensor_muon.Muon``'s rows alone (no torch.optim rows, no update comparison, no
  "× AdamW"; the result file's name ends in ``_muon_only``), so that a whole step that fits a card beside its
  own state but not beside the references' (Qwen3-30B-A3B's 8 layers on an 80 GB H100) can still be timed;
- with ``--offload``: ``dtensor_muon.Muon(..., offload="host")`` (momentum and AdamW moments in pinned host
  memory, streamed through the GPU each step), and on CUDA the card's pinned copy rates (host to device,
  device to host, both at once on two streams: :func:`copy_rates`) with the bytes the offload moves each way.

Every optimizer gets lr 0.02, weight decay 0.1, AdamW betas (0.9, 0.95), eps 1e-8; both Muons momentum 0.95,
Nesterov, 5 Newton–Schulz steps in bf16, Keller's coefficients, ``adjust_lr_fn=None`` (torch's default).
Reported per optimizer: median step time over ``--steps`` steps after ``--warmup`` (host clock, device
synchronized around each step), memory allocated after construction (before the first step; dtensor_muon
creates its state eagerly, torch lazily) and the peak over the steps (CUDA only). Also the largest
difference between the two Muons' updates, per parameter kind (2-D matrices, expert slices, AdamW
parameters), relative to the largest update of torch's: on CPU with the same arguments it is 0 (seen for all
three kinds). On CUDA it is taken over the first ``--check-params`` parameters of each kind only (a copy of
each is kept on the host); there the two Muons' bf16 Newton–Schulz runs different kernels.

Host overhead, per optimizer, after its timed steps (both extra steps count in the update comparison, which
sees the same number of steps from both Muons):

- one step unprofiled, the device synchronized before it and only at its end: ``host ms`` is the time until
  ``step()`` returns (the host issuing the work; where the optimizer itself waits on the device, that wait is
  in it), ``wall ms`` the time until the device has finished;
- one step under ``torch.profiler``: on CUDA, ``launches`` counts the host's kernel-launch runtime calls
  (``cudaLaunchKernel``, ``cudaLaunchKernelExC``, ``cuLaunchKernel``, ``cuLaunchKernelEx``, ``cudaGraphLaunch``:
  one graph launch counts once, whatever it replays) and ``device ms`` sums the durations of the device
  activities the profiler records (kernels, memcpy, memset; kernels replayed inside a CUDA graph count
  where the profiler reports them). On CPU there are no launches: ``launches`` is then the count of top-level
  aten ops (an ``aten::`` event with no ``aten::`` ancestor), a proxy for the same host work, and there is no
  device time.

On CUDA it also prints the Newton–Schulz FLOP floor of the Muon matrices: their 5-step FLOPs, counted with
symmetric products (3m²n + m³ per iteration, m ≤ n) and plainly (4m²n + 2m³), over the bf16 8192³ matmul
rate measured in the same run; and the step's floor, that NS floor (symmetric) plus the state traffic no step
can avoid at the device-to-device copy rate measured in the same run (each byte read or written counted once):
per Muon parameter the fp32 gradient read (4 bytes), the fp32 momentum read and written (8) and the fp32
parameter read and written (8), 20 bytes (:data:`MUON_STATE_BYTES`); per AdamW parameter 28 (the gradient 4,
the parameter 8, two moments 16: :data:`ADAMW_STATE_BYTES`). The products and the state's passes share one
device's time, so the floors add. "× NS floor" and "× step floor" are the median step over each.

Per-rank view (``--world-size W``, repeatable or a comma list): the Muon parameters are laid out as FSDP2 lays
them over W ranks (``Shard(0)``, ``dtensor_muon.plan.simulate.fsdp_layout``) and planned by
``dtensor_muon.plan.build_plan`` with ``MuonRule.cost`` (as the optimizer plans them; bf16 wire, the default
bucket size). The busiest rank (the largest planned FLOPs; the lowest such rank) is then timed alone on this
device, with real random data and no communication. Its share per step, in the optimizer's order:

- the momentum step (``B.lerp_(g)``, then the Nesterov input) on its FSDP shard of every Muon parameter, all shards
  at once as the optimizer runs them (``momentum_steps``: a fused pass per large shard, multi-tensor lerps for the rest);
- every unit it computes (owned and local), as one tensor ``[B, m, n]`` or ``[m, n]``: bf16 for an owned unit
  (it arrives on the bf16 wire), for a local one as the momentum pass writes U (bf16 on CUDA, fp32 elsewhere),
  through ``MuonRule.direction``
  with the optimizer's Newton–Schulz runner (``NewtonSchulzGraphs`` on CUDA, ``newton_schulz`` elsewhere); with
  ``--units-per-stack N``, also a row per N whose same-size units of one shape and origin run N to a call
  (:func:`stacked_calls`, the dispatch deciding as for one unit; a stack that gathers several parameters' local
  units copies their runs into one input every step, as the engine does);
- the apply (``θ·(1 − γλ) − γ'·O``) on its shard of every Muon parameter, O taken from a preallocated buffer;
- AdamW on its shard of every other parameter, as the optimizer runs it (``rules.adamw.step``: torch's fused AdamW
  on CUDA with the step counts on the host, foreach elsewhere).

Not included: the exchanges (the all-to-all of U to the owners and of O back), packing and unpacking their
buffers, the optimizer's metrics and non-finite checks, and the host work of planning. Reported per W: the
busiest rank's planned FLOPs (its units' ``MuonRule.cost``, = max of the plan's per-rank FLOPs) and the mean,
its share ms and the units' Newton–Schulz alone (ns ms), its NS floor (the units' FLOPs with symmetric products
over the measured matmul rate; CUDA only) and share/floor, its step floor (the NS floor plus the state traffic
of its shards at the copy rate, as for the whole step) and share/step floor; the share's steps issued back to
back (share ms back to back: the mean step of a block of ``--steps`` steps with the device synchronized at the
block's ends only, the median of 3 blocks: the pace of a training loop whose host runs ahead of the device,
where a step's host work before its first kernel overlaps the work still queued) and its ratio to the step
floor, and for a profiled block of max(``--steps``, 10) such steps the device's busy ms a step and its idle ms
a step between its first activity and its last (near 0: the steps are device-bound; the profiler's own host
cost makes it an upper bound); the same share as a step of several ranks runs it (transactional share ms: the
momentum pass gives U without advancing the buffer; after the directions are queued the host reads the step's
failure flag beside the queued work once the momentum pass is done, as the consensus all-reduce's result is read:
it follows the exchanges out, which follow that pass, while the exchanges back are held until it; then the buffer
advances in a second pass, so that a step that fails on any rank changes nothing), synchronized around each step
and back to back; and back to back with the flag read after the directions instead (flag after directions back to
back: a consensus that followed exchanges back launched as each bucket was computed, so it waited for the device's
directions and the host work after it was not hidden by queued work); the share without Newton–Schulz (element-wise
ms: the momentum pass, the apply and AdamW on its other shards) against the traffic floor of its shards' state at
the copy rate (CUDA only) and their ratio, with its host ms (the median over the timed steps of the time until the
call returns, the device synchronized before it), device ms and launches (one profiled call, as for the whole
step's host overhead below), and the whole share's host ms, device ms and launches; beside it a fused AdamW step
(foreach on CPU) over the same rank's FSDP shard of every parameter (about 1/W of each): AdamW share ms.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import importlib
import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from common import benchmark_parser, markdown_table, median, write_result
from dispatch_settings import TUNABLES, number, settings
from torch import nn
from torch.autograd import DeviceType

from dtensor_muon import AttentionHeads, Muon
from dtensor_muon.distributed.layout import box_shape
from dtensor_muon.distributed.side_streams import CONSENSUS, beside_queued_work
from dtensor_muon.kernels.batching import group_into_stacks, holder_stack_keys, stack_units, stacking_pays
from dtensor_muon.kernels.elementwise import decay_and_add_many, momentum_steps
from dtensor_muon.kernels.shapes import decide_as_batch
from dtensor_muon.linalg.newton_schulz import newton_schulz
from dtensor_muon.linalg.ns_graphs import NewtonSchulzGraphs
from dtensor_muon.plan import Plan, build_plan, matrix_shape
from dtensor_muon.plan.placement import Local, Owned
from dtensor_muon.plan.routing import uses_muon
from dtensor_muon.plan.simulate import MODEL_FAMILIES, fsdp_layout
from dtensor_muon.rules import adamw as adamw_rule
from dtensor_muon.rules.muon import MuonRule

Shapes = list[tuple[str, tuple[int, ...]]]

MODELS = {
    "llama3_8b": ("llama3", "8B"),
    "deepseek_v3_16b": ("deepseek_v3", "16B"),
    "qwen3_30b_a3b": ("qwen3", "30B-A3B"),
    "kimi_k2": ("deepseek_v3", "kimi_k2"),
}
FAMILIES = {**MODEL_FAMILIES, "qwen3": ("torchtitan.models.qwen3", "Qwen3Model", "qwen3_args")}
QUICK_FLAVOR = "debugmodel"
QUICK_FLAVORS = {"qwen3_30b_a3b": "debugmodel_moe", "kimi_k2": "kimi_k2"}
"""The flavor ``--quick`` shrinks, where it is not :data:`QUICK_FLAVOR`."""
QUICK_EXPERTS = 4
QUICK_ARGS: dict[
    str, dict[str, Any]
] = {  # the small flavors shrunk further: --quick runs in seconds on a busy 2-core CPU
    "llama3": {"dim": 64, "n_heads": 4, "vocab_size": 256, "multiple_of": 32},
    "deepseek_v3": {
        "dim": 64,
        "inter_dim": 128,
        "moe_inter_dim": 32,
        "n_heads": 4,
        "vocab_size": 256,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_experts": QUICK_EXPERTS,
    },
    "qwen3": {
        "dim": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "hidden_dim": 128,
        "moe_inter_dim": 32,
        "num_experts": 16,  # units of two experts (dtensor_muon.plan stacks 1/8 of a parameter's experts)
    },
}
QUICK_FLAVOR_ARGS: dict[tuple[str, str], dict[str, Any]] = {("deepseek_v3", "kimi_k2"): {"q_lora_rank": 32}}
"""Overrides of one flavor under ``--quick``, after its family's :data:`QUICK_ARGS`."""
LR, WEIGHT_DECAY, MOMENTUM, BETAS, ADAM_EPS, NS_STEPS = 0.02, 0.1, 0.95, (0.9, 0.95), 1e-8, 5
MUON_ARGS: dict[str, Any] = dict(
    lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=True, ns_steps=NS_STEPS, adjust_lr_fn=None
)
"""The arguments both Muons get (torch.optim.Muon's names and meaning)."""
BUCKET_BYTES, WIRE_ITEMSIZE = 64 * 2**20, 2  # dtensor_muon.Muon's defaults: 64 MB buckets, bf16 wire
CEILING_SIZE = 8192
GIB = 2**30

KIMI_K2_ARGS: dict[str, Any] = {
    "vocab_size": 163840,
    "dim": 7168,
    "inter_dim": 18432,
    "moe_inter_dim": 2048,
    "n_layers": 61,
    "n_dense_layers": 1,
    "n_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
"""Kimi K2's ``DeepSeekV3ModelArgs`` fields (torchtitan 0.2.2 has no Kimi flavor); its MoE: :data:`KIMI_K2_MOE`."""
KIMI_K2_MOE: dict[str, Any] = {
    "num_experts": 384,
    "num_shared_experts": 1,
    "top_k": 8,
    "score_func": "sigmoid",
    "route_norm": True,
    "route_scale": 2.827,
    "score_before_experts": False,
}

# The torchtitan 0.2.2 model arguments that decide parameter shapes, for machines without torchtitan (the GPU
# image has none); tests/test_bench_product.py and tests/test_bench_moe.py check that they give torchtitan's shapes.
_QWEN3_COMMON = {"head_dim": 128, "qk_norm": True, "enable_weight_tying": False, "num_shared_experts": 0}
BUILTIN_ARGS: dict[tuple[str, str], dict[str, Any]] = {
    ("llama3", "8B"): {
        "dim": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "vocab_size": 128256,
        "multiple_of": 1024,
        "ffn_dim_multiplier": 1.3,
    },
    ("llama3", "debugmodel"): {
        "dim": 256,
        "n_layers": 6,
        "n_heads": 16,
        "n_kv_heads": None,
        "vocab_size": 2048,
        "multiple_of": 256,
        "ffn_dim_multiplier": None,
    },
    ("deepseek_v3", "16B"): {
        "dim": 2048,
        "n_layers": 27,
        "n_dense_layers": 1,
        "n_heads": 16,
        "vocab_size": 102400,
        "inter_dim": 10944,
        "moe_inter_dim": 1408,
        "num_experts": 64,
        "num_shared_experts": 2,
        "q_lora_rank": 0,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    ("deepseek_v3", "debugmodel"): {
        "dim": 256,
        "n_layers": 6,
        "n_dense_layers": 1,
        "n_heads": 16,
        "vocab_size": 2048,
        "inter_dim": 1024,
        "moe_inter_dim": 256,
        "num_experts": 8,
        "num_shared_experts": 2,
        "q_lora_rank": 0,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    ("deepseek_v3", "kimi_k2"): {
        **KIMI_K2_ARGS,
        "num_experts": KIMI_K2_MOE["num_experts"],
        "num_shared_experts": KIMI_K2_MOE["num_shared_experts"],
    },
    ("qwen3", "30B-A3B"): {
        **_QWEN3_COMMON,
        "dim": 2048,
        "n_layers": 48,
        "n_heads": 32,
        "n_kv_heads": 4,
        "vocab_size": 151936,
        "hidden_dim": 6144,
        "moe_enabled": True,
        "moe_inter_dim": 768,
        "num_experts": 128,
    },
    ("qwen3", "debugmodel_moe"): {
        **_QWEN3_COMMON,
        "dim": 256,
        "n_layers": 8,
        "n_heads": 16,
        "n_kv_heads": 8,
        "vocab_size": 2048,
        "hidden_dim": 3072,
        "moe_enabled": True,
        "moe_inter_dim": 768,
        "num_experts": 64,
    },
}


def check_layers(layers: int, available: int, family: str, flavor: str) -> None:
    """Raise unless ``layers`` is in [1, ``available``]."""
    if not 1 <= layers <= available:
        raise ValueError(f"--layers must be in [1, {available}] for {family} {flavor}, got {layers}")


def check_experts(experts: int, available: int, family: str, flavor: str) -> None:
    """Raise unless ``experts`` is in [1, ``available``]."""
    if not 1 <= experts <= available:
        raise ValueError(f"--experts must be in [1, {available}] for {family} {flavor}, got {experts}")


def shape_overrides(family: str, flavor: str, quick: bool) -> dict[str, Any]:
    """The argument values ``--quick`` sets (``num_experts`` stands for ``moe_args.num_experts``)."""
    if not quick:
        return {}
    return {**QUICK_ARGS[family], **QUICK_FLAVOR_ARGS.get((family, flavor), {})}


def torchtitan_args(family: str, flavor: str) -> Any:
    """A fresh copy of torchtitan's model arguments of ``family`` ``flavor`` (Kimi K2: built, see the docstring)."""
    module_name, _, args_name = FAMILIES[family]
    module = importlib.import_module(module_name)
    flavors = getattr(module, args_name)
    if flavor in flavors:
        return copy.deepcopy(flavors[flavor])
    if (family, flavor) == ("deepseek_v3", "kimi_k2"):
        from torchtitan.models.moe import MoEArgs

        return module.DeepSeekV3ModelArgs(**KIMI_K2_ARGS, moe_args=MoEArgs(**KIMI_K2_MOE))
    raise ValueError(f"no {family} flavor {flavor!r}")


def torchtitan_shapes(
    family: str, flavor: str, layers: int | None, quick: bool = False, experts: int | None = None
) -> Shapes:
    """(name, shape) of every parameter of the torchtitan model, built on the meta device."""
    module_name, class_name, _ = FAMILIES[family]
    args = torchtitan_args(family, flavor)
    if layers is not None:
        check_layers(layers, args.n_layers, family, flavor)
        args.n_layers = layers
    for key, value in shape_overrides(family, flavor, quick).items():
        setattr(args.moe_args if key == "num_experts" else args, key, value)
    if experts is not None:
        check_experts(experts, args.moe_args.num_experts, family, flavor)
        args.moe_args.num_experts = experts
    if family == "deepseek_v3" and not hasattr(args, "moe_impl"):
        args.moe_impl = "standard"  # what torchtitan's update_from_config sets (as in dtensor_muon.plan.simulate)
    with torch.device("meta"):
        net = getattr(importlib.import_module(module_name), class_name)(args)
    return [(n, tuple(p.shape)) for n, p in net.named_parameters()]


def builtin_shapes(
    family: str, flavor: str, layers: int | None, quick: bool = False, experts: int | None = None
) -> Shapes:
    """The same list as :func:`torchtitan_shapes`, written out from :data:`BUILTIN_ARGS`."""
    a = {**BUILTIN_ARGS[family, flavor], **shape_overrides(family, flavor, quick)}
    if layers is not None:
        check_layers(layers, a["n_layers"], family, flavor)
        a["n_layers"] = layers
    if experts is not None:
        check_experts(experts, a.get("num_experts", 0), family, flavor)
        a["num_experts"] = experts
    layer_shapes = {"llama3": llama3_layer, "deepseek_v3": deepseek_v3_layer, "qwen3": qwen3_layer}[family]
    d, vocab = a["dim"], a["vocab_size"]
    out: Shapes = [("tok_embeddings.weight", (vocab, d))]
    for i in range(a["n_layers"]):
        out += [(f"layers.{i}.{name}", shape) for name, shape in layer_shapes(a, i)]
    out.append(("norm.weight", (d,)))
    if not a.get("enable_weight_tying", False):  # a tied head is the embedding: named_parameters lists it once
        out.append(("output.weight", (vocab, d)))
    return out


def feed_forward(prefix: str, hidden: int, d: int) -> Shapes:
    """torchtitan's SwiGLU ``FeedForward`` (w1, w2, w3) of width ``hidden`` under ``prefix``."""
    return [
        (prefix + "w1.weight", (hidden, d)),
        (prefix + "w2.weight", (d, hidden)),
        (prefix + "w3.weight", (hidden, d)),
    ]


def moe(a: dict[str, Any], d: int) -> Shapes:
    """torchtitan's ``MoE``: grouped experts, the router's gate, the shared experts (if any)."""
    e, f = a["num_experts"], a["moe_inter_dim"]
    out: Shapes = [
        ("moe.experts.w1", (e, f, d)),
        ("moe.experts.w2", (e, d, f)),
        ("moe.experts.w3", (e, f, d)),
        ("moe.router.gate.weight", (e, d)),
    ]
    if a["num_shared_experts"] > 0:
        out += feed_forward("moe.shared_experts.", f * a["num_shared_experts"], d)
    return out


def llama3_layer(a: dict[str, Any], i: int) -> Shapes:
    """One llama3 ``TransformerBlock``."""
    d = a["dim"]
    head = d // a["n_heads"]
    kv = (a["n_kv_heads"] or a["n_heads"]) * head
    hidden = int(2 * 4 * d / 3)
    if a["ffn_dim_multiplier"] is not None:
        hidden = int(a["ffn_dim_multiplier"] * hidden)
    hidden = a["multiple_of"] * ((hidden + a["multiple_of"] - 1) // a["multiple_of"])
    return [
        ("attention.wq.weight", (d, d)),
        ("attention.wk.weight", (kv, d)),
        ("attention.wv.weight", (kv, d)),
        ("attention.wo.weight", (d, d)),
        *feed_forward("feed_forward.", hidden, d),
        ("attention_norm.weight", (d,)),
        ("ffn_norm.weight", (d,)),
    ]


def deepseek_v3_layer(a: dict[str, Any], i: int) -> Shapes:
    """One deepseek_v3 ``TransformerBlock``: MLA (with a low-rank query where q_lora_rank > 0), then a dense
    feed-forward (the first ``n_dense_layers``) or an MoE."""
    d, heads, rank, q_rank = a["dim"], a["n_heads"], a["kv_lora_rank"], a["q_lora_rank"]
    q_out = heads * (a["qk_nope_head_dim"] + a["qk_rope_head_dim"])
    if q_rank:
        query: Shapes = [
            ("attention.wq_a.weight", (q_rank, d)),
            ("attention.q_norm.weight", (q_rank,)),
            ("attention.wq_b.weight", (q_out, q_rank)),
        ]
    else:
        query = [("attention.wq.weight", (q_out, d))]
    out = query + [
        ("attention.wkv_a.weight", (rank + a["qk_rope_head_dim"], d)),
        ("attention.kv_norm.weight", (rank,)),
        ("attention.wkv_b.weight", (heads * (a["qk_nope_head_dim"] + a["v_head_dim"]), rank)),
        ("attention.wo.weight", (d, heads * a["v_head_dim"])),
        ("attention_norm.weight", (d,)),
        ("ffn_norm.weight", (d,)),
    ]
    return out + (feed_forward("feed_forward.", a["inter_dim"], d) if i < a["n_dense_layers"] else moe(a, d))


def qwen3_layer(a: dict[str, Any], i: int) -> Shapes:
    """One qwen3 ``TransformerBlock``: attention with per-head q/k norms, then an MoE or a dense feed-forward."""
    d, hd, heads = a["dim"], a["head_dim"], a["n_heads"]
    kv = a["n_kv_heads"] or heads
    norms: Shapes = [("attention.q_norm.weight", (hd,)), ("attention.k_norm.weight", (hd,))] if a["qk_norm"] else []
    out = norms + [
        ("attention.wq.weight", (heads * hd, d)),
        ("attention.wk.weight", (kv * hd, d)),
        ("attention.wv.weight", (kv * hd, d)),
        ("attention.wo.weight", (d, heads * hd)),
    ]
    out += moe(a, d) if a["moe_enabled"] else feed_forward("feed_forward.", a["hidden_dim"], d)
    return out + [("attention_norm.weight", (d,)), ("ffn_norm.weight", (d,))]


def parameter_shapes(
    family: str, flavor: str, layers: int | None, quick: bool = False, experts: int | None = None
) -> tuple[Shapes, str]:
    """(shapes, source): torchtitan's meta-built model where torchtitan imports, else :func:`builtin_shapes`."""
    try:
        importlib.import_module(FAMILIES[family][0])
    except ImportError:
        return builtin_shapes(family, flavor, layers, quick, experts), "built-in table (torchtitan not importable)"
    return torchtitan_shapes(family, flavor, layers, quick, experts), "torchtitan meta model"


def model_flavor(model: str, quick: bool = False) -> tuple[str, str]:
    """(family, flavor) of a :data:`MODELS` key: its flavor or, with ``quick``, its cut-down one."""
    family, flavor = MODELS[model]
    return family, QUICK_FLAVORS.get(model, QUICK_FLAVOR) if quick else flavor


def model_shapes(model: str, layers: int | None, quick: bool = False, experts: int | None = None) -> tuple[Shapes, str]:
    """:func:`parameter_shapes` of a :data:`MODELS` key in :func:`model_flavor`'s flavor."""
    family, flavor = model_flavor(model, quick)
    return parameter_shapes(family, flavor, layers, quick, experts)


def ns_flops(shape: tuple[int, ...], steps: int = NS_STEPS) -> tuple[float, float]:
    """Newton–Schulz FLOPs of a Muon parameter: (with symmetric products, plain), over all its matrices."""
    batch = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2:] if len(shape) == 3 else (shape[0], int(torch.Size(shape[1:]).numel()))
    m, n = min(rows, cols), max(rows, cols)
    return batch * steps * (3 * m * m * n + m**3), batch * steps * (4 * m * m * n + 2 * m**3)


def matmul_ceiling(device: torch.device, reps: int = 100) -> dict[str, float]:
    """Median time and TFLOP/s of a bf16 8192³ matmul (CUDA events, after warm-up)."""
    a = torch.randn(CEILING_SIZE, CEILING_SIZE, device=device, dtype=torch.bfloat16)
    b = torch.randn(CEILING_SIZE, CEILING_SIZE, device=device, dtype=torch.bfloat16)
    for _ in range(20):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = median(times)
    del a, b
    return {"ms": ms, "tflops": 2 * CEILING_SIZE**3 / (ms * 1e9)}


class ParameterSet:
    """One allocation of the model's parameters and gradients; values regenerated from seeds on demand."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], device: torch.device) -> None:
        self.device = device
        self.named = [(n, nn.Parameter(torch.empty(s, device=device))) for n, s in shapes]
        for _, p in self.named:
            p.grad = torch.empty_like(p)
        self.muon_names = {n for n, p in self.named if uses_muon(n, p, None)}
        self.qk_clip_heads: dict[str, AttentionHeads] = {}  # the attention layers, for the QK-clip row

    def kind(self, index: int) -> str:
        """ "matrices" (2-D Muon), "experts" (3-D Muon) or "adamw"."""
        name, p = self.named[index]
        return "adamw" if name not in self.muon_names else ("experts" if p.ndim == 3 else "matrices")

    def by_kind(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i in range(len(self.named)):
            out.setdefault(self.kind(i), []).append(i)
        return out

    def reset(self) -> None:
        """Fill parameters (std 0.02) and gradients (std 1) from per-parameter seeds."""
        with torch.no_grad():
            for i, (_, p) in enumerate(self.named):
                p.normal_(0.0, 0.02, generator=self.generator(2 * i))
                p.grad.normal_(0.0, 1.0, generator=self.generator(2 * i + 1))

    def initial(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s value as :meth:`reset` sets it."""
        p = self.named[index][1]
        return torch.empty_like(p).normal_(0.0, 0.02, generator=self.generator(2 * index))

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def split(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """torch.optim.Muon's 2-D parameters (experts as views of their slices) and the AdamW parameters."""
        matrices, rest = [], []
        for name, p in self.named:
            if name not in self.muon_names:
                rest.append(p)
            elif p.ndim == 2:
                matrices.append(p)
            elif p.ndim == 3:
                for e in range(p.shape[0]):
                    view = nn.Parameter(p.data[e])
                    view.grad = p.grad[e]
                    matrices.append(view)
            else:
                raise ValueError(f"{name}: a {p.ndim}-D Muon parameter; this benchmark handles 2-D and 3-D")
        return matrices, rest


QK_CLIP_TAU = 100.0
"""τ of the QK-clip row: :class:`MuonClippingHalfTheHeads` hands over maxima of 2τ and τ/2, head by head."""


def qk_clip_heads(shapes: Shapes, family: str, flavor: str, quick: bool) -> dict[str, AttentionHeads]:
    """Each attention layer's heads, from the parameter names and the flavor's head counts (:data:`BUILTIN_ARGS`):
    ``wq``/``wk`` (MHA, GQA: head_dim from wq's rows) or ``wkv_b`` with ``wq`` or ``wq_b`` (MLA)."""
    a = {**BUILTIN_ARGS[family, flavor], **shape_overrides(family, flavor, quick)}
    rows = {name: shape[0] for name, shape in shapes}
    heads = {}
    for name in rows:
        layer = name.rsplit(".", 2)[0]
        if name.endswith(".attention.wkv_b.weight"):
            q = f"{layer}.wq.weight" if f"{layer}.wq.weight" in rows else f"{layer}.wq_b.weight"
            heads[layer] = AttentionHeads(
                q, name, n_heads=a["n_heads"], qk_nope_head_dim=a["qk_nope_head_dim"],
                qk_rope_head_dim=a["qk_rope_head_dim"], v_head_dim=a["v_head_dim"],
            )  # fmt: skip
        elif name.endswith(".attention.wk.weight"):
            head_dim = rows[f"{layer}.wq.weight"] // a["n_heads"]
            heads[layer] = AttentionHeads(
                f"{layer}.wq.weight", name, n_heads=a["n_heads"], head_dim=head_dim, n_kv_heads=rows[name] // head_dim
            )
    return heads


class MuonClippingHalfTheHeads(Muon):
    """``dtensor_muon.Muon`` with QK-clip, handed before each step the maxima an attention would hand over: 2τ for
    every other head, τ/2 for the rest, so each step pays the clip's all-reduce and the row scaling of half the
    heads (GQA: of every key group)."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for layer, heads in self.clipped_heads.items():
            alternating = torch.tensor([2 * QK_CLIP_TAU, QK_CLIP_TAU / 2]).repeat(heads.n_heads)[: heads.n_heads]
            self.record_max_logits(layer, alternating)
        return super().step(closure)


def stack_spec(text: str) -> tuple[int, dict[str, float]]:
    """``N`` or ``N:NAME=VALUE:...``: up to N units per stack, with the dispatch's constants NAME set to VALUE
    (:data:`dispatch_settings.TUNABLES`: ``8:STACK_MAX_SIDE=2048`` stacks 1408-wide experts too,
    ``16:MIN_SMALL_SYRK_TILES=10**9`` keeps 768-wide ones on cuBLAS)."""
    head, *items = text.split(":")
    units = int(head)
    if units < 1:
        raise ValueError(f"{text!r}: N must be >= 1")
    constants = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in TUNABLES or not value:
            raise ValueError(f"{text!r}: expected NAME=VALUE with NAME one of {sorted(TUNABLES)}, got {item!r}")
        constants[name] = number(value)
    return units, constants


class MuonInStacks(Muon):
    """``dtensor_muon.Muon`` whose steps compute up to ``units_per_stack`` same-size units of one shape in one call
    (:func:`dtensor_muon.kernels.batching.stack_units`; the optimizer's default is ``MAX_STACK``), with the
    dispatch's ``constants`` set around each step."""

    def __init__(self, *args: Any, units_per_stack: int, constants: dict[str, float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.units_per_stack, self.constants = units_per_stack, constants

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        with stack_units(self.units_per_stack), settings(self.constants):
            return super().step(closure)


def build_optimizer(kind: str, params: ParameterSet) -> list[torch.optim.Optimizer]:
    fused = params.device.type == "cuda"
    if kind == "dtensor_muon":
        return [Muon(params.named, **MUON_ARGS, adamw_betas=BETAS, adamw_eps=ADAM_EPS)]
    if kind == "dtensor_muon_qk_clip":
        heads = params.qk_clip_heads
        opt = MuonClippingHalfTheHeads(
            params.named, **MUON_ARGS, adamw_betas=BETAS, adamw_eps=ADAM_EPS, qk_clip_tau=QK_CLIP_TAU,
            qk_clip_heads=heads,
        )  # fmt: skip
        opt.clipped_heads = heads
        return [opt]
    if kind == "dtensor_muon_offload":
        return [Muon(params.named, **MUON_ARGS, adamw_betas=BETAS, adamw_eps=ADAM_EPS, offload="host")]
    if kind.startswith("dtensor_muon_stacks_"):
        units, constants = stack_spec(kind.removeprefix("dtensor_muon_stacks_"))
        return [
            MuonInStacks(
                params.named,
                **MUON_ARGS,
                adamw_betas=BETAS,
                adamw_eps=ADAM_EPS,
                units_per_stack=units,
                constants=constants,
            )
        ]
    if kind.startswith("dtensor_muon_momentum_"):
        dtype = kind.removeprefix("dtensor_muon_momentum_")
        return [Muon(params.named, **MUON_ARGS, adamw_betas=BETAS, adamw_eps=ADAM_EPS, momentum_dtype=dtype)]
    if kind == "torch_muon_adamw":
        matrices, rest = params.split()
        return [
            torch.optim.Muon(matrices, **MUON_ARGS),
            torch.optim.AdamW(rest, lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY, fused=fused),
        ]
    if kind == "adamw":
        return [
            torch.optim.AdamW(
                [p for _, p in params.named], lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY, fused=fused
            )
        ]
    raise ValueError(kind)


LABELS = {
    "dtensor_muon": "dtensor_muon.Muon",
    "dtensor_muon_qk_clip": "dtensor_muon.Muon + QK-clip (half the heads)",
    "dtensor_muon_offload": 'dtensor_muon.Muon offload="host"',
    "dtensor_muon_momentum_bfloat16": 'dtensor_muon.Muon momentum_dtype="bfloat16"',
    "dtensor_muon_momentum_int8": 'dtensor_muon.Muon momentum_dtype="int8"',
    "torch_muon_adamw": "torch.optim.Muon + AdamW{}",
    "adamw": "AdamW{} on everything",
}


def optimizer_label(kind: str) -> str:
    """The table's name of optimizer ``kind`` (a ``{}`` left for " (fused)")."""
    if kind.startswith("dtensor_muon_stacks_"):
        units, *constants = kind.removeprefix("dtensor_muon_stacks_").split(":")
        return f"dtensor_muon.Muon, stacks of ≤ {units} units" + "".join(f", {c}" for c in constants)
    return LABELS[kind]


MUON_STATE_BYTES = 20
"""Bytes a Muon parameter's step must move at the least: the fp32 gradient read, momentum and parameter each read
and written."""
ADAMW_STATE_BYTES = 28
"""Bytes an AdamW parameter's step must move at the least: the fp32 gradient read, the parameter and both moments
each read and written."""


def device_copy_gbps(device: torch.device, nbytes: int = 2**30, reps: int = 20) -> float:
    """The device-to-device copy rate in GB/s, bytes read plus bytes written (``dst.copy_(src)`` on ``nbytes``
    bytes of fp32, median of ``reps`` by CUDA events after warm-up)."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()  # its 2 GiB go back before the model's tensors are allocated
    return 2 * nbytes / (median(times) * 1e6)


def state_bytes(muon_values: int, other_values: int) -> int:
    """The state traffic no step can avoid: :data:`MUON_STATE_BYTES` a Muon value, :data:`ADAMW_STATE_BYTES` an
    AdamW one."""
    return MUON_STATE_BYTES * muon_values + ADAMW_STATE_BYTES * other_values


def step_floors(shapes: Shapes, muon_names: set[str], tflops: float, copy_gbps: float) -> dict[str, float]:
    """The floors of a step over ``shapes`` (module docstring) at a matmul rate and a copy rate: the Muon matrices'
    Newton–Schulz with symmetric products (``syrk_ms``) and plain (``plain_ms``), the state traffic (``state_gb``,
    ``traffic_ms`` at ``copy_gbps``) and the step's floor (``step_ms`` = syrk_ms + traffic_ms)."""
    muon = [shape for name, shape in shapes if name in muon_names]
    muon_values = sum(torch.Size(shape).numel() for shape in muon)
    traffic = state_bytes(muon_values, sum(torch.Size(shape).numel() for _, shape in shapes) - muon_values)
    floors = {
        "syrk_ms": 1e3 * sum(ns_flops(shape)[0] for shape in muon) / (tflops * 1e12),
        "plain_ms": 1e3 * sum(ns_flops(shape)[1] for shape in muon) / (tflops * 1e12),
        "copy_gbps": copy_gbps,
        "state_gb": traffic / 1e9,
        "traffic_ms": traffic / (copy_gbps * 1e6),
    }
    floors["step_ms"] = floors["syrk_ms"] + floors["traffic_ms"]
    return floors


def copy_rates(device: torch.device, nbytes: int, reps: int = 5) -> dict[str, float]:
    """GB/s of copies between pinned host memory and ``device``, median of ``reps``: host to device, device to
    host, and both directions at once (on two streams, the offload's pattern)."""
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)]

    def timed(work: Callable[[], None]) -> float:
        times = []
        for _ in range(reps):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            work()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return median(times)

    def both() -> None:
        with torch.cuda.stream(streams[0]):
            on_device[0].copy_(host_in, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host_out.copy_(on_device[1], non_blocking=True)

    h2d = timed(lambda: on_device[0].copy_(host_in, non_blocking=True))
    d2h = timed(lambda: host_out.copy_(on_device[1], non_blocking=True))
    together = timed(both)
    return {
        "copy_bytes": nbytes,
        "h2d_gbps": nbytes / h2d / 1e9,
        "d2h_gbps": nbytes / d2h / 1e9,
        "both_gbps": 2 * nbytes / together / 1e9,
    }


def offloaded_bytes(params: ParameterSet) -> int:
    """Bytes offload="host" moves each way per step: Muon's float32 momentum and AdamW's two moments."""
    return sum((4 if name in params.muon_names else 8) * p.numel() for name, p in params.named)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


LAUNCH_EVENTS = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}
)
"""The host's kernel-launch runtime calls counted as launches (a CUDA-graph launch counts once)."""


def step_all(optimizers: list[torch.optim.Optimizer]) -> None:
    """One step of every optimizer, in order."""
    for opt in optimizers:
        opt.step()


def host_timing(step: Callable[[], None], device: torch.device) -> dict[str, float]:
    """One ``step()``, the device synchronized before it and only at its end: host ms (until it returns) and
    wall ms (until the device has finished)."""
    sync(device)
    start = time.perf_counter()
    step()
    returned = time.perf_counter()
    sync(device)
    end = time.perf_counter()
    return {"host_ms": 1e3 * (returned - start), "wall_ms": 1e3 * (end - start)}


def has_aten_ancestor(event: Any) -> bool:
    """Whether a profiler event runs inside an ``aten::`` op."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def device_activities(events: Any) -> list[Any]:
    """The device's kernels, copies and sets among profiler ``events``; not the GPU-side range of an
    ``Optimizer.step#…`` annotation, which spans them and would count everything twice."""
    return [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("Optimizer.")]


def profiled_events(run: Callable[[], None], device: torch.device) -> Any:
    """The torch.profiler events of ``run()`` (host ops; on CUDA the device's activities too), the device
    synchronized before it and inside the profiled range after it."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        sync(device)
    return prof.events()


def profile_counts(step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """One ``step()`` under torch.profiler: launches (CUDA: launch runtime calls; CPU: top-level aten ops) and
    device ms (CUDA: summed durations of the device activities; CPU: None)."""
    events = profiled_events(step, device)
    if device.type == "cuda":
        launches = sum(e.name in LAUNCH_EVENTS for e in events)
        device_us = sum(e.time_range.elapsed_us() for e in device_activities(events))
        return {"launches": launches, "launches_counted": "CUDA launch calls", "device_ms": device_us / 1e3}
    launches = sum(e.name.startswith("aten::") and not has_aten_ancestor(e) for e in events)
    return {"launches": launches, "launches_counted": "top-level aten ops (CPU proxy)", "device_ms": None}


def busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, span) of (start, end) intervals: busy = the length of their union (overlapping activities of
    several streams count once), span = the last end − the first start; (0, 0) for none."""
    if not intervals:
        return 0.0, 0.0
    ordered = sorted(intervals)
    busy, (start, end) = 0.0, ordered[0]
    for a, b in ordered[1:]:
        if a > end:
            busy += end - start
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    return busy, max(b for _, b in ordered) - ordered[0][0]


def device_idle_back_to_back(step: Callable[[], None], device: torch.device, steps: int) -> dict[str, Any]:
    """``steps`` steps issued back to back under torch.profiler (the device synchronized before the first and after
    the last): per step, the device's busy ms (the union of its kernels, copies and sets) and its idle ms inside
    the span from the first activity to the last (:func:`busy_and_span`). Idle near 0: the steps are
    device-bound; else the device waits that long for the host, the profiler's own host cost included (an upper
    bound). CUDA only (None elsewhere)."""
    if device.type != "cuda":
        return {"busy_ms": None, "idle_ms": None}

    def block() -> None:
        for _ in range(steps):
            step()

    events = profiled_events(block, device)
    busy, span = busy_and_span([(e.time_range.start, e.time_range.end) for e in device_activities(events)])
    return {"busy_ms": busy / steps / 1e3, "idle_ms": (span - busy) / steps / 1e3}


def run_optimizer(kind: str, params: ParameterSet, warmup: int, steps: int) -> dict[str, Any]:
    """Median step time after ``warmup`` steps, memory, then one unprofiled and one profiled step (host
    overhead; see the module docstring)."""
    device = params.device
    params.reset()
    free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    optimizers = build_optimizer(kind, params)
    sync(device)
    before = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    times = []
    for step in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        step_all(optimizers)
        sync(device)
        if step >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    one_step = functools.partial(step_all, optimizers)
    overhead = host_timing(one_step, device)
    overhead.update(profile_counts(one_step, device))
    del one_step
    for opt in optimizers:
        flush = getattr(opt, "flush", None)
        if flush is not None:
            flush()
    del optimizers
    free(device)
    label = optimizer_label(kind).format(" (fused)" if device.type == "cuda" else "")
    return {
        "optimizer": label,
        "key": kind,
        "step_ms": median(times),
        "min_ms": min(times),
        "mem_before_gib": before,
        "peak_gib": peak,
        **overhead,
    }


def snapshot(params: ParameterSet, indices: list[int]) -> dict[int, torch.Tensor]:
    return {i: params.named[i][1].detach().to("cpu", copy=True) for i in indices}


def update_differences(params: ParameterSet, ours: dict[int, torch.Tensor], theirs: dict[int, torch.Tensor]) -> dict:
    """Per kind, max over parameters of max|Δθ_ours − Δθ_torch| / max|Δθ_torch|."""
    worst: dict[str, float] = {}
    for i, final_ours in ours.items():
        kind = params.kind(i)
        start = params.initial(i).cpu()
        delta_ours, delta_theirs = final_ours - start, theirs[i] - start
        scale = delta_theirs.abs().max().clamp(min=1e-30)
        rel = ((delta_ours - delta_theirs).abs().max() / scale).item()
        worst[kind] = max(worst.get(kind, 0.0), rel)
    return {f"max_rel_update_diff_{k}": v for k, v in sorted(worst.items())}


def muon_group() -> dict[str, Any]:
    """The Muon param group ``dtensor_muon.Muon`` builds with this benchmark's arguments (what its rule reads)."""
    opt = Muon([("w", nn.Parameter(torch.zeros(2, 2)))], **MUON_ARGS)
    return next(g for g in opt.param_groups if g["use_muon"])


@dataclass
class RankShare:
    """The busiest rank of the FSDP plan at ``world_size``: its units and its shards (see the module docstring)."""

    world_size: int
    rank: int
    units: list[tuple[tuple[int, ...], bool]]
    """Per unit it computes: the stacked input shape (``[B, m, n]`` or ``[m, n]``) and whether it is owned."""
    planned_flops: int
    """Its units' ``MuonRule.cost`` summed."""
    rank_flops: list[int] = field(repr=False)
    lower_bound: float
    muon_shards: list[tuple[tuple[int, ...], tuple[int, int]]]
    """Per Muon parameter with a non-empty shard on this rank: (shard shape, matrix shape for γ')."""
    other_shards: list[tuple[int, ...]]
    """Its non-empty shards of the other (AdamW) parameters."""
    unit_params: list[int] = field(default_factory=list)
    """Per unit, the index of its parameter (which local units stack together: :func:`stacked_calls`)."""

    @property
    def units_owned(self) -> int:
        return sum(owned for _, owned in self.units)

    @property
    def matrices(self) -> int:
        return sum(shape[0] if len(shape) == 3 else 1 for shape, _ in self.units)


def fsdp_plan(muon: Shapes, group: dict[str, Any], world_size: int) -> Plan:
    """dtensor_muon's plan of the Muon parameters laid out as FSDP2 lays them over ``world_size`` ranks,
    costed by ``MuonRule.cost`` (as the optimizer plans one mesh)."""
    rule = MuonRule()

    def cost(k: int, shape: tuple[int, int]) -> tuple[int, int]:
        c = rule.cost(group, shape)
        return c.flops, c.owner_state_bytes

    return build_plan(
        [fsdp_layout(name, shape, world_size) for name, shape in muon],
        list(range(len(muon))),
        BUCKET_BYTES,
        WIRE_ITEMSIZE,
        batchable=[rule.can_batch(group)] * len(muon),
        cost_fn=cost,
    )


def busiest_units(plan: Plan, rank: int) -> list[tuple[list[int], bool]]:
    """(route indices, owned) of every unit ``rank`` computes: those it owns and the local ones it holds."""
    out = []
    for unit in plan.units:
        p = unit.placement
        if isinstance(p, Owned):
            if p.rank == rank:
                out.append((list(unit.members), True))
        elif isinstance(p, Local):
            if any(r == rank for r, _ in plan.routes[unit.members[0]].holders):
                out.append((list(unit.members), False))
        else:
            raise ValueError(f"unexpected placement {p!r} in an FSDP plan")
    return out


def rank_share(shapes: Shapes, muon_names: set[str], group: dict[str, Any], world_size: int) -> RankShare:
    """Plan the Muon parameters over ``world_size`` FSDP ranks and describe the busiest rank's share."""
    muon = [(n, s) for n, s in shapes if n in muon_names]
    plan = fsdp_plan(muon, group, world_size)
    rank = plan.rank_flops.index(max(plan.rank_flops))
    rule = MuonRule()
    units, unit_params, planned = [], [], 0
    for members, owned in busiest_units(plan, rank):
        mshape = plan.routes[members[0]].spec.shape
        units.append(((len(members), *mshape) if len(members) > 1 else mshape, owned))
        unit_params.append(plan.routes[members[0]].spec.param_index)
        planned += sum(rule.cost(group, plan.routes[i].spec.shape).flops for i in members)
    muon_shards, other_shards = [], []
    for name, shape in shapes:
        shard = box_shape(fsdp_layout(name, shape, world_size).boxes[rank])
        if torch.Size(shard).numel() == 0:
            continue
        if name in muon_names:
            muon_shards.append((shard, matrix_shape(shape)))
        else:
            other_shards.append(shard)
    return RankShare(
        world_size, rank, units, planned, plan.rank_flops, plan.lower_bound, muon_shards, other_shards, unit_params
    )


def stacked_calls(
    units: list[tuple[tuple[int, ...], bool]], units_per_stack: int, params: list[int] | None = None
) -> list[tuple[tuple[int, ...], bool, int | None, list[int] | None]]:
    """The share's units as calls with stacks of up to ``units_per_stack`` units: (call shape, owned, matrices
    per unit when the call is a stack of several, else None, and the units of each parameter's run when the stack
    gathers several parameters' local units, else None). Batched units of one shape (where stacking pays) and
    origin stack k at a time in their order, as the engine stacks an owner's units (over consecutive exchange
    buckets). Local units (``params``: each unit's parameter) stack as a holder's do
    (:func:`dtensor_muon.kernels.batching.holder_stack_keys`): those of parameters with at most
    ``GATHER_MAX_UNITS`` stackable units on the rank across parameters, their views copied into one input; the
    others only with their own parameter's (one run of experts of the shard)."""

    def own_key(i: int) -> tuple | None:
        shape, owned = units[i]
        return (shape, owned) if len(shape) == 3 and stacking_pays(shape[0], shape[1:]) else None

    keys: list[Hashable | None] = [own_key(i) for i in range(len(units))]
    if params is not None:
        held = [i for i, (_, owned) in enumerate(units) if not owned]
        for i, key in zip(held, holder_stack_keys([params[i] for i in held], [keys[i] for i in held])):
            keys[i] = key
    calls = []
    for stack in group_into_stacks(range(len(units)), keys.__getitem__, units_per_stack):
        shape, owned = units[stack[0]]
        if len(stack) == 1:
            calls.append((shape, owned, None, None))
            continue
        runs = [1]
        for before, after in itertools.pairwise(stack):
            if owned or params is None or params[before] == params[after]:
                runs[-1] += 1
            else:
                runs.append(1)
        calls.append(((len(stack) * shape[0], *shape[1:]), owned, shape[0], runs if len(runs) > 1 else None))
    return calls


class ShareWork:
    """The busiest rank's share on this device: its tensors and one step of its work (see the module docstring)."""

    def __init__(self, share: RankShare, group: dict[str, Any], device: torch.device, units_per_stack: int = 1) -> None:
        self.group, self.rule = group, MuonRule()
        self.runner = NewtonSchulzGraphs() if device.type == "cuda" else newton_schulz
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=device).to(dtype)

        calls = stacked_calls(share.units, units_per_stack, share.unit_params)
        # a local unit's U as the momentum pass writes it (the direction's input dtype on CUDA, fp32 elsewhere)
        held = self.rule.input_dtype(group) if device.type == "cuda" else torch.float32
        self.input_dtype = held
        self.inputs: list[list[torch.Tensor]] = []  # per call: its input, or the runs its input is copied from
        for shape, owned, per_unit, runs in calls:
            dtype = torch.bfloat16 if owned else held
            pieces = [(per_unit * units, *shape[1:]) for units in runs] if runs is not None else [shape]
            self.inputs.append([randn(piece, dtype) for piece in pieces])
        self.decide_as = [per_unit for _, _, per_unit, _ in calls]
        self.shards = [
            (randn(s), randn(s), torch.zeros(s, device=device), randn(s), self.rule.adjusted_lr(group, m))
            for s, m in share.muon_shards
        ]  # (parameter, gradient, momentum buffer, received O, γ')
        self.outcome = torch.zeros(1, dtype=torch.int64, device=device)  # the step's failure flag
        self.others = [randn(s) for s in share.other_shards]
        self.other_grads = [randn(s) for s in share.other_shards]
        self.other_states = [adamw_rule.init_state(p) for p in self.others]

    def newton_schulz(self) -> None:
        """The direction of every unit (or stack of units), through the optimizer's runner."""
        for pieces, per_unit in zip(self.inputs, self.decide_as):
            u = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # a gathered stack's copy, as the engine's
            with decide_as_batch(per_unit) if per_unit is not None else contextlib.nullcontext():
                self.rule.direction(u, [{}] * (u.shape[0] if u.ndim == 3 else 1), self.group, self.runner)

    def step(self, transactional: bool = False, directions: bool = True, flag_after_directions: bool = False) -> None:
        """Momentum on the shards, the units' directions, the apply on the shards, AdamW on the other shards.
        ``transactional``: as a step of several ranks runs it, the momentum pass gives U without advancing the
        buffer, the host reads the step's failure flag beside the queued work once the momentum pass is done (the
        consensus follows the exchanges out, which follow that pass; the exchanges back are launched after it), and
        the buffer advances in a second pass (the commit). ``flag_after_directions``: the transactional step with
        the flag read after the directions on the current stream instead (a consensus behind exchanges back that
        follow the directions: the host waits for the device there). ``directions=False``: the element-wise passes
        and AdamW alone, without Newton–Schulz."""
        momentum, nesterov = self.group["momentum"], self.group["nesterov"]
        grads, bufs = [shard[1] for shard in self.shards], [shard[2] for shard in self.shards]
        momentum_steps(  # U in the direction's input dtype, as MomentumRule.prepare_many asks for it
            grads,
            bufs,
            momentum,
            nesterov,
            write_buffer=not transactional,
            want_input=True,
            input_dtype=self.input_dtype,
        )
        exchanges_out = None
        if transactional and not flag_after_directions and self.outcome.is_cuda:
            exchanges_out = torch.cuda.Event()
            exchanges_out.record()
        if directions:
            self.newton_schulz()
        if exchanges_out is not None:  # the consensus: its flag (never set here) follows the exchanges out only
            with beside_queued_work(self.outcome.device, CONSENSUS, after=exchanges_out):
                self.outcome.item()
        elif transactional:
            # on the CPU, or read behind exchanges back that follow the directions: the host queues what follows
            # once the device has done the directions
            self.outcome.item()
        if transactional:
            momentum_steps(grads, bufs, momentum, False, write_buffer=True, want_input=False)  # the commit's advance
        decay = 1 - LR * WEIGHT_DECAY
        decay_and_add_many(  # the optimizer's apply
            [shard[0] for shard in self.shards],
            [shard[3] for shard in self.shards],
            [decay] * len(self.shards),
            [-float(shard[4]) for shard in self.shards],
        )
        adamw_rule.step(  # as the optimizer runs its AdamW shards (fused on CUDA, the step counts on the host)
            self.others,
            self.other_grads,
            [state["exp_avg"] for state in self.other_states],
            [state["exp_avg_sq"] for state in self.other_states],
            [state["step"] for state in self.other_states],
            lr=LR,
            betas=BETAS,
            eps=ADAM_EPS,
            weight_decay=WEIGHT_DECAY,
        )


def adamw_share(share: RankShare, shapes: Shapes, device: torch.device) -> torch.optim.Optimizer:
    """A fused AdamW (foreach on CPU) over the rank's FSDP shard of every parameter, gradients filled."""
    gen = torch.Generator(device=device).manual_seed(1)
    params = []
    for name, shape in shapes:
        shard = box_shape(fsdp_layout(name, shape, share.world_size).boxes[share.rank])
        if torch.Size(shard).numel():
            p = nn.Parameter(torch.randn(shard, generator=gen, device=device))
            p.grad = torch.randn(shard, generator=gen, device=device)
            params.append(p)
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY, fused=fused)


def median_host_ms(step: Callable[[], None], device: torch.device, calls: int) -> float:
    """Median over ``calls`` calls of :func:`host_timing`'s host ms: the time until ``step()`` returns, the device
    synchronized before it."""
    return median([host_timing(step, device)["host_ms"] for _ in range(calls)])


def median_ms(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> float:
    """Median over ``steps`` calls after ``warmup`` (host clock, device synchronized around each)."""
    times = []
    for i in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return median(times)


def back_to_back_ms(step: Callable[[], None], device: torch.device, warmup: int, steps: int, blocks: int = 3) -> float:
    """Median over ``blocks`` blocks of the mean time a step of ``steps`` steps issued back to back, after
    ``warmup`` (host clock, the device synchronized before a block's first step and after its last only): the pace
    of a training loop whose host runs ahead of the device, where the host's work before a step's first kernel
    overlaps the device's work still queued (:func:`median_ms` synchronizes around each step and so pays that
    latency at every step)."""
    for _ in range(warmup):
        step()
    means = []
    for _ in range(blocks):
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        means.append(1e3 * (time.perf_counter() - start) / steps)
    return median(means)


def run_share(
    share: RankShare,
    shapes: Shapes,
    group: dict[str, Any],
    device: torch.device,
    warmup: int,
    steps: int,
    rate: float | None,
    spec: str = "1",
    copy_gbps: float | None = None,
) -> dict[str, Any]:
    """Time the busiest rank's share (stacks as ``spec`` says: :func:`stack_spec`) and an AdamW step over its
    shards; one result row (floors with the matmul ``rate`` in FLOP/s and the copy rate ``copy_gbps``: CUDA)."""
    units_per_stack, constants = stack_spec(spec)
    with settings(constants):  # the calls are formed under the constants too (STACK_MAX_SIDE, GATHER_MAX_UNITS)
        work = ShareWork(share, group, device, units_per_stack)
        calls = len(work.inputs)
        share_ms = median_ms(work.step, device, warmup, steps)
        back_to_back = back_to_back_ms(work.step, device, warmup, steps)
        back_to_back_device = device_idle_back_to_back(work.step, device, max(steps, 10))
        transactional = functools.partial(work.step, transactional=True)
        transactional_ms = median_ms(transactional, device, warmup, steps)
        transactional_back_to_back = back_to_back_ms(transactional, device, warmup, steps)
        flag_after_directions = functools.partial(work.step, transactional=True, flag_after_directions=True)
        flag_after_directions_back_to_back = back_to_back_ms(flag_after_directions, device, warmup, steps)
        ns_ms = median_ms(work.newton_schulz, device, 1, steps)
        elementwise = functools.partial(work.step, directions=False)
        elementwise_ms = median_ms(elementwise, device, warmup, steps)
        elementwise_host_ms = median_host_ms(elementwise, device, steps)
        elementwise_profile = profile_counts(elementwise, device)
        share_host_ms = median_host_ms(work.step, device, steps)
        share_profile = profile_counts(work.step, device)
    del work
    free(device)
    adamw = adamw_share(share, shapes, device)
    adamw_ms = median_ms(adamw.step, device, warmup, steps)
    del adamw
    free(device)
    syrk = sum(ns_flops(shape)[0] for shape, _ in share.units)
    floor_ms = 1e3 * syrk / rate if rate else None
    traffic = state_bytes(
        sum(torch.Size(shard).numel() for shard, _ in share.muon_shards),
        sum(torch.Size(shard).numel() for shard in share.other_shards),
    )
    traffic_ms = traffic / (copy_gbps * 1e6) if copy_gbps else None
    step_floor_ms = floor_ms + traffic_ms if floor_ms and traffic_ms else None
    return {
        "world_size": share.world_size,
        "rank": share.rank,
        "units": len(share.units),
        "units_per_stack": units_per_stack,
        "dispatch": ", ".join(spec.split(":")[1:]) or "default",
        "calls": calls,
        "units_owned": share.units_owned,
        "matrices": share.matrices,
        "planned_gflop": share.planned_flops / 1e9,
        "planned_flops": share.planned_flops,
        "max_rank_flops": max(share.rank_flops),
        "mean_rank_gflop": sum(share.rank_flops) / len(share.rank_flops) / 1e9,
        "lower_bound_gflop": share.lower_bound / 1e9,
        "share_ms": share_ms,
        "ns_ms": ns_ms,
        "ns_floor_ms": floor_ms,
        "share_vs_floor": share_ms / floor_ms if floor_ms else None,
        "step_floor_ms": step_floor_ms,
        "share_vs_step_floor": share_ms / step_floor_ms if step_floor_ms else None,
        "share_back_to_back_ms": back_to_back,
        "back_to_back_vs_step_floor": back_to_back / step_floor_ms if step_floor_ms else None,
        "back_to_back_busy_ms": back_to_back_device["busy_ms"],
        "back_to_back_idle_ms": back_to_back_device["idle_ms"],
        "transactional_share_ms": transactional_ms,
        "transactional_back_to_back_ms": transactional_back_to_back,
        "transactional_back_to_back_vs_step_floor": (
            transactional_back_to_back / step_floor_ms if step_floor_ms else None
        ),
        "flag_after_directions_back_to_back_ms": flag_after_directions_back_to_back,
        "flag_after_directions_back_to_back_vs_step_floor": (
            flag_after_directions_back_to_back / step_floor_ms if step_floor_ms else None
        ),
        "elementwise_ms": elementwise_ms,
        "traffic_floor_ms": traffic_ms,
        "elementwise_vs_floor": elementwise_ms / traffic_ms if traffic_ms else None,
        "elementwise_host_ms": elementwise_host_ms,
        "elementwise_device_ms": elementwise_profile["device_ms"],
        "elementwise_launches": elementwise_profile["launches"],
        "share_host_ms": share_host_ms,
        "share_device_ms": share_profile["device_ms"],
        "share_launches": share_profile["launches"],
        "adamw_share_ms": adamw_ms,
        "ns_tflop_syrk": syrk / 1e12,
    }


def world_sizes(values: list[str]) -> list[int]:
    """``--world-size`` values, each one number or a comma list, in order."""
    out = [int(v) for value in values for v in value.split(",") if v.strip()]
    if any(w < 1 for w in out):
        raise ValueError(f"--world-size must be >= 1, got {out}")
    return out


def parse_args() -> Any:
    """The command line (see the module docstring)."""
    parser = benchmark_parser(__doc__, "optimizer_step")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3_8b")
    parser.add_argument("--layers", type=int, default=None, help="first N transformer layers (default: all; quick: 2)")
    parser.add_argument("--experts", type=int, default=None, help="keep the first N experts of every MoE layer")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--check-params",
        type=int,
        default=4,
        help="CUDA: compare the two Muons on the first N parameters of each kind (CPU: all)",
    )
    parser.add_argument(
        "--world-size",
        action="append",
        default=[],
        help="time the busiest FSDP rank's share at W ranks (repeatable or a comma list: 8,64,256)",
    )
    parser.add_argument("--skip-whole", action="store_true", help="only the per-rank view (no whole-step rows)")
    parser.add_argument(
        "--skip-references",
        action="store_true",
        help="whole step: dtensor_muon's rows only (no torch.optim rows, no update comparison), to fit a smaller card",
    )
    parser.add_argument(
        "--qk-clip", action="store_true", help="also dtensor_muon.Muon with QK-clip on half the heads (its cost)"
    )
    parser.add_argument(
        "--momentum-dtypes",
        nargs="*",
        default=[],
        choices=["bfloat16", "int8"],
        help="also dtensor_muon.Muon with its momentum in these formats (the step time of each)",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help='also dtensor_muon.Muon with offload="host", and the card\'s host<->device copy rates (CUDA)',
    )
    parser.add_argument(
        "--units-per-stack",
        nargs="*",
        default=[],
        metavar="N[:NAME=VALUE...]",
        help="also dtensor_muon.Muon computing up to N same-size units of one shape per call, the dispatch's "
        "constants NAME set to VALUE (one row per spec; see stack_spec)",
    )
    args = parser.parse_args()
    for spec in args.units_per_stack:
        try:
            stack_spec(spec)
        except ValueError as exc:
            parser.error(f"--units-per-stack: {exc}")
    try:
        args.world_size = world_sizes(args.world_size)
    except ValueError as exc:
        parser.error(str(exc))
    # one result file per model and study: bench/results/optimizer_step_MODEL.json, and apart from it the runs
    # that add QK-clip (qk_clip_step_MODEL.json), stacks (optimizer_step_stacks_MODEL.json) or the state modes
    # (optimizer_step_state_modes_MODEL.json)
    if args.qk_clip:
        args.benchmark = f"qk_clip_step_{args.model}"
    elif args.units_per_stack:
        args.benchmark = f"optimizer_step_stacks_{args.model}"
    elif args.offload or args.momentum_dtypes:
        args.benchmark = f"optimizer_step_state_modes_{args.model}"
    else:
        args.benchmark = f"optimizer_step_{args.model}"
    if args.skip_references:
        args.benchmark += "_muon_only"
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        torch.set_num_threads(1)  # tiny matrices: more threads only wait on each other on a shared CPU
        if args.layers is None:
            args.layers = 2
    return args


WHOLE_COLUMNS = [
    ("optimizer", "optimizer", "{}"),
    ("step_ms", "step ms", "{:.2f}"),
    ("min_ms", "min ms", "{:.2f}"),
    ("vs_adamw", "× AdamW", "{:.2f}"),
    ("vs_ns_floor", "× NS floor", "{:.2f}"),
    ("vs_step_floor", "× step floor", "{:.2f}"),
    ("launches", "launches", "{:,}"),
    ("host_ms", "host ms", "{:.2f}"),
    ("wall_ms", "wall ms", "{:.2f}"),
    ("device_ms", "device ms", "{:.2f}"),
    ("mem_before_gib", "GiB before step 1", "{:.1f}"),
    ("peak_gib", "peak GiB", "{:.1f}"),
]
SHARE_COLUMNS = [
    ("world_size", "ranks", "{}"),
    ("rank", "busiest rank", "{}"),
    ("units", "units", "{}"),
    ("units_per_stack", "units per stack", "{}"),
    ("dispatch", "dispatch", "{}"),
    ("calls", "NS calls", "{}"),
    ("units_owned", "owned", "{}"),
    ("matrices", "matrices", "{}"),
    ("planned_gflop", "planned GFLOP", "{:,.4g}"),
    ("mean_rank_gflop", "mean GFLOP", "{:,.4g}"),
    ("share_ms", "share ms", "{:.2f}"),
    ("ns_ms", "NS ms", "{:.2f}"),
    ("ns_floor_ms", "NS floor ms", "{:.2f}"),
    ("share_vs_floor", "share/floor", "{:.2f}"),
    ("step_floor_ms", "step floor ms", "{:.2f}"),
    ("share_vs_step_floor", "share/step floor", "{:.2f}"),
    ("share_back_to_back_ms", "share ms back to back", "{:.2f}"),
    ("back_to_back_vs_step_floor", "back to back/step floor", "{:.2f}"),
    ("back_to_back_busy_ms", "profiled back to back: device busy ms", "{:.2f}"),
    ("back_to_back_idle_ms", "device idle ms", "{:.2f}"),
    ("transactional_share_ms", "transactional share ms", "{:.2f}"),
    ("transactional_back_to_back_ms", "transactional back to back", "{:.2f}"),
    ("transactional_back_to_back_vs_step_floor", "transactional back to back/step floor", "{:.2f}"),
    ("flag_after_directions_back_to_back_ms", "flag after directions back to back", "{:.2f}"),
    (
        "flag_after_directions_back_to_back_vs_step_floor",
        "flag after directions back to back/step floor",
        "{:.2f}",
    ),
    ("elementwise_ms", "element-wise ms", "{:.2f}"),
    ("traffic_floor_ms", "traffic floor ms", "{:.2f}"),
    ("elementwise_vs_floor", "element-wise/floor", "{:.2f}"),
    ("elementwise_host_ms", "element-wise host ms", "{:.2f}"),
    ("elementwise_device_ms", "element-wise device ms", "{:.2f}"),
    ("elementwise_launches", "element-wise launches", "{}"),
    ("share_host_ms", "share host ms", "{:.2f}"),
    ("share_device_ms", "share device ms", "{:.2f}"),
    ("share_launches", "share launches", "{}"),
    ("adamw_share_ms", "AdamW share ms", "{:.2f}"),
]


def whole_step(args: Any, params: ParameterSet, floor: dict[str, float] | None) -> tuple[list[dict], dict]:
    """The three optimizers' rows and the two Muons' update differences; with ``args.skip_references``
    dtensor_muon's rows alone."""
    device = params.device
    check = [
        i
        for indices in params.by_kind().values()
        for i in (indices[: args.check_params] if device.type == "cuda" else indices)
    ]
    rows, finals = [], {}
    kinds = (
        "dtensor_muon",
        *(("dtensor_muon_qk_clip",) if args.qk_clip else ()),
        *(f"dtensor_muon_momentum_{dtype}" for dtype in args.momentum_dtypes),
        *(("dtensor_muon_offload",) if args.offload else ()),
        *(f"dtensor_muon_stacks_{units}" for units in args.units_per_stack),
        *(() if args.skip_references else ("torch_muon_adamw", "adamw")),
    )
    for kind in kinds:
        rows.append(run_optimizer(kind, params, args.warmup, args.steps))
        if kind in ("dtensor_muon", "torch_muon_adamw") and not args.skip_references:
            finals[kind] = snapshot(params, check)
        print(f"  {rows[-1]['optimizer']}: {rows[-1]['step_ms']:.2f} ms", flush=True)
    differences = (
        {} if args.skip_references else update_differences(params, finals["dtensor_muon"], finals["torch_muon_adamw"])
    )
    if args.offload and device.type == "cuda":
        moved = offloaded_bytes(params)
        rates = copy_rates(device, min(moved, 2**30))
        differences.update(offloaded_bytes=moved, **rates)
        print(
            f"offload moves {moved / GIB:.2f} GiB each way per step; pinned copies: host→device "
            f"{rates['h2d_gbps']:.1f} GB/s, device→host {rates['d2h_gbps']:.1f} GB/s, both at once "
            f"{rates['both_gbps']:.1f} GB/s: {1e3 * 2 * moved / (rates['both_gbps'] * 1e9):.1f} ms at that rate"
        )
    adamw_ms = rows[-1]["step_ms"] if rows[-1]["key"] == "adamw" else None
    for row in rows:
        row["vs_adamw"] = row["step_ms"] / adamw_ms if adamw_ms else None
        if floor is not None and row["key"] != "adamw":
            row["vs_ns_floor"] = row["step_ms"] / floor["syrk_ms"]
            row["vs_step_floor"] = row["step_ms"] / floor["step_ms"]
    return rows, (differences if args.skip_references else {"checked_parameters": len(check), **differences})


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    family, flavor = model_flavor(args.model, args.quick)
    shapes, shapes_from = model_shapes(args.model, args.layers, args.quick, args.experts)
    muon_names = {n for n, s in shapes if uses_muon(n, torch.empty(s, device="meta"), None)}
    muon_shapes = [s for n, s in shapes if n in muon_names]
    n_params = sum(torch.Size(s).numel() for _, s in shapes)
    n_muon = sum(torch.Size(s).numel() for s in muon_shapes)
    syrk_flops = sum(ns_flops(s)[0] for s in muon_shapes)
    plain_flops = sum(ns_flops(s)[1] for s in muon_shapes)
    experts = f", {args.experts} experts per MoE layer" if args.experts else ""
    print(
        f"{family} {flavor}, {args.layers or 'all'} layers{experts}: {len(shapes)} parameters, {n_params / 1e9:.3f} B "
        f"values ({n_muon / 1e9:.3f} B in {len(muon_shapes)} Muon parameters), fp32, on {device}; "
        f"median of {args.steps} steps after {args.warmup}; shapes from the {shapes_from}"
    )

    ceiling = matmul_ceiling(device) if device.type == "cuda" else None
    rate = ceiling["tflops"] * 1e12 if ceiling is not None else None
    copy_gbps = device_copy_gbps(device) if device.type == "cuda" else None
    floor = step_floors(shapes, muon_names, ceiling["tflops"], copy_gbps) if ceiling and copy_gbps else None

    rows: list[dict] = []
    extra: dict[str, Any] = {}
    if not args.skip_whole:
        params = ParameterSet(shapes, device)
        params.qk_clip_heads = qk_clip_heads(shapes, family, flavor, args.quick) if args.qk_clip else {}
        rows, extra = whole_step(args, params, floor)
        free(device)
        print(markdown_table(rows, WHOLE_COLUMNS))
        print(
            f"launches: {rows[0]['launches_counted']}; host ms: until step() returns, wall ms: until the device is done"
        )
    if floor is not None:
        print(
            f"bf16 {CEILING_SIZE}³ matmul: {ceiling['ms']:.3f} ms = {ceiling['tflops']:.0f} TFLOP/s; Newton–Schulz "
            f"floor of the Muon matrices at that rate: {floor['syrk_ms']:.1f} ms with symmetric products "
            f"({syrk_flops / 1e12:.2f} TFLOP), {floor['plain_ms']:.1f} ms plain ({plain_flops / 1e12:.2f} TFLOP); "
            f"device copies {copy_gbps:.0f} GB/s: state traffic {floor['state_gb']:.1f} GB, {floor['traffic_ms']:.1f} "
            f"ms; step floor {floor['step_ms']:.1f} ms"
        )
    if "checked_parameters" in extra:
        print(
            "dtensor_muon.Muon vs torch.optim.Muon + AdamW, max relative update difference: "
            + ", ".join(
                f"{k.removeprefix('max_rel_update_diff_')} {v:.2e}" for k, v in extra.items() if k.startswith("max_")
            )
        )

    per_rank = []
    if args.world_size:
        group = muon_group()
        for world in args.world_size:
            share = rank_share(shapes, muon_names, group, world)
            for spec in dict.fromkeys(["1", *args.units_per_stack]):
                per_rank.append(run_share(share, shapes, group, device, args.warmup, args.steps, rate, spec, copy_gbps))
                print(
                    f"  {world} ranks: busiest rank {share.rank}, stacks {spec}: {per_rank[-1]['share_ms']:.2f} ms",
                    flush=True,
                )
        print("Busiest FSDP rank's share (no exchange; see the module docstring):")
        print(markdown_table(per_rank, SHARE_COLUMNS))

    write_result(
        args,
        rows,
        model=f"{family}:{flavor}",
        layers=args.layers,
        experts=args.experts,
        shapes_from=shapes_from,
        parameters=n_params,
        muon_parameters=n_muon,
        ns_tflop_syrk=syrk_flops / 1e12,
        ns_tflop_plain=plain_flops / 1e12,
        matmul_ceiling=ceiling,
        ns_floor_ms=floor,
        per_rank=per_rank,
        **extra,
    )


if __name__ == "__main__":
    main()
