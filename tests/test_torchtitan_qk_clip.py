"""QK-clip in torchtitan 0.2 (:mod:`torchtitan_ext.qk_clip`): the heads read from the real models, the causal
logit maxima against a float64 reference, the maxima the hooks hand over against the attention's own inputs, and
a CPU training with τ low enough to clip."""

import copy

import pytest
import torch

pytest.importorskip("torchtitan")
from torchtitan_ext.version import LINE

if LINE != "0.2":
    pytest.skip("torchtitan 0.2.x tests", allow_module_level=True)

from titan_runs import torchrun

from torchtitan_ext import qk_clip


def model(name: str, device: str = "meta") -> torch.nn.Module:
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args["debugmodel"])
    args.update_from_config(ConfigManager().parse_args([]))
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
    handles = qk_clip.record_maxima(layers, lambda layer, maxima: recorded.__setitem__(layer, maxima))
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
