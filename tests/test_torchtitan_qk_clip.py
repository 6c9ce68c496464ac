"""QK-clip in torchtitan 0.2 (:mod:`torchtitan_ext.qk_clip`, :mod:`torchtitan_ext.qk_clip_kernel`): the heads
read from the real models, the causal logit maxima against a float64 reference, the maxima the hooks hand over
against the attention's own inputs, FlexAttention's kernel path (on CPU through a stand-in with the kernel's
results: torch 2.13 returns ``max_scores`` from the Triton kernel only), and a CPU training with τ low enough to
clip; under tensor parallelism (the maxima of each rank's heads at their global positions, assembled by the
MAX all-reduce, against one process's) and pipeline parallelism (every stage configures the whole model's layers)
on gloo processes, and CPU trainings with TP 2, PP 2 and FSDP 2 × TP 2 that clip.

GPU tests (skipped with "needs a CUDA GPU" where CUDA is unavailable): the kernel's maxima against the exact
fallback's within the float32 rounding of both, the attention's output with the statistic asked for bitwise the
output without, and a DeepSeek-V3 training with FlexAttention whose maxima come from the kernel."""

import copy
import math

import pytest
import torch
from torch.nn.attention.flex_attention import AuxOutput, and_masks, create_block_mask

pytest.importorskip("torchtitan")
from torchtitan_ext.version import LINE

if LINE != "0.2":
    pytest.skip("torchtitan 0.2.x tests", allow_module_level=True)

from titan_runs import failure, torchrun

from torchtitan_ext import qk_clip, qk_clip_kernel

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def model(name: str, device: str = "meta", **changes: int) -> torch.nn.Module:
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args["debugmodel"])
    args.update_from_config(ConfigManager().parse_args([]))
    for key, value in changes.items():
        setattr(args, key, value)
    with torch.device(device):
        return spec.model_cls(args)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "deepseek_v3"])
def test_heads_are_read_from_the_model_with_the_rows_of_their_weights(name):
    m = model(name)
    layers = qk_clip.attention_heads(m)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert len(layers) == len(m.layers)
    for layer, (_, heads) in layers.items():
        assert layer.endswith(".attention")
        for weight, rows in heads.row_counts().items():
            assert shapes[weight][0] == rows, (weight, shapes[weight], rows)
    assert next(iter(layers.values()))[1].is_mla == (name == "deepseek_v3")


def test_varlen_attention_is_refused_naming_it():
    m = model("llama3")
    m.layers["0"].attention.attn_type = "varlen"
    with pytest.raises(NotImplementedError, match=r"attention 'layers\.0\.attention' runs 'varlen'"):
        qk_clip.attention_heads(m)


def reference_maxima(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """float64, every query head against its key head (h // (H / K)), positions j ≤ i."""
    q64, k64 = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("bhid,bhjd->bhij", q64, k64) * scale
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))


def test_causal_maxima_equal_the_float64_reference_within_float32_products(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 16, 4, generator=g), torch.randn(2, 2, 16, 4, generator=g)
    monkeypatch.setattr(qk_clip, "SCORES_BYTES", 3 * 4 * 16 * 16)  # three query heads at a time: chunks cut groups
    got = qk_clip.max_logits(q, k, 0.5)
    want = reference_maxima(q, k, 0.5)
    # each score is a 4-term float32 dot product: within 4·2⁻²⁴ of Σ|q||k| per entry, times the scale
    bound = 4 * 2**-24 * 0.5 * (q.abs().amax() * k.abs().amax() * 4)
    assert (got.double() - want).abs().max() <= bound
    future = torch.zeros(1, 1, 16, 4)
    future[0, 0, 0] = 1.0  # only query position 0 sees a key at position 0; a large future key must not count
    keys = torch.zeros(1, 1, 16, 4)
    keys[0, 0, 5] = 100.0
    assert qk_clip.max_logits(future, keys, 1.0).item() == 0.0


