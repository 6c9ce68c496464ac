"""The AdamW-to-Muon learning-rate rule: its ratio is the one the GPU study measured, the shipped torchtitan 0.2
configs carry it, and the study's MoE layer and curve reading are what they say."""

import json
import math
import re
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from bench_modules import bench_module

from dtensor_muon import LR_PER_ADAMW_LR, MUON_LR_PER_ADAMW_LR, lr_from_adamw, muon_lr_from_adamw
from dtensor_muon.optim.lr_scaling import ADAMW_UPDATE_RMS

ROOT = Path(__file__).resolve().parents[1]

TORCHTITAN_ADAMW_LR = {
    "llama3_8b": 3e-4,  # torchtitan 0.2.2 models/llama3/train_configs/llama3_8b.toml
    "llama3_8b_2layers_gpu": 3e-4,
    "deepseek_v3_16b": 2.2e-4,  # models/deepseek_v3/train_configs/deepseek_v3_16b.toml
    "deepseek_v3_16b_2layers_gpu": 2.2e-4,
    "qwen3_30b_a3b_2layers_gpu": 3e-4,  # torchtitan 0.3's qwen3_moe_debug
    "llama3_tiny": 8e-4,  # models/llama3/train_configs/debug_model.toml
    "moe_tiny": 8e-4,  # models/deepseek_v3/train_configs/debug_model.toml
}
"""The AdamW lr of torchtitan's own config for the model of each shipped config."""


def test_the_rule_is_the_studys_measured_ratio_on_both_models():
    best = json.loads((ROOT / "bench" / "results" / "lr_study.json").read_text())["best"]
    lrs = {(row["model"], row["optimizer"]): row["lr"] for row in best}
    for model, optimizer in (("moe", "Muon"), ("moe", "NorMuon"), ("dense", "Muon"), ("dense", "NorMuon")):
        ratio = lrs[(model, optimizer)] / lrs[(model, "AdamW")]
        assert math.isclose(ratio, MUON_LR_PER_ADAMW_LR), (model, optimizer, ratio)


def test_the_soap_familys_ratios_are_the_studys():
    """:data:`LR_PER_ADAMW_LR` for SOAP and KL-SOAP (``match_update_rms=0.2``): each the ratio of its best lr to
    AdamW's on both models, each best bracketed by worse runs on both sides and run over 3 seeds."""
    study = json.loads((ROOT / "bench" / "results" / "lr_study.json").read_text())
    best = {(row["model"], row["optimizer"]): row for row in study["best"]}
    sweep = {(row["model"], row["optimizer"]): row for row in study["sweep"]}
    for model, soap, klsoap in (("moe", "SOAP-cholqr", "KLSOAP-cholqr"), ("dense", "SOAP", "KLSOAP")):
        adamw_lr = best[(model, "AdamW")]["lr"]
        for optimizer, ratio in ((soap, LR_PER_ADAMW_LR["SOAP"]), (klsoap, LR_PER_ADAMW_LR["KLSOAP"])):
            row = best[(model, optimizer)]
            assert math.isclose(row["lr"] / adamw_lr, ratio), (model, optimizer, row["lr"])
            assert row["seeds"] == 3, (model, optimizer)
            losses = {
                float(key.removeprefix("lr ")): loss
                for key, loss in sweep[(model, optimizer)].items()
                if key.startswith("lr ")
            }
            below = max(lr for lr in losses if lr < row["lr"])
            above = min(lr for lr in losses if lr > row["lr"])
            assert losses[below] > losses[row["lr"]] < losses[above], (model, optimizer, losses)


def test_lr_from_adamw_scales_by_the_table_and_refuses_what_it_does_not_know():
    assert lr_from_adamw("KLSOAP", 3e-4) == LR_PER_ADAMW_LR["KLSOAP"] * 3e-4
    assert lr_from_adamw("Muon", 2.2e-4) == muon_lr_from_adamw(2.2e-4)
    with pytest.raises(ValueError, match="lr_from_adamw: optimizer must be one of Muon, NorMuon, SOAP, KLSOAP"):
        lr_from_adamw("MOP", 3e-4)
    with pytest.raises(ValueError, match="lr_from_adamw: adamw_lr must be a number >= 0"):
        lr_from_adamw("SOAP", -1.0)


