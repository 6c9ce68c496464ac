"""The whole optimizer step on a real model's parameter shapes: dtensor_muon.Muon vs torch.optim.Muon + AdamW
vs fused AdamW, side by side in one process on one device.

    PYTHONPATH=src python bench/optimizer_step.py --model llama3_8b --layers 16
    PYTHONPATH=src python bench/optimizer_step.py --model deepseek_v3_16b --layers 12
    PYTHONPATH=src python bench/optimizer_step.py --quick [--model deepseek_v3_16b]   # CPU, seconds

The parameter set is the torchtitan model's own (built on the meta device, first ``--layers`` layers; the
embeddings, final norm and head always), in fp32 with random fixed-seed values and gradients (one gradient
per parameter, the same at every step). ``--quick`` takes the family's torchtitan ``debugmodel`` flavor, shrunk to width 64.
One parameter set is allocated and kept; before each optimizer its values and gradients are regenerated from
the same seeds, and each optimizer's state is freed before the next. Optimizers:

- ``dtensor_muon.Muon(model.named_parameters(), ...)``: Muon on the matrices, AdamW on embeddings, head
  and norms (its routing).
- ``torch.optim.Muon`` on the same matrices + ``torch.optim.AdamW`` (fused on CUDA) on the rest.
  torch.optim.Muon takes 2-D parameters only, so each 3-D expert weight ``[E, m, n]`` is handed to it as
  E 2-D parameters that are views of the same storage (expert e's slice, with gradient slice e): the same
  E Newton–Schulz problems, one at a time.
- ``torch.optim.AdamW`` (fused on CUDA) on every parameter.

Every optimizer gets lr 0.02, weight decay 0.1, AdamW betas (0.9, 0.95), eps 1e-8; both Muons momentum 0.95,
Nesterov, 5 Newton–Schulz steps in bf16, Keller's coefficients, ``adjust_lr_fn=None`` (torch's default).
Reported per optimizer: median step time over ``--steps`` steps after ``--warmup`` (host clock, device
synchronized around each step), memory allocated after construction (before the first step; dtensor_muon
creates its state eagerly, torch lazily) and the peak over the steps (CUDA only). Also the largest
difference between the two Muons' updates, per parameter kind (2-D matrices, expert slices, AdamW
parameters), relative to the largest update of torch's: on CPU with the same arguments it is 0 (seen for all
three kinds). On CUDA it is taken over the first ``--check-params`` parameters of each kind only (a copy of
each is kept on the host); there the two Muons' bf16 Newton–Schulz runs different kernels.

On CUDA it also prints the Newton–Schulz FLOP floor of the Muon matrices: their 5-step FLOPs, counted with
symmetric products (3m²n + m³ per iteration, m ≤ n) and plainly (4m²n + 2m³), over the bf16 8192³ matmul
rate measured in the same run.
"""

from __future__ import annotations

import copy
import gc
import importlib
import time

import torch
from common import benchmark_parser, markdown_table, median, write_result
from torch import nn

from dtensor_muon import Muon
from dtensor_muon.routing import uses_muon
from dtensor_muon.simulate import MODEL_FAMILIES

MODELS = {"llama3_8b": ("llama3", "8B"), "deepseek_v3_16b": ("deepseek_v3", "16B")}
QUICK_FLAVOR = "debugmodel"
QUICK_ARGS = {  # the debugmodel flavors shrunk further, so that --quick runs in seconds on a busy 2-core CPU
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
    },
}
QUICK_EXPERTS = 4
LR, WEIGHT_DECAY, MOMENTUM, BETAS, ADAM_EPS, NS_STEPS = 0.02, 0.1, 0.95, (0.9, 0.95), 1e-8, 5
CEILING_SIZE = 8192
GIB = 2**30


# The torchtitan 0.2.2 model arguments that decide parameter shapes, for machines without torchtitan (the GPU
# image has none); tests/test_bench_product.py checks that they give torchtitan's shapes.
BUILTIN_ARGS = {
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
}