def test_hooks_hand_over_the_maxima_of_the_attentions_own_inputs():
    m = model("llama3", device="cpu")
    layers = qk_clip.attention_heads(m)
    seen, recorded = {}, {}

    def keep_inputs(layer):
        def hook(module, args, kwargs):
            seen[layer] = (args[0].detach().clone(), args[1].detach().clone(), kwargs.get("scale"))

        return hook

    for layer, (inner, _) in layers.items():
        inner.register_forward_pre_hook(keep_inputs(layer), with_kwargs=True)
    handles, paths = qk_clip.record_maxima(
        layers, lambda layer, maxima: recorded.__setitem__(layer, maxima), torch.device("cpu")
    )
    assert set(paths.values()) == {"ScaledDotProductAttentionWrapper is not FlexAttention and returns no row maxima"}
    torch.manual_seed(0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    m(torch.randint(0, 100, (2, 12)))
    for layer, (q, k, scale) in seen.items():
        want = reference_maxima(q, k, scale or q.shape[-1] ** -0.5)
        assert torch.allclose(recorded[layer].double(), want, rtol=1e-5, atol=1e-5), layer
    for handle in handles:
        handle.remove()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("config", ["llama3_tiny.toml", "moe_tiny.toml"], ids=["llama3-gqa", "deepseek_v3-mla"])
def test_a_low_tau_clips_heads_and_trains(tmp_path, config):
    args = ["--training.local_batch_size", "2", "--training.seq_len", "128", "--metrics.log_freq", "1",
            "--training.steps", "4", "--lr_scheduler.warmup_steps", "2", "--muon.qk_clip_tau", "0.1"]  # fmt: skip
    code, output, losses = torchrun(config, tmp_path, *args)
    assert code == 0, output[-3000:]
    lines = [line for line in output.splitlines() if "optimizer: " in line]
    assert len(lines) == 4 and all("qk_clip max " in line for line in lines), lines
    fields = [line.split("qk_clip max ")[1].split() for line in lines]  # [max, "clipped", count, ...]
    peak, clipped = [float(f[0]) for f in fields], [int(f[2]) for f in fields]
    # the debug models' first logits lie well above τ = 0.1 (about 0.6 for Llama3): those heads are clipped, and
    # the next step's forward (new batch, weights updated and clipped) sees logits back near τ
    assert clipped[0] > 0 and peak[0] > 0.1 and peak[1] < peak[0] / 2, lines
    assert sorted(losses) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(list(losses.values()))))
    source = next(line for line in output.splitlines() if "QK-clip: logit maxima of" in line)
    assert "by the exact fallback" in source and "kernel" not in source, source  # SDPA: the fallback


TP_RUNS = {
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
}
"""Processes and parallelism of each run; every data-parallel rank takes llama3_tiny.toml's 4 sequences a step."""


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("run", list(TP_RUNS))
def test_a_low_tau_clips_heads_under_tensor_and_pipeline_parallelism(tmp_path, run):
    """Llama3's debug model (16 heads × 6 layers) with τ = 0.1: the first step's logits exceed τ in every head,
    so all 96 are clipped, which needs every head's maximum, assembled over the TP ranks (each sees 8 heads of
    a layer) or the PP stages (each holds 3 layers); the next step's maximum falls as in one process."""
    nproc, parallelism = TP_RUNS[run]
    args = ["--training.seq_len", "128", "--metrics.log_freq", "1", "--training.steps", "4",
            "--lr_scheduler.warmup_steps", "2", "--muon.qk_clip_tau", "0.1", *parallelism]  # fmt: skip
    code, output, losses = torchrun("llama3_tiny.toml", tmp_path, *args, nproc=nproc, timeout=400)
    assert code == 0, output[-3000:]
    lines = [line for line in output.splitlines() if "optimizer: " in line]
    assert len(lines) == 4 and all("qk_clip max " in line for line in lines), lines
    fields = [line.split("qk_clip max ")[1].split() for line in lines]
    peak, clipped = [float(f[0]) for f in fields], [int(f[2]) for f in fields]
    assert clipped[0] == 96 and peak[0] > 0.1 and peak[1] < peak[0] / 2, lines
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    source = next(line for line in output.splitlines() if "QK-clip: logit maxima of" in line)
    if run == "pp2":
        assert "logit maxima of 3 attention layers" in source and "(of the 6 this part's optimizer clips" in source, (
            source
        )
    else:
        assert "each rank's 1/2 of the heads" in source, source


class Recorder:
    """A stand-in for the optimizer :func:`qk_clip.build_with_qk_clip` builds: it keeps the heads it is given
    and each layer's recorded maxima (their elementwise max, as the optimizer does)."""

    def __init__(self, qk_clip_heads, **kwargs):
        self.heads, self.maxima = qk_clip_heads, {}

    def record_max_logits(self, layer, maxima):
        assert maxima.shape == (self.heads[layer].n_heads,), (layer, maxima.shape)
        before = self.maxima.get(layer)
        self.maxima[layer] = maxima.clone() if before is None else torch.maximum(before, maxima)