GPU_CONFIGS = sorted(name for name in TORCHTITAN_ADAMW_LR if name.endswith("_gpu"))


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_shipped_gpu_configs_give_the_soap_family_the_rule(name):
    """[soap] and [klsoap] match AdamW's update RMS; SOAP runs at the config's lr (its ratio is Muon's), and the
    lr the config's comment gives for KL-SOAP is its ratio's, to the 3 digits written."""
    text = (ROOT / "train_configs" / f"{name}.toml").read_text()
    config = tomllib.loads(text)
    assert config["soap"]["match_update_rms"] == config["klsoap"]["match_update_rms"] == ADAMW_UPDATE_RMS
    adamw_lr = TORCHTITAN_ADAMW_LR[name]
    assert math.isclose(config["optimizer"]["lr"], lr_from_adamw("SOAP", adamw_lr), rel_tol=1e-12)
    klsoap_lr = float(re.search(r"--optimizer\.lr (\S+) with it", text).group(1))
    assert math.isclose(klsoap_lr, lr_from_adamw("KLSOAP", adamw_lr), rel_tol=5e-3), (klsoap_lr, adamw_lr)


def test_muon_lr_from_adamw_scales_and_refuses_what_is_not_an_lr():
    assert muon_lr_from_adamw(3e-4) == MUON_LR_PER_ADAMW_LR * 3e-4
    for bad in (-1e-3, "3e-4", True, None):
        with pytest.raises(ValueError, match="muon_lr_from_adamw: adamw_lr must be a number >= 0"):
            muon_lr_from_adamw(bad)


@pytest.mark.parametrize("name", sorted(TORCHTITAN_ADAMW_LR))
def test_shipped_muon_configs_carry_the_rule(name):
    config = tomllib.loads((ROOT / "train_configs" / f"{name}.toml").read_text())
    assert config["optimizer"]["name"] == "Muon" and config["muon"]["adjust_lr_fn"] == "match_rms_adamw"
    assert math.isclose(config["optimizer"]["lr"], muon_lr_from_adamw(TORCHTITAN_ADAMW_LR[name]), rel_tol=1e-12)


def test_every_shipped_muon_config_is_checked():
    shipped = {p.stem for p in (ROOT / "train_configs").glob("*.toml")}
    muon = {
        s
        for s in shipped
        if tomllib.loads((ROOT / "train_configs" / f"{s}.toml").read_text())["optimizer"]["name"] == "Muon"
    }
    assert muon == set(TORCHTITAN_ADAMW_LR)


def float64_moe(capacity_factor: float, seed: int):
    """The study's MoE layer (dim 16, 4 experts of width 8, top 2) in float64 with N(0, 0.3) weights, and an input
    of 2 × 5 tokens."""
    study = bench_module("lr_study")
    config = study.ModelConfig(dim=16, experts=4, expert_ffn=8, top_k=2, capacity_factor=capacity_factor)
    torch.manual_seed(seed)
    layer = study.MoE(config).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer, torch.randn(2, 5, 16, dtype=torch.float64)


def moe_by_token(layer, tokens: torch.Tensor, capacity: int | None = None) -> tuple[torch.Tensor, int]:
    """Σ_k w_k·SwiGLU_{e_k}(x) per token over its 2 experts of largest router probability (weights renormalized),
    a choice dropped when ``capacity`` earlier choices (token order, then rank among the token's k) already went
    to its expert; and the number dropped. A loop written from the formula."""
    want, used, dropped = torch.zeros_like(tokens), [0] * 4, 0
    for t, token in enumerate(tokens):
        top = (layer.router.weight @ token).softmax(-1).topk(2)
        for weight, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            used[e] += 1
            if capacity is not None and used[e] > capacity:
                dropped += 1
                continue
            w1, w3, w2 = (w[e] for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2))
            want[t] += weight * (w2 @ (F.silu(w1 @ token) * (w3 @ token)))
    return want, dropped