def torchtitan_shapes(
    family: str, flavor: str, layers: int | None, quick: bool = False
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the torchtitan model, built on the meta device."""
    module_name, class_name, args_name = MODEL_FAMILIES[family]
    module = importlib.import_module(module_name)
    args = copy.deepcopy(getattr(module, args_name)[flavor])
    if layers is not None:
        check_layers(layers, args.n_layers, family, flavor)
        args.n_layers = layers
    if quick:
        for key, value in QUICK_ARGS[family].items():
            setattr(args, key, value)
        if family == "deepseek_v3":
            args.moe_args.num_experts = QUICK_EXPERTS
    if family == "deepseek_v3" and not hasattr(args, "moe_impl"):
        args.moe_impl = "standard"  # what torchtitan's update_from_config sets (as in dtensor_muon.simulate)
    with torch.device("meta"):
        net = getattr(module, class_name)(args)
    return [(n, tuple(p.shape)) for n, p in net.named_parameters()]


def check_layers(layers: int, available: int, family: str, flavor: str) -> None:
    if not 1 <= layers <= available:
        raise ValueError(f"--layers must be in [1, {available}] for {family} {flavor}, got {layers}")


def builtin_shapes(
    family: str, flavor: str, layers: int | None, quick: bool = False
) -> list[tuple[str, tuple[int, ...]]]:
    """The same list as :func:`torchtitan_shapes`, written out from :data:`BUILTIN_ARGS`."""
    a = dict(BUILTIN_ARGS[family, flavor])
    if quick:
        a.update(QUICK_ARGS[family])
        if family == "deepseek_v3":
            a["num_experts"] = QUICK_EXPERTS
    if layers is not None:
        check_layers(layers, a["n_layers"], family, flavor)
        a["n_layers"] = layers
    d, vocab = a["dim"], a["vocab_size"]
    out: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (vocab, d))]
    for i in range(a["n_layers"]):
        pre = f"layers.{i}."
        if family == "llama3":
            head = d // a["n_heads"]
            kv = (a["n_kv_heads"] or a["n_heads"]) * head
            hidden = int(2 * 4 * d / 3)
            if a["ffn_dim_multiplier"] is not None:
                hidden = int(a["ffn_dim_multiplier"] * hidden)
            hidden = a["multiple_of"] * ((hidden + a["multiple_of"] - 1) // a["multiple_of"])
            out += [
                (pre + "attention.wq.weight", (d, d)),
                (pre + "attention.wk.weight", (kv, d)),
                (pre + "attention.wv.weight", (kv, d)),
                (pre + "attention.wo.weight", (d, d)),
                (pre + "feed_forward.w1.weight", (hidden, d)),
                (pre + "feed_forward.w2.weight", (d, hidden)),
                (pre + "feed_forward.w3.weight", (hidden, d)),
                (pre + "attention_norm.weight", (d,)),
                (pre + "ffn_norm.weight", (d,)),
            ]
            continue
        if a["q_lora_rank"]:
            raise ValueError("the built-in DeepSeek-V3 shapes cover q_lora_rank 0 only")
        heads, rank = a["n_heads"], a["kv_lora_rank"]
        out += [
            (pre + "attention.wq.weight", (heads * (a["qk_nope_head_dim"] + a["qk_rope_head_dim"]), d)),
            (pre + "attention.wkv_a.weight", (rank + a["qk_rope_head_dim"], d)),
            (pre + "attention.kv_norm.weight", (rank,)),
            (pre + "attention.wkv_b.weight", (heads * (a["qk_nope_head_dim"] + a["v_head_dim"]), rank)),
            (pre + "attention.wo.weight", (d, heads * a["v_head_dim"])),
            (pre + "attention_norm.weight", (d,)),
            (pre + "ffn_norm.weight", (d,)),
        ]
        if i < a["n_dense_layers"]:
            f = a["inter_dim"]
            out += [
                (pre + "feed_forward.w1.weight", (f, d)),
                (pre + "feed_forward.w2.weight", (d, f)),
                (pre + "feed_forward.w3.weight", (f, d)),
            ]
        else:
            e, f = a["num_experts"], a["moe_inter_dim"]
            shared = f * a["num_shared_experts"]
            out += [
                (pre + "moe.experts.w1", (e, f, d)),
                (pre + "moe.experts.w2", (e, d, f)),
                (pre + "moe.experts.w3", (e, f, d)),
                (pre + "moe.router.gate.weight", (e, d)),
                (pre + "moe.shared_experts.w1.weight", (shared, d)),
                (pre + "moe.shared_experts.w2.weight", (d, shared)),
                (pre + "moe.shared_experts.w3.weight", (shared, d)),
            ]
    return out + [("norm.weight", (d,)), ("output.weight", (vocab, d))]


def parameter_shapes(family: str, flavor: str, layers: int | None, quick: bool = False):
    """(shapes, source): torchtitan's meta-built model where torchtitan imports, else :func:`builtin_shapes`."""
    try:
        importlib.import_module(MODEL_FAMILIES[family][0])
    except ImportError:
        return builtin_shapes(family, flavor, layers, quick), "built-in table (torchtitan not importable)"
    return torchtitan_shapes(family, flavor, layers, quick), "torchtitan meta model"


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


def build_optimizer(kind: str, params: ParameterSet) -> list[torch.optim.Optimizer]:
    fused = params.device.type == "cuda"
    if kind == "dtensor_muon":
        return [
            Muon(
                params.named,
                lr=LR,
                weight_decay=WEIGHT_DECAY,
                momentum=MOMENTUM,
                nesterov=True,
                ns_steps=NS_STEPS,
                adjust_lr_fn=None,
                adamw_betas=BETAS,
                adamw_eps=ADAM_EPS,
            )
        ]
    if kind == "torch_muon_adamw":
        matrices, rest = params.split()
        return [
            torch.optim.Muon(
                matrices,
                lr=LR,
                weight_decay=WEIGHT_DECAY,
                momentum=MOMENTUM,
                nesterov=True,
                ns_steps=NS_STEPS,
                adjust_lr_fn=None,
            ),
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
    "torch_muon_adamw": "torch.optim.Muon + AdamW{}",
    "adamw": "AdamW{} on everything",
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_optimizer(kind: str, params: ParameterSet, warmup: int, steps: int) -> dict:
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
        for opt in optimizers:
            opt.step()
        sync(device)
        if step >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    for opt in optimizers:
        flush = getattr(opt, "flush", None)
        if flush is not None:
            flush()
    del optimizers
    free(device)
    label = LABELS[kind].format(" (fused)" if device.type == "cuda" else "")
    return {
        "optimizer": label,
        "key": kind,
        "step_ms": median(times),
        "min_ms": min(times),
        "mem_before_gib": before,
        "peak_gib": peak,
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


def main() -> None:
    parser = benchmark_parser(__doc__, "optimizer_step")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3_8b")
    parser.add_argument("--layers", type=int, default=None, help="first N transformer layers (default: all; quick: 2)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--check-params",
        type=int,
        default=4,
        help="CUDA: compare the two Muons on the first N parameters of each kind (CPU: all)",
    )
    args = parser.parse_args()
    args.benchmark = (
        f"optimizer_step_{args.model}"  # one result file per model: bench/results/optimizer_step_MODEL.json
    )
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        torch.set_num_threads(1)  # tiny matrices: more threads only wait on each other on a shared CPU
        if args.layers is None:
            args.layers = 2
    device = torch.device(args.device)
    family, flavor = MODELS[args.model]
    flavor = QUICK_FLAVOR if args.quick else flavor
    shapes, shapes_from = parameter_shapes(family, flavor, args.layers, args.quick)
    params = ParameterSet(shapes, device)
    muon_shapes = [s for n, s in shapes if n in params.muon_names]
    n_params = sum(torch.Size(s).numel() for _, s in shapes)
    n_muon = sum(torch.Size(s).numel() for s in muon_shapes)
    syrk_flops = sum(ns_flops(s)[0] for s in muon_shapes)
    plain_flops = sum(ns_flops(s)[1] for s in muon_shapes)
    print(
        f"{family} {flavor}, {args.layers or 'all'} layers: {len(shapes)} parameters, {n_params / 1e9:.3f} B "
        f"values ({n_muon / 1e9:.3f} B in {len(muon_shapes)} Muon parameters), fp32, on {device}; "
        f"median of {args.steps} steps after {args.warmup}; shapes from the {shapes_from}"
    )

    ceiling = matmul_ceiling(device) if device.type == "cuda" else None
    floor = None
    if ceiling is not None:
        rate = ceiling["tflops"] * 1e12
        floor = {"syrk_ms": 1e3 * syrk_flops / rate, "plain_ms": 1e3 * plain_flops / rate}

    check = [
        i
        for indices in params.by_kind().values()
        for i in (indices[: args.check_params] if device.type == "cuda" else indices)
    ]
    rows, finals = [], {}
    for kind in ("dtensor_muon", "torch_muon_adamw", "adamw"):
        rows.append(run_optimizer(kind, params, args.warmup, args.steps))
        if kind != "adamw":
            finals[kind] = snapshot(params, check)
        print(f"  {rows[-1]['optimizer']}: {rows[-1]['step_ms']:.2f} ms", flush=True)
    differences = update_differences(params, finals["dtensor_muon"], finals["torch_muon_adamw"])
    adamw_ms = rows[-1]["step_ms"]
    for row in rows:
        row["vs_adamw"] = row["step_ms"] / adamw_ms
        if floor is not None and row["key"] != "adamw":
            row["vs_ns_floor"] = row["step_ms"] / floor["syrk_ms"]
    print(
        markdown_table(
            rows,
            [
                ("optimizer", "optimizer", "{}"),
                ("step_ms", "step ms", "{:.2f}"),
                ("min_ms", "min ms", "{:.2f}"),
                ("vs_adamw", "× AdamW", "{:.2f}"),
                ("vs_ns_floor", "× NS floor", "{:.2f}"),
                ("mem_before_gib", "GiB before step 1", "{:.1f}"),
                ("peak_gib", "peak GiB", "{:.1f}"),
            ],
        )
    )
    if floor is not None:
        print(
            f"bf16 {CEILING_SIZE}³ matmul: {ceiling['ms']:.3f} ms = {ceiling['tflops']:.0f} TFLOP/s; Newton–Schulz "
            f"floor of the Muon matrices at that rate: {floor['syrk_ms']:.1f} ms with symmetric products "
            f"({syrk_flops / 1e12:.2f} TFLOP), {floor['plain_ms']:.1f} ms plain ({plain_flops / 1e12:.2f} TFLOP)"
        )
    print(
        "dtensor_muon.Muon vs torch.optim.Muon + AdamW, max relative update difference: "
        + ", ".join(f"{k.removeprefix('max_rel_update_diff_')} {v:.2e}" for k, v in differences.items())
    )
    write_result(
        args,
        rows,
        model=f"{family}:{flavor}",
        layers=args.layers,
        shapes_from=shapes_from,
        parameters=n_params,
        muon_parameters=n_muon,
        ns_tflop_syrk=syrk_flops / 1e12,
        ns_tflop_plain=plain_flops / 1e12,
        matmul_ceiling=ceiling,
        ns_floor_ms=floor,
        checked_parameters=len(check),
        **differences,
    )


if __name__ == "__main__":
    main()