def tensor_parallel_maxima(rank: int, world_size: int) -> dict:
    """On every rank: Llama3's debug model with GQA (16 query heads over 4 key heads), seeded alike; the maxima
    one process records for a batch, then the maxima this rank records for the same batch under torchtitan's
    tensor-parallel plan over all ranks (before and after the MAX all-reduce); and the heads a pipeline-like
    split (each rank keeps its share of the layers) configures."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    torch.manual_seed(0)
    m = model("llama3", device="cpu", n_kv_heads=4)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    m.init_weights = None
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    whole = copy.deepcopy(m)
    one = qk_clip.build_with_qk_clip(Recorder, whole, {"qk_clip_tau": 1.0})
    whole(tokens)
    apply_tp(m, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)), False, False)
    tp = qk_clip.build_with_qk_clip(Recorder, m, {"qk_clip_tau": 1.0})
    m(tokens)
    local = {layer: maxima.clone() for layer, maxima in tp.maxima.items()}
    for maxima in tp.maxima.values():
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    stage = copy.deepcopy(whole)
    for i in list(stage.layers):
        if int(i) % world_size != rank:
            del stage.layers[i]
    split = qk_clip.build_with_qk_clip(Recorder, stage, {"qk_clip_tau": 1.0})
    return {"one": one.maxima, "local": local, "reduced": tp.maxima, "heads": (one.heads, tp.heads, split.heads)}


@pytest.mark.slow
def test_tensor_parallel_maxima_after_the_all_reduce_equal_one_processs():
    from dist_harness import run_distributed

    results = run_distributed(tensor_parallel_maxima, 2)
    for rank, result in enumerate(results):
        one_heads, tp_heads, split_heads = result["heads"]
        assert len(one_heads) == 6 and tp_heads == one_heads and split_heads == one_heads  # every rank: all 6
        for layer, want in result["one"].items():
            local = result["local"][layer]  # this rank's 8 query heads at their places, −inf elsewhere
            mine = torch.zeros(16, dtype=torch.bool)
            mine[8 * rank : 8 * (rank + 1)] = True
            assert torch.isinf(local[~mine]).all() and torch.isfinite(local[mine]).all(), (rank, layer, local)
            assert torch.allclose(local[mine], want[mine], rtol=1e-5, atol=1e-6), (rank, layer)
            assert torch.allclose(result["reduced"][layer], want, rtol=1e-5, atol=1e-6), (rank, layer)


def test_a_tensor_parallel_rank_hands_over_its_heads_at_their_global_positions():
    recorded = []
    record = qk_clip.on_all_heads("layer", 8, (1, 2), lambda layer, m: recorded.append(m))
    record("layer", torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(recorded[0], torch.tensor([-math.inf] * 4 + [1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ValueError, match=r"'layer' saw 8 query heads; with its 8 split over tensor parallelism"):
        record("layer", torch.zeros(8))

    def keep(layer, maxima):
        recorded.append(maxima)

    assert qk_clip.on_all_heads("layer", 8, (0, 1), keep) is keep  # no tensor parallelism: handed over as they are


def test_no_maxima_are_recorded_from_a_pipeline_stages_metadata_inference_forward(monkeypatch):
    """torch's PipelineStage runs a stage once on uninitialized tensors to learn its shapes: a hook called inside
    that forward records nothing, nor one handed maxima on the meta device (where a torch without the
    ``_forward_metadata_inference`` method runs its shape inference); real forwards record."""
    from torch.distributed.pipelining.stage import PipelineStage

    recorded = []
    record = None
    metadata_forward = hasattr(PipelineStage, "_forward_metadata_inference")

    def metadata_inference(stage):
        record("layer", torch.full((2,), math.nan))  # what attention over uninitialized memory may give

    if metadata_forward:
        monkeypatch.setattr(PipelineStage, "_forward_metadata_inference", metadata_inference)
    record = qk_clip.real_forwards_only(lambda layer, maxima: recorded.append(maxima))
    if metadata_forward:
        PipelineStage._forward_metadata_inference(None)
    record("layer", torch.zeros(2, device="meta"))
    assert recorded == [] and qk_clip._metadata_forwards == 0
    record("layer", torch.ones(2))
    assert len(recorded) == 1


def test_context_parallel_wrapping_of_the_inner_attention_is_refused():
    m = model("llama3")
    inner = m.layers["2"].attention.inner_attention
    original = inner.forward

    def cp_forward(*args, **kwargs):  # as torchtitan 0.3's apply_cp_to_forward wraps it
        return original(*args, **kwargs)

    def forward_with_redistribution(*args, **kwargs):  # and its tensor parallelism wraps that in turn
        return cp_forward(*args, **kwargs)

    inner.forward = forward_with_redistribution
    assert qk_clip.context_parallel(inner)
    assert not qk_clip.context_parallel(m.layers["1"].attention.inner_attention)
    with pytest.raises(NotImplementedError, match=r"'layers\.2\.attention'.*context parallelism"):
        qk_clip.attention_heads(m)


def test_flex_attention_masks_are_reproduced_from_their_mask_mod():
    """Two documents per sequence (a different split in each batch row), causal inside each: the maxima only see
    the positions the block mask lets attention see."""
    from torch.nn.attention.flex_attention import create_block_mask

    seq = 16
    starts = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])  # document id of each position, per batch row

    def same_document_causal(b, h, q_idx, kv_idx):
        return (starts[b, q_idx] == starts[b, kv_idx]) & (kv_idx <= q_idx)

    block_mask = create_block_mask(same_document_causal, 2, None, seq, seq, device="cpu")
    dense = qk_clip.dense_mask(block_mask, torch.device("cpu"))
    want = torch.tensor(
        [[[bool(starts[b, i] == starts[b, j] and j <= i) for j in range(seq)] for i in range(seq)] for b in range(2)]
    )
    assert torch.equal(dense[:, 0], want)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, seq, 8, generator=g), torch.randn(2, 4, seq, 8, generator=g)
    k[:, :, 4] = 50.0  # a huge key at position 4: in row 0's first document only
    got = qk_clip.max_logits(q, k, 0.25, dense)
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * 0.25
    reference = scores.masked_fill(~want[:, None], float("-inf")).amax(dim=(0, 2, 3))
    assert torch.allclose(got.double(), reference, rtol=1e-5)
    assert not torch.allclose(got, qk_clip.max_logits(q, k, 0.25))  # the plain causal mask would see more


def stand_in_kernel(q, k, v, *, block_mask, scale=None, enable_gqa=False, return_lse=False, return_aux=None):
    """torchtitan's compiled ``flex_attention`` on CPU, with the kernel's documented results: the output, the lse
    and max_scores[b, h, i] = max over allowed j of q_i·k_j·scale (−inf for a row the mask leaves empty)."""
    scale = scale or q.shape[-1] ** -0.5
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~qk_clip.dense_mask(block_mask, q.device), -math.inf)
    out = torch.nan_to_num(torch.softmax(scores, dim=-1)) @ v
    lse = scores.logsumexp(dim=-1)
    if return_aux is not None:
        return out, AuxOutput(lse if return_aux.lse else None, scores.amax(dim=-1) if return_aux.max_scores else None)
    return (out, lse) if return_lse else out


def padded_causal(valid: int):
    """Causal attention over the first ``valid`` positions; the queries after them see nothing (empty rows)."""
    return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx < valid)


def test_the_kernel_path_serves_flex_attention_on_cuda_only():
    from torchtitan.models.attention import FlexAttentionWrapper, ScaledDotProductAttentionWrapper

    flex, cuda = FlexAttentionWrapper(), torch.device("cuda")
    assert qk_clip_kernel.unavailable(flex, cuda) is None
    assert "not on cpu" in qk_clip_kernel.unavailable(flex, torch.device("cpu"))
    assert "not FlexAttention" in qk_clip_kernel.unavailable(ScaledDotProductAttentionWrapper(), cuda)
    paths = {"layers.0.attention": None, "layers.1.attention": "SDPA returns no row maxima"}
    assert qk_clip.describe(paths) == (
        "QK-clip: logit maxima of 2 attention layers: 1 from FlexAttention's kernel (max_scores), 1 by the exact "
        "fallback, one more Q·Kᵀ each (SDPA returns no row maxima)"
    )


def test_the_kernel_path_hands_over_the_row_maxima_per_head_and_returns_what_the_call_returns(monkeypatch):
    """torchtitan 0.2's FlexAttentionWrapper with its compiled function replaced by :func:`stand_in_kernel`: once
    hooked, each forward hands over max over batch and non-empty rows of the kernel's row maxima, and returns
    the call's own output (and lse), bit for bit."""
    from torchtitan.models.attention import FlexAttentionWrapper

    monkeypatch.setattr(FlexAttentionWrapper, "_compiled_flex_attn", stand_in_kernel)
    seq, inner = 16, FlexAttentionWrapper()
    block_mask = create_block_mask(padded_causal(12), 2, None, seq, seq, device="cpu")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, seq, 8, generator=g) for h in (4, 2, 2))
    call = {"block_mask": block_mask, "scale": 0.3, "enable_gqa": True}
    plain, (plain_lse_out, plain_lse) = inner(q, k, v, **call), inner(q, k, v, **call, return_lse=True)
    recorded = []
    heads = qk_clip.AttentionHeads(q="wq", k="wk", n_heads=4, head_dim=8, n_kv_heads=2)
    handles, paths = qk_clip.record_maxima(
        {"layers.0.attention": (inner, heads)}, lambda layer, m: recorded.append((layer, m)), torch.device("cuda")
    )
    assert paths == {"layers.0.attention": None}
    assert torch.equal(inner(q, k, v, **call), plain)
    out, lse = inner(q, k, v, **call, return_lse=True)
    assert torch.equal(out, plain_lse_out) and torch.equal(lse, plain_lse)
    want = qk_clip.max_logits(q, k, 0.3, qk_clip.dense_mask(block_mask, q.device))  # rows 12..15 are empty
    assert [layer for layer, _ in recorded] == ["layers.0.attention"] * 2
    for _, maxima in recorded:
        assert maxima.shape == (4,) and torch.allclose(maxima, want, rtol=1e-6, atol=0)
    assert torch.equal(
        qk_clip_kernel.per_head(torch.tensor([[[1.0, -math.inf]], [[-math.inf, 3.0]]])), torch.tensor([3.0])
    )
    with pytest.raises(NotImplementedError, match="score_mod"):
        inner(q, k, v, **call, score_mod=lambda score, b, h, i, j: score)
    with monkeypatch.context() as patch:
        patch.setattr(inner, "forward", lambda q, k, v, **kwargs: q)  # a forward that bypasses the kernel
        with pytest.raises(RuntimeError, match=r"'layers\.0\.attention' made 0 calls"):
            inner(q, k, v, **call)
    for handle in handles:
        handle.remove()
    assert torch.equal(inner(q, k, v, **call), plain) and len(recorded) == 2  # unhooked: passed through