def test_the_studys_moe_layer_equals_a_per_token_sum_over_its_chosen_experts():
    """With capacity for every token, the layer's output is Σ_k w_k·SwiGLU_{e_k}(x) per token, the k experts of
    largest router probability and their renormalized weights (a loop written from the formula), in float64."""
    layer, x = float64_moe(capacity_factor=2.0, seed=0)
    got = layer(x)
    tokens = x.reshape(-1, 16)
    want, _ = moe_by_token(layer, tokens)
    torch.testing.assert_close(got.reshape(-1, 16), want, rtol=1e-12, atol=1e-12)
    share = torch.zeros(4, dtype=torch.float64)
    probs = (tokens @ layer.router.weight.T).softmax(-1).detach()
    for e in probs.topk(2).indices.flatten().tolist():
        share[e] += 1 / (tokens.shape[0] * 2)
    assert math.isclose(float(layer.balance.detach()), float(4 * (share * probs.mean(0)).sum()), rel_tol=1e-12)


def test_the_studys_moe_layer_drops_the_choices_past_an_experts_capacity():
    """With capacity ⌈0.5·T·k/E⌉ = 3 of 20 choices over 4 experts, a token's choice reaches its expert only if
    fewer than 3 earlier choices (token order, then rank among the token's k) went there; a dropped choice adds
    nothing (a loop written from that rule, float64)."""
    layer, x = float64_moe(capacity_factor=0.5, seed=1)
    want, dropped = moe_by_token(layer, x.reshape(-1, 16), capacity=3)
    assert dropped > 0  # the case exercises the drop
    torch.testing.assert_close(layer(x).reshape(-1, 16), want, rtol=1e-12, atol=1e-12)


def test_steps_to_reach_interpolates_between_evaluations():
    study = bench_module("lr_study")
    curve = [[0, 8.0], [25, 4.0], [50, 3.0], [75, 2.5]]
    assert study.steps_to_reach(curve, 3.5) == 37.5
    assert study.steps_to_reach(curve, 2.5) == 75
    assert study.steps_to_reach(curve, 2.0) is None


def test_the_soap_variants_take_the_cholqr_refresh():
    """``SOAP-cholqr`` and ``KLSOAP-cholqr`` are the front ends with ``basis="cholqr"`` and the study's other SOAP
    settings; plain ``SOAP`` keeps the default refresh."""
    study = bench_module("lr_study")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    for name, front, basis in (
        ("SOAP-cholqr", "SOAP", "cholqr"),
        ("KLSOAP-cholqr", "KLSOAP", "cholqr"),
        ("SOAP", "SOAP", "qr"),
    ):
        opt = study.build_optimizer(study.Run("moe", name, 1e-3, 0), model, torch.device("cpu"))
        groups = [g for g in opt.param_groups if g["use_muon"]]
        assert type(opt).__name__ == front, name
        assert {g["basis"] for g in groups} == {basis} and {g["precondition_frequency"] for g in groups} == {10}, name


@pytest.mark.parametrize("optimizer", ["Muon", "SOAP-cholqr"])
def test_a_run_stopped_and_continued_equals_one_run_through(tmp_path, optimizer):
    """A study run stopped at step 7 with its state saved, then continued from the file, gives the same training
    and held-out losses, bit for bit, as the run done in one go (tiny MoE, 12 steps: across the SOAP refresh at
    step 10; a synthetic token stream); the state file is gone once the run ends."""
    study = bench_module("lr_study")
    g = torch.Generator().manual_seed(0)
    tokens = tmp_path / "tokens.pt"
    streams = {k: torch.randint(0, 64, (4000,), generator=g, dtype=torch.int16) for k in ("train", "val")}
    torch.save({**streams, "vocab": 64}, tokens)
    run = study.Run("moe", optimizer, 1e-2, 0, steps=12)
    whole = study.train(run, quick=True, tokens=tokens)
    state = tmp_path / "state"
    assert study.train(run, quick=True, tokens=tokens, state_dir=state, until_step=7) is None
    assert (state / f"{run.name}.pt").exists()
    parts = study.train(run, quick=True, tokens=tokens, state_dir=state)
    assert parts["train"] == whole["train"] and len(parts["train"]) == 12
    assert parts["val"] == whole["val"]
    assert not (state / f"{run.name}.pt").exists()