def rounding_bound(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor) -> float:
    """Largest |kernel − fallback| of a head's maximum. Both compute s = q·k·scale from a float32 dot product of d
    terms (products exact in bf16, rounded in float32; sums in any order): each within γ_d·P·scale of the exact
    value, γ_d = d·u/(1 − d·u), u = 2⁻²⁴, P = Σ_c |q_c||k_c|; the scale costs each one more rounding, the kernel's
    log2 units (×1/ln 2 in float32, then ×ln 2 in float32) at most four more, each ≤ u·|s| ≤ u·P·scale. The max
    over positions moves no more than its entries, so |Δ| ≤ (2γ_d + 6u)·scale·max P over allowed pairs."""
    d, u = q.shape[-1], 2.0**-24
    repeat = q.shape[1] // k.shape[1]
    spans = q.double().abs() @ k.double().abs().repeat_interleave(repeat, dim=1).transpose(-2, -1)
    largest = spans.masked_fill(~mask, 0).max().item()
    return (2 * d * u / (1 - d * u) + 6 * u) * scale * largest


def document_causal(tokens: torch.Tensor, eos: int):
    """torchtitan's block_causal mask of ``tokens``: causal within each document (its own mask_mods)."""
    from torchtitan.models.attention import get_causal_mask_mod, get_document_mask_mod

    return and_masks(get_causal_mask_mod(), get_document_mask_mod(tokens, eos))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask", ["causal", "documents", "padded"])
def test_the_kernels_maxima_equal_the_exact_fallbacks_within_their_rounding(dtype, mask):
    """Query and key from one generator, GQA (8 query heads over 2 key heads), 2 × 384 positions (three 128-blocks
    each way, full and partial); torchtitan's compiled flex_attention asked for max_scores through the kernel
    path against :func:`qk_clip.max_logits` on the block mask made dense."""
    from torchtitan.models.attention import FlexAttentionWrapper, get_causal_mask_mod

    batch, seq, dev = 2, 384, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    q, k, v = (torch.randn(batch, h, seq, 64, generator=g, device=dev).to(dtype) for h in (8, 2, 2))
    tokens = torch.randint(1, 50, (batch, seq), generator=g, device=dev)
    tokens[0, [40, 200]], tokens[1, 300] = 0, 0  # document ends (eos id 0)
    mask_mod = {"causal": get_causal_mask_mod(), "documents": document_causal(tokens, 0), "padded": padded_causal(300)}
    block_mask = create_block_mask(mask_mod[mask], batch, None, seq, seq, device=dev)
    inner, recorded = FlexAttentionWrapper(), {}
    qk_clip_kernel.record_from_kernel("layer", inner, recorded.__setitem__)
    inner(q, k, v, block_mask=block_mask, scale=0.125, enable_gqa=True)
    dense = qk_clip.dense_mask(block_mask, dev)
    want = qk_clip.max_logits(q, k, 0.125, dense)
    bound = rounding_bound(q, k, 0.125, dense)
    assert (recorded["layer"].double() - want.double()).abs().max().item() <= bound, (recorded["layer"], want, bound)


@needs_gpu
def test_the_attention_output_with_the_kernel_statistic_is_bitwise_the_output_without(monkeypatch):
    """torchtitan's FlexAttentionWrapper on the same inputs, before and after the kernel path's hooks: output, lse
    and the gradients of q, k and v bit for bit. Its compiled flex_attention is compiled here without
    max-autotune: the kernel with ``max_scores`` is the same Triton template with one more store, and with one
    configuration per (head_dim, dtype) both variants run the same tiles. (torchtitan's own compile autotunes each
    variant by timing, so the two may pick different tiles, as two autotuned processes may.)"""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.attention import FlexAttentionWrapper

    monkeypatch.setattr(FlexAttentionWrapper, "_compiled_flex_attn", torch.compile(flex_attention))
    batch, seq, dev = 2, 256, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(4)
    q, k, v = (torch.randn(batch, 16, seq, 64, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    tokens = torch.randint(1, 50, (batch, seq), generator=g, device=dev)
    tokens[:, 100] = 0
    block_mask = create_block_mask(document_causal(tokens, 0), batch, None, seq, seq, device=dev)
    inner = FlexAttentionWrapper()

    def run() -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = inner(*leaves, block_mask=block_mask, scale=0.125, return_lse=True)
        out.float().square().sum().backward()
        return [out.detach(), lse.detach(), *(t.grad for t in leaves)]

    without, recorded = run(), []
    handles = qk_clip_kernel.record_from_kernel("layer", inner, lambda layer, m: recorded.append(m))
    with_statistic = run()
    assert len(recorded) == 1 and recorded[0].shape == (16,) and torch.isfinite(recorded[0]).all()
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], without, with_statistic, strict=True):
        assert torch.equal(a, b), name
    for handle in handles:
        handle.remove()


@needs_gpu
@pytest.mark.slow
@pytest.mark.e2e
def test_a_low_tau_clips_flex_attention_heads_from_the_kernel_on_a_gpu(tmp_path):
    """torchtitan's Llama3 debug model with FlexAttention (flavor ``debugmodel_flex_attn``, block-causal document
    masks) on one GPU: every layer's maxima come from the kernel, and τ = 0.1 clips as on CPU. Not DeepSeek-V3's
    flex flavor: one GPU trains it with fp32 attention, and torch 2.11's Inductor has no flex-attention backward
    configuration for fp32 queries of head dim 192 (MLA's) within Hopper's 227 KiB of shared memory; that training
    fails with or without QK-clip ("No valid triton configs ... out of resource")."""
    args = ["--model.flavor", "debugmodel_flex_attn", "--training.local_batch_size", "2", "--training.seq_len", "256",
            "--metrics.log_freq", "1", "--training.steps", "4", "--lr_scheduler.warmup_steps", "2",
            "--muon.qk_clip_tau", "0.1"]  # fmt: skip
    code, output, losses = torchrun("llama3_tiny.toml", tmp_path, *args, nproc=1, timeout=900, env={}, tail=3000)
    assert code == 0, failure(output)
    assert "QK-clip: logit maxima of 6 attention layers: 6 from FlexAttention's kernel (max_scores)\n" in output + "\n"
    lines = [line for line in output.splitlines() if "optimizer: " in line]
    fields = [line.split("qk_clip max ")[1].split() for line in lines]
    peak, clipped = [float(f[0]) for f in fields], [int(f[2]) for f in fields]
    assert len(lines) == 4 and clipped[0] > 0 and peak[0] > 0.1 and peak[1] < peak[0] / 2, lines
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
